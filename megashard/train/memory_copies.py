"""Live copies of the training state in host memory: what a re-formed world restores instead of a checkpoint.

    copies = MemoryCopies(entries, copies=1, world_id=..., local_world_size=2)   # per world (collective)
    copies.capture(step)                                  # after every optimizer step (collective with copies=1)
    step = restore(copies_or_None, targets, put)          # in the new world (collective): the step, or None

``entries()`` lists ``(key, tensor or DTensor)`` of the state to protect; :func:`job_entries` gives the training
job's (what its checkpoints save), :func:`module_entries` any model's parameters and optimizer state.

After every step each rank copies its model and optimizer shards — the global-DTensor entries a checkpoint saves
(:func:`megashard.train.checkpointing.state_entries`) — into host memory; with ``checkpoint.memory_copies: 1`` it
also sends them to the same local rank of the next node, which keeps them beside its own. Two generations are kept
(the step just trained and the one before), so a node lost in the middle of a capture still leaves a step whose
pieces all survive. HSDP replicas (``dp_outer > 1``) hold the same chunks, so they cover each other without copies.

:func:`restore` runs in the new world (survivors of the old one, and newcomers that hold nothing): every rank says
what it holds, the newest step whose chunks cover every tensor of the old world is chosen, each needed holding is
broadcast from one rank that has it, and every rank cuts its new local shards out of the pieces — whatever the new
layout (the data-parallel axis absorbs the world size). No file is read. When no step is covered (a node lost with
no copy of its shards), :func:`restore` returns None and the caller reads the newest checkpoint instead.

Cost: per rank ``2 × (1 + memory_copies) ×`` its shard bytes of host memory (:func:`bytes_per_rank`), one host copy
and (copies=1) one send and receive of its shards per step; a restore moves the whole state to every rank once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megashard.state import ParallelState

__all__ = ["MemoryCopies", "restore", "bytes_per_rank", "Chunk", "job_entries", "module_entries", "module_targets"]

_ALIGN = 64  # byte alignment of every tensor in a flat buffer (any dtype view is legal)


@dataclass(frozen=True)
class Chunk:
    """One tensor piece of one rank: ``key`` (``model/<name>``, ``optim/<name>.exp_avg``), its place in the global
    tensor, and where its bytes sit in that rank's flat buffer."""

    key: str
    offsets: tuple
    sizes: tuple
    global_size: tuple
    dtype: str
    start: int
    nbytes: int

    def box(self) -> tuple:
        return (self.key, self.offsets, self.sizes)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def job_entries(model, optimizer, state) -> list[tuple[str, Any]]:
    """``(key, tensor or DTensor)`` of everything a checkpoint of the training job saves, in a fixed order."""
    from megashard.train.checkpointing import state_entries

    sd = state_entries(model, optimizer, state)
    return [(f"{section}/{name}", v) for section in ("model", "optim") for name, v in sd[section].items()]


