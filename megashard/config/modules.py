"""`ModulesConfig`: several parallel layouts on disjoint rank ranges of one job (multi-module models).

A vision encoder on ranks 0-3 with tp=1 and a language model on ranks 4-11 with tp=2, pp=2, the encoder's output
feeding the model's first stage::

    modules:
      - name: encoder
        ranks: 0-3              # first-last, inclusive (or one rank: 7)
        parallel: {tp: 1}
      - name: llm
        ranks: 4-11
        parallel: {tp: 2, pp: 2}
    connect:                    # optional; default: each module feeds the next one in the list
      - [encoder, llm]
    launch: {nnodes: 1, nproc_per_node: 12}   # optional: the world size for `megashard plan`

Each module's ``parallel`` section is a :class:`~megashard.config.ParallelConfig` resolved for its own number of
ranks. Checked once, when built; :meth:`MultiModuleLayout.from_config
<megashard.layout.modules.MultiModuleLayout.from_config>` gives every module's layout for a world size (the config
does not know the layout).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from megashard.config.parallel import ParallelConfig
from megashard.config.sizes import MAX_WORLD_SIZE
from megashard.errors import ConfigError, unknown_names

__all__ = ["ModuleConfig", "ModulesConfig", "parse_rank_range"]

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_MODULE_KEYS = ("name", "ranks", "parallel")
_TOP_KEYS = ("modules", "connect", "launch")


def parse_rank_range(value: Any, where: str) -> tuple[int, int]:
    """``"4-11"`` (inclusive) or ``7`` -> ``(first, count)``; ConfigError naming ``where`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        first, last = value, value
    else:
        m = _RANGE.match(value) if isinstance(value, str) else None
        if m is None:
            raise ConfigError(f"{where}={value!r} must be a rank range 'first-last' (inclusive, e.g. '4-11') or one rank")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
    if first < 0 or last < first or last >= MAX_WORLD_SIZE:
        raise ConfigError(f"{where}={value!r}: need 0 <= first <= last < {MAX_WORLD_SIZE:,}")
    return first, last - first + 1


@dataclass(frozen=True)
class ModuleConfig:
    """One module: a name, its ranks ``first .. first + count - 1``, and its parallel layout."""

    name: str
    """Module name (letters, digits, ``_``, ``-``), unique in the job."""
    first_rank: int
    """First global rank of the module."""
    num_ranks: int
    """Number of ranks; the module's ParallelConfig is resolved for this many."""
    parallel: ParallelConfig
    """The module's parallel layout (sizes as in a job's ``parallel:`` section)."""

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.num_ranks - 1


@dataclass(frozen=True)
class ModulesConfig:
    """Modules on disjoint rank ranges and the connections between them (``(src, dst)``: src's last pipeline stage
    feeds dst's first). Checked when built: unique names, disjoint ranges, known connection ends."""

    modules: tuple[ModuleConfig, ...]
    """The modules, in the order written (the default connections follow it)."""
    connections: tuple[tuple[str, str], ...]
    """``(src, dst)`` module names: src's last pipeline stage feeds dst's first."""

    def __post_init__(self) -> None:
        if not self.modules:
            raise ConfigError("modules: the list is empty; give at least one module with name, ranks and parallel")
        names = [m.name for m in self.modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"modules: name(s) {', '.join(dup)} used twice; each module needs its own name")
        spans = sorted(self.modules, key=lambda m: m.first_rank)
        for a, b in zip(spans, spans[1:]):
            if b.first_rank <= a.last_rank:
                raise ConfigError(f"modules: ranks of '{a.name}' ({a.first_rank}-{a.last_rank}) and '{b.name}' "
                                  f"({b.first_rank}-{b.last_rank}) overlap; modules need disjoint rank ranges")
        for src, dst in self.connections:
            for end in (src, dst):
                if end not in names:
                    raise ConfigError(f"connect: unknown module {unknown_names([end], names)}; modules: {', '.join(names)}")
            if src == dst:
                raise ConfigError(f"connect: [{src}, {dst}] connects a module to itself; name two modules")

    @property
    def min_world_size(self) -> int:
        """The smallest world that holds every module (its last rank + 1)."""
        return max(m.last_rank for m in self.modules) + 1

    def module(self, name: str) -> ModuleConfig:
        for m in self.modules:
            if m.name == name:
                return m
        raise ConfigError(f"unknown module {unknown_names([name], [m.name for m in self.modules])}; modules: "
                          f"{', '.join(m.name for m in self.modules)}")

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], path: str = "config") -> "ModulesConfig":
        """Build from a parsed YAML mapping with a ``modules:`` list (see the module docstring)."""
        bad = [k for k in doc if k not in _TOP_KEYS]
        if bad:
            raise ConfigError(f"{path}: unknown section(s) {unknown_names(bad, _TOP_KEYS)}; a multi-module config has "
                              f"{', '.join(_TOP_KEYS)}")
        items = doc.get("modules")
        if not isinstance(items, list):
            raise ConfigError(f"{path}: 'modules' must be a list of {{name, ranks, parallel}} mappings, got {items!r}")
        modules = []
        for i, item in enumerate(items):
            where = f"{path}: modules[{i}]"
            if not isinstance(item, Mapping):
                raise ConfigError(f"{where} must be a mapping with keys {', '.join(_MODULE_KEYS)}, got {item!r}")
            bad = [k for k in item if k not in _MODULE_KEYS]
            missing = [k for k in ("name", "ranks") if k not in item]
            if bad or missing:
                what = f"unknown key(s) {unknown_names(bad, _MODULE_KEYS)}" if bad else f"missing {', '.join(missing)}"
                raise ConfigError(f"{where}: {what}; a module has {', '.join(_MODULE_KEYS)}")
            name = item["name"]
            if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_-]+$", name):
                raise ConfigError(f"{where}.name={name!r} must be a word of letters, digits, '_' or '-'")
            first, count = parse_rank_range(item["ranks"], f"{where}.ranks")
            section = item.get("parallel") or {}
            if not isinstance(section, Mapping):
                raise ConfigError(f"{where}.parallel must be a mapping of ParallelConfig keys, got {section!r}")
            try:
                parallel = ParallelConfig.from_dict(section, where=f"{where}.parallel", yaml_words=True)
            except ConfigError as e:
                raise ConfigError(f"module '{name}': {e}") from None
            modules.append(ModuleConfig(name, first, count, parallel))
        raw = doc.get("connect")
        if raw is None:
            connections = tuple((a.name, b.name) for a, b in zip(modules, modules[1:]))
        else:
            if not isinstance(raw, list) or not all(isinstance(c, list) and len(c) == 2 for c in raw):
                raise ConfigError(f"{path}: 'connect' must be a list of [src, dst] pairs of module names, got {raw!r}")
            connections = tuple((str(a), str(b)) for a, b in raw)
        return cls(tuple(modules), connections)
