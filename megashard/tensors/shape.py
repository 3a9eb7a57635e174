"""Local shard shape and global offset of a DTensor for *any* rank, with no process group needed.

A DTensor of global shape ``G`` laid out with ``placements`` on a device mesh gives every mesh
coordinate one local shard. This module answers, for any coordinate or global rank, which global
indices that shard holds, as DTensor itself (torch 2.13) defines them:

* placements are applied left to right (mesh axis 0 outermost), each one splitting what the earlier
  axes left on that rank;
* ``Shard(d)`` over an axis of size ``n`` splits the current extent ``L`` of dim ``d`` like
  ``torch.chunk``: chunks of ``ceil(L / n)``, trailing ranks may get fewer or zero elements;
* ``_StridedShard(d, split_factor=sf)`` first chunks ``L`` into ``sf`` pieces, chunks every piece
  into ``n`` parts and gives rank ``i`` the concatenation of part ``i`` of every piece (the FSDP2 +
  TP layout written left to right);
* ``Replicate`` and ``Partial`` do not split anything.

Index sets are kept as runs of half-open ``(start, stop)`` global intervals, so the arithmetic is
exact for uneven sizes, empty shards and strided layouts, and costs O(runs) instead of O(elements).

Meshes. Every public function takes ``mesh`` as either

* a :class:`~torch.distributed.device_mesh.DeviceMesh` (real, or built on the ``fake`` backend), or
* a plain *rank grid*: an integer tensor (or nested lists) whose shape is the mesh shape and whose
  entries are global ranks, e.g. ``torch.arange(8).reshape(2, 2, 2)``.

Both are read only for their shape and rank grid; nothing communicates. ``rank=None`` means the
calling rank (``mesh.get_coordinate()`` for a DeviceMesh, ``torch.distributed.get_rank()`` for a
grid). A rank that is not in the mesh gets PyTorch's answer for that case: ``((0,), ())``.
To work directly in mesh coordinates use :func:`local_shape_and_offset_at`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from megashard._compat import _StridedShard
from megashard.chunks import chunk_bounds
from megashard.errors import ShardingError, StateError

__all__ = [
    "MeshLike",
    "Runs",
    "compute_local_shape_and_global_offset",
    "get_local_shape_and_global_offset",
    "local_shape_and_offset_at",
    "global_index_runs_at",
    "compute_global_index_runs",
    "mesh_coordinate_of",
    "explicit_order_placements",
    "ordered_index_runs_at",
    "_explicit_order_placements",
]

MeshLike = Union[DeviceMesh, torch.Tensor, Sequence[Any]]
Runs = tuple[tuple[int, int], ...]
"""Global indices of one dim as half-open ``(start, stop)`` intervals, in local (storage) order."""


# ---------------------------------------------------------------------------------------------------
# Run arithmetic: a shard of one dim is the concatenation of its runs.
# ---------------------------------------------------------------------------------------------------
def _runs_len(runs: Sequence[tuple[int, int]]) -> int:
    return sum(b - a for a, b in runs)


def _select(runs: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Local positions ``[lo, hi)`` of the concatenated ``runs``, as runs of global indices."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in runs:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            start, stop = a + s - pos, a + e - pos
            if out and out[-1][1] == start:  # keep runs maximal so contiguity is visible
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        pos += n
        if pos >= hi:
            break
    return out


def _shard_runs(runs: list[tuple[int, int]], placement: Placement, axis_size: int, index: int) -> list[tuple[int, int]]:
    length = _runs_len(runs)
    if isinstance(placement, _StridedShard):
        sf = int(placement.split_factor)
        out: list[tuple[int, int]] = []
        for piece in range(sf):
            p_lo, p_hi = chunk_bounds(length, sf, piece)
            c_lo, c_hi = chunk_bounds(p_hi - p_lo, axis_size, index)
            for run in _select(runs, p_lo + c_lo, p_lo + c_hi):
                if out and out[-1][1] == run[0]:
                    out[-1] = (out[-1][0], run[1])
                else:
                    out.append(run)
        return out
    lo, hi = chunk_bounds(length, axis_size, index)
    return _select(runs, lo, hi)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------
def _is_shard_like(p: Placement) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def _normalized_dim(p: Placement, ndim: int, axis: int, placements: Sequence[Placement]) -> int:
    d = p.dim
    if d < 0:
        d += ndim
    if not 0 <= d < ndim:
        raise ShardingError(
            f"placement {p} on mesh axis {axis} of {list(placements)} shards dim {p.dim}, but the tensor has "
            f"{ndim} dims; legal dims are {-ndim}..{ndim - 1}"
        )
    return d


def _check(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> None:
    if len(placements) != len(mesh_shape):
        raise ShardingError(
            f"got {len(placements)} placements {list(placements)} for a {len(mesh_shape)}-axis mesh of shape "
            f"{tuple(mesh_shape)}; give exactly one placement per mesh axis (Replicate() for an unused axis)"
        )
    if any(int(s) < 0 for s in global_shape):
        raise ShardingError(f"global_shape {tuple(global_shape)} has a negative size; sizes must be >= 0")
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            if int(p.split_factor) < 1:
                raise ShardingError(f"{p} on mesh axis {axis} has split_factor {p.split_factor}; it must be >= 1")
        elif not isinstance(p, (Shard, Replicate, Partial)):
            raise ShardingError(
                f"placement {p!r} on mesh axis {axis} is not supported; use Shard, _StridedShard, Replicate or Partial"
            )


# ---------------------------------------------------------------------------------------------------
# Coordinate-level API (pure arithmetic)
# ---------------------------------------------------------------------------------------------------
def global_index_runs_at(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[Runs, ...]:
    """Global indices held at mesh ``coordinate``, per tensor dim, as runs of ``(start, stop)``.

    A dim whose result has more than one run is not a contiguous slice of the global tensor (only
    ``_StridedShard`` without a later ``Shard`` of the same dim does that). An empty shard has ``()``.
    """
    _check(global_shape, mesh_shape, placements)
    if len(coordinate) != len(mesh_shape):
        raise ShardingError(f"coordinate {tuple(coordinate)} has {len(coordinate)} entries; the mesh {tuple(mesh_shape)} has {len(mesh_shape)} axes")
    ndim = len(global_shape)
    runs: list[list[tuple[int, int]]] = [[(0, int(s))] if int(s) > 0 else [] for s in global_shape]
    for axis, p in enumerate(placements):
        if not _is_shard_like(p):
            continue
        c, n = int(coordinate[axis]), int(mesh_shape[axis])
        if not 0 <= c < n:
            raise ShardingError(f"coordinate {tuple(coordinate)} is outside the mesh {tuple(mesh_shape)} on axis {axis}")
        d = _normalized_dim(p, ndim, axis, placements)
        runs[d] = _shard_runs(runs[d], p, n, c)
    return tuple(tuple(r) for r in runs)


def local_shape_and_offset_at(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the shard at mesh ``coordinate`` (no mesh object needed).

    The offset of a dim is the global index of its first local element; for an empty shard it is the
    global size of that dim (as PyTorch reports it). Unsharded dims have offset 0.
    """
    runs = global_index_runs_at(global_shape, mesh_shape, placements, coordinate)
    sharded = {_normalized_dim(p, len(global_shape), a, placements) for a, p in enumerate(placements) if _is_shard_like(p)}
    shape = tuple(_runs_len(r) for r in runs)
    offset = tuple(
        (r[0][0] if r else int(global_shape[d])) if d in sharded else 0 for d, r in enumerate(runs)
    )
    return shape, offset


