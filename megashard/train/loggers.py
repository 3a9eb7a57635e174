"""Rank 0's experiment loggers: TensorBoard (``train.tensorboard``) and Weights & Biases (``train.wandb``).

Both are optional extras (``pip install 'megashard[tensorboard]'``, ``'megashard[wandb]'``); a job that asks for one
that is not installed stops before any process starts, naming what to install (``JobConfig.validate``).

Every record of ``metrics.jsonl`` goes to both through :meth:`megashard.train.metrics.MetricsWriter.write` — the one
function every path that writes a step record calls, the loop and the elastic path alike —, so what the job computes
is what the loggers show: per step ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/step_time_s``,
``train/tokens_per_s``, ``train/tokens_per_s_per_device``, ``train/model_tflops_per_device``, ``train/mfu``,
``world/size``; ``valid/loss`` at evaluations; at a restart or world change ``world/steps_redone``,
``world/seconds_lost`` and the change itself as text; the hang doctor's newest straggler comparison
(``doctor/straggler_lag_ms``, ``doctor/straggler_rank``); at the end the summary (parameters, peak memory per rank).

Resuming into the same log: TensorBoard writes into ``<out_dir>/tensorboard/`` with ``purge_step`` = the first step
of the resumed run, so the steps an interrupted run logged after its checkpoint are dropped by every reader;
W&B's run id is kept in ``<out_dir>/wandb.json`` and every later start of the job resumes that run
(``resume="allow"``) under ``<out_dir>/wandb/`` (offline runs: ``wandb sync <out_dir>/wandb/offline-run-*``).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megashard.train.config import JobConfig

from megashard.train.sections import WANDB_MODES

__all__ = ["Loggers", "WANDB_MODES", "scalars_of", "wandb_mode", "read_wandb_id"]

#: metrics.jsonl key → logger tag.
_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "step_time_s": "train/step_time_s",
         "tokens_per_s": "train/tokens_per_s", "tokens_per_s_per_device": "train/tokens_per_s_per_device",
         "model_tflops_per_device": "train/model_tflops_per_device", "mfu": "train/mfu", "world_size": "world/size",
         "valid_loss": "valid/loss"}


def wandb_mode(job: "JobConfig") -> str:
    """``train.wandb`` as one of :data:`WANDB_MODES` (YAML reads a bare ``off`` as false)."""
    v = job.train.wandb
    return "off" if v is False or v is None else str(v)


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The scalars a metrics record gives the loggers, by tag (world changes as their counts)."""
    out = {tag: float(record[k]) for k, tag in _TAGS.items() if isinstance(record.get(k), (int, float))
           and not isinstance(record.get(k), bool)}
    change = record.get("world_change")
    if isinstance(change, dict):
        out["world/steps_redone"] = float(change.get("steps_redone") or 0)
        out["world/seconds_lost"] = float((change.get("seconds_down") or 0.0) + (change.get("seconds_redone") or 0.0))
        if change.get("world_size_before") is not None:
            out["world/size_before"] = float(change["world_size_before"])
    last = (record.get("stragglers") or {}).get("last") if isinstance(record.get("stragglers"), dict) else None
    if isinstance(last, dict) and isinstance(last.get("lag_ms"), (int, float)):  # the hang doctor's newest comparison
        out["doctor/straggler_lag_ms"] = float(last["lag_ms"])
        if isinstance(last.get("rank"), int):
            out["doctor/straggler_rank"] = float(last["rank"])
    return out


class Loggers:
    """TensorBoard and W&B of rank 0 for one run of a job (either may be off): :meth:`log` per metrics record,
    :meth:`summary` once at the end, :meth:`close` always."""

    def __init__(self, job: "JobConfig", start_step: int) -> None:
        self.tb: Any = None
        self.wandb: Any = None
        out = job.out_dir
        if job.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's first step; the events an interrupted run wrote from there on are dropped
            self.tb = SummaryWriter(log_dir=os.path.join(out, "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)
            if not start_step:
                self.tb.add_text("config", "```\n" + json.dumps(job.to_dict(), indent=1, default=str) + "\n```", 0)
        mode = wandb_mode(job)
        if mode != "off":
            self.wandb = _start_wandb(job, mode)

    @property
    def active(self) -> bool:
        return self.tb is not None or self.wandb is not None

    def log(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (its ``step``)."""
        step = int(record["step"])
        scalars = scalars_of(record)
        if self.tb is not None:
            for tag, v in scalars.items():
                self.tb.add_scalar(tag, v, step)
            if isinstance(record.get("world_change"), dict):
                self.tb.add_text("world/change", json.dumps(record["world_change"], default=str), step)
            self.tb.flush()
        if self.wandb is not None:
            data: dict[str, Any] = dict(scalars)
            if isinstance(record.get("world_change"), dict):
                data["world/change"] = json.dumps(record["world_change"], default=str)
            self.wandb.log(data, step=step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        """The end summary (numbers by key): scalars at ``step`` and the run's summary."""
        nums: dict[str, float] = {}
        for k, v in values.items():  # per-rank lists (memory peaks) as one scalar per rank
            for key, x in ([(f"summary/{k}/rank_{r}", x) for r, x in enumerate(v)] if isinstance(v, list)
                           else [(f"summary/{k}", v)]):
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    nums[key] = float(x)
        if self.tb is not None:
            for tag, v in nums.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.add_text("summary", json.dumps(values, default=str), step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.summary.update(values)

    def close(self, ok: bool = True) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            run.finish(exit_code=0 if ok else 1)


def _start_wandb(job: "JobConfig", mode: str) -> Any:
    """``wandb.init`` of this job's run: the id kept in ``<out_dir>/wandb.json`` (made at the first start), resumed."""
    import wandb

    out = job.out_dir
    path = os.path.join(out, "wandb.json")
    info: dict[str, Any] = {}
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {}
    run_id = info.get("id") if isinstance(info.get("id"), str) else None
    if run_id is None:
        from megashard.outputs import temp_path

        import uuid

        run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
        tmp = temp_path(path)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"id": run_id, "project": job.train.wandb_project, "name": job.name}, f)
        os.replace(tmp, path)
    os.makedirs(os.path.join(out, "wandb"), exist_ok=True)
    try:
        return wandb.init(project=job.train.wandb_project, name=job.name, id=run_id, resume="allow", mode=mode,
                          dir=out, config=job.to_dict(), settings=wandb.Settings(silent=True, console="off", disable_git=True))
    except Exception as e:  # noqa: BLE001 - wandb's own errors (login, network, service): one line, no restart
        from megashard.errors import ConfigError

        why = " ".join(str(e).split())[:300]
        hint = "; log in (wandb login) or use train.wandb=offline" if mode == "online" else ""
        raise ConfigError(f"train.wandb={mode}: wandb.init failed: {type(e).__name__}: {why}{hint}") from None


def read_wandb_id(out_dir: str) -> Optional[str]:
    """The W&B run id of the job whose run directory is ``out_dir`` (None before its first start with W&B)."""
    try:
        with open(os.path.join(out_dir, "wandb.json"), encoding="utf-8") as f:
            return json.load(f).get("id")
    except (OSError, ValueError, AttributeError):
        return None
