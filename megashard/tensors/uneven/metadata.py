"""Chunk metadata of uneven DTensors: every rank learns where its shard sits, in one exchange per mesh axis.

Metadata cost. For a whole state dict, per device mesh, there is ONE exchange per mesh axis (axis 0
first): a fixed-size header all-gather (count of DTensors, fingerprints of keys and of shapes /
placements / dtypes, payload length, error flag) and, if the headers agree, one all-gather of every
tensor's extents batched together. Never one collective per tensor. Ranks that disagree (different
keys, shapes, placements) all raise :class:`StateDictMismatchError`; no rank is left waiting.

The result is a :class:`~megashard.tensors.uneven.layout.ChunkLayout` per DTensor, found *from the
actual local sizes* (not from the placements), plus the Megatron-FSDP checks on it
(:func:`gather_and_compute_chunk_metadata`, :func:`validate_uneven_dtensor`).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megashard._compat import dtensor_local
from megashard.errors import MegashardError, StateDictMismatchError, UnevenDTensorError
from megashard.tensors.uneven.layout import ChunkLayout, Level, attached_layout, dim_orders, make_layout, require_dtensor

__all__ = [
    "ExchangeErrors",
    "ExtentTables",
    "axis_peers",
    "compute_chunk_layouts",
    "fingerprint",
    "gather_and_compute_chunk_metadata",
    "layout_summaries",
    "mesh_comm_device",
    "single_layout",
    "validate_uneven_dtensor",
]


# Error codes of an exchange; every rank ends with the same (rank, code), lowest first.
ERR_LOCAL, ERR_KEYS, ERR_LAYOUT, ERR_TILING = 1, 2, 3, 4
ERR_TEXT = {
    ERR_LOCAL: "a local shard or placement is invalid",
    ERR_KEYS: "ranks hold different DTensor keys (or numbers of DTensors) on this mesh",
    ERR_LAYOUT: "ranks disagree on a DTensor's global shape, placements or dtype",
    ERR_TILING: "the local shards do not tile the global shape",
}
_NO_RANK = 2**62


def fingerprint(items: Sequence[Any]) -> int:
    """A stable 62-bit hash of ``repr(items)`` (same on every rank and Python process)."""
    return int.from_bytes(hashlib.blake2b(repr(items).encode(), digest_size=8).digest(), "little") >> 2

class ExtentTables:
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
        self.orders = dim_orders(mesh_shape, dtensor.placements, len(self.gshape))
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
        return make_layout(self.gshape, self.lshape, levels, self.dtensor.placements), None


def _nested(flat: Sequence[int], shape: Sequence[int]) -> Any:
    """A row-major flat list as nested lists of ``shape`` (a scalar for ``()``), for messages."""
    if not shape:
        return flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def axis_peers(mesh: DeviceMesh, axis: int, coord: Sequence[int]):
    """(group, global ranks by coordinate on ``axis``, group rank of each coordinate)."""
    group = mesh.get_group(axis)
    index = tuple(slice(None) if a == axis else c for a, c in enumerate(coord))
    line = [int(r) for r in mesh.mesh[index].tolist()]
    return group, line, [dist.get_group_rank(group, r) for r in line]


def mesh_comm_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh's collectives run on (its device type; CPU for gloo meshes)."""
    return torch.device("cpu") if mesh.device_type == "cpu" else torch.device(mesh.device_type)


def _all_gather_rows(vec: Sequence[int], group, group_ranks: Sequence[int], device) -> list[list[int]]:
    """All-gather one int64 vector per rank of ``group`` (same length everywhere); rows in mesh-coordinate order."""
    t = torch.tensor(vec, dtype=torch.int64, device=device)
    outs = [torch.empty_like(t) for _ in group_ranks]
    dist.all_gather(outs, t, group=group)
    return [outs[g].tolist() for g in group_ranks]


def layout_summaries(items: Sequence[tuple[str, DTensor]]) -> list[tuple]:
    """``(key, global shape, placements, dtype)`` per DTensor: what the ranks of a mesh must agree on."""
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


class ExchangeErrors:
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
        cls = StateDictMismatchError if self.code in (ERR_KEYS, ERR_LAYOUT) else UnevenDTensorError
        here = "; ".join(self.details[:6]) if self.details else f"see the error raised on rank {self.rank}"
        raise cls(
            f"uneven DTensor metadata on mesh {tuple(mesh.shape)} {mesh.mesh_dim_names or ''} failed "
            f"(reported by rank {self.rank}): {ERR_TEXT[self.code]}: {here}. Every rank of a mesh must pass "
            "the same DTensor keys with the same global shapes, placements and dtypes, and the local shards must "
            "tile the global shape (consecutive pieces per mesh axis, nested with mesh axis 0 outermost)."
        )


