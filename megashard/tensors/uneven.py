"""Uneven DTensors: chunk metadata, validation, checkpoint (DCP) hooks, gather and split.

A DTensor is *uneven* when its local shards have sizes its placements do not predict: FSDP2's
``torch.chunk`` shards of a dim that does not divide, or any ``DTensor.from_local(..., shape=,
stride=, run_check=False)`` whose ranks hold arbitrary lengths (zero included). This module finds
where every local shard sits in the global tensor *from the actual local sizes*, so that DCP saves
and loads such tensors correctly and a full tensor can be gathered on gloo as well as NCCL.

Layout model. Each tensor dim ``d`` is split by the mesh axes whose placement shards it, nested in
PyTorch's order: mesh axis 0 outermost, except that a run of ``_StridedShard(d)`` closed by a
``Shard(d)`` means the ``Shard`` axis splits first (FSDP2 + TP; see ``shape._explicit_order_placements``).
Level by level, a block of the dim is cut into consecutive pieces, one per coordinate of that axis,
with arbitrary (uneven) lengths. The result equals ``DTensor.full_tensor()`` wherever that is defined.

Metadata cost. For a whole state dict, per device mesh, there is ONE exchange per mesh axis (axis 0
first): a fixed-size header all-gather (count of DTensors, fingerprints of keys and of shapes /
placements / dtypes, payload length, error flag) and, if the headers agree, one all-gather of every
tensor's extents batched together. Never one collective per tensor. Ranks that disagree (different
keys, shapes, placements) all raise :class:`StateDictMismatchError`; no rank is left waiting.

Names and signatures follow Megatron-FSDP's ``uneven_dtensor`` module.
"""
from __future__ import annotations

import functools
import hashlib
import math
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from megashard._compat import dtensor_local
from megashard.errors import MegashardError, StateDictKeyError, StateDictMismatchError, UnevenDTensorError
from megashard.tensors.shape import _explicit_order_placements, get_local_shape_and_global_offset

__all__ = [
    "ChunkLayout",
    "Level",
    "compute_chunk_layouts",
    "filter_unflattened_state_dict",
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "get_chunk_layout",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
    "split_dtensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
]

_LAYOUT_ATTR = "_megashard_chunk_layout"


# ---------------------------------------------------------------------------------------------------
# The layout of one rank's shard
# ---------------------------------------------------------------------------------------------------
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


def _make_layout(global_shape, local_shape, levels, placements) -> ChunkLayout:
    start, offsets = [], []
    for d, lv in enumerate(levels):
        s = sum(sum(level.extents[: level.index]) for level in lv)
        start.append(s)
        offsets.append(int(global_shape[d]) if lv and local_shape[d] == 0 else s)
    return ChunkLayout(
        tuple(int(x) for x in global_shape), tuple(int(x) for x in local_shape), tuple(start), tuple(offsets),
        tuple(tuple(lv) for lv in levels), tuple(placements),
    )


def get_chunk_layout(dtensor: DTensor) -> Optional[ChunkLayout]:
    """The layout attached to ``dtensor`` by :func:`update_uneven_dtensor_chunk_metadata`, a preprocess,
    a split or a gather; None if there is none or it no longer matches the DTensor's shapes."""
    layout = getattr(dtensor, _LAYOUT_ATTR, None)
    if layout is None:
        return None
    if layout.local_shape != tuple(dtensor_local(dtensor).shape) or layout.global_shape != tuple(dtensor.shape):
        return None
    return layout


# ---------------------------------------------------------------------------------------------------
# Metadata exchange: one batched exchange per mesh axis
# ---------------------------------------------------------------------------------------------------
_ERR_LOCAL, _ERR_KEYS, _ERR_LAYOUT, _ERR_TILING = 1, 2, 3, 4
_ERR_TEXT = {
    _ERR_LOCAL: "a local shard or placement is invalid",
    _ERR_KEYS: "ranks hold different DTensor keys (or numbers of DTensors) on this mesh",
    _ERR_LAYOUT: "ranks disagree on a DTensor's global shape, placements or dtype",
    _ERR_TILING: "the local shards do not tile the global shape",
}
_NO_RANK = 2**62


def _fingerprint(items: Sequence[Any]) -> int:
    """A stable 62-bit hash of ``repr(items)`` (same on every rank and Python process)."""
    return int.from_bytes(hashlib.blake2b(repr(items).encode(), digest_size=8).digest(), "little") >> 2