# ---------------------------------------------------------------------------------------------------
# Mesh / rank resolution
# ---------------------------------------------------------------------------------------------------
def _rank_grid(mesh: MeshLike) -> torch.Tensor:
    if isinstance(mesh, DeviceMesh):
        return mesh.mesh
    grid = mesh if isinstance(mesh, torch.Tensor) else torch.as_tensor(mesh)
    if grid.dtype.is_floating_point or grid.dtype == torch.bool or grid.dim() == 0:
        raise ShardingError(
            f"mesh must be a DeviceMesh or an integer rank grid with >= 1 axis (e.g. torch.arange(8).reshape(2, 4)); "
            f"got a {grid.dim()}-d {grid.dtype} tensor"
        )
    if grid.unique().numel() != grid.numel():
        raise ShardingError(f"rank grid {grid.tolist()} lists a rank twice; every rank may appear once")
    return grid


def mesh_coordinate_of(mesh: MeshLike, rank: int | None = None) -> tuple[int, ...] | None:
    """Coordinate of global ``rank`` (default: the calling rank) in ``mesh``, or None if it is not in it."""
    if rank is None and isinstance(mesh, DeviceMesh):
        c = mesh.get_coordinate()
        return None if c is None else tuple(int(x) for x in c)
    if rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise StateError(
                "rank=None means the calling rank, but torch.distributed is not initialised; "
                "pass rank=<global rank> explicitly or initialise a process group"
            )
        rank = dist.get_rank()
    hits = (_rank_grid(mesh) == int(rank)).nonzero()
    return None if hits.numel() == 0 else tuple(int(x) for x in hits[0])


