"""Save a training checkpoint with ``torch.distributed.checkpoint`` (DCP), crash-safe, from any layout.

:func:`save` writes model and optimizer state (FSDP2 / TP / HSDP DTensors, uneven shards included), the
per-rank RNG and data-loader states, the step and the global sample count, plus the config and rank
layout it was saved with. Steps, each ending with every rank agreeing (:func:`~megashard.checkpoint.collective.agree`):

0. every rank collects its state dict and checks its arguments; all agree on root and step before
   rank 0 touches the disk, then rank 0 creates the temporary directory;
1. DCP writes the tensors, each replicated shard by one holder (:mod:`megashard.checkpoint.planners`),
   hashing every file and storage item as it writes (:mod:`megashard.checkpoint.storage`);
2. every rank writes its rank state (:func:`megashard.checkpoint.rank_state.write_rank_state`);
3. rank 0 writes the layout file, then the completion marker, and publishes the directory by one
   rename (:func:`megashard.checkpoint.safety.commit_checkpoint`); retention runs last.

A save killed at any point leaves the previous checkpoints untouched and only a ``.tmp-`` directory,
removed by the next save (:mod:`megashard.checkpoint.safety`).
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException

from megashard._compat import dcp_flatten_state_dict
from megashard.checkpoint import checksums, rank_state, safety
from megashard.checkpoint.collective import agree, capture, dist_on, rank_world, unwrap_dcp_error
from megashard.checkpoint.planners import MegashardSavePlanner, check_weights_only
from megashard.checkpoint.state_dict import attach_uneven_layouts, collect_state_dict
from megashard.checkpoint.storage import DCP_METADATA, ChecksummingFileSystemWriter
from megashard.errors import CheckpointError

__all__ = ["save"]

logger = logging.getLogger("megashard.checkpoint")


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
    job: Optional[dict] = None,
    run_id: Optional[str] = None,
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
        job: the job's config (a YAML-ready dict, e.g. ``JobConfig.to_dict()``), recorded in ``megashard.json``
            so offline tools (``megashard ckpt export-hf``) know the model.
        run_id: the id of the run that saves (recorded in ``megashard.json``); with ``keep_last``, retention then
            deletes only this run's older checkpoints (:func:`megashard.checkpoint.safety.apply_retention`). Without
            it retention considers every checkpoint of ``root``. Either way the newest ``keep_last`` by completion
            time are kept, and never the checkpoint just written.

    Returns: the path of the complete checkpoint.
    """
    t0 = time.perf_counter()
    root, final, tmp, sd, layout = start(root, step, keep_last=keep_last, checksum=checksum, overwrite=overwrite,
                                         parallel_state=parallel_state, model=model, optimizer=optimizer,
                                         state_dict=state_dict, sections=sections, data_state=data_state)

    # Step 1: DCP writes the tensors, each replicated shard by one of its holders.
    attach_uneven_layouts(sd)
    writer = ChecksummingFileSystemWriter(tmp, checksum, sync_files=sync_files, thread_count=thread_count)
    try:
        with warnings.catch_warnings():  # DCP warns that a single process is assumed: that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata = dcp_save(sd, storage_writer=writer, planner=MegashardSavePlanner(), no_dist=not dist_on())
    except CheckpointException as e:
        raise unwrap_dcp_error(e) from None

    removed = finish(writer, metadata, sd, root=root, final=final, tmp=tmp, step=step, checksum=checksum,
                     overwrite=overwrite, keep_last=keep_last, consumed_samples=consumed_samples, data_state=data_state,
                     layout=layout, job=job, run_id=run_id)
    rank, world = rank_world()
    if rank == 0:
        logger.info("saved checkpoint %s (%d ranks, %.2f s)%s", final, world, time.perf_counter() - t0,
                    f"; retention removed {removed}" if removed else "")
    return final


def start(root: str, step: int, *, keep_last: Optional[int], checksum: str, overwrite: bool, parallel_state=None,
          model=None, optimizer=None, state_dict: Optional[dict] = None, sections: Optional[dict] = None,
          data_state: Any = None) -> tuple[str, str, str, dict, dict]:
    """The start of every save, synchronous or not: arguments checked, paths, step 0 (:func:`begin`: collective).
    Returns ``(root, final, tmp, state dict, layout record)`` (absolute paths; the layout of ``parallel_state``)."""
    _, world = rank_world()
    st = rank_state.current_state(parallel_state)
    root, final, tmp = targets(root, step)
    check_arguments(keep_last, checksum)
    sd = begin(root, step, final, tmp, overwrite, model, optimizer, state_dict, sections, data_state)
    return root, final, tmp, sd, rank_state.layout_record(st, world)


def targets(root: str, step: int) -> tuple[str, str, str]:
    """``(root, final, tmp)`` absolute paths of the checkpoint of ``step`` under ``root``."""
    name = safety.checkpoint_dirname(step)
    root = os.path.abspath(root)
    return root, os.path.join(root, name), os.path.join(root, safety.TMP_PREFIX + name)


