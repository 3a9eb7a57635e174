"""YAML files and dotted command-line overrides (``parallel.tp=2``)."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from typing import Any, Iterable, Mapping

import yaml

from megashard.errors import ConfigError


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load`` (no arbitrary Python objects)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(doc).__name__}")
    return doc


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"parallel.tp=2"`` → (["parallel", "tp"], 2); the value is parsed as YAML (ints, floats, null, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. parallel.tp=2)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(doc: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``doc`` with every ``a.b.c=value`` override applied (intermediate mappings created)."""
    out = copy.deepcopy(doc)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: '{p}' is {nxt!r}, not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def reject_unknown_keys(cls: type, data: Mapping[str, Any], section: str) -> None:
    """Raise ConfigError naming every key of ``data`` that is not a field of dataclass ``cls``, with a "did you mean"."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        msgs = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), names, n=1)
            msgs.append(f"'{section}.{k}'" + (f" (did you mean '{section}.{close[0]}'?)" if close else ""))
        raise ConfigError(f"unknown config key(s): {', '.join(msgs)}; valid keys of '{section}': {', '.join(names)}")
