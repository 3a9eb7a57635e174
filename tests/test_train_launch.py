"""`megashard run` end to end through torchrun: the README command, and a fault that torchrun recovers from.

Two real launches of the default config (4 gloo processes each) from the repository root:

* the README's command, shortened: ``megashard run configs/default.yaml train.steps=6`` (outputs in a
  temporary directory, a checkpoint every 2 steps);
* the same with ``train.fail_at_step=4 train.fail_rank=1``: rank 1 exits after step 4 (before that
  step's checkpoint), torchrun (``launch.max_restarts: 1`` in default.yaml) restarts all workers, they
  resume from step 2 and finish. Its metrics and final parameters must equal the uninterrupted run's,
  and its output says so in one line (no tracebacks of the ranks that lost their peers).

And the process hygiene of ``megashard run`` (on 2 processes, ``parallel.tp=1``: half the start-up, and nothing
checked there depends on the layout): SIGKILL to the launcher's process group leaves no worker and no torchrun
behind; the run's checkpoint-directory lock, left behind by the killed launcher, is taken over by the next run with
a note and released at its end; a directory a live job holds is refused before anything starts.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from tests._helpers import processes_with as _processes_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = [f"train.steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=0", "train.plot=false"]
TWO = ["parallel.tp=1", "launch.nproc_per_node=2"]  # the hygiene checks' layout: 2 processes


def _megashard() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "megashard")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "megashard"]


def _run(args: list[str], check: bool = False) -> subprocess.CompletedProcess:
    """``megashard run configs/default.yaml ARGS``; ``check``: with the check before launch, as a user runs it (the
    suite turns it off elsewhere: tests/conftest.py)."""
    env = {**os.environ, "MEGASHARD_CHECK": "auto"} if check else None
    return subprocess.run(_megashard() + ["run", "configs/default.yaml"] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def launches():
    tmp = tempfile.mkdtemp(prefix="megashard-run-")
    try:
        plain = _run(COMMON + [f"train.out_dir={tmp}/plain"], check=True)
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
    # the check before launch, on by default for a job this cheap: every rank's collectives matched, once
    assert err.count("megashard run: collectives: OK: 4 ranks, ") == 1, err
    assert f"step {STEPS}/{STEPS} [" in err and "tok/s" in err and "left" in err  # rank 0's progress bar
    assert err.count(f"megashard run: default: step {STEPS}, loss") == 1  # the summary, once (rank 0 only)
    records = read_metrics(os.path.join(tmp, "plain", "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(records[0])
    ckpts = sorted(os.listdir(os.path.join(tmp, "plain", "checkpoints")))
    assert ckpts == [f"step_{s:08d}" for s in (2, 4, 6)], ckpts
    assert os.path.isfile(os.path.join(tmp, "plain", "config.yaml"))
    # the hang doctor (train.doctor, on by default): every rank's record at the end, no hang
    from megashard.doctor import read_run_dir, summarize

    recs, bad = read_run_dir(os.path.join(tmp, "plain"))
    assert sorted(recs) == [0, 1, 2, 3] and not bad, (sorted(recs), bad)
    assert all(r["reason"] == "exit" and r["step"] == STEPS and not r["findings"] for r in recs.values()), recs[0]
    assert recs[0]["groups"]["tp:0"]["seq"] > 0 and summarize(recs)["rows"] == []


def test_fault_restarts_and_matches_uninterrupted_run(launches):
    from megashard.train.checkpointing import read_full_model
    from megashard.train.metrics import read_metrics

    tmp, plain, fault = launches
    assert plain.returncode == 0, _explain(plain)
    assert fault.returncode == 0, _explain(fault)
    assert "rank 1: injected failure after step 4" in fault.stderr, _explain(fault)
    assert (f"megashard run: resumed from step 2 ({tmp}/fault/checkpoints/step_00000002), data position restored; "
            "2 steps redone (steps 3-4 of the previous start)\n" in fault.stderr), _explain(fault)
    assert "rng:" not in fault.stderr and "consumed_samples" not in fault.stderr, _explain(fault)
    # The surviving ranks' broken connections and torchrun's own logs are one line, not ~70 of tracebacks.
    assert ("megashard run: rank 1 failed (exit code 1); the other ranks lost their peers; torchrun restarts the "
            "job from the newest checkpoint (restart 1 of 1)\n") in fault.stderr, _explain(fault)
    assert "Traceback" not in fault.stderr and "Connection" not in fault.stderr, _explain(fault)
    assert "closing signal" not in fault.stderr and "torchrun:" not in fault.stderr, _explain(fault)
    assert len(fault.stderr.splitlines()) <= 20, _explain(fault)
    assert "torchrun:" not in plain.stderr and "Traceback" not in plain.stderr, _explain(plain)
    want = read_metrics(os.path.join(tmp, "plain", "metrics.jsonl"))
    got = read_metrics(os.path.join(tmp, "fault", "metrics.jsonl"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # steps 3-4 of the failed attempt were dropped
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    # the restart in the same world, recorded with the work it cost (megashard.train.world)
    change = got[2]["world_change"]
    assert [r["step"] for r in got if "world_change" in r] == [3] and got[2]["world_size"] == 4, got[2]
    assert (change["world_size_before"], change["resumed_from"], change["last_step_before"], change["steps_redone"],
            change["nodes_left"], change["nodes_joined"]) == (4, 2, 4, 2, [], []), change
    assert change["seconds_down"] > 0 and change["seconds_redone"] > 0, change
    # The hang doctor kept the failed attempt's records (the restart's go to doctor/restart_1/, the rendezvous round
    # the restarted workers share): the ranks that lost their peers named rank 1, which left only its start record
    # (os._exit).
    from megashard.doctor import attempt_dirs, read_attempts, read_run_dir, summarize

    dirs = attempt_dirs(os.path.join(tmp, "fault"))
    assert [label for label, _ in dirs] == ["first attempt", "restart 1"], dirs
    first, _ = read_run_dir(dirs[0][1])
    assert first and first[1]["reason"] == "start", {r: rec["reason"] for r, rec in first.items()}
    summary = summarize(first)
    assert 1 in summary["started_only"] and 1 in {r for row in summary["rows"] for r in row["culprits"]}, summary
    again, _ = read_run_dir(dirs[1][1])
    assert sorted(again) == [0, 1, 2, 3] and not any(r["findings"] for r in again.values())
    # one identity per world: the ranks of each attempt agree on it, the two attempts differ, both of this job
    assert len({r["run"] for r in first.values()}) == 1 and len({r["run"] for r in again.values()}) == 1
    assert {r["world"] for r in first.values()} == {0} and {r["world"] for r in again.values()} == {1}
    worlds = read_attempts(os.path.join(tmp, "fault"))
    assert [a.label for a in worlds.kept] == ["first attempt", "restart 1"] and not worlds.other_runs, worlds
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


def test_a_failure_without_restarts_is_reported_in_two_lines(tmp_path):
    p = _run(["train.steps=3", "train.fail_at_step=1", "train.fail_rank=1", "launch.max_restarts=0",
              f"train.out_dir={tmp_path}", "train.plot=false", "train.progress=false"] + TWO)
    assert p.returncode == 1, _explain(p)
    assert "megashard run: rank 1 failed (exit code 1); no restarts (launch.max_restarts=0)\n" in p.stderr, _explain(p)
    assert (f"megashard run: the job failed (torchrun exit code 1); rerun the same command to resume from the newest "
            f"checkpoint in {tmp_path}/checkpoints\n") in p.stderr, _explain(p)
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, _explain(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    doctor = [ln for ln in lines if ln.startswith("megashard doctor: ")]  # its peers, left waiting for the dead rank
    assert all("rank 1 never reached it" in ln for ln in doctor), _explain(p)
    checked = [ln for ln in lines if ln.startswith("megashard run: collectives: OK: ")]  # the check before launch
    assert len(lines) - len(doctor) - len(checked) == 4, _explain(p)  # header, rank 1's own line, these two


# ---------------------------------------------------------------------------------------------- process hygiene
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
def test_killing_the_launcher_leaves_no_process_and_the_next_run_takes_over_its_lock(tmp_path):
    from megashard.train.ckptlock import LOCK_NAME, read_holder

    out = str(tmp_path / "killed")  # unique: in the command line of the launcher, torchrun and every worker
    args = ["train.steps=100000", f"train.out_dir={out}", "checkpoint.interval=0", "checkpoint.save_final=false",
            "train.plot=false", "train.progress=false"] + TWO
    launcher = subprocess.Popen(_megashard() + ["run", "configs/default.yaml"] + args, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    metrics = os.path.join(out, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 300
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):  # rank 0 finished a step
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        running = _processes_with(out)
        assert len(running) == 4, running  # megashard run, torchrun (megashard.launch.agent), 2 workers
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun starts its workers in sessions of their own
        launcher.wait()
        t0 = time.monotonic()
        while _processes_with(out) and time.monotonic() - t0 < 120:  # a hang guard: how fast they go is not timed
            time.sleep(0.05)
        assert _processes_with(out) == [], f"still running {time.monotonic() - t0:.1f} s after the kill"
    finally:
        for pid, _ in _processes_with(out):
            os.kill(pid, signal.SIGKILL)
        launcher.stderr.close()
    ckpt = os.path.join(out, "checkpoints")
    dead = read_holder(ckpt)
    assert dead is not None and dead.pid == launcher.pid and dead.owner == "launcher"
    again = _run(["train.steps=2", f"train.out_dir={out}", "train.plot=false"] + TWO)
    assert again.returncode == 0, _explain(again)
    assert (f"megashard run: note: took over the lock of {ckpt} from job 'default' on host {dead.host} "
            f"(pid {launcher.pid}, since ") in again.stderr and "): its process is gone\n" in again.stderr, _explain(again)
    assert not os.path.exists(os.path.join(ckpt, LOCK_NAME))  # released at the end
    assert sorted(os.listdir(ckpt)) == ["step_00000002"]


def test_a_checkpoint_directory_held_by_a_live_job_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from megashard import cli
    from megashard.train.ckptlock import CheckpointLock

    def no_launch(*a, **k):  # pragma: no cover - reached only if the lock let the run through
        raise AssertionError("torchrun was started although another job holds the checkpoint directory")

    out = str(tmp_path / "busy")
    held = CheckpointLock.acquire(os.path.join(out, "checkpoints"), job="other", job_id="other-job", owner="launcher")
    try:
        monkeypatch.setattr(subprocess, "run", no_launch)
        assert cli.main(["run", os.path.join(ROOT, "configs/default.yaml"), f"train.out_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"megashard run: error: checkpoint directory {out}/checkpoints is in use by job 'other' on host "), err
        assert f"(pid {os.getpid()}, since " in err and "delete " in err, err
        assert sorted(os.listdir(out)) == ["checkpoints"]  # no config.yaml written
        # --dry-run starts nothing and is not refused
        assert cli.main(["run", os.path.join(ROOT, "configs/default.yaml"), f"train.out_dir={out}", "--dry-run"]) == 0
    finally:
        held.release()