def _dim_orders(mesh_shape: Sequence[int], placements: Sequence[Any], ndim: int) -> dict[int, list[int]]:
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
    for axis, p in _explicit_order_placements(mesh_shape, placements):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise UnevenDTensorError(f"{p} on mesh axis {axis} shards dim {p.dim} of a {ndim}-d tensor")
            orders.setdefault(d, []).append(axis)
    return tuple((d, tuple(a)) for d, a in sorted(orders.items()))


class _Work:
    """Per-tensor state of the exchange: a table of extents per sharded dim, collapsed level by level.

    ``tab[d]`` is a row-major table ``(flat values, shape)`` with one axis per processed, not yet
    collapsed mesh axis in ``tab_axes[d]`` (other coordinates are the caller's own). A level collapses
    as soon as it and every level inside it are known: its sibling extents become a :class:`Level` and
    the table is summed over it. Plain Python ints: the tables have a few entries each, where a tensor
    (or array) op per step would cost more than the arithmetic.
    """

    __slots__ = ("key", "dtensor", "gshape", "lshape", "orders", "tab", "tab_axes", "todo", "levels")

    def __init__(self, key: str, dtensor: DTensor, mesh_shape: Sequence[int]) -> None:
        self.key, self.dtensor = key, dtensor
        self.gshape = tuple(int(s) for s in dtensor.shape)
        self.lshape = tuple(int(s) for s in dtensor_local(dtensor).shape)
        self.orders = _dim_orders(mesh_shape, dtensor.placements, len(self.gshape))
        lsh = self.lshape if len(self.lshape) == len(self.gshape) else (0,) * len(self.gshape)
        self.tab: dict[int, tuple[list[int], list[int]]] = {d: ([lsh[d]], []) for d in sorted(self.orders)}
        self.tab_axes: dict[int, list[int]] = {d: [] for d in self.orders}
        self.todo = {d: len(a) for d, a in self.orders.items()}
        self.levels: dict[int, list[Level]] = {d: [] for d in self.orders}

    def local_problem(self) -> Optional[str]:
        if len(self.lshape) != len(self.gshape):
            return f"{self.key}: local shard has {len(self.lshape)} dims, the global shape {self.gshape} has {len(self.gshape)}"
        for d, (g, n) in enumerate(zip(self.gshape, self.lshape)):
            if d not in self.orders and g != n:
                return (f"{self.key}: dim {d} is not sharded by {list(self.dtensor.placements)}, so the local shard "
                        f"must span all {g} elements of it, but it has {n}")
        return None

    def payload(self) -> list[int]:
        """Every table's values, flattened into one list (what this rank sends)."""
        return [v for flat, _ in self.tab.values() for v in flat]

    def absorb(self, axis: int, rows: Sequence[Sequence[int]], coord: Sequence[int]) -> Optional[str]:
        """Fold the peers' payloads (one row per coordinate on ``axis``) into the tables."""
        pos, problem = 0, None
        for d, (flat, shape) in self.tab.items():
            size = len(flat)
            vals = [list(row[pos:pos + size]) for row in rows]
            pos += size
            if axis in self.orders[d]:
                # Stack along a new last table axis: element (i, j) = row j's value i.
                self.tab[d] = ([v for col in zip(*vals) for v in col], shape + [len(vals)])
                self.tab_axes[d].append(axis)
                self._collapse(d, coord)
            elif problem is None and any(v != vals[0] for v in vals):
                problem = (f"{self.key}: dim {d} is not split by mesh axis {axis}, yet the ranks along that axis "
                           f"hold different extents of it: {[_nested(v, shape) for v in vals]}")
        return problem

    def _collapse(self, d: int, coord: Sequence[int]) -> None:
        order, axes = self.orders[d], self.tab_axes[d]
        flat, shape = self.tab[d]
        while self.todo[d] and order[self.todo[d] - 1] in axes:
            s = order[self.todo[d] - 1]
            pos = axes.index(s)
            strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
            base = sum(coord[a] * strides[i] for i, a in enumerate(axes) if i != pos)
            m, post = shape[pos], strides[pos]
            self.levels[d].append(Level(s, tuple(flat[base + k * post] for k in range(m)), int(coord[s])))
            flat = [sum(flat[(p * m + k) * post + q] for k in range(m))
                    for p in range(math.prod(shape[:pos])) for q in range(post)]
            shape = shape[:pos] + shape[pos + 1:]
            axes.pop(pos)
            self.todo[d] -= 1
        self.tab[d] = (flat, shape)

    def finish(self) -> tuple[Optional[ChunkLayout], Optional[str]]:
        for d, (flat, _) in self.tab.items():
            total = flat[0]  # every level has collapsed: one value left
            if total != self.gshape[d]:
                return None, (f"{self.key}: the local shards along dim {d} add up to {total} elements, but the "
                              f"global shape {self.gshape} has {self.gshape[d]}")
        levels = [tuple(reversed(self.levels[d])) if d in self.levels else () for d in range(len(self.gshape))]
        return _make_layout(self.gshape, self.lshape, levels, self.dtensor.placements), None


