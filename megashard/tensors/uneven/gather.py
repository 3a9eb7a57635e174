"""Gather an uneven DTensor to its full tensor on every rank of its mesh (gloo and NCCL alike).

Per sharded level, one broadcast per piece, straight into the result: unlike gloo's all-gather a
broadcast takes pieces of any size, so no padding is needed. A DTensor without an attached layout
finds it first (:mod:`~megashard.tensors.uneven.metadata`); a small one sharded over a single mesh
axis sends its metadata and data together in one round (:func:`_eager_gather_1d`).
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from megashard._compat import dtensor_gather_crashes, dtensor_local
from megashard.chunks import chunk_size
from megashard.errors import UnevenDTensorError
from megashard.tensors.uneven.dcp_hooks import attach_chunk_layout
from megashard.tensors.uneven.layout import ChunkLayout, Level, dim_orders, get_chunk_layout, make_layout, require_dtensor
from megashard.tensors.uneven.metadata import (
    ERR_LAYOUT,
    ERR_LOCAL,
    ERR_TILING,
    ExchangeErrors,
    ExtentTables,
    axis_peers,
    fingerprint,
    layout_summaries,
    single_layout,
)

__all__ = [
    "full_tensor",
    "gather_uneven_dtensor_to_full_tensor",
    "redistribute_uneven_dtensor_to_replicated",
    "uneven_dtensor_to_full_tensor",
    "_assemble_full_tensor_from_uneven_chunks",
]


def _box(t: torch.Tensor, lo: Sequence[int], ln: Sequence[int]) -> torch.Tensor:
    for d, (a, n) in enumerate(zip(lo, ln)):
        if a != 0 or n != t.shape[d]:
            t = t.narrow(d, a, n)
    return t


def _broadcast_boxes(full: torch.Tensor, boxes: Sequence[Optional[tuple]], srcs: Sequence[int], own: int, group) -> None:
    """Fill ``full``'s ``boxes[i]`` (``(lo, len)`` per dim, None = skip) from global rank ``srcs[i]``.

    Uses one broadcast per box, all in flight at once: unlike gloo's all-gather it takes pieces of
    any size, and a box that is contiguous in ``full`` is received in place (no padding, no copy).
    """
    works, copies = [], []
    for i, box in enumerate(boxes):
        if box is None:
            continue
        view = _box(full, *box)
        if view.numel() == 0:
            continue
        if view.is_contiguous():
            buf = view
        elif i == own:
            buf = view.contiguous()
        else:
            buf = torch.empty(view.shape, dtype=full.dtype, device=full.device)
            copies.append((view, buf))
        works.append(dist.broadcast(buf, src=srcs[i], group=group, async_op=True))
    for w in works:
        w.wait()
    for view, buf in copies:
        view.copy_(buf)


def _reduce_partials(local: torch.Tensor, dtensor: DTensor) -> torch.Tensor:
    mesh = dtensor.device_mesh
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    for axis, p in enumerate(dtensor.placements):
        if not isinstance(p, Partial) or mesh.size(axis) == 1:
            continue
        op = getattr(p, "reduce_op", "sum")
        if op not in ops:
            raise UnevenDTensorError(f"{p} on mesh axis {axis}: reduce op {op!r} is not supported; use one of {sorted(ops)}")
        local = local.contiguous().clone()
        dist.all_reduce(local, op=ops[op], group=mesh.get_group(axis))
        if op == "avg":
            local = local / mesh.size(axis)
    return local


def _assemble(local: torch.Tensor, layout: ChunkLayout, mesh: DeviceMesh) -> torch.Tensor:
    """Gather along each sharded dim, innermost level first, straight into the full tensor."""
    coord = [int(c) for c in mesh.get_coordinate()]
    full = torch.empty(layout.global_shape, dtype=local.dtype, device=local.device)
    lo, ln = list(layout.start), list(layout.local_shape)
    if local.numel():
        _box(full, lo, ln).copy_(local)
    for d, levels in enumerate(layout.levels):
        starts = [0]
        for lv in levels:
            starts.append(starts[-1] + sum(lv.extents[: lv.index]))
        for j in reversed(range(len(levels))):
            lv = levels[j]
            if len(lv.extents) > 1:
                group, line, _ = axis_peers(mesh, lv.axis, coord)
                boxes, pos = [], starts[j]
                for ext in lv.extents:
                    blo, bln = list(lo), list(ln)
                    blo[d], bln[d] = pos, ext
                    boxes.append((blo, bln))
                    pos += ext
                _broadcast_boxes(full, boxes, line, lv.index, group)
            lo[d], ln[d] = starts[j], sum(lv.extents)
    return full


def _wrap_replicated(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=full.shape, stride=full.stride())


def _finish(full: torch.Tensor, mesh: DeviceMesh, target_device, return_dtensor: bool):
    if target_device is not None:
        full = full.to(target_device)
    if not return_dtensor:
        return full
    if full.device.type != mesh.device_type:
        raise UnevenDTensorError(
            f"target_device {full.device} is not of the mesh's device type {mesh.device_type!r}, so the result "
            "cannot be a DTensor on that mesh; pass return_dtensor=False to get a plain tensor there"
        )
    return _wrap_replicated(full, mesh)


def gather_uneven_dtensor_to_full_tensor(
    dtensor: DTensor,
    target_device: Optional[torch.device] = None,
    *,
    return_dtensor: bool = True,
) -> Union[DTensor, torch.Tensor]:
    """The full tensor of an (uneven) DTensor on every rank of its mesh.

    Equals ``dtensor.full_tensor()`` wherever that is defined, and is also right for arbitrary
    local sizes. Collective over the mesh: if no layout is attached, one small all-gather per mesh
    axis finds it and attaches it to ``dtensor`` (as :func:`update_uneven_dtensor_chunk_metadata`
    does), so the next gather of the same DTensor moves data only: per sharded level, one
    broadcast per piece, straight into the result (works on gloo, which rejects differently sized
    all-gathers; no padding). Partial axes are reduced first. No autograd.

    Args:
        dtensor: the DTensor, shape ``G`` (any placements).
        target_device: move the result there (default: the local shard's device).
        return_dtensor: True (Megatron-FSDP's contract): a DTensor replicated on the mesh, whose
            ``to_local()`` is the full tensor; False: the plain full tensor of shape ``G``.
    """
    require_dtensor(dtensor, "gather_uneven_dtensor_to_full_tensor")
    mesh = dtensor.device_mesh
    layout = get_chunk_layout(dtensor)
    with torch.no_grad():
        if layout is None:  # every rank gets here together (the layout follows the shapes only)
            eager = _eager_gather_1d(dtensor)
            if eager is not None:
                full, layout = eager
                attach_chunk_layout(dtensor, layout)
                return _finish(full, mesh, target_device, return_dtensor)
            layout = single_layout(dtensor)
            attach_chunk_layout(dtensor, layout)
        local = _reduce_partials(dtensor_local(dtensor), dtensor)
        full = _assemble(local, layout, mesh)
    return _finish(full, mesh, target_device, return_dtensor)


def _mesh_backend(mesh: DeviceMesh) -> str:
    """The backend of the mesh's groups ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...); "" without groups."""
    try:
        return ",".join(sorted({str(dist.get_backend(mesh.get_group(a))) for a in range(mesh.ndim)}))
    except (RuntimeError, ValueError):
        return ""


def full_tensor(dtensor: DTensor, *, avoid_dtensor_gather: Optional[bool] = None) -> torch.Tensor:
    """``dtensor.full_tensor()`` (the plain full tensor on every rank of the mesh; collective), by a way that works.

    On a CUDA mesh over gloo some torch releases crash inside DTensor's own gather (2.11: SIGSEGV in every rank, see
    :func:`megashard._compat.dtensor_gather_crashes`); there this gathers with broadcasts
    (:func:`gather_uneven_dtensor_to_full_tensor`), elsewhere it is ``dtensor.full_tensor()``. No autograd on the
    way round. ``avoid_dtensor_gather``: force the choice (None: decide from the mesh and the torch release).
    """
    mesh = dtensor.device_mesh
    if avoid_dtensor_gather is None:
        avoid_dtensor_gather = dtensor_gather_crashes(mesh.device_type, _mesh_backend(mesh))
    if not avoid_dtensor_gather:
        return dtensor.full_tensor()
    return gather_uneven_dtensor_to_full_tensor(dtensor, return_dtensor=False)


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The full tensor (plain ``torch.Tensor`` of shape ``dtensor.shape``) of an (uneven) DTensor, on every rank of
    its mesh: Megatron-FSDP's name. Collective; attaches the chunk metadata when it is missing, as Megatron-FSDP does.

    Raises: TypeError when ``dtensor`` is not a DTensor (as Megatron-FSDP)."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"Input must be a DTensor, got {type(dtensor).__name__}.")
    return gather_uneven_dtensor_to_full_tensor(dtensor, return_dtensor=False)


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """The (uneven) DTensor as a DTensor replicated on its mesh (``to_local()`` is the full tensor): Megatron-FSDP's
    name for :func:`gather_uneven_dtensor_to_full_tensor` (which it deprecates in favour of this one)."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"Input must be a DTensor, got {type(dtensor).__name__}.")
    return gather_uneven_dtensor_to_full_tensor(dtensor, return_dtensor=True)


_EAGER_CAP = 4 << 20  # bytes per rank sent eagerly with the metadata (small tensors: one round, not two)
_EAGER_SLACK = 1.25  # room for pieces up to 1.25x the torch.chunk size before a second round is needed


def _eager_gather_1d(dtensor: DTensor) -> Optional[tuple[torch.Tensor, ChunkLayout]]:
    """Gather a small DTensor sharded by one mesh axis in ONE round: metadata and data together.

    Each rank broadcasts ``[fingerprint, error, local shape | first K bytes of its shard]`` with K
    fixed by the global shape (every rank computes the same K): pieces up to ``_EAGER_SLACK`` times
    the torch.chunk size (all of FSDP's) arrive in that round; the bytes of larger pieces beyond K
    follow in a second round, straight into place when the piece is contiguous. Returns None (use the general path) unless exactly one mesh axis has size > 1 and
    it is a ``Shard`` whose torch.chunk piece is at most ``_EAGER_CAP`` bytes.
    """
    mesh = dtensor.device_mesh
    axes = [a for a in range(mesh.ndim) if mesh.size(a) > 1]
    if len(axes) != 1 or not isinstance(dtensor.placements[axes[0]], Shard):
        return None
    axis, n = axes[0], mesh.size(axes[0])
    gshape = tuple(int(x) for x in dtensor.shape)
    ndim = len(gshape)
    orders = dim_orders(tuple(mesh.shape), dtensor.placements, ndim)
    if list(orders.values()) != [[axis]]:  # a size-1 axis also shards some dim: the general path knows how
        return None
    (d, _), = orders.items()
    local = dtensor_local(dtensor)
    row = math.prod(g for i, g in enumerate(gshape) if i != d) * local.element_size()
    cap = int(chunk_size(gshape[d], n) * _EAGER_SLACK + 1) * row
    if cap > _EAGER_CAP:
        return None
    coord = [int(c) for c in mesh.get_coordinate()]
    me = coord[axis]
    group, line, _ = axis_peers(mesh, axis, coord)
    work = ExtentTables("<tensor>", dtensor, tuple(mesh.shape))  # for its local checks only
    problem = work.local_problem()
    head = 8 * (3 + ndim)
    fp = fingerprint(layout_summaries([("<tensor>", dtensor)]))
    bufs = [torch.empty(head + cap, dtype=torch.uint8, device=local.device) for _ in range(n)]
    mine = bufs[me]
    lshape = (list(local.shape) + [0] * ndim)[:ndim]  # fixed length even for a malformed shard
    mine[:head].view(torch.int64).copy_(torch.tensor([fp, 1 if problem else 0, dist.get_rank()] + lshape))
    nbytes = local.numel() * local.element_size()
    if nbytes and not problem:
        flat = local.contiguous().view(-1).view(torch.uint8)
        mine[head:head + min(nbytes, cap)].copy_(flat[:cap])
    works = [dist.broadcast(bufs[c], src=line[c], group=group, async_op=True) for c in range(n)]
    for w in works:
        w.wait()
    heads = [b[:head].view(torch.int64).tolist() for b in bufs]
    shapes = [h[3:] for h in heads]
    errs = ExchangeErrors()
    if problem:
        errs.add(ERR_LOCAL, dist.get_rank(), problem)
    for h in heads:
        if h[1]:
            errs.add(ERR_LOCAL, h[2])
        if h[0] != heads[0][0]:
            errs.add(ERR_LAYOUT, min(line), f"mesh axis {axis} (ranks {line}): ranks passed DTensors with "
                     "different global shapes, placements or dtypes to the same call")
    extents = tuple(int(s[d]) for s in shapes)
    if not errs.code and sum(extents) != gshape[d]:
        errs.add(ERR_TILING, min(line), f"<tensor>: the local shards along dim {d} add up to {sum(extents)} "
                 f"elements, but the global shape {gshape} has {gshape[d]}")
    errs.raise_if_any(mesh)
    levels = [((Level(axis, extents, me),) if i == d else ()) for i in range(ndim)]
    layout = make_layout(gshape, local.shape, levels, dtensor.placements)
    full = torch.empty(gshape, dtype=local.dtype, device=local.device)
    starts = [0, *accumulate(extents)]
    works, copies = [], []
    for c in range(n):
        piece = full.narrow(d, starts[c], extents[c])
        size = piece.numel() * local.element_size()
        if c == me:
            piece.copy_(local)
            if size > cap:  # the rest of my piece follows in round two
                rest = local.contiguous().view(-1).view(torch.uint8)[cap:]
                works.append(dist.broadcast(rest, src=line[c], group=group, async_op=True))
        elif size <= cap:
            piece.copy_(bufs[c][head:head + size].view(local.dtype).view(piece.shape))
        else:  # round two brings the bytes that did not fit
            if piece.is_contiguous():
                tmp = piece.view(-1).view(torch.uint8)
            else:
                tmp = torch.empty(size, dtype=torch.uint8, device=local.device)
                copies.append((piece, tmp))
            tmp[:cap].copy_(bufs[c][head:])
            works.append(dist.broadcast(tmp[cap:], src=line[c], group=group, async_op=True))
    for w in works:
        w.wait()
    for piece, tmp in copies:
        piece.copy_(tmp.view(local.dtype).view(piece.shape))
    return full, layout


def _parse_chunk_info(info: Any) -> tuple[list[int], list[int]]:
    if isinstance(info, ChunkStorageMetadata):
        return list(info.offsets), list(info.sizes)
    for ok in ("offsets", "offset", "global_offset"):
        for sk in ("sizes", "shape", "local_shape", "size"):
            if ok in info and sk in info:
                return [int(x) for x in info[ok]], [int(x) for x in info[sk]]
    raise UnevenDTensorError(
        f"chunk info {info!r} must be a ChunkStorageMetadata or a dict with 'offsets' and 'sizes' (or 'offset'/'shape')"
    )


def _assemble_full_tensor_from_uneven_chunks(
    dtensor: DTensor,
    all_chunk_info: List[dict],
    process_group: dist.ProcessGroup,
    target_device: Optional[torch.device],
) -> DTensor:
    """Assemble the full tensor from the chunks of every rank of ``process_group``.

    ``all_chunk_info[i]`` describes group rank ``i``'s local shard of ``dtensor``: a
    ``ChunkStorageMetadata`` or a dict with ``offsets`` and ``sizes`` (global offsets and local
    shape). Ranks holding the same chunk (replicas) are read once. Each chunk moves by one
    broadcast straight into place, so chunk sizes may differ (gloo included).
    Returns a DTensor replicated on ``dtensor``'s mesh whose local tensor is the full tensor.
    """
    n = dist.get_world_size(process_group)
    if len(all_chunk_info) != n:
        raise UnevenDTensorError(f"all_chunk_info has {len(all_chunk_info)} entries for a process group of {n} ranks")
    chunks = [_parse_chunk_info(c) for c in all_chunk_info]
    own = dist.get_rank(process_group)
    local = dtensor_local(dtensor)
    if tuple(chunks[own][1]) != tuple(local.shape):
        raise UnevenDTensorError(
            f"all_chunk_info[{own}] (this rank) says sizes {chunks[own][1]}, but the local shard is {tuple(local.shape)}"
        )
    with torch.no_grad():
        full = torch.empty(tuple(dtensor.shape), dtype=local.dtype, device=local.device)
        seen: set = set()
        boxes: list[Optional[tuple]] = []
        for off, size in chunks:
            key = (tuple(off), tuple(size))
            empty = 0 in size
            boxes.append(None if empty or key in seen else (off, size))
            seen.add(key)
        if local.numel():
            _box(full, *chunks[own]).copy_(local)
        _broadcast_boxes(full, boxes, [dist.get_global_rank(process_group, i) for i in range(n)], own, process_group)
    return _finish(full, dtensor.device_mesh, target_device, True)