def _mesh_shape(mesh: MeshLike) -> tuple[int, ...]:
    return tuple(int(s) for s in _rank_grid(mesh).shape)


# ---------------------------------------------------------------------------------------------------
# Public API (OLMo-core names and signatures)
# ---------------------------------------------------------------------------------------------------
def compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh: MeshLike,
    placements: Sequence[Placement],
    rank: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shard shape and global offset of a DTensor on global ``rank`` (default: the calling rank).

    Args:
        global_shape: shape of the full tensor (elements per dim).
        mesh: a DeviceMesh or an integer rank grid (see module docstring).
        placements: one placement per mesh axis: Shard, _StridedShard, Replicate or Partial.
        rank: global rank to answer for; None means the calling rank.

    Returns:
        ``(local_shape, global_offset)``, one entry per tensor dim. The offset of an empty shard
        is the global size of that dim; a rank outside the mesh gets ``((0,), ())`` — both as
        ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` reports them.

    Example (mesh (2, 4) = ranks [[0..3], [4..7]], global (8, 4), [Shard(0), Shard(0)]):
        rank r -> ((1, 4), (r, 0)). For global (2,) with [Shard(0)] on a 1-D mesh of 8:
        ranks 0, 1 -> ((1,), (r,)); ranks 2..7 -> ((0,), (2,)).
    """
    coord = mesh_coordinate_of(mesh, rank)
    if coord is None:
        return ((0,), ())
    return local_shape_and_offset_at(global_shape, _mesh_shape(mesh), placements, coord)


def get_local_shape_and_global_offset(
    dtensor: DTensor, rank: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Like :func:`compute_local_shape_and_global_offset`, reading shape, mesh and placements from a DTensor."""
    return compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements, rank)


def compute_global_index_runs(
    global_shape: Sequence[int],
    mesh: MeshLike,
    placements: Sequence[Placement],
    rank: int | None = None,
) -> tuple[Runs, ...] | None:
    """Exact global indices of ``rank``'s shard per dim (runs of ``(start, stop)``), None if not in the mesh.

    Use this instead of the offset when a layout may be strided (a dim with more than one run).
    """
    coord = mesh_coordinate_of(mesh, rank)
    if coord is None:
        return None
    return global_index_runs_at(global_shape, _mesh_shape(mesh), placements, coord)


def explicit_order_placements(
    mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> Sequence[tuple[int, Placement]]:
    """Rewrite ``_StridedShard`` placements as plain shards applied in an explicit order.

    Returns ``(mesh_axis, placement)`` pairs in the order the sharding is applied. A run of
    ``_StridedShard(d)`` placements closed by a ``Shard(d)`` means "the ``Shard(d)`` axis split the dim
    first, then the strided axes, right to left", e.g. on a 3-axis mesh::

        [Shard(0), _StridedShard(0, split_factor=2), Shard(0)]  (mesh (n0, n1, 2))
        -> [(0, Shard(0)), (2, Shard(0)), (1, Shard(0))]

    Each ``split_factor`` must equal the product of the sizes of the axes that split the dim before it
    in that order. The rewrite is exact whenever every split in the strided part divides evenly (and
    for FSDP2 + TP whenever the TP split does); for other uneven sizes use the ordered list as the
    layout *intended* and :func:`global_index_runs_at` for what DTensor does with the placements.
    """
    if len(placements) != len(mesh_shape):
        raise ShardingError(
            f"got {len(placements)} placements {list(placements)} for a {len(mesh_shape)}-axis mesh {tuple(mesh_shape)}; "
            "give exactly one placement per mesh axis"
        )
    ordered: list[tuple[int, Placement]] = []
    deferred: dict[int, list[tuple[int, Placement]]] = defaultdict(list)
    strided_part_ended: set[int] = set()
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            deferred[p.dim].append((axis, p))
            continue
        ordered.append((axis, p))
        if not isinstance(p, Shard):
            continue
        if p.dim in strided_part_ended:
            raise ShardingError(
                f"{p} on mesh axis {axis} of {list(placements)} shards dim {p.dim} after its strided part ended; "
                "a dim may have one run of _StridedShard placements closed by one Shard"
            )
        if p.dim in deferred:
            strided_part_ended.add(p.dim)
            pending = deferred.pop(p.dim)
            aggregate = int(mesh_shape[axis])
            while pending:  # right to left: the strided axis nearest the closing Shard splits next
                s_axis, s = pending.pop()
                if int(s.split_factor) != aggregate:
                    raise ShardingError(
                        f"{s} on mesh axis {s_axis} of {list(placements)} (mesh {tuple(mesh_shape)}) needs "
                        f"split_factor == {aggregate}, the product of the mesh axes that split dim {p.dim} before it"
                    )
                aggregate *= int(mesh_shape[s_axis])
                ordered.append((s_axis, Shard(p.dim)))
    if deferred:
        left = {d: [str(p) for _, p in v] for d, v in deferred.items()}
        raise ShardingError(
            f"_StridedShard placements {left} in {list(placements)} are not closed by a Shard of the same dim on a "
            "later mesh axis, so they cannot be rewritten as ordered Shards"
        )
    return ordered


_explicit_order_placements = explicit_order_placements  # PyTorch's (private) name for the same rewrite


def ordered_index_runs_at(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    ordered: Sequence[tuple[int, Placement]],
    coordinate: Sequence[int],
) -> tuple[Runs, ...]:
    """Global index runs per dim when plain shards are applied in the explicit ``ordered`` sequence.

    ``ordered`` is :func:`explicit_order_placements` output: this is the layout the placements *mean*
    (e.g. TP split first, then FSDP chunks the local shard), where :func:`global_index_runs_at` gives
    what DTensor reads from them.
    """
    runs: list[list[tuple[int, int]]] = [[(0, int(s))] if int(s) > 0 else [] for s in global_shape]
    for axis, p in ordered:
        if isinstance(p, Shard) and not isinstance(p, _StridedShard):
            lo, hi = chunk_bounds(_runs_len(runs[p.dim]), int(mesh_shape[axis]), int(coordinate[axis]))
            runs[p.dim] = _select(runs[p.dim], lo, hi)
    return tuple(tuple(r) for r in runs)
