"""The learning-rate schedule: its own length, stored with every checkpoint, kept by a resume.

    lr = lr_at(step, job)                          # 0-based step: warm-up, then decay to min_lr at optim.decay_steps
    sched, line = resume_schedule(job, record)     # a resumed run: the checkpoint's schedule unless overridden

A schedule is ``optim.schedule`` (cosine, linear, constant), ``optim.lr``, ``optim.min_lr``, ``optim.warmup_steps``
and ``optim.decay_steps``: the step at which the decay reaches ``min_lr`` (Megatron-LM's ``--lr-decay-iters``),
after which the learning rate stays at ``min_lr``. ``decay_steps: null`` means the ``train.steps`` of the run that
started the job (from scratch): the run resolves it at its start, and every checkpoint records the resolved value
(in the job config of its ``megashard.json``), so raising ``train.steps`` to go on does not stretch the decay.

A resumed run compares this config's schedule with the checkpoint's: when they differ it keeps the checkpoint's and
says so in one line (the keys, both values, the learning rate of the next step both ways); ``optim.override_schedule:
true`` takes this config's instead (Megatron's ``--override-opt_param-scheduler``), also said in one line. A
checkpoint that records no job config (saved by another script) leaves this config's schedule as it is.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megashard.train.config import JobConfig

__all__ = ["Schedule", "lr_at", "resume_schedule", "SCHEDULE_KEYS"]

#: The ``optim`` keys that make up the schedule (what a resume keeps from its checkpoint).
SCHEDULE_KEYS = ("schedule", "lr", "min_lr", "warmup_steps", "decay_steps")


@dataclass(frozen=True)
class Schedule:
    """A resolved learning-rate schedule (``decay_steps`` never null)."""

    schedule: str
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    @classmethod
    def of(cls, job: "JobConfig") -> "Schedule":
        """The schedule ``job`` asks for, ``optim.decay_steps: null`` resolved to ``train.steps``."""
        o = job.optim
        return cls(o.schedule, o.lr, o.min_lr, o.warmup_steps, o.decay_steps or job.train.steps)

    @classmethod
    def recorded(cls, record: Optional[dict]) -> Optional["Schedule"]:
        """The schedule a checkpoint's ``megashard.json`` records (its job config), or None when it records none or
        one that does not parse. A checkpoint of a version without ``decay_steps`` decayed over its ``train.steps``."""
        saved = (record or {}).get("job") or {}
        optim, train = saved.get("optim"), saved.get("train")
        if not isinstance(optim, dict) or not isinstance(train, dict):
            return None
        try:
            decay = optim.get("decay_steps") or train["steps"]
            return cls(str(optim["schedule"]), float(optim["lr"]), float(optim["min_lr"]), int(optim["warmup_steps"]),
                       int(decay))
        except (KeyError, TypeError, ValueError):
            return None

    def at(self, step: int) -> float:
        """Learning rate of 0-based ``step``: linear warm-up to ``lr``, then cosine/linear decay to ``min_lr`` at
        step ``decay_steps`` and ``min_lr`` after it (or ``lr`` throughout: constant)."""
        s = self
        if step < s.warmup_steps:
            return s.lr * (step + 1) / s.warmup_steps
        if s.schedule == "constant":
            return s.lr
        progress = min(1.0, (step - s.warmup_steps) / max(1, s.decay_steps - s.warmup_steps))
        if s.schedule == "linear":
            return s.lr + (s.min_lr - s.lr) * progress
        return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))

    def apply(self, job: "JobConfig") -> None:
        """Make ``job.optim`` this schedule (``decay_steps`` resolved): what the run trains and records."""
        job.optim = dataclasses.replace(job.optim, schedule=self.schedule, lr=self.lr, min_lr=self.min_lr,
                                        warmup_steps=self.warmup_steps, decay_steps=self.decay_steps)

    def describe(self) -> str:
        """``cosine 3e-03 → 3e-04 over steps 20..200`` (or ``constant 3e-03``)."""
        if self.schedule == "constant":
            return f"constant {self.lr:.3g} after {self.warmup_steps} warm-up steps"
        return (f"{self.schedule} {self.lr:.3g} → {self.min_lr:.3g}, warm-up {self.warmup_steps} steps, decay to step "
                f"{self.decay_steps}")


def lr_at(step: int, job: "JobConfig") -> float:
    """Learning rate of 0-based ``step`` under ``job``'s schedule (``optim.decay_steps: null`` = ``train.steps``)."""
    return Schedule.of(job).at(step)


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def resume_schedule(job: "JobConfig", record: Optional[dict], step: int) -> tuple[Schedule, Optional[str]]:
    """The schedule a run resumed from a checkpoint of ``step`` trains with, and the line to print (None when
    nothing changes). ``record``: the checkpoint's ``megashard.json`` (:func:`megashard.train.startpoint.read_record`).

    Keeps the checkpoint's schedule when this config's differs, unless ``optim.override_schedule`` is true."""
    here = Schedule.of(job)
    saved = Schedule.recorded(record)
    if saved is None or saved == here:
        return here, None
    diffs = [f"optim.{k}: {_fmt(getattr(saved, k))} in the checkpoint, {_fmt(getattr(here, k))} here"
             + (" (train.steps)" if k == "decay_steps" and job.optim.decay_steps is None else "")
             for k in SCHEDULE_KEYS if getattr(saved, k) != getattr(here, k)]
    nxt = step + 1
    kept, new = saved.at(step), here.at(step)
    if job.optim.override_schedule:
        return here, (f"megashard run: learning-rate schedule from this config (optim.override_schedule=true), not the "
                      f"checkpoint's: {'; '.join(diffs)}; lr at step {nxt}: {new:.4g} (the checkpoint's schedule: "
                      f"{kept:.4g})")
    return saved, (f"megashard run: keeping the checkpoint's learning-rate schedule ({saved.describe()}): this config "
                   f"would change it ({'; '.join(diffs)}); lr at step {nxt}: {kept:.4g} ({new:.4g} with this config's: "
                   "add optim.override_schedule=true to take it)")