def _nested(flat: Sequence[int], shape: Sequence[int]) -> Any:
    """A row-major flat list as nested lists of ``shape`` (a scalar for ``()``), for messages."""
    if not shape:
        return flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _axis_peers(mesh: DeviceMesh, axis: int, coord: Sequence[int]):
    """(group, global ranks by coordinate on ``axis``, group rank of each coordinate)."""
    group = mesh.get_group(axis)
    index = tuple(slice(None) if a == axis else c for a, c in enumerate(coord))
    line = [int(r) for r in mesh.mesh[index].tolist()]
    return group, line, [dist.get_group_rank(group, r) for r in line]


def _comm_device(mesh: DeviceMesh) -> torch.device:
    return torch.device("cpu") if mesh.device_type == "cpu" else torch.device(mesh.device_type)


def _all_gather_rows(vec: Sequence[int], group, group_ranks: Sequence[int], device) -> list[list[int]]:
    """All-gather one int64 vector per rank of ``group`` (same length everywhere); rows in mesh-coordinate order."""
    t = torch.tensor(vec, dtype=torch.int64, device=device)
    outs = [torch.empty_like(t) for _ in group_ranks]
    dist.all_gather(outs, t, group=group)
    return [outs[g].tolist() for g in group_ranks]


def _summaries(items: Sequence[tuple[str, DTensor]]) -> list[tuple]:
    return [(k, tuple(int(x) for x in dt.shape), tuple(str(p) for p in dt.placements), str(dt.dtype)) for k, dt in items]


def _describe_mismatch(rows: Sequence[list[tuple]], line: Sequence[int]) -> str:
    """Human-readable difference between the state-dict summaries of the ranks in ``line``."""
    ref = {s[0]: s for s in rows[0]}
    msgs = []
    for rank, summ in zip(line[1:], rows[1:]):
        mine = {s[0]: s for s in summ}
        extra, missing = sorted(set(mine) - set(ref)), sorted(set(ref) - set(mine))
        if extra:
            msgs.append(f"rank {rank} has keys rank {line[0]} lacks: {extra[:5]}")
        if missing:
            msgs.append(f"rank {rank} lacks keys rank {line[0]} has: {missing[:5]}")
        for k in sorted(set(mine) & set(ref)):
            if mine[k] != ref[k]:
                msgs.append(f"{k!r} is (shape, placements, dtype) {mine[k][1:]} on rank {rank} but {ref[k][1:]} "
                            f"on rank {line[0]}")
                break
    return "; ".join(msgs[:6]) or "the key lists are equal but in a different order"


class _Errors:
    """The first error of a mesh exchange, agreed on by every rank (min of (rank, code) pairs)."""

    def __init__(self) -> None:
        self.code, self.rank = 0, _NO_RANK
        self.details: list[str] = []  # what this rank saw itself

    def add(self, code: int, rank: int, detail: Optional[str] = None) -> None:
        if detail:
            self.details.append(detail)
        if code and (self.code == 0 or (rank, code) < (self.rank, self.code)):
            self.code, self.rank = code, rank

    def raise_if_any(self, mesh: DeviceMesh) -> None:
        if not self.code:
            return
        cls = StateDictMismatchError if self.code in (_ERR_KEYS, _ERR_LAYOUT) else UnevenDTensorError
        here = "; ".join(self.details[:6]) if self.details else f"see the error raised on rank {self.rank}"
        raise cls(
            f"uneven DTensor metadata on mesh {tuple(mesh.shape)} {mesh.mesh_dim_names or ''} failed "
            f"(reported by rank {self.rank}): {_ERR_TEXT[self.code]}: {here}. Every rank of a mesh must pass "
            "the same DTensor keys with the same global shapes, placements and dtypes, and the local shards must "
            "tile the global shape (consecutive pieces per mesh axis, nested with mesh axis 0 outermost)."
        )


