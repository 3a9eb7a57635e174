"""The advisor's input checks, shared by ``megashard plan --suggest`` and the Python API (same rule, same words).

    parse_bytes("80GiB", "--device-memory")      # 85899345920
    parse_bytes(80 << 30, "device_memory")       # the Python API also takes bytes as an int
    check_count("world_size", 0, 1, 1 << 16)     # ConfigError: world_size=0: must be in 1..65,536

**Sizes.** A number with a unit: decimal ``B``, ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` (powers of 1000)
or binary ``KiB``/``Ki``, ``MiB``/``Mi``, ``GiB``/``Gi``, ``TiB``/``Ti`` (powers of 1024), in any case, a space allowed:
``80GiB``, ``80GB``, ``80G``, ``81920MiB``, ``141 gb``. **A number without a unit is bytes** (as the Python API's
``device_memory`` int is), and such a number below 1 MiB is refused — no device has so little memory, so ``80`` is a
forgotten unit, not 80 bytes.
"""
from __future__ import annotations

import math
import re
from typing import Any

from megashard.errors import ConfigError

MIB = 1 << 20
UNITS = {"b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4,
         "tb": 1000**4, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
         "ti": 1 << 40, "tib": 1 << 40}
_EXAMPLES = "80GiB, 80GB, 80G or 81920MiB"


def _label(option: str, value: Any) -> str:
    """``--device-memory '80'`` (a CLI flag) or ``device_memory=80`` (a Python argument)."""
    return f"{option} {value!r}" if option.startswith("-") else f"{option}={value!r}"


def parse_bytes(value: Any, option: str = "--device-memory") -> int:
    """Bytes of a size given as text with a unit (module docstring) or, in Python, an int of bytes.

    ConfigError naming ``option`` (a flag such as ``--device-memory`` or an argument such as ``device_memory``) for
    anything else: no number, an unknown unit, zero or less, or a number without a unit below 1 MiB.
    """
    what = _label(option, value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{what}: give a size as bytes (an int) or text such as {_EXAMPLES}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{what}: must be a finite number of bytes")
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if not m or (unit and unit not in UNITS):
            raise ConfigError(f"{what}: give a size such as {_EXAMPLES} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, "
                              "TiB; K, M, G, T are powers of 1000)")
        number = float(m.group(1))
    if not number > 0:
        raise ConfigError(f"{what}: must be more than 0 bytes")
    if not unit and number < MIB:
        raise ConfigError(f"{what}: a size without a unit is bytes, and {number:,.0f} bytes is less than 1 MiB; give the "
                          f"unit, e.g. {_EXAMPLES}")
    size = int(number * UNITS.get(unit or "b", 1))
    if size < MIB:  # with a unit: still no device (checked here, so the re-check of the bytes never blames the unit)
        raise ConfigError(f"{what}: {size:,} bytes is less than 1 MiB, less than any device has; give the device's "
                          f"memory, e.g. {_EXAMPLES}")
    return size


def check_count(option: str, value: Any, low: int, high: int | None = None, note: str = "") -> int:
    """``value`` when it is an int in ``low..high``; else a ConfigError naming ``option`` and the rule."""
    if high is None:
        rule = "a positive integer" if low == 1 else f"an integer >= {low}"
    else:
        rule = f"in {low}..{high:,}"
    if isinstance(value, bool) or not isinstance(value, int):
        kind = rule if rule.startswith("a") else f"an integer {rule}"
        raise ConfigError(f"{_label(option, value)}: must be {kind}{note}")
    if value < low or (high is not None and value > high):
        label = f"{option} {value}" if option.startswith("-") else f"{option}={value}"
        raise ConfigError(f"{label}: must be {rule}{note}")
    return value
