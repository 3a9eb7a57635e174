"""TensorBoard and W&B (offline) on the default job, and the numbers of every line (issue 40).

Two real launches of ``configs/default.yaml`` (4 gloo processes, through torchrun) into one run directory:

* ``train.steps=12``, validation every 4 steps, TensorBoard and W&B offline, rank 1 killed after step 10 (before
  that step's checkpoint): torchrun restarts the workers, they resume from step 8 and finish;
* the same command with ``train.steps=16``: resumes from step 12 into the same logs.

The event files are read back with TensorBoard's ``EventAccumulator`` and the W&B run files with
:mod:`tests._wandb_records`: every step 1..16 once (the failed attempt's steps 9-10 purged), loss, lr and validation
loss equal to ``metrics.jsonl``'s, one W&B run id throughout. The launch's own lines: the start line names the
resolved config, the progress line shows lr, grad norm and step time, a line per checkpoint, and the summary
(``summary.json``) the throughput per device, MFU against its stated peak, the parameter count (checked against
the checkpoint's tensors) and every rank's peak host RSS growth.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("tensorboard", reason="the TensorBoard logger needs tensorboard (pip install 'megashard[tensorboard]')")
pytest.importorskip("wandb", reason="the W&B logger needs wandb (pip install 'megashard[wandb]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["checkpoint.interval=4", "checkpoint.keep=0", "train.eval_interval=4", "data.valid_fraction=0.05",
          "train.tensorboard=true", "train.wandb=offline", "train.log_interval=1", "train.plot=false"]


def _megashard() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "megashard")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "megashard"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run(_megashard() + ["run", "configs/default.yaml"] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=env)


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stderr ---\n{p.stderr[-6000:]}"


@pytest.fixture(scope="module")
def launches():
    tmp = tempfile.mkdtemp(prefix="megashard-loggers-")
    out = os.path.join(tmp, "run")
    try:
        first = _run(COMMON + [f"train.out_dir={out}", "train.steps=12", "train.fail_at_step=10", "train.fail_rank=1"])
        second = _run(COMMON + [f"train.out_dir={out}", "train.steps=16"]) if first.returncode == 0 else None
        yield out, first, second
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _scalars(out: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step twice in the TensorBoard log: {steps}"
        got[tag] = {e.step: e.value for e in events}
    return got


def test_tensorboard_holds_every_step_once_after_a_restart_and_a_resume(launches):
    from megashard.train.metrics import read_metrics

    out, first, second = launches
    assert first.returncode == 0, _explain(first)
    assert second is not None and second.returncode == 0, _explain(second)
    assert "resumed from step 8" in first.stderr and "resumed from step 12" in second.stderr, _explain(second)
    records = {r["step"]: r for r in read_metrics(os.path.join(out, "metrics.jsonl"))}
    assert sorted(records) == list(range(1, 17))
    tb = _scalars(out)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        assert sorted(tb[tag]) == list(range(1, 17)), tag  # steps 9-10 of the failed attempt purged, not doubled
        assert all(tb[tag][s] == pytest.approx(records[s][key], rel=1e-6) for s in records), tag  # float32 events
    assert sorted(tb["valid/loss"]) == [4, 8, 12, 16]
    assert all(tb["valid/loss"][s] == pytest.approx(records[s]["valid_loss"], rel=1e-6) for s in (4, 8, 12, 16))
    for tag in ("train/tokens_per_s_per_device", "train/model_tflops_per_device", "train/mfu", "world/size"):
        assert sorted(tb[tag]) == list(range(1, 17)), tag
    # the restart (a world change record in metrics.jsonl) is logged too
    assert records[9]["world_change"]["steps_redone"] == 2
    assert tb["world/steps_redone"] == {9: 2.0}
    # the end summary, per rank
    assert sorted(k for k in tb if k.startswith("summary/host_peak_rss_growth_bytes/")) == [
        f"summary/host_peak_rss_growth_bytes/rank_{r}" for r in range(4)]


def test_wandb_offline_runs_hold_every_step_under_one_run_id(launches):
    from megashard.train.loggers import read_wandb_id
    from megashard.train.metrics import read_metrics
    from tests._wandb_records import history, run_ids

    out, first, second = launches
    assert first.returncode == 0 and second is not None and second.returncode == 0, _explain(second or first)
    run_id = read_wandb_id(out)
    dirs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))
    assert len(dirs) == 3, dirs  # the first attempt, torchrun's restart, the resumed launch
    assert all(d.endswith(f"-{run_id}") and run_ids(d) == {run_id} for d in dirs)
    records = {r["step"]: r for r in read_metrics(os.path.join(out, "metrics.jsonl"))}
    rows = [history(d) for d in dirs]
    steps = [[r["_step"] for r in rs] for rs in rows]
    # the failed attempt's last records may not reach the file (its rank 0 is stopped from outside)
    assert 8 <= len(steps[0]) <= 10 and steps[0] == list(range(1, len(steps[0]) + 1)), steps
    assert steps[1:] == [list(range(9, 13)), list(range(13, 17))], steps
    latest = {r["_step"]: r for rs in rows for r in rs}  # a later attempt's step replaces the failed one's
    for s, rec in records.items():
        assert latest[s]["train/loss"] == rec["loss"] and latest[s]["train/lr"] == rec["lr"], s
    assert {s: latest[s]["valid/loss"] for s in latest if "valid/loss" in latest[s]} == {
        s: records[s]["valid_loss"] for s in (4, 8, 12, 16)}


def test_the_launch_says_what_it_wrote_and_what_it_used(launches):
    from megashard.train.checkpointing import read_full_model

    out, first, second = launches
    assert second is not None and second.returncode == 0, _explain(first)
    err = second.stderr
    assert (f"megashard run: default: 4 processes (1 node(s) × 4), tp=2, dp_shard=2, 16 steps → {out} (resolved "
            f"config: {out}/config.yaml)\n") in err, err
    bar = [ln for ln in err.splitlines() if ln.startswith("step 16/16 [")]
    assert len(bar) == 1 and " | lr 2.40e-03 | grad norm " in bar[0] and " ms/step | " in bar[0], bar
    assert f"megashard run: step 16: checkpoint {out}/checkpoints/step_00000016 (" in err
    assert err.count(": checkpoint ") == 1 and f"megashard run: step 4: checkpoint {out}/" in first.stderr
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    full = read_full_model(os.path.join(out, "checkpoints", "step_00000016"))
    assert summary["parameters"] == sum(t.numel() for t in full.values()) == 136_960
    matmul = sum(t.numel() for n, t in full.items() if t.dim() == 2 and n not in ("pos", "embed.weight"))
    assert summary["model_flops_per_token"] == 6 * matmul + 12 * 2 * 64 * 64  # layers × seq_len × hidden
    assert summary["devices"] == 4 and summary["final_step"] == 16 and summary["start_step"] == 12
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 4)
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_device"] / summary["peak_tflops_per_device"])
    assert summary["peak_source"].startswith("CPU, float32 matmul measured at the start")
    growth = summary["host_peak_rss_growth_bytes"]
    assert len(growth) == 4 and all(20 << 20 < g < 4 << 30 for g in growth), growth  # bytes, plausible per rank
    assert summary["device_peak_allocated_bytes"] is None  # CPU: the device is the host
    assert (f"  per device: {summary['tokens_per_s_per_device']:,.0f} tokens/s, model "
            f"{summary['model_tflops_per_device']:.3g} TFLOP/s, MFU ") in err
    assert "  model: 136,960 parameters, " in err and "  peak memory per rank: host RSS +" in err


def test_a_missing_extra_is_one_line_naming_what_to_install(monkeypatch):
    from megashard.errors import ConfigError
    from megashard.train.config import JobConfig

    default = os.path.join(ROOT, "configs", "default.yaml")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed (find_spec -> None)
    with pytest.raises(ConfigError, match=r"^train.tensorboard=true needs the tensorboard package, which is not "
                       r"installed: pip install 'megashard\[tensorboard\]'"):
        JobConfig.from_yaml(default, ["train.tensorboard=true"]).validate_sections()
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"^train.wandb=offline needs the wandb package, which is not installed: "
                       r"pip install 'megashard\[wandb\]'"):
        JobConfig.from_yaml(default, ["train.wandb=offline"]).validate_sections()
    JobConfig.from_yaml(default, ["train.wandb=off"]).validate_sections()  # off needs nothing
    with pytest.raises(ConfigError, match=r"^train.wandb='cloud' is not a W&B mode; valid: off, offline, online$"):
        JobConfig.from_yaml(default, ["train.wandb=cloud"]).validate_sections()
