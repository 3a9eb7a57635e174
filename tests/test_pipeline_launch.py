"""Kill and resume a pipeline job: ``megashard run configs/pp.yaml`` (pp=2 × tp=2, 1F1B) through torchrun.

Two real launches from the repository root: the uninterrupted run (6 steps, a checkpoint every 2) and the same
with ``train.fail_at_step=3 train.fail_rank=3``: the last stage's second tp rank exits after step 3, torchrun
restarts all workers (``launch.max_restarts: 1`` in pp.yaml), they resume every stage from step 2 and finish.
The metrics and final parameters must equal the uninterrupted run's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from tests.test_train_launch import ROOT, _explain, _megashard

STEPS = 6
COMMON = [f"train.steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=0", "train.plot=false"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_megashard() + ["run", "configs/pp.yaml"] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def launches():
    tmp = tempfile.mkdtemp(prefix="megashard-pp-run-")
    try:
        plain = _run(COMMON + [f"train.out_dir={tmp}/plain"])
        fault = _run(COMMON + [f"train.out_dir={tmp}/fault", "train.fail_at_step=3", "train.fail_rank=3"])
        yield tmp, plain, fault
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.long
def test_a_killed_pipeline_job_resumes_and_matches_the_uninterrupted_run(launches):
    from megashard.train.checkpointing import read_full_model
    from megashard.train.metrics import read_metrics

    tmp, plain, fault = launches
    assert plain.returncode == 0, _explain(plain)
    assert "pp=2" in plain.stderr, _explain(plain)
    assert fault.returncode == 0, _explain(fault)
    assert "rank 3: injected failure after step 3" in fault.stderr, _explain(fault)
    assert "megashard run: resumed from step 2 (" in fault.stderr and "step_00000002), data position restored" in fault.stderr, _explain(fault)
    assert "Traceback" not in fault.stderr, _explain(fault)
    want = read_metrics(os.path.join(tmp, "plain", "metrics.jsonl"))
    got = read_metrics(os.path.join(tmp, "fault", "metrics.jsonl"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    a = read_full_model(os.path.join(tmp, "plain", "checkpoints"))
    b = read_full_model(os.path.join(tmp, "fault", "checkpoints"))
    assert sorted(a) == sorted(b) and "blocks.3.attn.qkv.weight" in a and "blocks.0.attn.qkv.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