def _exchange(mesh: DeviceMesh, works: list[_Work], items: Sequence[tuple[str, DTensor]], check_peers: bool) -> list[ChunkLayout]:
    """Run the per-axis exchange for ``works`` (all on ``mesh``); raise on every rank if anything is wrong.

    Axes go 0, 1, ...; after axis k every rank agrees with all ranks that differ from it only in
    axes <= k, so after the last axis all ranks of the mesh agree on the error state.
    ``check_peers`` (state dicts) adds a fixed-size header round first, so ranks with different
    state dicts notice it before exchanging payloads of different lengths, and skip the payload
    once anything is wrong. Without it (one DTensor, whose shape and placements every rank shares
    by contract) the error flag travels in the payload, whose length is then always the same.
    """
    coord = [int(c) for c in mesh.get_coordinate()]
    device = _comm_device(mesh)
    me = dist.get_rank()
    errs = _Errors()
    for w in works:
        problem = w.local_problem()
        if problem:
            errs.add(_ERR_LOCAL, me, problem)
    summary = _summaries(items)
    fp_keys, fp_layout = _fingerprint([k for k, _ in items]), _fingerprint(summary)

    for axis, n in enumerate(int(s) for s in mesh.shape):
        if n == 1:
            for w in works:
                if not errs.code or not check_peers:
                    w.absorb(axis, [w.payload()], coord)
            continue
        group, line, granks = _axis_peers(mesh, axis, coord)
        if check_peers:
            payloads = [w.payload() for w in works] if not errs.code else []
            length = sum(len(p) for p in payloads)
            header = [len(items), fp_keys, fp_layout, length, errs.code, errs.rank]
            heads = _all_gather_rows(header, group, granks, device)
            for h in heads:
                errs.add(h[4], h[5])
            if not errs.code and any(h[:4] != heads[0][:4] for h in heads):
                # Every rank of this group sees the same headers, so all of them take this extra step.
                summaries: list[Any] = [None] * n
                dist.all_gather_object(summaries, summary, group=group)
                keys_differ = any(h[0] != heads[0][0] or h[1] != heads[0][1] for h in heads)
                errs.add(_ERR_KEYS if keys_differ else _ERR_LAYOUT, min(line),
                         f"mesh axis {axis} (ranks {line}): " + _describe_mismatch([summaries[g] for g in granks], line))
            if errs.code:
                continue
            flat = [v for p in payloads for v in p]
            rows = _all_gather_rows(flat, group, granks, device) if length else [flat] * n
        else:
            payloads = [w.payload() for w in works]
            vec = [fp_layout, errs.code, errs.rank] + [v for p in payloads for v in p]
            full = _all_gather_rows(vec, group, granks, device)
            for r in full:
                errs.add(r[1], r[2])
            if any(r[0] != full[0][0] for r in full):
                errs.add(_ERR_LAYOUT, min(line), f"mesh axis {axis} (ranks {line}): ranks passed DTensors with "
                         "different global shapes, placements or dtypes to the same call")
            rows = [r[3:] for r in full]
        pos = 0
        for w, p in zip(works, payloads):
            problem = w.absorb(axis, [r[pos:pos + len(p)] for r in rows], coord)
            pos += len(p)
            if problem:
                errs.add(_ERR_TILING, min(line), problem)

    layouts: list[ChunkLayout] = []
    if not errs.code:
        for w in works:
            layout, problem = w.finish()
            errs.add(_ERR_TILING if problem else 0, 0, problem)  # same totals on every rank
            layouts.append(layout)
    errs.raise_if_any(mesh)
    return layouts


def _mesh_signature(mesh: DeviceMesh) -> tuple:
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh_dim_names or ()))


