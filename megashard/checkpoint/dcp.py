"""Save and load training checkpoints with ``torch.distributed.checkpoint`` (DCP), in any layout.

``save`` writes model and optimizer state (FSDP2 / TP / HSDP DTensors, uneven shards included), the
per-rank RNG states, the step, the global sample count and each rank's data-loader state, plus the
config and rank layout it was saved with. ``load`` reads it into the current model and optimizer,
whatever their layout (tp2·dp2 → dp4, → tp4, → one process, HSDP ↔ FSDP): DCP reads, for every local
shard, the overlapping pieces of the saved shards, so the full tensors are bit-identical.

What cannot be resharded is reported in the returned :class:`LoadReport` (and logged), never dropped:

* RNG states are per rank. They are restored exactly when the layout is unchanged; otherwise every
  stream is re-seeded deterministically from ``(seed, step)`` by :func:`reseed_value` and
  :func:`megashard.state.rng.model_parallel_manual_seed`.
* A rank's data-loader state belongs to its data-parallel rank. It is restored when the data-parallel
  size is unchanged (dp rank ``d`` gets what dp rank ``d`` saved); otherwise the position is recomputed
  from the global sample count ``consumed_samples``, which does not depend on the layout.

Who writes what: replicated shards (e.g. a TP-replicated bias, HSDP replicas, optimizer ``step``) are
held by several ranks; :class:`MegashardSavePlanner` gives each to exactly one holder, balancing the
bytes per rank with :func:`megashard.checkpoint.exchange.distribute_shards_to_ranks`.

Crash safety (temporary directory, completion marker with checksums, retention) is in
:mod:`megashard.checkpoint.safety`; hashing while writing and verifying while reading (every DCP storage
item against its checksum in the marker) in :mod:`megashard.checkpoint.storage`. Non-tensor data is never
unpickled freely: DCP's ``.metadata`` goes through a restricted unpickler and every other object through
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import io
import logging
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from megashard._compat import dcp_flatten_state_dict, dcp_load_state_dict, dcp_set_element
from megashard.checkpoint import safety
from megashard.checkpoint.exchange import distribute_shards_to_ranks
from megashard.checkpoint.storage import (  # noqa: F401  (re-exported: part of this module's API)
    DCP_METADATA,
    ChecksummingFileSystemWriter,
    SafeFileSystemReader,
    load_dcp_metadata,
)
from megashard.errors import CheckpointCorruptedError, CheckpointError, MegashardError

__all__ = [
    "LoadReport",
    "MegashardLoadPlanner",
    "MegashardSavePlanner",
    "SafeFileSystemReader",
    "dedup_write_items",
    "load",
    "load_dcp_metadata",
    "reseed_value",
    "save",
]

logger = logging.getLogger("megashard.checkpoint")

_TEST_HOOK = None  # tests: called with a stage name ("after_data", "before_commit") on every rank


def _hook(stage: str) -> None:
    if _TEST_HOOK is not None:
        _TEST_HOOK(stage)


# ---------------------------------------------------------------------------------------------------
# Save planner: one writer per replicated shard, chosen by megashard's distribution
# ---------------------------------------------------------------------------------------------------
def _item_id(index) -> tuple:
    """A sortable shard id of a DCP write item: ``(fqn, global offset)``."""
    return (index.fqn, tuple(int(o) for o in index.offset) if index.offset is not None else ())


def _item_bytes(item) -> int:
    """Bytes of the chunk a write item stores (DCP's ``tensor_storage_size`` counts the whole tensor)."""
    td = item.tensor_data
    if td is None:
        return 1  # a non-tensor object: size unknown before pickling, counted as DCP counts it
    n = 1
    for s in td.chunk.sizes:
        n *= int(s)
    return n * td.properties.dtype.itemsize


def dedup_write_items(all_plans: Sequence[SavePlan]) -> tuple[list[SavePlan], dict[tuple, int]]:
    """Keep every write item in exactly one plan: the holder :func:`distribute_shards_to_ranks` picks.

    ``all_plans[r]`` is rank ``r``'s local plan; an item in several plans is a replica (same fqn and
    offset). Sizes are the bytes of each chunk (1 for a non-tensor item).

    Returns: the new plans and ``{(fqn, offset): writing rank}`` for every item.
    """
    holders: dict[tuple, list[int]] = defaultdict(list)
    sizes: dict[tuple, int] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            sid = _item_id(item.index)
            holders[sid].append(rank)
            if sid not in sizes:
                sizes[sid] = _item_bytes(item)
    assignment = distribute_shards_to_ranks(dict(holders), sizes, max(len(all_plans), 1))
    plans = [
        dataclasses.replace(plan, items=[it for it in plan.items if assignment[_item_id(it.index)] == rank])
        for rank, plan in enumerate(all_plans)
    ]
    return plans, assignment


class MegashardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that replicated items are spread by megashard's distribution.

    After a save, ``write_assignment`` (on the coordinator, rank 0) maps ``(fqn, offset)`` to the rank
    that wrote it; the data file names (``__<rank>_<n>.distcp``) say the same.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.write_assignment: dict[tuple, int] = {}

    def create_global_plan(self, all_plans: list[SavePlan]):
        plans, self.write_assignment = dedup_write_items(all_plans)
        # The default dedup that follows finds nothing left to remove.
        return super().create_global_plan(plans)


# ---------------------------------------------------------------------------------------------------
# Load side: weights-only objects (the verified reader is in megashard.checkpoint.storage)
# ---------------------------------------------------------------------------------------------------
def _load_weights_only(value: io.BytesIO, what: str) -> Any:
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: not a plain weights-only object
        raise CheckpointCorruptedError(
            f"{what} cannot be loaded with torch.load(weights_only=True) ({type(e).__name__}: {e}); megashard only "
            "loads tensors, numbers, strings and containers of them from disk, never arbitrary pickled objects"
        ) from None


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor items load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_weights_only(value, f"checkpoint item {fqn!r}")
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class MegashardLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner with weights-only loading of non-tensor items."""


# ---------------------------------------------------------------------------------------------------
# Helpers: distributed agreement, state-dict collection, layouts
# ---------------------------------------------------------------------------------------------------
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def _unwrap(e: BaseException) -> BaseException:
    """The megashard error inside a DCP CheckpointException (lowest rank first), else a CheckpointError."""
    if isinstance(e, CheckpointException):
        for rank in sorted(e.failures):
            exc = e.failures[rank][0]
            if isinstance(exc, MegashardError):
                return exc
        first = sorted(e.failures)[0] if e.failures else None
        inner = e.failures[first][0] if first is not None else e
        return CheckpointError(f"DCP failed on ranks {sorted(e.failures)}; rank {first}: {type(inner).__name__}: {inner}")
    return e


def _agree(error: Optional[BaseException]) -> None:
    """Collective: if any rank failed, raise the lowest rank's error on every rank (megashard type kept)."""
    if not _dist_on():
        if error is not None:
            raise error
        return
    errors: list = [None] * dist.get_world_size()
    payload = None
    if error is not None:
        payload = error if isinstance(error, MegashardError) else CheckpointError(f"{type(error).__name__}: {error}")
    dist.all_gather_object(errors, payload)
    for rank, err in enumerate(errors):
        if err is not None:
            if err is payload:
                raise err
            raise type(err)(f"(raised on rank {rank}) {err}")


def _portable(e: Optional[BaseException]) -> Optional[BaseException]:
    """``e`` itself if it is a megashard error (picklable, keeps its type), else a CheckpointError describing it."""
    if e is None or isinstance(e, MegashardError):
        return e
    return CheckpointError(f"{type(e).__name__}: {e}")


def _broadcast_from_0(obj: Any) -> Any:
    if not _dist_on() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _as_list(optimizer) -> list:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _collect(model, optimizer, extra: Optional[dict], sections: Optional[dict] = None) -> dict:
    """``{"model": ..., "optim": ..., "extra": ..., **sections}`` with DCP's own (FQN-keyed, sharded) state dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    opts = _as_list(optimizer)
    sd: dict = {}
    if opts and model is None:
        raise CheckpointError("an optimizer was given without its model; pass model= as well (optimizer state is keyed by parameter names)")
    if model is not None:
        if opts:
            sd["model"], sd["optim"] = get_state_dict(model, opts)
        else:
            sd["model"] = get_model_state_dict(model)
    if extra:
        if not isinstance(extra, dict):
            raise CheckpointError(f"state_dict= must be a dict of tensors / DTensors / small values, got {type(extra).__name__}")
        _check_weights_only(_without_tensors(extra), "state_dict= (its non-tensor values)")
        sd["extra"] = extra
    for name, section in (sections or {}).items():
        if not isinstance(name, str) or not name or "." in name or name in sd or name == "extra":
            raise CheckpointError(
                f"sections= name {name!r} is not allowed: names must be non-empty strings without '.', other than "
                f"'extra' and the sections model=/optimizer= fill ({sorted(k for k in sd if k != 'extra')})")
        if not isinstance(section, dict):
            raise CheckpointError(f"sections[{name!r}] must be a dict of tensors / DTensors / small values, got "
                                  f"{type(section).__name__}")
        _check_weights_only(_without_tensors(section), f"sections[{name!r}] (its non-tensor values)")
        sd[name] = section
    if not sd:
        raise CheckpointError("nothing to checkpoint: pass model= (and optimizer=), state_dict= or sections=")
    return sd


def _without_tensors(x: Any) -> Any:
    """``x`` with every tensor replaced by None (to check the other values cheaply)."""
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, dict):
        return {k: _without_tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_without_tensors(v) for v in x]
    return x


def _preprocess(sd: dict) -> None:
    from megashard.tensors.uneven import preprocess_state_dict_for_uneven_dtensor

    preprocess_state_dict_for_uneven_dtensor(sd)


def _current_state(parallel_state):
    if parallel_state is not None:
        return parallel_state
    from megashard.state import get_parallel_state, is_initialized

    return get_parallel_state() if is_initialized() else None


def _layout_record(st, world: int) -> dict:
    if st is None:
        return {"world_size": world, "config": None, "sizes": None}
    return {"world_size": st.world_size, "config": st.config.to_dict(), "sizes": st.sizes.as_dict()}


def _dp_pp(layout: dict, rank: int) -> tuple[int, int, int, int]:
    """(dp size, dp rank, pp size, pp rank) of ``rank`` in a layout record (no state: pure data parallel)."""
    if layout["sizes"] is None:
        return layout["world_size"], rank, 1, 0
    lay = _rank_layout(layout)
    return lay.size("dp"), lay.rank_in("dp", rank), lay.size("pp"), lay.rank_in("pp", rank)


def _rank_layout(layout: dict):
    from megashard.config import ResolvedSizes
    from megashard.layout import RankLayout

    sizes = dict(layout["sizes"])
    sizes["order"] = tuple(str(sizes["order"]).split("-"))
    return RankLayout(ResolvedSizes(**sizes))


def _saved_rank_with(layout: dict, dp_rank: int, pp_rank: int) -> int:
    """The saved rank at data-parallel index ``dp_rank`` of stage ``pp_rank`` (tp, cp coordinates 0)."""
    if layout["sizes"] is None:
        return dp_rank
    lay = _rank_layout(layout)
    anchor = lay.group_of("pp", 0)[pp_rank]  # rank 0 has every coordinate 0: this is (pp=pp_rank, rest 0)
    return lay.group_of("dp", anchor)[dp_rank]


def reseed_value(seed: int, step: int) -> int:
    """The base seed used after a layout change: a hash of ``(seed, step)``, in ``[0, 2**31)``.

    Deterministic (same on every rank and every run) and different for every step, so a resumed run
    does not replay the random numbers of the run it resumes.
    """
    h = hashlib.blake2b(f"megashard-reseed:{int(seed)}:{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**31 - 1)


# ---------------------------------------------------------------------------------------------------
# Per-rank state: RNG and data-loader position
# ---------------------------------------------------------------------------------------------------
def _rank_state_name(rank: int) -> str:
    return f"{safety.RANK_STATE_DIR}/{rank:06d}.pt"


def _rng_snapshot() -> dict:
    from megashard.state.rng import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = {}
    if tracker.is_initialized():
        for name, s in tracker.get_states().items():
            states[name] = s.get_state() if isinstance(s, torch.Generator) else s
    return {
        "tracker": states,
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _rng_restore(rng: dict) -> None:
    from megashard.state.rng import get_cuda_rng_tracker

    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng.get("tracker"):
        get_cuda_rng_tracker().set_states(dict(rng["tracker"]))


def _check_weights_only(obj: Any, what: str) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{what} must hold only tensors, numbers, strings, None and lists/tuples/dicts of them, so that it "
            f"loads with torch.load(weights_only=True); it does not ({type(e).__name__}: {str(e)[:300]})"
        ) from None


def _write_rank_state(tmp_dir: str, rank: int, data_state: Any) -> str:
    name = _rank_state_name(rank)
    path = os.path.join(tmp_dir, name)
    obj = {"rank": rank, "rng": _rng_snapshot(), "data_state": data_state}
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return name


def _read_rank_state(ckpt_dir: str, rank: int) -> dict:
    path = os.path.join(ckpt_dir, _rank_state_name(rank))
    with open(path, "rb") as f:
        return _load_weights_only(io.BytesIO(f.read()), f"per-rank state {path}")


# ---------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------
def save(
    root: str,
    step: int,
    model: Optional[torch.nn.Module] = None,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
    *,
    state_dict: Optional[dict] = None,
    sections: Optional[dict] = None,
    consumed_samples: Optional[int] = None,
    data_state: Any = None,
    keep_last: Optional[int] = None,
    checksum: str = "crc32",
    overwrite: bool = False,
    parallel_state=None,
    sync_files: bool = True,
    thread_count: int = 1,
) -> str:
    """Save a checkpoint of ``step`` under ``root`` (collective over the default process group).

    Args:
        root: checkpoint root directory; the checkpoint becomes ``root/step_<step:08d>`` once complete.
        step: training step (same on every rank).
        model / optimizer: saved with DCP's ``get_state_dict`` (FSDP2, TP, HSDP DTensors, uneven shards).
        state_dict: more state saved under ``"extra"`` (tensors, DTensors, small values).
        sections: named top-level sections saved as given, e.g. ``{"model": {...}, "optim": {...}}`` from a
            training loop that builds its own (global DTensor) state dict; the consolidated file
            (:func:`megashard.checkpoint.consolidate.consolidate`) then holds ``full["model"]`` etc.
        consumed_samples: global number of samples consumed so far (layout independent; used to
            recompute the data position when the data-parallel size changes).
        data_state: this rank's data-loader state (tensors / numbers / strings / containers).
        keep_last: after saving, delete all but the newest ``keep_last`` complete checkpoints.
        checksum: ``"crc32"`` (default, fastest; detects accidental damage) or ``"sha256"``: the digest of every
            file and of every DCP storage item, computed as the bytes are written and recorded in the marker.
        overwrite: replace an existing checkpoint of the same step (else CheckpointError).
        parallel_state: the ParallelState whose layout is recorded (default: the current one, if any).
        sync_files: fsync every file (needed for crash safety; False only for benchmarks / tests).
        thread_count: writer threads per rank.

    Returns: the path of the complete checkpoint.
    """
    rank, world = _rank_world()
    st = _current_state(parallel_state)
    name = safety.checkpoint_dirname(step)
    root = os.path.abspath(root)
    final, tmp = os.path.join(root, name), os.path.join(root, safety.TMP_PREFIX + name)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be an int >= 1 or None (keep everything), got {keep_last!r}")
    if checksum not in safety.CHECKSUM_ALGORITHMS:
        raise CheckpointError(f"checksum={checksum!r} is not supported; use one of {sorted(safety.CHECKSUM_ALGORITHMS)}")
    t0 = time.perf_counter()
    # Phase 0: every rank collects its state and checks its arguments; then all agree (same root and step,
    # nothing wrong anywhere) before rank 0 touches the disk.
    err: Optional[BaseException] = None
    sd: dict = {}
    try:
        if data_state is not None:
            _check_weights_only(data_state, "data_state")
        sd = _collect(model, optimizer, state_dict, sections)
    except Exception as e:  # noqa: BLE001
        err = e
    if _dist_on() and world > 1:
        seen: list = [None] * world
        dist.all_gather_object(seen, (root, step, _portable(err)))
        for r, (_, _, e) in enumerate(seen):
            if e is not None:
                raise e if r == rank else type(e)(f"(raised on rank {r}) {e}")
        bad = [r for r, (rt, s, _) in enumerate(seen) if (rt, s) != seen[0][:2]]
        if bad:
            raise CheckpointError(
                f"ranks disagree on the checkpoint: rank 0 saves step {seen[0][1]} to {seen[0][0]}, but ranks {bad[:8]} "
                f"pass {[seen[r][:2] for r in bad[:3]]}; every rank must call save() with the same root and step"
            )
    elif err is not None:
        raise err
    err = None
    if rank == 0:  # rank 0 prepares the temporary directory
        try:
            if os.path.exists(final) and not overwrite:
                raise CheckpointError(f"checkpoint {final} already exists; pass overwrite=True to replace it")
            os.makedirs(root, exist_ok=True)
            safety.cleanup_stale(root)
            os.makedirs(os.path.join(tmp, safety.RANK_STATE_DIR))
        except Exception as e:  # noqa: BLE001
            err = _portable(e)
    err = _broadcast_from_0(err)
    if err is not None:
        raise err

    # Phase 1: DCP writes the tensors, each replicated shard by one of its holders.
    _preprocess(sd)
    planner = MegashardSavePlanner()
    writer = ChecksummingFileSystemWriter(tmp, checksum, sync_files=sync_files, thread_count=thread_count)
    try:
        with warnings.catch_warnings():  # DCP warns that a single process is assumed: that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata = dcp_save(sd, storage_writer=writer, planner=planner, no_dist=not _dist_on())
    except CheckpointException as e:
        raise _unwrap(e) from None
    _hook("after_data")

    # Phase 2: per-rank state; the data files were hashed (whole and per item) as they were written.
    records: dict = {}
    items: dict = {}
    err = None
    try:
        records, items = writer.checksums(metadata, rank)
        own = [_write_rank_state(tmp, rank, data_state)] + ([DCP_METADATA] if rank == 0 else [])
        records.update({f: safety.file_record(os.path.join(tmp, f), checksum) for f in own})
    except Exception as e:  # noqa: BLE001
        err = e
    gathered = _gather_to_0((records, items, data_state is not None, _portable(err)))

    # Phase 3: rank 0 writes the layout file, then the marker (last), and publishes the directory by renaming it.
    result: Any = None
    if rank == 0:
        try:
            for r, (_, _, _, e) in enumerate(gathered):
                if e is not None:
                    raise e if r == 0 else type(e)(f"(raised on rank {r}) {e}")
            all_records: dict = {}
            all_items: dict = {}
            for recs, its, _, _ in gathered:
                all_records.update(recs)
                all_items.update(its)
            safety.write_json_atomic(os.path.join(tmp, safety.LAYOUT_FILE), {
                "format": safety.FORMAT, "version": safety.FORMAT_VERSION, "step": step,
                "consumed_samples": consumed_samples, "layout": _layout_record(st, world),
                "sections": {k: len(dcp_flatten_state_dict({k: v})[0]) for k, v in sd.items()},
                "has_data_state": any(h for _, _, h, _ in gathered), "torch": torch.__version__,
                "megashard": _megashard_version(), "created": time.time(),
            })
            all_records[safety.LAYOUT_FILE] = safety.file_record(os.path.join(tmp, safety.LAYOUT_FILE), checksum)
            safety.write_marker(tmp, step, all_records, checksum, all_items)
            _hook("before_commit")
            safety.commit_checkpoint(tmp, final, overwrite=overwrite)
            removed = safety.apply_retention(root, keep_last) if keep_last is not None else []
            result = ("ok", removed)
        except Exception as e:  # noqa: BLE001
            result = ("error", _portable(e))
    result = _broadcast_from_0(result)
    if result[0] == "error":
        raise result[1]
    if rank == 0:
        logger.info("saved checkpoint %s (%d ranks, %.2f s)%s", final, world, time.perf_counter() - t0,
                    f"; retention removed {result[1]}" if result[1] else "")
    return final


def _gather_to_0(obj: Any) -> list:
    if not _dist_on() or dist.get_world_size() == 1:
        return [obj]
    out: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def _megashard_version() -> str:
    try:
        from megashard import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


# ---------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    """What :func:`load` restored, and what it could not restore exactly and how it handled that.

    ``rng``: ``"restored"`` (same layout), ``"reseeded"`` (layout changed: streams re-seeded with
    ``model_parallel_manual_seed(reseed_value(seed, step))``, value in ``rng_seed``) or ``"untouched"``
    (``restore_rng=False``).
    ``data``: ``"restored"`` (``data_state`` holds this rank's saved data-loader state), ``"recomputed"``
    (data-parallel size changed or no state saved: resume from the global ``consumed_samples``), or
    ``"not saved"`` (neither a data state nor a sample count was saved).
    """

    path: str
    step: int
    consumed_samples: Optional[int]
    saved_layout: dict
    current_layout: dict
    same_layout: bool
    rng: str
    rng_seed: Optional[int]
    data: str
    data_state: Any = None
    missing_keys: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        def sizes(layout: dict) -> str:
            s = layout.get("sizes")
            if not s:
                return f"{layout['world_size']} ranks (no megashard layout)"
            keys = ("tp", "cp", "pp", "dp_outer", "dp_shard", "ep", "expt_tp")
            return f"{s['world_size']} ranks (" + ", ".join(f"{k}={s[k]}" for k in keys if s.get(k, 1) != 1 or k == "dp_shard") + ")"

        lines = [f"loaded {self.path} (step {self.step}) saved with {sizes(self.saved_layout)} into {sizes(self.current_layout)}",
                 f"  rng: {self.rng}" + (f" (base seed {self.rng_seed})" if self.rng_seed is not None else ""),
                 f"  data position: {self.data}" + (f" (consumed_samples={self.consumed_samples})" if self.consumed_samples is not None else "")]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _verify_distributed(ckpt: str, marker: safety.Marker, checksum: bool) -> set:
    """Check every file once, the work spread over the ranks by bytes hashed; every rank raises on any problem.

    Files with per-item checksums get a size check only: the reader verifies their items as it reads them.
    Older checkpoints (no item checksums) are hashed whole here, before DCP reads anything.
    """
    rank, world = _rank_world()

    def cost(n: str) -> int:
        return 1 if (n in marker.items or not checksum) else marker.files[n]["size"] + 1

    names = sorted(marker.files, key=lambda n: (-cost(n), n))
    heap = [(0, r) for r in range(min(world, len(names)))]  # (bytes so far, rank): a heap already
    mine = []
    for n in names:  # largest file first to the least-loaded rank (ties: lower rank); same answer on every rank
        load_, r = heapq.heappop(heap)
        heapq.heappush(heap, (load_ + cost(n), r))
        if r == rank:
            mine.append(n)
    problems = safety.verify_files(ckpt, marker, mine, checksum=checksum, defer_items=True)
    if _dist_on() and world > 1:
        everything: list = [None] * world
        dist.all_gather_object(everything, problems)
        problems = [p for ps in everything for p in ps]
    safety.raise_problems(ckpt, sorted(problems))
    return set(marker.files)


def _precheck(sd: dict, md: Metadata, strict: bool) -> tuple[list, list]:
    """Missing keys and shape mismatches, named, before DCP sees the state dict."""
    flat, _ = dcp_flatten_state_dict(sd)
    stored = md.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    notes = []
    for k, v in flat.items():
        m = stored.get(k)
        if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
            if tuple(v.shape) != tuple(m.size):
                raise CheckpointError(
                    f"{k!r} has shape {tuple(v.shape)} here but {tuple(m.size)} in the checkpoint; the model does not "
                    "match the saved one (check the model config)"
                )
            if v.dtype != m.properties.dtype:
                notes.append(f"{k}: saved as {m.properties.dtype}, loaded into {v.dtype} (converted)")
    if missing and strict:
        sections = sorted({k.split(".", 1)[0] for k in stored})
        raise CheckpointError(
            f"{len(missing)} key(s) are not in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}; the "
            f"checkpoint has sections {sections} and {len(stored)} keys. Pass strict=False to load the rest."
        )
    return missing, notes


def load(
    path: str,
    model: Optional[torch.nn.Module] = None,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
    *,
    state_dict: Optional[dict] = None,
    sections: Optional[dict] = None,
    parallel_state=None,
    seed: Optional[int] = None,
    verify: bool = True,
    strict: bool = True,
    restore_rng: bool = True,
) -> LoadReport:
    """Load a checkpoint into ``model`` / ``optimizer`` / ``state_dict``, in the current layout.

    Collective over the default process group (or a single process without one).

    Args:
        path: a checkpoint directory, or a root: then its newest *complete* checkpoint.
        model / optimizer: loaded in place (any layout: FSDP2, TP, HSDP, plain modules).
        state_dict: the ``"extra"`` state to load in place (same keys as saved).
        sections: named sections (as saved with ``save(sections=...)``) to load in place. A checkpoint that
            holds none of them but an ``"extra"`` section (the same dict saved with ``state_dict=``) is read
            from there.
        parallel_state: the current layout (default: the current ParallelState, if any).
        seed: base seed for re-seeding after a layout change (default: the current config's seed, else the
            saved config's, else 1234).
        verify: verify every byte that is read against the checksums recorded at save time, as it is read
            (each DCP storage item in a thread pool while the previous one is deserialised; the small files
            before anything is read; checkpoints without per-item checksums are hashed whole first). False
            checks file sizes only. A damaged file raises before any of its damaged bytes are used, but
            tensors read before the damage was found may already hold the checkpoint's values: after a
            CheckpointCorruptedError, load another checkpoint.
        strict: every requested key must be in the checkpoint (False: load what is there, list the rest).
        restore_rng: restore (or re-seed) RNG states; False leaves the generators alone.

    Returns: a :class:`LoadReport`; ``report.data_state`` is this rank's data-loader state if restored.
    Raises: CheckpointNotFoundError, CheckpointCorruptedError (naming the file), CheckpointError.
    """
    rank, world = _rank_world()
    st = _current_state(parallel_state)

    # Rank 0 picks the checkpoint and reads the small JSON files; everyone gets the same answer.
    head: Any
    if rank == 0:
        try:
            ckpt = os.path.abspath(safety.resolve_checkpoint(path))
            head = ("ok", ckpt, safety.read_marker(ckpt))
        except Exception as e:  # noqa: BLE001
            head = ("error", e if isinstance(e, MegashardError) else CheckpointError(f"{type(e).__name__}: {e}"))
    else:
        head = None
    head = _broadcast_from_0(head)
    if head[0] == "error":
        raise head[1]
    _, ckpt, marker = head

    verified = _verify_distributed(ckpt, marker, checksum=verify)
    err: Optional[BaseException] = None
    try:  # files are verified: read the layout and DCP metadata, check the requested keys and shapes
        info = safety.read_json(os.path.join(ckpt, safety.LAYOUT_FILE), "layout file")
        saved_layout, step = info["layout"], int(info["step"])
        reader = SafeFileSystemReader(ckpt, marker, verified=verified, checksum=verify)
        saved_sections = info.get("sections") or {}
        if sections and state_dict is None and "extra" in saved_sections and not set(sections) & set(saved_sections):
            sd = _collect(model, optimizer, sections)  # saved with state_dict= (section "extra")
        else:
            sd = _collect(model, optimizer, state_dict, sections)
        missing, notes = _precheck(sd, reader.read_metadata(), strict)
    except Exception as e:  # noqa: BLE001
        err = e if isinstance(e, MegashardError) else CheckpointCorruptedError(
            f"{os.path.join(ckpt, safety.LAYOUT_FILE)} or {DCP_METADATA}: unexpected content ({type(e).__name__}: {e})")
    _agree(err)
    current_layout = _layout_record(st, world)
    _preprocess(sd)
    try:
        dcp_load_state_dict(sd, reader, MegashardLoadPlanner(allow_partial_load=not strict), no_dist=not _dist_on())
    except CheckpointException as e:
        raise _unwrap(e) from None
    _apply(model, optimizer, sd)

    report = LoadReport(ckpt, step, info.get("consumed_samples"), saved_layout, current_layout,
                        _same_layout(saved_layout, current_layout), rng="untouched", rng_seed=None, data="not saved",
                        missing_keys=missing, notes=notes)
    err = None
    try:
        _restore_rank_state(report, ckpt, info, st, rank, seed, restore_rng)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(err)
    if rank == 0:
        changed = report.rng == "reseeded" or report.data == "recomputed" or report.missing_keys or report.notes
        (logger.warning if changed else logger.info)("%s", report.summary())
    return report


def _apply(model, optimizer, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    opts = _as_list(optimizer)
    if model is None:
        return
    if opts:
        set_state_dict(model, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        set_model_state_dict(model, sd["model"])


def _same_layout(a: dict, b: dict) -> bool:
    return a["world_size"] == b["world_size"] and a.get("sizes") == b.get("sizes")


def _restore_rank_state(report: LoadReport, ckpt: str, info: dict, st, rank: int, seed: Optional[int], restore_rng: bool) -> None:
    saved, current = report.saved_layout, report.current_layout
    # RNG: exact per-rank streams only make sense in the identical layout.
    if restore_rng:
        if report.same_layout:
            _rng_restore(_read_rank_state(ckpt, rank)["rng"])
            report.rng = "restored"
        else:
            base = seed
            if base is None and st is not None:
                base = st.config.seed
            if base is None and saved.get("config"):
                base = saved["config"].get("seed")
            base = 1234 if base is None else int(base)
            value = reseed_value(base, report.step)
            _reseed(value)
            report.rng, report.rng_seed = "reseeded", value
            report.notes.append(
                f"RNG states are per rank and the layout changed, so every stream was re-seeded from seed={base} and "
                f"step={report.step} (base seed {value}; model_parallel_manual_seed rule)"
            )
    # Data position: dp rank d resumes from what dp rank d saved, if the data-parallel size is unchanged.
    s_dp, _, s_pp, _ = _dp_pp(saved, 0)
    c_dp, c_dp_rank, c_pp, c_pp_rank = _dp_pp(current, rank)
    if info.get("has_data_state") and s_dp == c_dp:
        # Same layout: this rank's own file. Otherwise the saved rank of the same dp rank (and pp stage, if pp
        # is unchanged) with tp = cp = 0: its tensor/context-parallel peers read the same data.
        src = rank if report.same_layout else _saved_rank_with(saved, c_dp_rank, c_pp_rank if s_pp == c_pp else 0)
        report.data_state = _read_rank_state(ckpt, src)["data_state"]
        report.data = "restored"
    elif report.consumed_samples is not None:
        report.data = "recomputed"
        why = (f"data-loader states are per data-parallel rank and dp changed ({s_dp} -> {c_dp}), so they were not "
               "restored" if info.get("has_data_state") else "no per-rank data-loader state was saved")
        report.notes.append(f"{why}; resume the data from the global sample count consumed_samples={report.consumed_samples}")
    elif info.get("has_data_state"):
        report.notes.append(
            f"data-loader states could not be restored (dp {s_dp} -> {c_dp}) and no consumed_samples was saved: "
            "the data position is unknown"
        )


def _reseed(value: int) -> None:
    from megashard.state.rng import model_parallel_manual_seed

    torch.manual_seed(value)
    model_parallel_manual_seed(value)
