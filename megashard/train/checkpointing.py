"""Save and resume the training job through :func:`megashard.checkpoint.save` / :func:`~megashard.checkpoint.load`.

Every checkpoint is a directory ``<checkpoint dir>/step_<N>`` published atomically (temporary
directory, completion marker, rename; see :mod:`megashard.checkpoint.safety`), so a run killed while
saving resumes from the previous complete one.

What is stored is layout-independent: every parameter and AdamW moment as a DTensor of the *global*
tensor (see :func:`megashard.models.parallelize.global_dtensor`: this rank's FSDP shard of its TP slice,
placed on ``state.fsdp_mesh``), plus AdamW's step count, in the checkpoint's sections ``model``
(parameter name → tensor) and ``optim`` (``<name>.exp_avg``, ``<name>.exp_avg_sq``, ``<name>.step``), so
``megashard ckpt consolidate`` gives ``full["model"]`` that loads into a plain model. (Checkpoints of
earlier versions hold the same two dicts under ``extra``; they load as well.)
Loading builds the same keys for the current layout and DCP reads each rank's part, so a run saved at
tp=2 · dp=2 resumes at dp=4 (or any other layout of the same model). The data position is a pure
function of the step (:mod:`megashard.train.data`) and the RNG is re-seeded from the step, so no
per-rank loader or generator state is needed.

Resuming (:func:`resume_checkpoint`): every byte read is verified against the checksums recorded at save
time. A damaged newest checkpoint is skipped — one line on rank 0 names it, the damaged file and why — and
the next older one is tried; no process exits, so no torchrun restart is spent. ``checkpoint.load_step`` /
``checkpoint.load_path`` pick a checkpoint explicitly; a damaged one is then an error (no fallback).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from megashard.models.parallelize import global_dtensor, local_tensor

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_full_model", "resume_checkpoint",
           "SaveSchedule", "state_entries", "fresh_entries", "put_entries"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState, *, fresh: bool) -> dict[str, Any]:
    """The global-DTensor state dict; ``fresh=True`` gives new empty local tensors (load targets)."""
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    opt_state = optimizer.state
    for name, p in model.named_parameters():
        loc = local_tensor(p.detach())
        sd["model"][name] = global_dtensor(torch.empty_like(loc) if fresh else loc, p, state)
        st = opt_state.get(p)
        if st is None and not fresh:
            continue  # no optimizer step yet
        for key in _MOMENTS:
            t = local_tensor(st[key]) if (st is not None and not fresh) else torch.empty_like(loc)
            sd["optim"][f"{name}.{key}"] = global_dtensor(t, p, state)
        step = st["step"] if (st is not None and not fresh) else torch.zeros((), dtype=torch.float32)
        sd["optim"][f"{name}.step"] = step.detach().clone() if fresh else step
    return sd


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState,
                    *, consumed_samples: Optional[int] = None, keep: int = 0, job: Optional[dict] = None,
                    saver: Optional[Any] = None, run_id: Optional[str] = None) -> str:
    """Write the checkpoint of ``step`` under ``root`` (all ranks call); keep the newest ``keep`` (0 = all).

    Uses :func:`megashard.checkpoint.save`: written to a temporary directory, published by an
    atomic rename with a completion marker, so a run killed mid-save leaves the previous checkpoint
    as the newest complete one. ``job``: the job's config (``JobConfig.to_dict()``), recorded for offline tools.
    ``saver``: a :class:`megashard.checkpoint.async_save.AsyncSaver` (``checkpoint.async``): returns once the state
    is staged in host memory; the checkpoint is complete when the saver's next save or ``wait()`` returns.
    ``run_id``: this run's id (recorded; retention deletes only checkpoints of this run, never the one just written).
    Returns the checkpoint directory.
    """
    from megashard import checkpoint

    if saver is not None:
        return saver.save(root, step, sections=_state_dict(model, optimizer, state, fresh=False),
                          consumed_samples=consumed_samples, keep_last=keep or None, checksum="crc32", overwrite=True,
                          parallel_state=state, job=job, run_id=run_id)

    return checkpoint.save(root, step, sections=_state_dict(model, optimizer, state, fresh=False),
                           consumed_samples=consumed_samples, keep_last=keep or None, checksum="crc32",
                           overwrite=True, parallel_state=state, job=job, run_id=run_id)


def latest_checkpoint(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint under ``root``, or None."""
    from megashard.checkpoint import safety

    return safety.latest_checkpoint(root)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState) -> int:
    """Load ``path`` (a checkpoint, or a root: its newest complete one) into the parallelized model and
    optimizer of the current layout, whatever layout it was saved with; returns its step.

    Every byte read is verified (a damaged file raises :class:`~megashard.errors.CheckpointCorruptedError`
    naming it; the model and optimizer are untouched then: the checkpoint is read into new tensors first).
    A checkpoint of another model raises :class:`~megashard.errors.CheckpointError` naming the first
    tensor whose shape differs.
    """
    from megashard import checkpoint

    sd = _state_dict(model, optimizer, state, fresh=True)
    # The data position is a function of the step and the RNG is re-seeded from it: the report's notes on per-rank
    # loader and RNG state concern other loops (the job prints its own line: startpoint.resumed_line).
    report = checkpoint.load(path, sections=sd, parallel_state=state, restore_rng=False, log=False)
    _put(sd, model, optimizer)
    return int(report.step)


