"""Load a megashard checkpoint into the current model and optimizer, whatever their layout.

:func:`load` reads a checkpoint saved by :func:`megashard.checkpoint.saving.save` into any layout
(tp2·dp2 → dp4, → tp4, → one process, HSDP ↔ FSDP): DCP reads, for every local shard, the overlapping
pieces of the saved shards, so the full tensors are bit-identical. Every byte read is verified against
the checksums recorded at save time (:mod:`megashard.checkpoint.storage`), the verification of whole
files spread over the ranks.

What cannot be resharded — per-rank RNG and data-loader states (:mod:`megashard.checkpoint.rank_state`)
— is reported in the returned :class:`LoadReport` (and logged), never dropped.
"""
from __future__ import annotations

import heapq
import logging
import os
from typing import Optional, Sequence, Union

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megashard._compat import dcp_load_state_dict
from megashard.checkpoint import rank_state, safety
from megashard.checkpoint.collective import agree, capture, dist_on, rank_world, unwrap_dcp_error
from megashard.checkpoint.planners import MegashardLoadPlanner
from megashard.checkpoint.report import LoadReport
from megashard.checkpoint.state_dict import (
    apply_state_dict,
    attach_uneven_layouts,
    check_against_metadata,
    collect_state_dict,
)
from megashard.checkpoint.storage import DCP_METADATA, SafeFileSystemReader
from megashard.errors import CheckpointCorruptedError, MegashardError

__all__ = ["LoadReport", "load", "verify_distributed"]

logger = logging.getLogger("megashard.checkpoint")


def verify_distributed(ckpt: str, marker: safety.Marker, checksum: bool) -> set:
    """Check every file once, the work spread over the ranks by bytes hashed; every rank raises on any problem.

    Files with per-item checksums get a size check only: the reader verifies their items as it reads them.
    Older checkpoints (no item checksums) are hashed whole here, before DCP reads anything.
    """
    rank, world = rank_world()

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
    problems = [p for ps in agree(problems) for p in ps]
    safety.raise_problems(ckpt, sorted(problems))
    return set(marker.files)


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
    log: bool = True,
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
        log: log the report's summary on rank 0 (logger ``megashard.checkpoint``; a warning when something was
            re-seeded, recomputed or is missing). False: the caller reports what matters to its users.

    Returns: a :class:`LoadReport`; ``report.data_state`` is this rank's data-loader state if restored.
    Raises: CheckpointNotFoundError, CheckpointCorruptedError (naming the file), CheckpointError.
    """
    rank, world = rank_world()
    st = rank_state.current_state(parallel_state)

    # Rank 0 picks the checkpoint and reads its marker; every rank gets the same answer.
    ckpt, marker = agree(rank0=lambda _: _pick(path))
    verified = verify_distributed(ckpt, marker, checksum=verify)
    # Files are verified: read the layout and DCP metadata, check the requested keys and shapes.
    prepared, err = capture(_prepare, ckpt, marker, verified, verify, model, optimizer, state_dict, sections, strict)
    agree(None, err)
    info, step, reader, sd, missing, notes = prepared
    current_layout = rank_state.layout_record(st, world)
    attach_uneven_layouts(sd)
    try:
        dcp_load_state_dict(sd, reader, MegashardLoadPlanner(allow_partial_load=not strict), no_dist=not dist_on())
    except CheckpointException as e:
        raise unwrap_dcp_error(e) from None
    apply_state_dict(model, optimizer, sd)

    saved_layout = info["layout"]
    report = LoadReport(ckpt, step, info.get("consumed_samples"), saved_layout, current_layout,
                        rank_state.same_layout(saved_layout, current_layout), rng="untouched", rng_seed=None,
                        data="not saved", missing_keys=missing, notes=notes)
    _, err = capture(rank_state.restore_rank_state, report, ckpt, info, st, rank, seed, restore_rng)
    agree(None, err)
    if rank == 0 and log:
        changed = report.rng == "reseeded" or report.data == "recomputed" or report.missing_keys or report.notes
        (logger.warning if changed else logger.info)("%s", report.summary())
    return report


def _pick(path: str) -> tuple[str, safety.Marker]:
    """Rank 0: the checkpoint ``path`` names (itself or the newest complete one under it) and its marker."""
    ckpt = os.path.abspath(safety.resolve_checkpoint(path))
    return ckpt, safety.read_marker(ckpt)


def _prepare(ckpt: str, marker: safety.Marker, verified: set, verify: bool, model, optimizer,
             state_dict: Optional[dict], sections: Optional[dict], strict: bool) -> tuple:
    """``(layout info, step, reader, state dict to fill, missing keys, notes)``; unexpected content of the small
    files raises CheckpointCorruptedError naming them."""
    try:
        info = safety.read_json(os.path.join(ckpt, safety.LAYOUT_FILE), "layout file")
        step, _ = int(info["step"]), info["layout"]
        reader = SafeFileSystemReader(ckpt, marker, verified=verified, checksum=verify)
        saved_sections = info.get("sections") or {}
        if sections and state_dict is None and "extra" in saved_sections and not set(sections) & set(saved_sections):
            sd = collect_state_dict(model, optimizer, sections)  # saved with state_dict= (section "extra")
        else:
            sd = collect_state_dict(model, optimizer, state_dict, sections)
        missing, notes = check_against_metadata(sd, reader.read_metadata(), strict)
    except MegashardError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointCorruptedError(f"{os.path.join(ckpt, safety.LAYOUT_FILE)} or {DCP_METADATA}: unexpected "
                                       f"content ({type(e).__name__}: {e})") from None
    return info, step, reader, sd, missing, notes
