"""The end of a job is orderly: every rank waits for rank 0's report at a final barrier, and when a worker returns
none of megashard's communicators (nor their threads) is left to die with the interpreter.

A gloo thread alive during interpreter shutdown that needs the GIL (to drop its last reference to a tensor of the
last collective) is killed inside a C++ destructor: "terminate called without an active exception", SIGABRT —
rank 1 "failed" after the final save while rank 0 still drew loss.png (starving the other ranks' gloo threads
of CPU), and torchrun restarted the finished job. Here rank 0's report is delayed (injected from the test) and
both ranks are checked right after ``megashard.launch.worker.main`` returns.
"""
from __future__ import annotations

import collections
import os
import time

from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
OUT_ENV = "MEGASHARD_TEST_ORDERLY_OUT"
REPORT_DELAY_S = 2.0


def _backend_threads() -> list[str]:
    """Names of this process's native threads that belong to gloo communicators (Linux /proc)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo_tcp")))


def check_delayed_rank0_report_then_orderly_end(rank, world_size):
    import megashard.train.metrics as metrics
    from megashard.launch import worker

    out = os.environ[OUT_ENV]
    marker = os.path.join(out, "report-done")
    if rank == 0:  # rank 0 takes its time over the report (as matplotlib does), then leaves a mark
        report = metrics.print_summary  # TrainRun.end looks it up when it runs

        def slow_report(*args, **kwargs):
            time.sleep(REPORT_DELAY_S)
            report(*args, **kwargs)
            with open(marker, "w") as f:
                f.write(str(time.time()))

        metrics.print_summary = slow_report
    before = collections.Counter(_backend_threads())  # the test harness's own default group
    assert before, "the spawned world has gloo threads before the job"
    code = worker.main([DEFAULT, "launch.nproc_per_node=2", "train.steps=2", "checkpoint.interval=1",
                        "train.plot=false", "train.progress=false", f"train.out_dir={out}"])
    assert code == 0
    # Every rank left the final barrier only after rank 0's report ...
    assert os.path.exists(marker), f"rank {rank} returned before rank 0 finished its report"
    # ... and every communicator megashard made is gone, threads included (the job used 2-rank and 1-rank groups,
    # each with its own threads): what is left is at most the default group the harness made before the job
    # (torch itself may keep that one object alive, idle, depending on import order).
    from megashard.state import pooled_group_count

    after = collections.Counter(_backend_threads())
    assert pooled_group_count() == 0
    assert after - before == collections.Counter(), (dict(before), dict(after))


def test_delayed_rank0_report_then_orderly_end(tmp_path, monkeypatch):
    monkeypatch.setenv(OUT_ENV, str(tmp_path / "out"))
    res = spawn_checks([check_delayed_rank0_report_then_orderly_end], world_size=2)
    res.assert_ok("check_delayed_rank0_report_then_orderly_end")
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["step_00000001", "step_00000002"]