def state_entries(model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState) -> dict[str, Any]:
    """What a checkpoint saves, as global DTensors over this rank's live tensors: ``{"model": {name: ...}, "optim":
    {"<name>.exp_avg": ..., "<name>.step": ...}}`` (no optimizer entries before the first step). The live copies of
    :mod:`megashard.train.memory_copies` hold the same."""
    return _state_dict(model, optimizer, state, fresh=False)


def fresh_entries(model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState) -> list[tuple[str, Any]]:
    """``(key, DTensor)`` targets of this layout to fill (new local tensors; keys as :mod:`memory_copies` names
    them: ``model/<name>``, ``optim/<name>.<moment>``); :func:`put_entries` puts them into the model."""
    sd = _state_dict(model, optimizer, state, fresh=True)
    return [(f"{section}/{name}", v) for section in ("model", "optim") for name, v in sd[section].items()]


def put_entries(entries: list[tuple[str, Any]], model: nn.Module, optimizer: torch.optim.Optimizer,
                state: ParallelState) -> None:
    """Copy filled :func:`fresh_entries` into the model's parameters and the optimizer's state."""
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    for key, v in entries:
        section, name = key.split("/", 1)
        sd[section][name] = v
    _put(sd, model, optimizer)


def _put(sd: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            local_tensor(p.detach()).copy_(local_tensor(sd["model"][name]))
            st = optimizer.state.get(p)
            if st is None:
                st = optimizer.state[p] = {}
            for key in _MOMENTS:
                if key not in st:
                    st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                local_tensor(st[key]).copy_(local_tensor(sd["optim"][f"{name}.{key}"]))
            st["step"] = local_tensor(sd["optim"][f"{name}.step"]).to(torch.float32).clone()


def read_full_model(path: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters saved in checkpoint ``path``, by name, read in this process alone.

    No process group needed: for inspection, exports and tests. Reads the whole checkpoint into memory.
    """
    from megashard.checkpoint import safety
    from megashard.checkpoint.consolidate import load_full_state_dict

    ckpt = safety.resolve_checkpoint(path)
    sections = safety.read_json(os.path.join(ckpt, safety.LAYOUT_FILE), "layout file").get("sections") or {}
    prefix = "model" if "model" in sections else "extra.model"  # earlier versions saved under "extra"
    # Verified bytes, tensors only, non-tensor items with weights_only=True: nothing unpickled blindly.
    nested = load_full_state_dict(ckpt, keys={prefix})
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            flat[key] = node

    walk(nested, "")
    return {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".")}


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def _why(e: BaseException) -> str:
    """The first damaged file (or item) and what is wrong with it, from a CheckpointCorruptedError."""
    problems = getattr(e, "problems", None)
    if problems:
        return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return str(e).split(" Restore the file(s)")[0]


def resume_checkpoint(job: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                      state: ParallelState, run_id: Optional[str] = None) -> tuple[Optional[str], int, str]:
    """Load the checkpoint the job starts from (all ranks call); returns ``(path, step, run id)``, ``(None, 0, run
    id)`` from scratch. The run id is what this run's checkpoints record (:mod:`megashard.train.startpoint`);
    ``run_id`` (rank 0): the id of this job's previous start, which a start from scratch goes on with (the launcher
    of the node that has rank 0 now may have given another, :mod:`megashard.train.world`).

    * ``checkpoint.load_step`` / ``checkpoint.load_path`` set: exactly that checkpoint. If it is damaged,
      :class:`~megashard.errors.CheckpointCorruptedError` says so — no fallback, the user asked for it.
    * otherwise, with ``train.resume``: the newest complete checkpoint of ``checkpoint_dir`` that verifies. A
      damaged one is skipped with one line on rank 0 (which checkpoint, which file, why) and the next older
      one is tried; if none verifies, CheckpointCorruptedError lists them.
    * ``train.resume=false``: from scratch, or from this run's own newest checkpoint (a torchrun restart); an
      earlier run's checkpoints stop the job (ConfigError) unless ``checkpoint.move_aside`` moves them aside.
    * a checkpoint of another model: ConfigError naming the differing ``model.*`` keys (before anything is read).
    """
    from megashard.checkpoint import safety
    from megashard.errors import CheckpointCorruptedError, ConfigError
    from megashard.train.startpoint import plan_resume

    root = job.checkpoint_dir
    requested = job.requested_checkpoint()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    box = [plan_resume(job, requested, run_id) if rank0 else None]  # rank 0 decides, every rank follows
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    plan = box[0]
    if plan.note:
        _say(plan.note)
    if plan.error:  # printed once, by rank 0 (megashard.launch.worker)
        raise ConfigError(plan.error if rank0 else f"(raised on rank 0) {plan.error}")
    if requested is not None:
        key = (f"checkpoint.load_step={job.checkpoint.load_step}" if job.checkpoint.load_step is not None
               else f"checkpoint.load_path={job.checkpoint.load_path!r}")
        step = safety.read_marker(requested).step
        newer = [e.path for e in safety.list_checkpoints(root) if e.complete and e.step > step]
        if newer:
            _say(f"megashard run: loading {requested} ({key}); the newer checkpoints "
                 f"{', '.join(os.path.basename(p) for p in newer)} in {root} will be replaced as this run saves those steps")
        try:
            return requested, load_checkpoint(requested, model, optimizer, state), plan.candidates[0][1]
        except CheckpointCorruptedError as e:
            raise CheckpointCorruptedError(
                f"the requested checkpoint {requested} ({key}) is damaged: {_why(e)}; no other checkpoint is tried "
                "because this one was asked for: restore the file, or pick another checkpoint (or drop the key to "
                "resume from the newest that verifies)") from None
    skipped = []
    for path, run_id in plan.candidates:
        try:
            return path, load_checkpoint(path, model, optimizer, state), run_id
        except CheckpointCorruptedError as e:
            skipped.append(path)
            _say(f"megashard run: skipping damaged checkpoint {os.path.basename(path)}: {_why(e)}; trying the next "
                 "older one")
    if skipped:
        raise CheckpointCorruptedError(
            f"no checkpoint in {root} verifies ({', '.join(os.path.basename(p) for p in skipped)} are damaged, see "
            "above): restore the damaged files, or start over with train.resume=false or another checkpoint.dir")
    return None, 0, plan.run_id


class SaveSchedule:
    """When the job saves: every ``checkpoint.interval`` steps, or every so many seconds (``"300s"``), and after the
    last step with ``checkpoint.save_final``.

    A time interval is decided by every rank together: per step one all-reduce (MAX) of each rank's seconds since the
    last save over the default group, so every rank sees the same number and saves after the same step (rank clocks,
    and when a rank started, may differ; a save is a collective). The clock starts at the run's start: after a
    restart the next save comes one interval later.
    """

    def __init__(self, job: JobConfig, state: ParallelState) -> None:
        self.job = job
        self.steps = job.checkpoint.interval_steps
        self.seconds = job.checkpoint.interval_seconds
        self.device = state.device_type
        self.last = time.monotonic()

    def due(self, done: int) -> bool:
        """Whether step ``done`` saves (every rank calls it after every step: with a time interval it is a
        collective)."""
        job = self.job
        if done == job.train.steps and job.checkpoint.save_final:
            return True
        if self.steps:
            return done % self.steps == 0
        if self.seconds is None:
            return False
        from megashard.state.devices import current_device

        elapsed = torch.tensor([time.monotonic() - self.last], dtype=torch.float64, device=current_device(self.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item()) >= self.seconds

    def saved(self) -> None:
        """A checkpoint was just written (or staged): the next one is due an interval from now."""
        self.last = time.monotonic()
