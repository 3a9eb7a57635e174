"""Where a job starts, decided from the checkpoint directory's records before any process starts.

    start = find_start(job)           # ConfigError for a checkpoint of another model or a fresh start into a used dir
    if start.finished: print(start.finished)          # "nothing to do, already at step 200 of 200 ..."

Every checkpoint of the job records its config and the id of its run (``megashard.json``: ``job``, ``run_id``),
so ``megashard run`` reads — without torch, in well under a second — what the workers would only find out
after starting, loading and failing (and burning a torchrun restart):

- **resume** (``train.resume: true``, the default): the checkpoint the job will load (``checkpoint.load_step`` /
  ``load_path``, else the newest complete one) must hold the same model: the keys that shape its parameters
  (:data:`MODEL_KEYS`) are compared, and a difference is one line naming each key, both values and the ways out.
  A job already at ``train.steps`` has nothing to do.
- **a fresh start** (``train.resume: false``) into a checkpoint directory holding an earlier run's checkpoints is
  refused (its checkpoints would mix with theirs, and the next plain run would resume whichever step is
  highest), unless ``checkpoint.move_aside: true`` moves them into ``<dir>/earlier-<date>-<time>/`` first.
- **run identity**: a fresh start gets a new run id (``MEGASHARD_RUN_ID`` from the launcher, else torchrun's run
  id); a resumed run keeps the id of the checkpoint it resumed from. Retention (``checkpoint.keep``) deletes only
  checkpoints of the saving run, the most recently written kept, the one just written never
  (:func:`megashard.checkpoint.safety.apply_retention`). A torchrun restart of a fresh start resumes from the
  checkpoints of its own run.

The workers repeat the model check on the checkpoint they actually load (:func:`check_same_model`), so a job
started without the launcher gets the same one-line error.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megashard.errors import ConfigError

if TYPE_CHECKING:
    from megashard.checkpoint.safety import CheckpointEntry
    from megashard.train.config import JobConfig

__all__ = ["MODEL_KEYS", "Start", "find_start", "check_same_model", "model_differences", "earlier_checkpoints",
           "move_aside", "new_run_id", "read_record", "RUN_ID_ENV"]

#: Environment variable through which ``megashard run`` gives every process (and restart) of a launch its run id.
RUN_ID_ENV = "MEGASHARD_RUN_ID"

#: The ``model.*`` keys that decide the parameters' names and shapes (what a checkpoint must match to load);
#: ``seq_len`` only for ``gpt`` (learned positions). Dropout, recompute, init and routing settings may change.
MODEL_KEYS = ("arch", "vocab_size", "hidden", "layers", "heads", "ffn_hidden", "tie_embeddings", "num_experts",
              "moe_every", "seq_len")


def new_run_id() -> str:
    """A fresh run id: ``<date>-<time>-<8 hex digits>`` (sorts by start time, unique across hosts)."""
    import uuid

    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def read_record(ckpt: str) -> Optional[dict]:
    """The layout file (``megashard.json``) of checkpoint ``ckpt``, or None when it is missing or unreadable."""
    from megashard.checkpoint.safety import LAYOUT_FILE

    from megashard.errors import MegashardError
    from megashard.readers import SMALL, read_json

    try:
        info = read_json(os.path.join(ckpt, LAYOUT_FILE), "layout file", limit=SMALL)
    except MegashardError:
        return None
    return info if isinstance(info, dict) else None


def _model_values(model: Any) -> Optional[dict]:
    """The :data:`MODEL_KEYS` of a model section (a ModelConfig or a recorded ``job["model"]`` mapping), plus
    ``ffn_hidden_resolved`` (null = the architecture's default); None when a recorded section does not parse."""
    from megashard.train.sections import ModelConfig, default_ffn_hidden, section_from_dict

    if not isinstance(model, ModelConfig):
        if not isinstance(model, dict):
            return None
        try:
            model = section_from_dict(ModelConfig, {k: v for k, v in model.items() if k in MODEL_KEYS}, "model")
        except ConfigError:
            return None
    values = {k: getattr(model, k) for k in MODEL_KEYS}
    values["ffn_hidden_resolved"] = model.ffn_hidden or default_ffn_hidden(model)
    if model.arch != "gpt":
        values.pop("seq_len")  # rotary positions: the context length shapes no parameter
    return values


def model_differences(job: "JobConfig", record: Optional[dict]) -> list[tuple[str, Any, Any]]:
    """``[(key, value in the checkpoint, value here), ...]`` of the model keys that differ; [] when they match or
    the checkpoint records no job config (saved by ``megashard.checkpoint.save`` from another script).

    A null ``ffn_hidden`` counts as its resolved value, shown only when no other key explains the difference."""
    saved = _model_values(((record or {}).get("job") or {}).get("model"))
    if saved is None:
        return []
    here = _model_values(job.model)
    diffs = [(f"model.{k}", saved[k], here[k]) for k in MODEL_KEYS
             if k != "ffn_hidden" and k in saved and k in here and saved[k] != here[k]]
    f_saved, f_here = saved["ffn_hidden_resolved"], here["ffn_hidden_resolved"]
    if f_saved != f_here and (not diffs or (saved["ffn_hidden"] is not None or here["ffn_hidden"] is not None)):
        diffs.append(("model.ffn_hidden", f_saved, f_here))
    return diffs


def _fmt(v: Any) -> str:
    return "true" if v is True else "false" if v is False else str(v)


def check_same_model(job: "JobConfig", ckpt: str, record: Optional[dict] = None) -> None:
    """ConfigError (one line) if checkpoint ``ckpt`` holds another model than ``job``'s: each differing key with both
    values, and the ways out."""
    diffs = model_differences(job, read_record(ckpt) if record is None else record)
    if not diffs:
        return
    what = "; ".join(f"{k}: {_fmt(saved)} in the checkpoint, {_fmt(here)} here" for k, saved, here in diffs)
    c = job.checkpoint
    which = ("checkpoint.load_path names" if c.load_path is not None else
             "checkpoint.load_step names" if c.load_step is not None else "to resume from")
    raise ConfigError(
        f"the checkpoint {which}, {_short(ckpt)}, holds another model: {what}; to train this model, start it in "
        "another directory (train.out_dir=<new dir>) or here from scratch (train.resume=false "
        "checkpoint.move_aside=true), or load a checkpoint of this model (checkpoint.load_path=<dir>/step_<N>)")


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (as a user typed it), else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel


# ---------------------------------------------------------------------------------------------- fresh starts
def earlier_checkpoints(job: "JobConfig", run_id: Optional[str] = None) -> list["CheckpointEntry"]:
    """The ``step_<N>`` directories of the checkpoint directory (complete or not) not saved by run ``run_id``."""
    from megashard.checkpoint.safety import list_checkpoints, run_of

    return [e for e in list_checkpoints(job.checkpoint_dir) if run_id is None or run_of(e.path) != run_id]


def _steps(entries: list["CheckpointEntry"]) -> str:
    steps = [str(e.step) for e in entries]
    return ", ".join(steps[:6]) + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")


def fresh_start_refusal(job: "JobConfig", entries: list["CheckpointEntry"]) -> ConfigError:
    """The error of a fresh start (``train.resume=false``) into a checkpoint directory holding ``entries``."""
    d = _short(job.checkpoint_dir)
    keep = f" and pruned against (checkpoint.keep={job.checkpoint.keep})" if job.checkpoint.keep else ""
    return ConfigError(
        f"train.resume=false starts a new run, but {d} holds checkpoints of an earlier run (steps {_steps(entries)}) "
        f"that its checkpoints would be mixed with{keep}; give this run another train.out_dir (or checkpoint.dir), "
        f"or add checkpoint.move_aside=true to move them into {os.path.join(d, 'earlier-<date>-<time>')}/ first")


def move_aside(job: "JobConfig", entries: list["CheckpointEntry"]) -> str:
    """Move ``entries`` into a new ``earlier-<date>-<time>`` subdirectory of the checkpoint directory (one rename
    each, on the same file system); returns that subdirectory."""
    from megashard.checkpoint.safety import fsync_dir

    root = job.checkpoint_dir
    base = os.path.join(root, "earlier-" + time.strftime("%Y%m%d-%H%M%S"))
    dest, n = base, 1
    while os.path.exists(dest):
        n += 1
        dest = f"{base}-{n}"
    os.makedirs(dest)
    for e in entries:
        os.rename(e.path, os.path.join(dest, os.path.basename(e.path)))
    fsync_dir(dest)
    fsync_dir(root)
    return dest


# ---------------------------------------------------------------------------------------------- the launcher's view
@dataclass
class Start:
    """What :func:`find_start` found for a job."""

    checkpoint: Optional[str] = None
    """The checkpoint the job resumes from (None: from scratch)."""
    step: int = 0
    """Its step (0 from scratch)."""
    earlier: list = field(default_factory=list)
    """A fresh start with ``checkpoint.move_aside``: the earlier run's step directories to move aside."""
    finished: Optional[str] = None
    """When the checkpoint is at ``train.steps`` already: the line that says there is nothing to do."""


def find_start(job: "JobConfig") -> Start:
    """Where ``job`` starts (see the module docstring), from the records alone: no torch, no process.

    Raises ConfigError for a checkpoint of another model and for a fresh start into a checkpoint directory that
    holds an earlier run's checkpoints (without ``checkpoint.move_aside``).
    """
    from megashard.checkpoint.safety import read_marker
    from megashard.errors import CheckpointError

    if not job.train.resume:
        entries = earlier_checkpoints(job)
        if entries and not job.checkpoint.move_aside:
            raise fresh_start_refusal(job, entries)
        return Start(earlier=entries)
    path = job.requested_checkpoint() or _newest(job.checkpoint_dir)
    if path is None:
        return Start()
    record = read_record(path)
    check_same_model(job, path, record)
    try:
        step = read_marker(path).step
    except CheckpointError:
        return Start(path)  # damaged: the workers skip it (or say so when it was requested)
    start = Start(path, step)
    if step >= job.train.steps:
        start.finished = (f"nothing to do, already at step {step} of {job.train.steps} ({_short(path)}); raise "
                          f"train.steps to train on{_schedule_after(record, step)}")
    return start


def _schedule_after(record: Optional[dict], step: int) -> str:
    """What the learning rate does after ``step`` when a resume keeps the checkpoint's schedule (its decay is over)."""
    from megashard.train.schedule import Schedule

    sched = Schedule.recorded(record)
    if sched is None or sched.schedule == "constant" or step < max(sched.decay_steps, sched.warmup_steps):
        return ""
    return (f" (at lr {sched.at(step):g}: the checkpoint's schedule decayed until optim.decay_steps={sched.decay_steps}; "
            "optim.override_schedule=true decays again over the new length)")


def _newest(root: str) -> Optional[str]:
    """The newest complete checkpoint of ``root`` whose files have their recorded sizes (None if none)."""
    from megashard.checkpoint.safety import list_checkpoints, read_marker, verify_files
    from megashard.errors import CheckpointError

    for e in reversed(list_checkpoints(root)):
        if not e.complete:
            continue
        try:
            if not verify_files(e.path, read_marker(e.path), checksum=False):
                return e.path
        except CheckpointError:
            continue
    return None


# ---------------------------------------------------------------------------------------------- the workers' view
def _sizes_text(sizes: Optional[dict]) -> str:
    if not sizes:
        return "?"
    keys = ("tp", "cp", "pp", "dp_outer", "dp_shard", "ep", "expt_tp")
    return ", ".join(f"{k}={sizes[k]}" for k in keys if sizes.get(k, 1) != 1 or k == "dp_shard")


def resumed_line(job: "JobConfig", path: str, step: int, record: Optional[dict], sizes: Any = None) -> str:
    """The one line a resumed run prints: the step and checkpoint, whether the data continues where it stopped
    (the batches are a function of the step, ``train.global_batch`` and the ``data`` section), and a layout change.
    ``sizes``: this run's ResolvedSizes (for the layout note)."""
    line = f"megashard run: resumed from step {step} ({_short(path)})"
    saved = (record or {}).get("job") or {}
    before = {k: (saved.get("train") or {}).get(k) for k in ("global_batch",)}
    if saved and before["global_batch"] not in (None, job.train.global_batch):
        line += (f", data position recomputed for train.global_batch={job.train.global_batch} (the checkpoint "
                 f"trained with {before['global_batch']}: step {step + 1} reads other samples than it would have)")
    elif saved and saved.get("data") not in (None, job.to_dict()["data"]):
        line += ", data section changed since the checkpoint: the batches from here on follow the new data"
    else:
        line += ", data position restored"
    saved_sizes = ((record or {}).get("layout") or {}).get("sizes")
    if sizes is not None and saved_sizes and _sizes_text(saved_sizes) != _sizes_text(sizes.as_dict()):
        line += f", resharded from {_sizes_text(saved_sizes)} to {_sizes_text(sizes.as_dict())}"
    return line


@dataclass
class ResumePlan:
    """Rank 0's decision for the workers (broadcast to every rank): the checkpoints to try, newest first, each
    with the run id it carries on, or the error that stops the job; and a note to print."""

    candidates: list = field(default_factory=list)
    """``[(path, run id), ...]``: try in order; the first that loads is the start."""
    run_id: str = ""
    """The run id of a start from scratch."""
    error: Optional[str] = None
    note: Optional[str] = None


def plan_resume(job: "JobConfig", requested: Optional[str], run_id: Optional[str] = None) -> ResumePlan:
    """Rank 0: what :func:`megashard.train.checkpointing.resume_checkpoint` tries (see the module docstring).

    This run's id: ``run_id`` (the previous start of the same job: :mod:`megashard.train.world`, so an elastic job whose
    rank 0 moved to another node's launcher stays one run), else the launcher's (``MEGASHARD_RUN_ID``), else
    torchrun's run id, else a new one. A fresh start (``train.resume=false``) resumes only from checkpoints of its own
    run (an earlier attempt, before a torchrun restart or a change of the world); an earlier run's checkpoints are
    moved aside (``checkpoint.move_aside``) or stop the job.
    """
    from megashard.checkpoint.safety import list_checkpoints, run_of

    this_run = run_id or os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or new_run_id()
    plan = ResumePlan(run_id=this_run)
    try:
        if requested is not None:
            paths = [requested]
        elif job.train.resume:
            paths = [e.path for e in reversed(list_checkpoints(job.checkpoint_dir)) if e.complete]
        else:
            earlier = earlier_checkpoints(job, this_run)
            if earlier and not job.checkpoint.move_aside:
                raise fresh_start_refusal(job, earlier)
            if earlier:
                dest = move_aside(job, earlier)
                plan.note = (f"megashard run: moved the earlier run's checkpoints (steps {_steps(earlier)}) into "
                             f"{_short(dest)}/")
            paths = [e.path for e in reversed(list_checkpoints(job.checkpoint_dir)) if e.complete]
        for i, path in enumerate(paths):
            record = read_record(path)
            if i == 0:  # the one that loads unless it is damaged
                check_same_model(job, path, record)
            plan.candidates.append((path, (run_of(path) or "") if record is not None else this_run))
    except ConfigError as e:
        plan.error = str(e)
    return plan
