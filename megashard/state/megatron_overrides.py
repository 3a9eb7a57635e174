"""Megatron-LM's ``set_*_world_size`` / ``set_*_rank`` overrides: process-wide values the Megatron-style getters
return instead of asking the groups (Megatron's ``_MPU_*`` globals, which its unit tests and some model code set,
e.g. ``set_tensor_model_parallel_world_size(2)`` before building a layer without any group).

:data:`OVERRIDES` maps a key (``tp_size``, ``tp_rank``, ``pp_size``, ``pp_rank``, ``dp_size``, ``dp_rank``,
``ep_size``, ``ep_rank``, ``expt_tp_size``, ``expt_tp_rank``, ``vpp_size``) to the value set; a missing key (or
None) means "ask the group". ``megashard.parallel_state.destroy_model_parallel`` clears them, as Megatron's does.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["OVERRIDES", "clear", "set_override"]

#: the overrides in force (key -> value; None or absent = none)
OVERRIDES: dict[str, Optional[int]] = {}


def set_override(key: str, value: Optional[int]) -> None:
    """Set (or, with None, drop) one override."""
    if value is None:
        OVERRIDES.pop(key, None)
    else:
        OVERRIDES[key] = value


def clear() -> None:
    """Drop every override (Megatron's ``destroy_model_parallel`` resets its ``_MPU_*`` globals)."""
    OVERRIDES.clear()
