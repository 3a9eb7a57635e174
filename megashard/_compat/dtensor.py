"""DTensor internals: the ``_StridedShard`` placement, DTensor's local-shape/offset arithmetic, a local shard without
autograd (:mod:`megashard.tensors`). Nothing here imports DTensor before it is called: ``import
megashard.parallel_state`` must not pay for it.
"""
from __future__ import annotations

import torch


# --- DTensor placement internals (used by megashard.tensors.shape / placements) ---------------------
# `_StridedShard` is the placement FSDP2 gives a parameter whose dim is sharded by TP and FSDP at once. It is
# looked up on first use (the package's module ``__getattr__``): importing DTensor costs ~0.5 s, and `import
# megashard.parallel_state` must not pay it.
def strided_shard_class() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def _torch_local_shape_offset_fn():
    """The plain-data core of DTensor's own local-shape/offset arithmetic (torch >= 2.9), or None."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - moved or renamed in some release
        return None
    return _compute_local_shape_and_global_offset


def torch_compute_local_shape_and_global_offset(global_shape, mesh, placements):
    """PyTorch's own `compute_local_shape_and_global_offset` for the calling rank (reference answer)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def torch_local_shape_and_offset_at(global_shape, mesh_shape, coordinate, placements):
    """PyTorch's answer for any mesh coordinate without a process group, or None if this torch lacks it."""
    fn = _torch_local_shape_offset_fn()
    if fn is None:
        return None
    return fn(global_shape, tuple(mesh_shape), list(coordinate), placements)


# --- DTensor local shard without autograd (used by megashard.tensors.uneven) -----------------------
def dtensor_local(dtensor) -> torch.Tensor:
    """The local shard of a DTensor without going through ``to_local()``'s autograd Function.

    ``DTensor._local_tensor`` costs nothing, where ``to_local()`` costs ~0.2 ms (it matters for state
    dicts of thousands of tensors); falls back to ``to_local()`` if the attribute ever disappears.
    """
    local = getattr(dtensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dtensor.to_local()