def compute_chunk_layouts(
    named_dtensors: Sequence[tuple[str, DTensor]], *, meshes: Sequence[DeviceMesh] = ()
) -> dict[str, ChunkLayout]:
    """Chunk layouts of many DTensors at the cost of one batched exchange per mesh axis.

    Collective over every mesh the DTensors (and ``meshes``) live on, in a deterministic order.
    DTensors whose mesh does not contain the calling rank are skipped. ``meshes`` lists meshes
    this rank must join even if it holds no DTensor on them, so a rank that lost all its tensors
    still meets its peers and gets the mismatch error instead of leaving them waiting.

    Returns: key -> :class:`ChunkLayout` of the calling rank.
    Raises: :class:`StateDictMismatchError` / :class:`UnevenDTensorError` on every rank of the mesh.
    """
    by_mesh: dict[tuple, tuple[DeviceMesh, list[tuple[str, DTensor]]]] = {}
    sig_cache: dict[int, tuple] = {}

    def add(mesh: DeviceMesh) -> tuple:
        sig = sig_cache.get(id(mesh))
        if sig is None:
            sig = sig_cache[id(mesh)] = _mesh_signature(mesh)
        by_mesh.setdefault(sig, (mesh, []))
        return sig

    for mesh in meshes:
        add(mesh)
    for key, dt in named_dtensors:
        if not isinstance(dt, DTensor):
            raise UnevenDTensorError(f"{key!r} is a {type(dt).__name__}, not a DTensor")
        by_mesh[add(dt.device_mesh)][1].append((key, dt))
    out: dict[str, ChunkLayout] = {}
    first_error: Optional[MegashardError] = None
    for sig in sorted(by_mesh, key=repr):
        mesh, items = by_mesh[sig]
        if mesh.get_coordinate() is None:
            continue
        items.sort(key=lambda kv: kv[0])
        works = []
        bad = None
        for key, dt in items:
            try:
                works.append(_Work(key, dt, tuple(mesh.shape)))
            except MegashardError as e:  # flag it through the exchange so every rank raises together
                bad = bad or f"{key}: {e}"
        if bad is not None:
            works = [_BrokenWork(bad)]  # type: ignore[list-item]
        try:
            layouts = _exchange(mesh, works, items, check_peers=True)
        except MegashardError as e:  # finish the other meshes first: their peers are waiting
            first_error = first_error or e
            continue
        for (key, _), layout in zip(items, layouts):
            out[key] = layout
    if first_error is not None:
        raise first_error
    return out


class _BrokenWork:
    """Stands in for a state dict with invalid placements: it only carries the error into the exchange."""

    def __init__(self, problem: str) -> None:
        self.problem = problem

    def local_problem(self) -> Optional[str]:
        return self.problem


def _single_layout(dtensor: DTensor) -> ChunkLayout:
    """Layout of one DTensor (collective over its mesh; one small all-gather per mesh axis)."""
    mesh = dtensor.device_mesh
    if mesh.get_coordinate() is None:
        raise UnevenDTensorError(f"the calling rank {dist.get_rank()} is not in this DTensor's mesh {mesh}")
    items = [("<tensor>", dtensor)]
    return _exchange(mesh, [_Work("<tensor>", dtensor, tuple(mesh.shape))], items, check_peers=False)[0]


