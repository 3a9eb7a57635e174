"""Split a DTensor along a dim like ``torch.split``, without communication or redistribution.

Every piece is a view of this rank's shard with the same mesh and placements; its layout follows
from the shard's :class:`~megashard.tensors.uneven.layout.ChunkLayout`, so pieces are in general uneven.
The layout is the attached one; without one it is computed in the call (collective: every rank of the mesh
calls ``split_dtensor``) whenever a mesh axis shards the tensor, because no rank can tell from its own shard
whether the others sit where the placements predict.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Iterator, List, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from megashard._compat import _StridedShard, dtensor_local
from megashard.chunks import chunk_sizes, contiguous_strides
from megashard.errors import UnevenDTensorError
from megashard.tensors.shape import get_local_shape_and_global_offset
from megashard.tensors.uneven.dcp_hooks import attach_chunk_layout
from megashard.tensors.uneven.layout import ChunkLayout, Level, dim_orders, get_chunk_layout, make_layout, require_dtensor
from megashard.tensors.uneven.metadata import single_layout

__all__ = ["split_dtensor", "_intersection", "_offset_slice"]


def _intersection(s1: slice, s2: slice) -> slice:
    """Intersection of two step-1 slices with explicit ends (empty: ``slice(x, x)``)."""
    start, stop = max(s1.start, s2.start), min(s1.stop, s2.stop)
    return slice(start, max(start, stop))


def _offset_slice(s: slice, offset: int) -> slice:
    """``s`` moved by ``offset`` (e.g. ``-chunk_start`` turns global indices into local ones)."""
    return slice(s.start + offset, s.stop + offset)


def _is_sharded(dtensor: DTensor) -> bool:
    """Whether a mesh axis of size > 1 shards the tensor (then ranks hold different pieces)."""
    mesh = dtensor.device_mesh
    return any(isinstance(p, (Shard, _StridedShard)) and mesh.size(a) > 1 for a, p in enumerate(dtensor.placements))


def _arithmetic_layout(dtensor: DTensor) -> ChunkLayout:
    """The layout placements predict (torch.chunk at every level), checked against the real shard."""
    mesh = dtensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnevenDTensorError(f"the calling rank {dist.get_rank()} is not in this DTensor's mesh {mesh}")
    gshape = tuple(int(s) for s in dtensor.shape)
    local_shape = tuple(int(s) for s in dtensor_local(dtensor).shape)
    orders = dim_orders(tuple(mesh.shape), dtensor.placements, len(gshape))
    levels, lshape = [], []
    for d, g in enumerate(gshape):
        ext, lv = g, []
        for axis in orders.get(d, ()):
            sizes = chunk_sizes(ext, int(mesh.size(axis)))
            lv.append(Level(axis, sizes, int(coord[axis])))
            ext = sizes[int(coord[axis])]
        levels.append(tuple(lv))
        lshape.append(ext)
    layout = make_layout(gshape, lshape, levels, dtensor.placements)
    torch_shape, torch_offset = get_local_shape_and_global_offset(dtensor)
    if tuple(lshape) != local_shape or (tuple(torch_shape), tuple(torch_offset)) != (tuple(lshape), layout.offsets):
        raise UnevenDTensorError(
            f"this DTensor's local shard {local_shape} is not the one its placements {list(dtensor.placements)} "
            f"describe for global shape {gshape} (expected {tuple(lshape)} at {layout.offsets}; PyTorch says "
            f"{tuple(torch_shape)} at {tuple(torch_offset)}), so its layout is unknown without communication: "
            "call update_uneven_dtensor_chunk_metadata(dtensor) on every rank"
        )
    return layout


def _piece_layout(layout: ChunkLayout, dim: int, a: int, size: int) -> tuple[ChunkLayout, int, int]:
    """Layout of global range ``[a, a + size)`` of ``dim``, and the local ``(start, length)`` to keep."""
    b = a + size
    levels = list(layout.levels)
    lo, hi = 0, layout.global_shape[dim]
    new = []
    for lv in layout.levels[dim]:
        starts = list(accumulate(lv.extents, initial=lo))
        ext = tuple(max(0, min(int(starts[c + 1]), b) - max(int(starts[c]), a)) for c in range(len(lv.extents)))
        new.append(Level(lv.axis, ext, lv.index))
        lo, hi = int(starts[lv.index]), int(starts[lv.index + 1])
    levels[dim] = tuple(new)
    own = _intersection(slice(lo, hi), slice(a, b))
    local = _offset_slice(own, -lo)
    shape = list(layout.global_shape)
    shape[dim] = size
    lshape = list(layout.local_shape)
    lshape[dim] = local.stop - local.start
    return make_layout(shape, lshape, levels, layout.placements), local.start, local.stop - local.start


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: Union[int, List[int]],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """Split a DTensor along ``dim`` like ``torch.split``, without any communication.

    Every piece keeps the placements and mesh; its local tensor is a view (narrow) of this rank's
    shard, so nothing is redistributed or copied (Replicate stays replicated: no OOM). Pieces are in
    general uneven (some ranks may hold nothing of a piece).

    The shard's layout comes from an attached one (:func:`update_uneven_dtensor_chunk_metadata`, a
    preprocess, a gather or an earlier split). Without one, and when a mesh axis shards the tensor, the call
    computes it from every rank's local sizes (collective over the mesh, in the call itself, not at the first
    piece: every rank of the mesh must call ``split_dtensor``) and attaches it to ``dtensor``, so later splits
    and gathers of it communicate nothing; shards need not sit where the placements predict.

    Args:
        split_size_or_sections: piece length (the last piece may be shorter) or list of lengths
            summing to ``dtensor.shape[dim]``.
        dim: tensor dim to split (negative counts from the end).
        update_uneven_dtensor_chunk_meta: attach each piece's chunk layout (computed locally, no
            collective), so DCP and :func:`gather_uneven_dtensor_to_full_tensor` use it directly.

    Yields: the pieces, in order. Example: ``for piece in split_dtensor(dt, 3, dim=1): ...``
    """
    require_dtensor(dtensor, "split_dtensor")
    ndim = dtensor.ndim
    if not -ndim <= dim < ndim:
        raise UnevenDTensorError(f"dim {dim} is out of range for a {ndim}-d DTensor; legal: {-ndim}..{ndim - 1}")
    dim %= ndim
    g = int(dtensor.shape[dim])
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise UnevenDTensorError(f"split size {step} must be a positive int")
        sections = [min(step, g - s) for s in range(0, g, step)] or [0]
    else:
        sections = [int(s) for s in split_size_or_sections]
        if any(s < 0 for s in sections) or sum(sections) != g:
            raise UnevenDTensorError(
                f"split sections {sections} must be >= 0 and sum to dim {dim}'s size {g} (they sum to {sum(sections)})"
            )
    layout = get_chunk_layout(dtensor)
    if layout is None:
        if _is_sharded(dtensor):  # every rank gets here together: the decision depends on placements only
            layout = single_layout(dtensor)
            attach_chunk_layout(dtensor, layout)
        else:
            layout = _arithmetic_layout(dtensor)
    return _pieces(dtensor, layout, dim, sections, update_uneven_dtensor_chunk_meta)


def _pieces(dtensor: DTensor, layout: ChunkLayout, dim: int, sections: List[int], attach: bool) -> Iterator[DTensor]:
    local = dtensor.to_local()
    mesh, placements = dtensor.device_mesh, dtensor.placements
    a = 0
    for size in sections:
        piece_layout, lstart, llen = _piece_layout(layout, dim, a, size)
        piece = DTensor.from_local(
            local.narrow(dim, lstart if llen else 0, llen), mesh, placements, run_check=False,
            shape=torch.Size(piece_layout.global_shape), stride=contiguous_strides(piece_layout.global_shape),
        )
        if attach:
            attach_chunk_layout(piece, piece_layout)
        a += size
        yield piece
