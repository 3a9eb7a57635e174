"""Megatron tensor-parallel (TP) attributes on parameters: read them, set them, copy them.

Megatron code marks how a parameter is split over the TP group with plain Python attributes. Three
dialects exist and all are understood here:

* Megatron-Core layers: ``tensor_model_parallel`` (bool), ``partition_dim`` (int, -1 when not split),
  ``partition_stride`` (int, > 1 when every rank holds ``stride`` interleaved chunks);
* Megatron-FSDP's annotation of foreign models: ``_tensor_parallel_mode`` = ``"column"`` (split on
  dim 0), ``"row"`` (split on dim 1) or ``"replicated"`` (a full copy on every TP rank);
* Megatron-FSDP internals: ``_mcore_tp``, ``_tp_partition_dim``, ``_tp_duplicated``.

``_tensor_parallel_mode`` wins over the others when present.
"""
from __future__ import annotations

from typing import Optional

import torch

from megashard.errors import ConfigError

__all__ = [
    "TP_MODES",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "get_mcore_tensor_parallel_partition_dim",
    "get_tensor_model_parallel_partition_stride",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "set_tensor_parallel_mode",
    "param_is_not_tensor_parallel_duplicate",
]

TP_MODES = {"column": 0, "row": 1, "replicated": None}
"""Legal ``_tensor_parallel_mode`` values and the tensor dim each one splits."""

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def _mode(param: torch.Tensor) -> Optional[str]:
    mode = getattr(param, "_tensor_parallel_mode", None)
    if mode is not None and mode not in TP_MODES:
        raise ConfigError(
            f"parameter of shape {tuple(param.shape)} has _tensor_parallel_mode={mode!r}; "
            f"legal values are {sorted(TP_MODES)}"
        )
    return mode


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """True if ``param`` is split over the TP group (column/row mode, ``tensor_model_parallel`` or ``_mcore_tp``)."""
    mode = _mode(param)
    if mode is not None:
        return mode in ("column", "row")
    return bool(getattr(param, "_mcore_tp", False) or getattr(param, "tensor_model_parallel", False))


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """True if ``param`` belongs to a TP layer but is a full copy on every TP rank (mode "replicated")."""
    mode = _mode(param)
    if mode is not None:
        return mode == "replicated"
    return bool(getattr(param, "_tp_duplicated", False))


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> Optional[int]:
    """Tensor dim ``param`` is split on over TP: "column" -> 0, "row" -> 1, else ``partition_dim``; None if unsplit."""
    mode = _mode(param)
    if mode is not None:
        return TP_MODES[mode]
    if not is_mcore_tensor_model_parallel(param):
        return None
    dim = getattr(param, "_tp_partition_dim", None) if getattr(param, "_mcore_tp", False) else None
    if dim is None:
        dim = getattr(param, "partition_dim", None)
    if dim is None or not isinstance(dim, int) or not -param.dim() <= dim < max(param.dim(), 1) or dim == -1:
        raise ConfigError(
            f"parameter of shape {tuple(param.shape)} is marked tensor_model_parallel but has partition_dim={dim!r}; "
            f"set it with set_tensor_model_parallel_attributes(param, True, dim, stride) with dim in 0..{param.dim() - 1}"
        )
    return dim % param.dim()


def get_tensor_model_parallel_partition_stride(param: torch.Tensor) -> int:
    """Megatron's ``partition_stride`` (1 unless each TP rank holds ``stride`` interleaved chunks)."""
    stride = getattr(param, "partition_stride", 1)
    if not isinstance(stride, int) or stride < 1:
        raise ConfigError(f"parameter of shape {tuple(param.shape)} has partition_stride={stride!r}; it must be an int >= 1")
    return stride


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` as Megatron does: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``.

    Like Megatron, refuses a tensor that already carries any of the three attributes (use
    :func:`copy_tensor_model_parallel_attributes` or delete them first).
    """
    already = [a for a in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(tensor, a)]
    if already:
        raise ConfigError(
            f"tensor of shape {tuple(tensor.shape)} already has TP attributes {already} "
            f"({', '.join(f'{a}={getattr(tensor, a)!r}' for a in already)}); each tensor is marked once"
        )
    if is_parallel and not (isinstance(dim, int) and 0 <= dim < tensor.dim()):
        raise ConfigError(f"partition dim {dim!r} is not a dim of a tensor of shape {tuple(tensor.shape)}; use 0..{tensor.dim() - 1}")
    if not isinstance(stride, int) or stride < 1:
        raise ConfigError(f"partition stride {stride!r} must be an int >= 1")
    tensor.tensor_model_parallel = bool(is_parallel)
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` Megatron's defaults (not parallel, dim -1, stride 1) for attributes it lacks."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy the three Megatron attributes (and ``_tensor_parallel_mode`` if set) from source to destination."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))
    if hasattr(source_tensor, "_tensor_parallel_mode"):
        destination_tensor._tensor_parallel_mode = source_tensor._tensor_parallel_mode


def set_tensor_parallel_mode(param: torch.Tensor, mode: str) -> None:
    """Annotate ``param`` the Megatron-FSDP way: ``mode`` is "column" (dim 0), "row" (dim 1) or "replicated"."""
    if mode not in TP_MODES:
        raise ConfigError(f"tensor parallel mode {mode!r} is not legal; use one of {sorted(TP_MODES)}")
    if TP_MODES[mode] is not None and TP_MODES[mode] >= param.dim():
        raise ConfigError(
            f"mode {mode!r} splits dim {TP_MODES[mode]}, but the parameter has shape {tuple(param.shape)}; "
            "use 'column' for 1-d parameters split over TP or 'replicated'"
        )
    param._tensor_parallel_mode = mode


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: Optional[int] = None) -> bool:
    """True if ``param`` should count once per model (TP-split, or on TP rank 0): Megatron's grad-norm filter.

    ``tp_rank`` defaults to the calling rank's TP rank from megashard's parallel state.
    """
    if is_mcore_tensor_model_parallel(param):
        return True
    if tp_rank is None:
        from megashard.state import get_parallel_state  # lazy: tp_attrs works without any parallel state

        tp_rank = get_parallel_state().rank_in("tp")
    return tp_rank == 0