def _exchange(mesh: DeviceMesh, works: list[ExtentTables], items: Sequence[tuple[str, DTensor]], check_peers: bool) -> list[ChunkLayout]:
    """Run the per-axis exchange for ``works`` (all on ``mesh``); raise on every rank if anything is wrong.

    Axes go 0, 1, ...; after axis k every rank agrees with all ranks that differ from it only in
    axes <= k, so after the last axis all ranks of the mesh agree on the error state.
    ``check_peers`` (state dicts) adds a fixed-size header round first, so ranks with different
    state dicts notice it before exchanging payloads of different lengths, and skip the payload
    once anything is wrong. Without it (one DTensor, whose shape and placements every rank shares
    by contract) the error flag travels in the payload, whose length is then always the same.
    """
    coord = [int(c) for c in mesh.get_coordinate()]
    device = mesh_comm_device(mesh)
    me = dist.get_rank()
    errs = ExchangeErrors()
    for w in works:
        problem = w.local_problem()
        if problem:
            errs.add(ERR_LOCAL, me, problem)
    summary = layout_summaries(items)
    fp_keys, fp_layout = fingerprint([k for k, _ in items]), fingerprint(summary)

    for axis, n in enumerate(int(s) for s in mesh.shape):
        if n == 1:
            for w in works:
                if not errs.code or not check_peers:
                    w.absorb(axis, [w.payload()], coord)
            continue
        group, line, granks = axis_peers(mesh, axis, coord)
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
                errs.add(ERR_KEYS if keys_differ else ERR_LAYOUT, min(line),
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
                errs.add(ERR_LAYOUT, min(line), f"mesh axis {axis} (ranks {line}): ranks passed DTensors with "
                         "different global shapes, placements or dtypes to the same call")
            rows = [r[3:] for r in full]
        pos = 0
        for w, p in zip(works, payloads):
            problem = w.absorb(axis, [r[pos:pos + len(p)] for r in rows], coord)
            pos += len(p)
            if problem:
                errs.add(ERR_TILING, min(line), problem)

    layouts: list[ChunkLayout] = []
    if not errs.code:
        for w in works:
            layout, problem = w.finish()
            errs.add(ERR_TILING if problem else 0, 0, problem)  # same totals on every rank
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
                works.append(ExtentTables(key, dt, tuple(mesh.shape)))
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


def single_layout(dtensor: DTensor) -> ChunkLayout:
    """Layout of one DTensor (collective over its mesh; one small all-gather per mesh axis)."""
    mesh = dtensor.device_mesh
    if mesh.get_coordinate() is None:
        raise UnevenDTensorError(f"the calling rank {dist.get_rank()} is not in this DTensor's mesh {mesh}")
    items = [("<tensor>", dtensor)]
    return _exchange(mesh, [ExtentTables("<tensor>", dtensor, tuple(mesh.shape))], items, check_peers=False)[0]


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk (offsets and sizes) of ``dtensor``, computed from every rank's local sizes.

    Collective over the DTensor's mesh: one small all-gather per mesh axis. Offsets follow
    PyTorch's convention (an empty shard's offset is the global size of that dim). For a state dict
    use :func:`preprocess_state_dict_for_uneven_dtensor`, which batches all tensors.
    """
    require_dtensor(dtensor, "gather_and_compute_chunk_metadata")
    return single_layout(dtensor).chunk()


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Check, collectively, that ``dtensor``'s local shards tile its global shape exactly.

    Checks: every dim not sharded is held whole; along every sharded dim the pieces of each level
    add up to the enclosing block and the top level to the global size (so every chunk is in
    bounds, chunks do not overlap and every boundary is covered); dims not split by a mesh axis
    agree along it; and a layout attached earlier still matches. Works on any device (no ``.cuda()``).

    Raises: :class:`UnevenDTensorError` on every rank of the mesh if any rank's shard is wrong.
    """
    require_dtensor(dtensor, "validate_uneven_dtensor")
    layout = single_layout(dtensor)
    attached = attached_layout(dtensor)
    stale = attached is not None and attached != layout
    flag = torch.tensor([int(stale)], device=mesh_comm_device(dtensor.device_mesh))
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