def check_arguments(keep_last: Optional[int], checksum: str) -> None:
    """CheckpointError for a bad ``keep_last`` or ``checksum`` argument of a save."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be an int >= 1 or None (keep everything), got {keep_last!r}")
    if checksum not in checksums.CHECKSUM_ALGORITHMS:
        raise CheckpointError(f"checksum={checksum!r} is not supported; use one of {sorted(checksums.CHECKSUM_ALGORITHMS)}")


def begin(root: str, step: int, final: str, tmp: str, overwrite: bool, model, optimizer, state_dict: Optional[dict],
          sections: Optional[dict], data_state: Any) -> dict:
    """Step 0 (collective, default group): every rank's state dict, checked; the temporary directory made."""
    # Every rank collects its state and checks its arguments; all agree (same root and step, nothing
    # wrong anywhere) before rank 0 prepares the temporary directory.
    sd, err = capture(_collect_checked, model, optimizer, state_dict, sections, data_state)

    def prepare(seen: list) -> None:  # rank 0, once every rank's target is known: one gather, one broadcast
        bad = [r for r, target in enumerate(seen) if target != seen[0]]
        if bad:
            raise CheckpointError(
                f"ranks disagree on the checkpoint: rank 0 saves step {seen[0][1]} to {seen[0][0]}, but ranks "
                f"{bad[:8]} pass {[seen[r] for r in bad[:3]]}; every rank must call save() with the same root and step"
            )
        _prepare_directory(root, final, tmp, overwrite)

    agree((root, step), err, rank0=prepare)
    return sd


def finish(writer: ChecksummingFileSystemWriter, metadata, sd: dict, *, root: str, final: str, tmp: str, step: int,
           checksum: str, overwrite: bool, keep_last: Optional[int], consumed_samples: Optional[int], data_state: Any,
           layout: dict, job: Optional[dict], group=None, run_id: Optional[str] = None) -> list:
    """Steps 2-3 (collective over ``group``): per-rank state (the data files were hashed, whole and per item, as
    they were written); then rank 0 writes the layout file and the marker (last), publishes the directory by
    renaming it and applies retention. Returns the paths retention removed."""
    rank, _ = rank_world()
    records, err = capture(_write_rank_files, writer, metadata, tmp, rank, data_state, checksum)
    return agree(records, err, group=group, rank0=lambda gathered: _publish(
        gathered, root=root, final=final, tmp=tmp, step=step, checksum=checksum, overwrite=overwrite,
        keep_last=keep_last, consumed_samples=consumed_samples, layout=layout,
        sections={k: len(dcp_flatten_state_dict({k: v})[0]) for k, v in sd.items()}, job=job, run_id=run_id))


def _collect_checked(model, optimizer, state_dict: Optional[dict], sections: Optional[dict], data_state: Any) -> dict:
    if data_state is not None:
        check_weights_only(data_state, "data_state")
    return collect_state_dict(model, optimizer, state_dict, sections)


def _prepare_directory(root: str, final: str, tmp: str, overwrite: bool) -> None:
    """Rank 0: refuse an existing checkpoint, clear leftovers of killed saves, create the temporary directory."""
    if os.path.exists(final) and not overwrite:
        raise CheckpointError(f"checkpoint {final} already exists; pass overwrite=True to replace it")
    os.makedirs(root, exist_ok=True)
    safety.cleanup_stale(root)
    os.makedirs(os.path.join(tmp, safety.RANK_STATE_DIR))


def _write_rank_files(writer: ChecksummingFileSystemWriter, metadata, tmp: str, rank: int, data_state: Any,
                      checksum: str) -> tuple[dict, dict, bool]:
    """This rank's marker records: ``(files, items, has data state)`` of the files it wrote."""
    files, items = writer.checksums(metadata, rank)
    own = [rank_state.write_rank_state(tmp, rank, data_state)] + ([DCP_METADATA] if rank == 0 else [])
    files.update({f: checksums.file_record(os.path.join(tmp, f), checksum) for f in own})
    return files, items, data_state is not None


def _publish(gathered: list, *, root: str, final: str, tmp: str, step: int, checksum: str, overwrite: bool,
             keep_last: Optional[int], consumed_samples: Optional[int], layout: dict, sections: dict,
             job: Optional[dict] = None, run_id: Optional[str] = None) -> list:
    """Rank 0: layout file, marker (last), rename to the final name, retention. Returns the removed paths."""
    all_files: dict = {}
    all_items: dict = {}
    for files, items, _ in gathered:
        all_files.update(files)
        all_items.update(items)
    safety.write_json_atomic(os.path.join(tmp, safety.LAYOUT_FILE), {
        "format": safety.FORMAT, "version": safety.FORMAT_VERSION, "step": step,
        "consumed_samples": consumed_samples, "layout": layout, "sections": sections,
        "has_data_state": any(has for _, _, has in gathered), "torch": torch.__version__,
        "megashard": _megashard_version(), "created": time.time(), **({"job": job} if job is not None else {}),
        **({"run_id": run_id} if run_id is not None else {}),
    })
    all_files[safety.LAYOUT_FILE] = checksums.file_record(os.path.join(tmp, safety.LAYOUT_FILE), checksum)
    safety.write_marker(tmp, step, all_files, checksum, all_items)
    safety.commit_checkpoint(tmp, final, overwrite=overwrite)
    if keep_last is None:
        return []
    return safety.apply_retention(root, keep_last, run_id=run_id, protect=final)


def _megashard_version() -> str:
    try:
        from megashard._version import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"