# ---------------------------------------------------------------------------------------------------
# Megatron-FSDP API: metadata, DCP hooks, validation
# ---------------------------------------------------------------------------------------------------
def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk (offsets and sizes) of ``dtensor``, computed from every rank's local sizes.

    Collective over the DTensor's mesh: one small all-gather per mesh axis. Offsets follow
    PyTorch's convention (an empty shard's offset is the global size of that dim). For a state dict
    use :func:`preprocess_state_dict_for_uneven_dtensor`, which batches all tensors.
    """
    return _single_layout(dtensor).chunk()


def _raise_if_partial(layout: ChunkLayout) -> None:
    if any(isinstance(p, Partial) for p in layout.placements):
        raise UnevenDTensorError(
            f"cannot checkpoint a DTensor with Partial placements {list(layout.placements)}: reduce it first "
            "(redistribute to Replicate or Shard)"
        )


def _attach(dtensor: DTensor, layout: ChunkLayout) -> None:
    """Make DCP use ``layout`` for this DTensor (instance overrides of DTensor's checkpoint hooks).

    The closures hold the layout only (not the tensor), so no reference cycle keeps memory alive.
    An empty local shard contributes no chunk (an empty chunk's offset could collide with a real
    chunk's in DCP's de-duplication); a tensor that is empty everywhere keeps one empty chunk.
    """
    global_empty = 0 in layout.global_shape

    def chunks() -> list[ChunkStorageMetadata]:
        _raise_if_partial(layout)
        if layout.numel == 0 and not global_empty:
            return []
        return [layout.chunk()]

    def write_items(fqn: str, obj: Any) -> list[WriteItem]:
        _raise_if_partial(layout)
        if layout.numel == 0 and not global_empty:
            return []
        chunk = layout.chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(dtensor_local(obj)),
                size=torch.Size(layout.global_shape),
            ),
        )]

    setattr(dtensor, _LAYOUT_ATTR, layout)
    dtensor.__create_chunk_list__ = chunks  # type: ignore[method-assign]
    dtensor.__create_write_items__ = write_items  # type: ignore[method-assign]


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Compute ``dtensor``'s chunk layout (collective) and attach it, in place, for DCP save/load.

    Afterwards ``dtensor.__create_chunk_list__()`` / ``__create_write_items__(fqn, dtensor)`` describe
    the real local shard, and gather/split use the attached layout without communicating.
    Returns this rank's chunk.
    """
    layout = _single_layout(dtensor)
    _attach(dtensor, layout)
    return layout.chunk()


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Check, collectively, that ``dtensor``'s local shards tile its global shape exactly.

    Checks: every dim not sharded is held whole; along every sharded dim the pieces of each level
    add up to the enclosing block and the top level to the global size (so every chunk is in
    bounds, chunks do not overlap and every boundary is covered); dims not split by a mesh axis
    agree along it; and a layout attached earlier still matches. Works on any device (no ``.cuda()``).

    Raises: :class:`UnevenDTensorError` on every rank of the mesh if any rank's shard is wrong.
    """
    layout = _single_layout(dtensor)
    attached = getattr(dtensor, _LAYOUT_ATTR, None)
    stale = attached is not None and attached != layout
    flag = torch.tensor([int(stale)], device=_comm_device(dtensor.device_mesh))
    for axis in range(dtensor.device_mesh.ndim):  # agree on staleness, so all ranks raise or none
        if dtensor.device_mesh.size(axis) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dtensor.device_mesh.get_group(axis))
    if int(flag.item()):
        raise UnevenDTensorError(
            f"the chunk layout attached to this DTensor is stale on at least one rank (here: attached "
            f"{attached.chunk() if attached else None}, actual {layout.chunk()}); call "
            "update_uneven_dtensor_chunk_metadata(dtensor) on every rank"
        )
    for d, (o, n, g) in enumerate(zip(layout.start, layout.local_shape, layout.global_shape)):
        if o < 0 or o + n > g:  # cannot happen after the exchange's checks; kept as a cheap guard
            raise UnevenDTensorError(f"chunk [{o}, {o + n}) of dim {d} is outside the global size {g}")


# ---------------------------------------------------------------------------------------------------
# Nested state dicts
# ---------------------------------------------------------------------------------------------------
def _children(node: Any):
    if isinstance(node, dict):
        return node.items()
    if isinstance(node, (list, tuple)):
        return enumerate(node)
    return ()


def filter_unflattened_state_dict(
    state_dict: Any,
    key_chain: Optional[List[Any]] = None,
    visit_condition: Callable[[Any], bool] = lambda x: isinstance(x, DTensor),
) -> List[List[Any]]:
    """Key chains of every item of a nested state dict for which ``visit_condition`` holds.

    Walks dicts and lists/tuples depth first in insertion order. A key chain is the list of keys
    from the root (dict keys as they are, usually ``str``; list positions as ``int``), prefixed by
    ``key_chain``. Default condition: the item is a DTensor.

    Example: ``{"model": {"w": dt}, "optim": {"state": {"w": {"exp_avg": dt2}}}}`` ->
    ``[["model", "w"], ["optim", "state", "w", "exp_avg"]]``.
    """
    prefix = list(key_chain or [])
    out: List[List[Any]] = []
    stack = [(prefix, state_dict)]
    while stack:
        chain, node = stack.pop()
        if visit_condition(node):
            out.append(chain)
            continue
        children = list(_children(node))
        stack.extend((chain + [k], v) for k, v in reversed(children))
    return out


def get_unflattened_state_dict(state_dict: Any, key_chain: Optional[List[Any]] = None) -> Any:
    """The value of a nested state dict at ``key_chain`` (``[]``: the state dict itself).

    Raises: :class:`StateDictKeyError` naming the first key that is missing.
    """
    node = state_dict
    for i, key in enumerate(key_chain or []):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise StateDictKeyError(
                f"key chain {list(key_chain)} breaks at position {i}: {key!r} is not in "
                f"{type(node).__name__} with keys {list(dict(_children(node)).keys())[:10]}"
            ) from None
    return node


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict, *, meshes: Sequence[DeviceMesh] = ()) -> dict:
    """Attach chunk layouts to every DTensor of a (nested) state dict, for DCP save or load.

    Collective over the DTensors' meshes: one batched exchange per mesh axis for the whole state
    dict. Call it on the state dict you pass to ``torch.distributed.checkpoint.save`` and on the one
    you pass to ``load`` (fresh DTensors of any, possibly different, uneven layout). Modifies the
    DTensors in place and returns ``state_dict``. See :func:`compute_chunk_layouts` for ``meshes``.

    Raises: :class:`StateDictMismatchError` on every rank if ranks of a mesh hold different DTensor
    keys, shapes, placements or dtypes; :class:`UnevenDTensorError` if local shards do not tile.
    """
    chains = filter_unflattened_state_dict(state_dict)
    named, seen = [], set()
    for chain in chains:
        key = ".".join(str(k) for k in chain)
        while key in seen:  # e.g. {"a.b": x, "a": {"b": y}}: keys must stay unique (and equal on every rank)
            key += "'"
        seen.add(key)
        named.append((key, get_unflattened_state_dict(state_dict, chain)))
    layouts = compute_chunk_layouts(named, meshes=meshes)
    for key, dt in named:
        if key in layouts:
            _attach(dt, layouts[key])
    return state_dict


# ---------------------------------------------------------------------------------------------------
# Gather to a full tensor
# ---------------------------------------------------------------------------------------------------
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
                group, line, _ = _axis_peers(mesh, lv.axis, coord)
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
    mesh = dtensor.device_mesh
    layout = get_chunk_layout(dtensor)
    with torch.no_grad():
        if layout is None:  # every rank gets here together (the layout follows the shapes only)
            eager = _eager_gather_1d(dtensor)
            if eager is not None:
                full, layout = eager
                _attach(dtensor, layout)
                return _finish(full, mesh, target_device, return_dtensor)
            layout = _single_layout(dtensor)
            _attach(dtensor, layout)
        local = _reduce_partials(dtensor_local(dtensor), dtensor)
        full = _assemble(local, layout, mesh)
    return _finish(full, mesh, target_device, return_dtensor)


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
    orders = _dim_orders(tuple(mesh.shape), dtensor.placements, ndim)
    if list(orders.values()) != [[axis]]:  # a size-1 axis also shards some dim: the general path knows how
        return None
    (d, _), = orders.items()
    local = dtensor_local(dtensor)
    row = math.prod(g for i, g in enumerate(gshape) if i != d) * local.element_size()
    cap = int(-(-gshape[d] // n) * _EAGER_SLACK + 1) * row
    if cap > _EAGER_CAP:
        return None
    coord = [int(c) for c in mesh.get_coordinate()]
    me = coord[axis]
    group, line, _ = _axis_peers(mesh, axis, coord)
    work = _Work("<tensor>", dtensor, tuple(mesh.shape))  # for its local checks only
    problem = work.local_problem()
    head = 8 * (3 + ndim)
    fp = _fingerprint(_summaries([("<tensor>", dtensor)]))
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
    errs = _Errors()
    if problem:
        errs.add(_ERR_LOCAL, dist.get_rank(), problem)
    for h in heads:
        if h[1]:
            errs.add(_ERR_LOCAL, h[2])
        if h[0] != heads[0][0]:
            errs.add(_ERR_LAYOUT, min(line), f"mesh axis {axis} (ranks {line}): ranks passed DTensors with "
                     "different global shapes, placements or dtypes to the same call")
    extents = tuple(int(s[d]) for s in shapes)
    if not errs.code and sum(extents) != gshape[d]:
        errs.add(_ERR_TILING, min(line), f"<tensor>: the local shards along dim {d} add up to {sum(extents)} "
                 f"elements, but the global shape {gshape} has {gshape[d]}")
    errs.raise_if_any(mesh)
    levels = [((Level(axis, extents, me),) if i == d else ()) for i in range(ndim)]
    layout = _make_layout(gshape, local.shape, levels, dtensor.placements)
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


# ---------------------------------------------------------------------------------------------------
# Split without redistribution
# ---------------------------------------------------------------------------------------------------
def _intersection(s1: slice, s2: slice) -> slice:
    """Intersection of two step-1 slices with explicit ends (empty: ``slice(x, x)``)."""
    start, stop = max(s1.start, s2.start), min(s1.stop, s2.stop)
    return slice(start, max(start, stop))


def _offset_slice(s: slice, offset: int) -> slice:
    """``s`` moved by ``offset`` (e.g. ``-chunk_start`` turns global indices into local ones)."""
    return slice(s.start + offset, s.stop + offset)


def _chunk_sizes(length: int, n: int) -> tuple[int, ...]:
    q = -(-length // n) if length else 0
    return tuple(max(0, min(q, length - q * i)) for i in range(n))


def _arithmetic_layout(dtensor: DTensor) -> ChunkLayout:
    """The layout placements predict (torch.chunk at every level), checked against the real shard."""
    mesh = dtensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnevenDTensorError(f"the calling rank {dist.get_rank()} is not in this DTensor's mesh {mesh}")
    gshape = tuple(int(s) for s in dtensor.shape)
    local_shape = tuple(int(s) for s in dtensor_local(dtensor).shape)
    orders = _dim_orders(tuple(mesh.shape), dtensor.placements, len(gshape))
    levels, lshape = [], []
    for d, g in enumerate(gshape):
        ext, lv = g, []
        for axis in orders.get(d, ()):
            sizes = _chunk_sizes(ext, int(mesh.size(axis)))
            lv.append(Level(axis, sizes, int(coord[axis])))
            ext = sizes[int(coord[axis])]
        levels.append(tuple(lv))
        lshape.append(ext)
    layout = _make_layout(gshape, lshape, levels, dtensor.placements)
    torch_shape, torch_offset = get_local_shape_and_global_offset(dtensor)
    if tuple(lshape) != local_shape or (tuple(torch_shape), tuple(torch_offset)) != (tuple(lshape), layout.offsets):
        raise UnevenDTensorError(
            f"this DTensor's local shard {local_shape} is not the one its placements {list(dtensor.placements)} "
            f"describe for global shape {gshape} (expected {tuple(lshape)} at {layout.offsets}; PyTorch says "
            f"{tuple(torch_shape)} at {tuple(torch_offset)}), so its layout is unknown without communication: "
            "call update_uneven_dtensor_chunk_metadata(dtensor) on every rank first"
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
    return _make_layout(shape, lshape, levels, layout.placements), local.start, local.stop - local.start


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


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

    The shard's layout comes from an attached one (:func:`update_uneven_dtensor_chunk_metadata`)
    or, if none, from the placements; a shard that matches neither raises UnevenDTensorError.

    Args:
        split_size_or_sections: piece length (the last piece may be shorter) or list of lengths
            summing to ``dtensor.shape[dim]``.
        dim: tensor dim to split (negative counts from the end).
        update_uneven_dtensor_chunk_meta: attach each piece's chunk layout (computed locally, no
            collective), so DCP and :func:`gather_uneven_dtensor_to_full_tensor` use it directly.

    Yields: the pieces, in order. Example: ``for piece in split_dtensor(dt, 3, dim=1): ...``
    """
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
    layout = get_chunk_layout(dtensor) or _arithmetic_layout(dtensor)
    local = dtensor.to_local()
    mesh, placements = dtensor.device_mesh, dtensor.placements
    a = 0
    for size in sections:
        piece_layout, lstart, llen = _piece_layout(layout, dim, a, size)
        piece = DTensor.from_local(
            local.narrow(dim, lstart if llen else 0, llen), mesh, placements, run_check=False,
            shape=torch.Size(piece_layout.global_shape), stride=_contiguous_stride(piece_layout.global_shape),
        )
        if update_uneven_dtensor_chunk_meta:
            _attach(piece, piece_layout)
        a += size
        yield piece