def module_entries(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[tuple[str, Any]]:
    """``(key, tensor or DTensor)`` of any model's parameters (``model/<name>``) and the tensors of its optimizer's
    state (``optim/<name>.<state key>``): DTensor parameters (FSDP2, TP) as they are, plain ones as replicated."""
    out: list[tuple[str, Any]] = [(f"model/{n}", p.detach()) for n, p in model.named_parameters()]
    if optimizer is not None:
        for n, p in model.named_parameters():
            for k, v in sorted((optimizer.state.get(p) or {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append((f"optim/{n}.{k}", v))
    return out


def module_targets(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], keys: dict) -> list:
    """:func:`module_entries` of a model just built for a new world, with the optimizer state the old world had
    (``keys``: ``{key: (global size, dtype)}``) created first: zeros shaped like the parameter, or like the key."""
    if optimizer is not None:
        params = dict(model.named_parameters())
        for key, (size, dtype) in keys.items():
            if not key.startswith("optim/"):
                continue
            name, _, k = key[len("optim/"):].rpartition(".")
            p = params.get(name)
            if p is None:
                continue
            st = optimizer.state.setdefault(p, {})
            if k not in st:
                like = tuple(size) == tuple(p.shape)
                st[k] = (torch.zeros_like(p.detach(), dtype=_dtype(dtype)) if like
                         else torch.zeros(size, dtype=_dtype(dtype)))
    return module_entries(model, optimizer)


def _table(entries: list[tuple[str, Any]]) -> tuple[list[Chunk], int]:
    """This rank's chunks (after the uneven layouts are attached) and the bytes of its flat buffer."""
    from torch.distributed.tensor import DTensor

    chunks, pos = [], 0
    for key, v in entries:
        if isinstance(v, DTensor):
            local = v.to_local()
            c = v.__create_chunk_list__()[0]
            offsets, sizes, gsize = tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes), tuple(v.shape)
        else:
            local = v
            offsets, sizes, gsize = (0,) * v.dim(), tuple(v.shape), tuple(v.shape)
        nbytes = local.numel() * local.element_size()
        chunks.append(Chunk(key, offsets, sizes, gsize, str(local.dtype), pos, nbytes))
        pos += -(-nbytes // _ALIGN) * _ALIGN
    return chunks, pos


def _view(flat: torch.Tensor, c: Chunk) -> torch.Tensor:
    """Chunk ``c`` of a flat uint8 buffer, as a tensor of its dtype and shape (shares the buffer's memory)."""
    return flat[c.start:c.start + c.nbytes].view(_dtype(c.dtype)).view(c.sizes)


def bytes_per_rank(shard_bytes: int, copies: int) -> int:
    """Host memory the live copies take per rank: two generations of its own shards and of ``copies`` peers'."""
    return 2 * (1 + copies) * shard_bytes


class MemoryCopies:
    """This rank's live copies: its own shards and (``copies=1``) those of one rank on the previous node, for the
    newest two captured steps; the chunk tables of every rank of the world they were taken in."""

    def __init__(self, entries: Callable[[], list], copies: int, world_id: str, local_world_size: int) -> None:
        from megashard.checkpoint.state_dict import attach_uneven_layouts

        self.entries = entries
        self.world_id = world_id
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        nodes = self.world // max(1, local_world_size)
        # the same local rank of the next node keeps a copy (none on one node: it would die with this one)
        self.copies = copies if nodes > 1 and self.world % local_world_size == 0 else 0
        self.dst = (self.rank + local_world_size) % self.world
        self.src = (self.rank - local_world_size) % self.world
        entries = self.entries()
        sd = {"s": {k: v for k, v in entries}}
        attach_uneven_layouts(sd)  # collective: the real (maybe uneven) chunk of every DTensor
        self.keys = [k for k, _ in entries]
        chunks, size = _table(entries)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (chunks, size))  # every rank's table: what a copy of it holds
        self.tables = {r: t for r, t in enumerate(every)}
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" and self.copies else None
        self.gens: list[dict] = []  # newest last: {"step", "own", "peer"}
        self._spare: list[dict] = []

    @property
    def shard_bytes(self) -> int:
        return self.tables[self.rank][1]

    def _buffers(self) -> dict:
        if self._spare:
            return self._spare.pop()
        own = torch.empty(self.shard_bytes, dtype=torch.uint8)
        peer = torch.empty(self.tables[self.src][1], dtype=torch.uint8) if self.copies else None
        return {"step": -1, "own": own, "peer": peer}

    @torch.no_grad()
    def capture(self, step: int) -> None:
        """Copy this rank's state after ``step`` into host memory (and, copies=1, exchange it with the ranks of the
        neighbouring nodes: collective). A generation is kept only once complete."""
        gen = self._buffers()
        table = self.tables[self.rank][0]
        for c, (key, v) in zip(table, self.entries()):
            local = v.to_local() if hasattr(v, "to_local") else v
            _view(gen["own"], c).copy_(local.detach().reshape(c.sizes))
        if self.copies:
            ops = [dist.P2POp(dist.isend, gen["own"], self.dst, group=self.group),
                   dist.P2POp(dist.irecv, gen["peer"], self.src, group=self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        gen["step"] = step
        self.gens.append(gen)
        if len(self.gens) > 2:
            self._spare.append(self.gens.pop(0))

    def holdings(self) -> dict:
        """What this rank can give a new world: ``{(old rank, step): (generation index, "own"|"peer")}``."""
        out = {}
        for i, g in enumerate(self.gens):
            out[(self.rank, g["step"])] = (i, "own")
            if self.copies:
                out[(self.src, g["step"])] = (i, "peer")
        return out

    def buffer(self, index: int, kind: str) -> torch.Tensor:
        return self.gens[index][kind]


def _covering(tables: dict, held: dict) -> Optional[tuple[int, dict]]:
    """The newest step whose held pieces cover every chunk of the old world, and which old rank's buffer to take
    from which holder: ``(step, {old rank: (holder, generation, kind)})``; None when no step is covered."""
    need = {c.box() for t, _ in tables.values() for c in t}
    for step in sorted({s for (_, s) in held}, reverse=True):
        chosen: dict = {}
        covered: set = set()
        for old in sorted(tables):
            boxes = {c.box() for c in tables[old][0]}
            if boxes <= covered or (old, step) not in held:
                continue
            chosen[old] = held[(old, step)]
            covered |= boxes
        if need <= covered:
            return step, chosen
    return None


def _intersect(a_off, a_size, b_off, b_size) -> Optional[tuple[tuple, tuple]]:
    """Slices of the overlap of boxes a and b, relative to a and to b; None if they do not overlap."""
    in_a, in_b = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        in_a.append(slice(lo - ao, hi - ao))
        in_b.append(slice(lo - bo, hi - bo))
    return tuple(in_a), tuple(in_b)


@torch.no_grad()
def restore(copies: Any, targets: Callable[[dict], list], put: Optional[Callable[[list], None]],
            device_type: str = "cpu") -> Optional[int]:
    """Collective over the new world: fill this world's tensors from the live copies the ranks hold; returns the
    step restored, or None when no step of an old world is covered (nothing is changed: read the checkpoint).

    ``copies``: this rank's :class:`MemoryCopies` (None for a newcomer), or a list of them — the current world's and
    the one before, until every rank has a complete generation of the current one (a node lost during the first
    capture of a world leaves the previous world's copies as the newest covered). ``targets(keys)``: the ``(key,
    tensor or DTensor)`` list to fill in this world's layout (``keys``: ``{key: (global size, dtype)}`` of the old
    world); ``put(targets)``: called once they are filled (None: they are the live tensors themselves)."""
    from megashard.checkpoint.state_dict import attach_uneven_layouts

    rank, world = dist.get_rank(), dist.get_world_size()
    held_here = [c for c in (copies if isinstance(copies, (list, tuple)) else [copies]) if c is not None and c.gens]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [(c.world_id, list(c.holdings().items())) for c in held_here])
    by_world: dict[str, dict] = {}
    for holder, entries in enumerate(every):
        for world_id, items in entries or ():
            for (old, step), (gen, kind) in items:
                by_world.setdefault(world_id, {}).setdefault((old, step), (holder, gen, kind))
    best = None  # (step, world id, chosen, tables)
    for world_id in sorted(by_world):
        holder = min(h for h, _, _ in by_world[world_id].values())
        box: list[Any] = [next(c.tables for c in held_here if c.world_id == world_id) if rank == holder else None]
        dist.broadcast_object_list(box, src=holder)
        found = _covering(box[0], by_world[world_id])
        if found is not None and (best is None or found[0] > best[0]):
            best = (found[0], world_id, found[1], box[0])
    if best is None:  # nobody holds anything (a fresh start), or no step survived whole: the checkpoint
        return None
    step, world_id, chosen, tables = best
    source = next((c for c in held_here if c.world_id == world_id), None)
    pieces: dict[str, list] = {}
    for old in sorted(chosen):
        holder, gen, kind = chosen[old]
        table, size = tables[old]
        buf = source.buffer(gen, kind) if rank == holder else torch.empty(size, dtype=torch.uint8)
        if world > 1:
            if dist.get_backend() == "gloo":
                dist.broadcast(buf, src=holder)
            else:
                _broadcast_via_device(buf, holder, device_type)
        for c in table:
            pieces.setdefault(c.key, []).append((c, _view(buf, c)))
    keys = {c.key: (c.global_size, c.dtype) for t, _ in tables.values() for c in t}
    targets = list(targets(keys))
    sd = {"s": dict(targets)}
    attach_uneven_layouts(sd)
    chunks, _ = _table(targets)
    for c, (key, v) in zip(chunks, targets):
        local = v.to_local() if hasattr(v, "to_local") else v
        dest = local.view(c.sizes) if local.numel() else local
        filled = 0
        for src_chunk, data in pieces.get(key, ()):
            hit = _intersect(c.offsets, c.sizes, src_chunk.offsets, src_chunk.sizes)
            if hit is None:
                continue
            dest[hit[0]].copy_(data[hit[1]])
            filled += math.prod(s.stop - s.start for s in hit[0])
        if filled < math.prod(c.sizes):  # replicas overlap (counted twice): only less than all is missing
            raise RuntimeError(f"live copies: {key} not covered ({filled} of {math.prod(c.sizes)} elements)")
    if put is not None:
        put(targets)
    return step


def _broadcast_via_device(buf: torch.Tensor, src: int, device_type: str) -> None:
    """Broadcast a host buffer over the default group of a device backend (NCCL): through the device."""
    from megashard.state.devices import current_device

    dev = current_device(device_type)
    t = buf.to(dev)
    dist.broadcast(t, src=src)
    buf.copy_(t.cpu())
