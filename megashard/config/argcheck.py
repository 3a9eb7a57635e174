"""The Python API's arguments checked by type, as the CLI checks its config: one line naming the argument.

A YAML value is checked by its field's type (:mod:`megashard.train.sections`, :class:`~megashard.config.ParallelConfig`);
a Python caller's argument gets the same care here: a string, float or None where a bool or an integer goes is
refused, never read as "truthy" (``use_sharp="no"`` is not True) or converted (``2.7`` is not 2).

Kinds: ``int>=N`` (an int, not a bool, at least N), ``number>0`` (a finite int or float > 0), ``bool``, ``str``,
``ints`` / ``strs`` (a list or tuple of them), ``callable``; a trailing ``?`` also allows None.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from megashard.errors import ConfigError

__all__ = ["check_args", "check_arg"]


def _ok(kind: str, v: Any) -> bool:
    if kind.startswith("int>="):
        return isinstance(v, int) and not isinstance(v, bool) and v >= int(kind[5:])
    if kind == "number>0":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if kind == "number>=0":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind in ("ints", "strs"):
        item = int if kind == "ints" else str
        return isinstance(v, (list, tuple)) and all(isinstance(x, item) and not isinstance(x, bool) for x in v)
    if kind == "callable":
        return callable(v)
    raise AssertionError(kind)  # pragma: no cover - a kind of this module's own tables


def _what(kind: str) -> str:
    if kind.startswith("int>="):
        return f"an integer >= {kind[5:]}"
    return {"number>0": "a finite number > 0", "number>=0": "a finite number >= 0", "bool": "True or False",
            "str": "a string", "ints": "a list of integers", "strs": "a list of strings",
            "callable": "a callable"}[kind]


def check_arg(function: str, name: str, value: Any, kind: str) -> None:
    """ConfigError ``"<function>: <name>=<value> must be <what>"`` unless ``value`` is of ``kind``."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if (optional and value is None) or _ok(base, value):
        return
    wrong_type = not (isinstance(value, int) and not isinstance(value, bool) and base.startswith("int"))
    got = "" if not wrong_type or value is None else f" (type {type(value).__name__})"
    raise ConfigError(f"{function}: {name}={value!r}{got} must be {_what(base)}{' or None' if optional else ''}")


def check_args(function: str, args: Mapping[str, Any], kinds: Mapping[str, str]) -> None:
    """:func:`check_arg` for every ``name: kind`` of ``kinds`` (a missing name is skipped)."""
    for name, kind in kinds.items():
        if name in args:
            check_arg(function, name, args[name], kind)
