"""Where one rank's shard of an uneven DTensor sits in the global tensor: :class:`ChunkLayout`.

Layout model. Each tensor dim ``d`` is split by the mesh axes whose placement shards it, nested in
PyTorch's order: mesh axis 0 outermost, except that a run of ``_StridedShard(d)`` closed by a
``Shard(d)`` means the ``Shard`` axis splits first (FSDP2 + TP; see
:func:`megashard.tensors.shape.explicit_order_placements`). Level by level, a block of the dim is cut
into consecutive pieces, one per coordinate of that axis, with arbitrary (uneven) lengths. The result
equals ``DTensor.full_tensor()`` wherever that is defined.

A layout is computed by the metadata exchange (:mod:`~megashard.tensors.uneven.metadata`), attached to
its DTensor, and read by the DCP hooks, the gather and the split without further communication.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from megashard._compat import dtensor_local
from megashard.errors import NotADTensorError, UnevenDTensorError
from megashard.tensors.shape import explicit_order_placements

__all__ = ["ChunkLayout", "Level", "attached_layout", "dim_orders", "get_chunk_layout", "make_layout", "remember_layout"]

_LAYOUT_ATTR = "_megashard_chunk_layout"


class Level(NamedTuple):
    """One nesting level of a sharded dim, seen from the calling rank.

    ``axis`` (a mesh axis) cuts the enclosing block into ``len(extents)`` consecutive pieces;
    ``extents[c]`` is the length (elements along the dim) of the piece at coordinate ``c`` on that
    axis, and ``index`` is the calling rank's coordinate.
    """

    axis: int
    extents: tuple[int, ...]
    index: int


@dataclass(frozen=True)
class ChunkLayout:
    """Where the calling rank's local shard sits in a DTensor's global tensor.

    ``start[d]`` is the first global index of the shard along dim ``d``; ``offsets`` is the same but
    with PyTorch's convention for an empty shard (offset = global size of that dim).
    ``levels[d]`` lists the nesting levels of dim ``d``, outermost first (``()`` if unsharded): it
    holds the sibling extents every gather or split needs, so neither needs another exchange.
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    start: tuple[int, ...]
    offsets: tuple[int, ...]
    levels: tuple[tuple[Level, ...], ...]
    placements: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def chunk(self) -> ChunkStorageMetadata:
        """This rank's chunk as DCP describes it (offsets with PyTorch's empty-shard convention)."""
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.local_shape))


def make_layout(global_shape: Sequence[int], local_shape: Sequence[int], levels: Sequence[Sequence[Level]],
                placements: Sequence[Any]) -> ChunkLayout:
    """The :class:`ChunkLayout` of a shard from its nesting ``levels`` per dim (start = extents before it)."""
    start, offsets = [], []
    for d, lv in enumerate(levels):
        s = sum(sum(level.extents[: level.index]) for level in lv)
        start.append(s)
        offsets.append(int(global_shape[d]) if lv and local_shape[d] == 0 else s)
    return ChunkLayout(
        tuple(int(x) for x in global_shape), tuple(int(x) for x in local_shape), tuple(start), tuple(offsets),
        tuple(tuple(lv) for lv in levels), tuple(placements),
    )


def require_dtensor(value: Any, fn: str, arg: str = "dtensor") -> None:
    """:class:`NotADTensorError` naming the function unless ``value`` is a DTensor (checked before any collective, so
    a plain tensor is one line, not an AttributeError from deep inside)."""
    if isinstance(value, DTensor):
        return
    what = type(value).__name__
    hint = (": a plain tensor has no device mesh or placements; make it a DTensor first, e.g. "
            "DTensor.from_local(t, mesh, [Shard(0)])") if isinstance(value, torch.Tensor) else ""
    raise NotADTensorError(f"{fn}({arg}=...): expects a DTensor (torch.distributed.tensor.DTensor), got {what}{hint}")


def attached_layout(dtensor: DTensor) -> Optional[ChunkLayout]:
    """The layout attached to ``dtensor`` (see :func:`remember_layout`), even if it no longer matches it."""
    return getattr(dtensor, _LAYOUT_ATTR, None)


def remember_layout(dtensor: DTensor, layout: ChunkLayout) -> None:
    """Attach ``layout`` to ``dtensor`` (an instance attribute: it lives and dies with the DTensor)."""
    setattr(dtensor, _LAYOUT_ATTR, layout)


def get_chunk_layout(dtensor: DTensor) -> Optional[ChunkLayout]:
    """The layout attached to ``dtensor`` by :func:`update_uneven_dtensor_chunk_metadata`, a preprocess,
    a split or a gather; None if there is none or it no longer matches the DTensor's shapes."""
    layout = attached_layout(dtensor)
    if layout is None:
        return None
    if layout.local_shape != tuple(dtensor_local(dtensor).shape) or layout.global_shape != tuple(dtensor.shape):
        return None
    return layout


def dim_orders(mesh_shape: Sequence[int], placements: Sequence[Any], ndim: int) -> dict[int, list[int]]:
    """Tensor dim -> mesh axes that split it, outermost first (PyTorch's order, strided runs resolved)."""
    key = (tuple(int(n) for n in mesh_shape), tuple(placements), ndim)
    try:
        orders = _dim_orders_cached(*key)
    except TypeError:  # an unhashable placement type: compute without the cache
        orders = _dim_orders_cached.__wrapped__(*key)
    return {d: list(axes) for d, axes in orders}


@functools.lru_cache(maxsize=1024)  # a state dict repeats a handful of layouts thousands of times
def _dim_orders_cached(mesh_shape: tuple, placements: tuple, ndim: int) -> tuple:
    orders: dict[int, list[int]] = {}
    for axis, p in explicit_order_placements(mesh_shape, placements):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise UnevenDTensorError(f"{p} on mesh axis {axis} shards dim {p.dim} of a {ndim}-d tensor")
            orders.setdefault(d, []).append(axis)
    return tuple((d, tuple(a)) for d, a in sorted(orders.items()))

