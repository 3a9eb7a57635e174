"""`megashard run` end to end through torchrun: the README command, and a fault that torchrun recovers from.

Two real launches of the default config (4 gloo processes each) from the repository root:

* the README's command, shortened: ``megashard run configs/default.yaml train.steps=6`` (outputs in a
  temporary directory, a checkpoint every 2 steps);
* the same with ``train.fail_at_step=4 train.fail_rank=1``: rank 1 exits after step 4 (before that
  step's checkpoint), torchrun (``launch.max_restarts: 1`` in default.yaml) restarts all workers, they
  resume from step 2 and finish. Its metrics and final parameters must equal the uninterrupted run's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = [f"train.steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=0", "train.plot=false"]


def _megashard() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "megashard")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "megashard"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_megashard() + ["run", "configs/default.yaml"] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def launches():
    tmp = tempfile.mkdtemp(prefix="megashard-run-")
    try:
        plain = _run(COMMON + [f"train.out_dir={tmp}/plain"])
        fault = _run(COMMON + [f"train.out_dir={tmp}/fault", "train.fail_at_step=4", "train.fail_rank=1"])
        yield tmp, plain, fault
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stderr ---\n{p.stderr[-6000:]}\n--- stdout ---\n{p.stdout[-2000:]}"


def test_readme_command_trains_and_writes_outputs(launches):
    from megashard.train.metrics import read_metrics

    tmp, plain, _ = launches
    assert plain.returncode == 0, _explain(plain)
    err = plain.stderr
    assert "4 processes (1 node(s) × 4), tp=2, dp_shard=2" in err
    assert f"step {STEPS}/{STEPS} [" in err and "tok/s" in err and "left" in err  # rank 0's progress bar
    assert err.count(f"megashard run: default: step {STEPS}, loss") == 1  # the summary, once (rank 0 only)
    records = read_metrics(os.path.join(tmp, "plain", "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(records[0])
    ckpts = sorted(os.listdir(os.path.join(tmp, "plain", "checkpoints")))
    assert ckpts == [f"step_{s:08d}" for s in (2, 4, 6)], ckpts
    assert os.path.isfile(os.path.join(tmp, "plain", "config.yaml"))


def test_fault_restarts_and_matches_uninterrupted_run(launches):
    from megashard.train.checkpointing import read_full_model
    from megashard.train.metrics import read_metrics

    tmp, plain, fault = launches
    assert plain.returncode == 0, _explain(plain)
    assert fault.returncode == 0, _explain(fault)
    assert "rank 1: injected failure after step 4" in fault.stderr, _explain(fault)
    assert "resumed from" in fault.stderr and "step_00000002 (step 2)" in fault.stderr, _explain(fault)
    want = read_metrics(os.path.join(tmp, "plain", "metrics.jsonl"))
    got = read_metrics(os.path.join(tmp, "fault", "metrics.jsonl"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # steps 3-4 of the failed attempt were dropped
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    a = read_full_model(os.path.join(tmp, "plain", "checkpoints"))
    b = read_full_model(os.path.join(tmp, "fault", "checkpoints"))
    assert sorted(a) == sorted(b) and len(a) == 29
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bad_config_fails_before_any_process_starts(monkeypatch, capsys):
    from megashard import cli

    def no_launch(*a, **k):  # pragma: no cover - reached only if validation let the config through
        raise AssertionError("torchrun was started for an invalid config")

    monkeypatch.setattr(subprocess, "run", no_launch)
    assert cli.main(["run", os.path.join(ROOT, "configs/default.yaml"), "parallel.tp=3"]) == 2
    err = capsys.readouterr().err
    assert "megashard run: error:" in err and "world size 4" in err and "Traceback" not in err
    assert cli.main(["run", os.path.join(ROOT, "configs/default.yaml"), "model.heads=3"]) == 2
    assert "model.hidden=64 must divide by model.heads=3" in capsys.readouterr().err
    assert cli.main(["run", os.path.join(ROOT, "configs/default.yaml"), "trian.steps=3"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err
