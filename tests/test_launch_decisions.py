"""What ``megashard run`` decides before and around the job: no lost checkpoints, another model caught before launch,
nothing to do without a launch, one line on Ctrl-C, no torchrun restart for an error a restart cannot fix.

Real launches of the default config from the repository root (on 2 gloo processes, ``parallel.tp=1``: what is
checked does not depend on the layout; the Ctrl-C cases on the default's 4; 4 steps), and the records they write
(``megashard.json``: the job's config and its run id). Each test builds what it needs from module fixtures (one first
run; one copy of it into which another model was started), and tests that read that directory get their own copy of
it: no test depends on another's leftovers or order, and nothing here is timed (what happens before launch is shown
by an untouched directory):

* two runs into one directory: a fresh start (``train.resume=false``) of another model into the first run's
  checkpoints is refused before any process starts (exit 2, one line); with ``checkpoint.move_aside=true`` the first
  run's checkpoints move into ``checkpoints/earlier-<date>-<time>/`` and every checkpoint of both runs survives
  retention (``checkpoint.keep=1`` prunes only the new run's older one, never the one just written);
* resuming that directory with the first model's settings, or ``model.arch=llama``: exit 2 naming the differing
  keys, before any process starts; the second model's own rerun: "nothing to do", no process started (not a
  file of the run directory written);
* a real SIGINT to the launcher's process group (a Ctrl-C) during training and during start-up: one line with the
  step reached and the step a rerun resumes from, no traceback, no C++ frames, no process left;
* torchrun (``megashard.launch.agent``) started directly on a resolved config whose checkpoint holds another model:
  the workers' error is printed once and the job is not restarted (``launch.max_restarts=1`` left unused).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from megashard.checkpoint import safety
from tests._helpers import processes_with, sigint_as_in_a_terminal, tree_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 processes instead of the default's 4 (half the start-up); every run of a directory uses the same layout.
QUIET = ["train.plot=false", "train.progress=false", "parallel.tp=1", "launch.nproc_per_node=2"]  # Ctrl-C: [:2]


def _megashard() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "megashard")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "megashard"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(_megashard() + ["run", "configs/default.yaml"] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stderr ---\n{p.stderr[-6000:]}\n--- stdout ---\n{p.stdout[-2000:]}"


def _steps(root: str) -> list[int]:
    return [e.step for e in safety.list_checkpoints(root) if e.complete]


def _model_of(ckpt: str) -> dict:
    with open(os.path.join(ckpt, safety.LAYOUT_FILE)) as f:
        return json.load(f)["job"]["model"]


def _processes_with(marker: str) -> list[int]:
    return [pid for pid, _ in processes_with(marker)]


# ---------------------------------------------------------------------------------------------- two runs, one directory
def _files(snapshot: dict) -> dict:
    """A ``tree_snapshot`` without directories' entries: directories' mtimes may move (the output checks'
    writability probe makes and removes its own entry there); every file and every entry's presence may not."""
    return {k: v for k, v in snapshot.items() if not stat.S_ISDIR(v[0])}


def _copy(src: str, dst) -> str:
    """A copy of run directory ``src`` at ``dst`` (a test's own, so nothing it does reaches another test)."""
    return shutil.copytree(src, str(dst), symlinks=True)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A finished run of the default model (hidden 64): checkpoints of steps 2 and 4 (``checkpoint.keep=2``).
    Never changed by a test (they copy it)."""
    out = str(tmp_path_factory.mktemp("first") / "run")
    first = _run(["train.steps=4", "checkpoint.interval=2", "checkpoint.keep=2", f"train.out_dir={out}"] + QUIET)
    assert first.returncode == 0, _explain(first)
    assert _steps(os.path.join(out, "checkpoints")) == [2, 4]
    return out


SECOND = ["model.hidden=128", "train.resume=false", "train.steps=4", "checkpoint.interval=2", "checkpoint.keep=1"]


@pytest.fixture(scope="module")
def second_model(first_run, tmp_path_factory):
    """A copy of the first run's directory into which another model (hidden 128) was started from scratch: first
    refused (no move_aside), then with ``checkpoint.move_aside=true``. Returns ``(out, refused, before, after,
    moved)``: the two commands and the directory's snapshots around the refused one. Its ``checkpoints/`` then holds
    step 4 of the new model, and ``checkpoints/earlier-*/`` the first run's. Tests that run in it copy it first."""
    out = _copy(first_run, tmp_path_factory.mktemp("second") / "run")
    before = tree_snapshot(out)
    refused = _run(SECOND + [f"train.out_dir={out}"] + QUIET)
    after = tree_snapshot(out)
    moved = _run(SECOND + [f"train.out_dir={out}", "checkpoint.move_aside=true"] + QUIET)
    return out, refused, before, after, moved


@pytest.fixture
def second_model_copy(second_model, tmp_path_factory):
    """This test's own copy of ``second_model``'s directory (hidden 128 at step 4), checked to be that (outside
    ``tmp_path``, which stays empty for the test's own files)."""
    out = _copy(second_model[0], tmp_path_factory.mktemp("copy") / "run")
    ck = os.path.join(out, "checkpoints")
    assert _steps(ck) == [4] and _model_of(os.path.join(ck, "step_00000004"))["hidden"] == 128
    return out


def test_a_fresh_start_never_mixes_with_or_prunes_an_earlier_runs_checkpoints(second_model):
    out, refused, before, after, moved = second_model
    ck = os.path.join(out, "checkpoints")
    assert refused.returncode == 2, _explain(refused)
    assert refused.stderr == (
        f"megashard run: error: train.resume=false starts a new run, but {ck} holds checkpoints of an earlier run "
        "(steps 2, 4) that its checkpoints would be mixed with and pruned against (checkpoint.keep=1); give this run "
        "another train.out_dir (or checkpoint.dir), or add checkpoint.move_aside=true to move them into "
        f"{ck}/earlier-<date>-<time>/ first\n"), _explain(refused)
    # Refused before launch: no entry added or removed, not one file written or touched (not timed).
    assert sorted(after) == sorted(before) and _files(after) == _files(before)

    assert moved.returncode == 0, _explain(moved)
    aside = [n for n in os.listdir(ck) if n.startswith("earlier-")]
    assert len(aside) == 1 and re.fullmatch(r"earlier-\d{8}-\d{6}", aside[0]), os.listdir(ck)
    earlier = os.path.join(ck, aside[0])
    assert (f"megashard run: moved the earlier run's checkpoints (steps 2, 4) into {earlier}/\n") in moved.stderr
    # Every checkpoint of the first run survives, complete and of its model; the new run kept its newest (keep=1).
    assert _steps(earlier) == [2, 4] and _steps(ck) == [4]
    for s in (2, 4):
        path = os.path.join(earlier, safety.checkpoint_dirname(s))
        assert safety.verify_files(path, safety.read_marker(path)) == [] and _model_of(path)["hidden"] == 64
    assert _model_of(os.path.join(ck, "step_00000004"))["hidden"] == 128
    assert safety.run_of(os.path.join(ck, "step_00000004")) != safety.run_of(os.path.join(earlier, "step_00000004"))


def test_a_checkpoint_of_another_model_is_refused_before_any_process_starts(second_model_copy):
    out = second_model_copy
    ck = os.path.join(out, "checkpoints")
    ways = ("to train this model, start it in another directory (train.out_dir=<new dir>) or here from scratch "
            "(train.resume=false checkpoint.move_aside=true), or load a checkpoint of this model "
            "(checkpoint.load_path=<dir>/step_<N>)\n")
    for extra, diff in (([], "model.hidden: 128 in the checkpoint, 64 here"),
                        (["model.hidden=128", "model.arch=llama"], "model.arch: gpt in the checkpoint, llama here")):
        before = tree_snapshot(out)
        p = _run([f"train.out_dir={out}", "train.steps=8"] + extra + QUIET)
        assert p.returncode == 2, _explain(p)
        assert p.stderr == (f"megashard run: error: the checkpoint to resume from, {ck}/step_00000004, holds another "
                            f"model: {diff}; " + ways), _explain(p)
        # Before any process started: a launch would write megashard.json, metrics, logs, the lock (not timed).
        after = tree_snapshot(out)
        assert sorted(after) == sorted(before) and _files(after) == _files(before)
    assert _steps(ck) == [4]


def test_rerunning_a_finished_job_says_nothing_to_do_before_launch(second_model_copy):
    out = second_model_copy
    ck = os.path.join(out, "checkpoints")
    before = tree_snapshot(out)
    p = _run(["model.hidden=128", f"train.out_dir={out}", "train.steps=4"] + QUIET)
    assert p.returncode == 0, _explain(p)
    assert p.stderr == (f"megashard run: default: nothing to do, already at step 4 of 4 ({ck}/step_00000004); raise "
                        "train.steps to train on\n"), _explain(p)
    # Decided before launch: no worker started, so no entry of the run directory was added or removed and not one
    # file was written or touched (a launch writes megashard.json, metrics.jsonl, logs and the checkpoint lock). Only
    # directories' mtimes may move: the output checks' writability probe makes and removes its own entry there.
    # Its speed is not timed here.
    after = tree_snapshot(out)
    assert sorted(after) == sorted(before) and _files(after) == _files(before)
    assert not os.path.exists(os.path.join(ck, ".megashard.lock"))


# ---------------------------------------------------------------------------------------------- Ctrl-C
def _start(out: str, args: list[str]) -> subprocess.Popen:
    """The default job (4 processes, as a user's first Ctrl-C would meet it)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(_megashard() + ["run", "configs/default.yaml", f"train.out_dir={out}"] + args + QUIET[:2],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a process group of its own, as a terminal's foreground job
                            preexec_fn=sigint_as_in_a_terminal)


def _ctrl_c(proc: subprocess.Popen, out: str) -> tuple[int, list[str]]:
    """SIGINT to the launcher's process group (what Ctrl-C in a terminal does); its exit code and stderr lines."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        err = proc.communicate(timeout=300)[1]  # a hang guard: the workers stop slowly on a loaded machine
    finally:
        for pid in _processes_with(out):
            os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while _processes_with(out) and time.monotonic() - t0 < 120:  # a hang guard: how fast they go is not timed
        time.sleep(0.1)
    assert _processes_with(out) == [], "processes left after Ctrl-C"
    # what Ctrl-C says, without the lines of a run going well (the check before launch, a checkpoint saved)
    return proc.returncode, [ln for ln in err.splitlines() if not _ROUTINE.match(ln)]


_ROUTINE = re.compile(r"^megashard run: (collectives: OK: |step \d+: checkpoint )")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
def test_ctrl_c_during_training_says_where_it_stopped_and_where_a_rerun_resumes(tmp_path):
    from megashard.train.metrics import read_metrics

    out = str(tmp_path / "ctrlc")
    proc = _start(out, ["train.steps=100000", "checkpoint.interval=3"])
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 300
    while not (len(read_metrics(metrics)) >= 4):  # past the checkpoint of step 3
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the job did not train"
        time.sleep(0.1)
    code, lines = _ctrl_c(proc, out)
    reached = max(r["step"] for r in read_metrics(metrics))
    resume = _steps(os.path.join(out, "checkpoints"))[-1]
    assert code == 130 and resume >= 3, lines
    assert lines[1:] == [f"megashard run: stopped at step {reached}; rerun the same command to resume from step {resume}"], lines
    assert len(lines) == 2 and lines[0].startswith("megashard run: default: 4 processes"), lines


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
def test_ctrl_c_during_start_up_is_one_line_not_a_page_of_frames(tmp_path):
    out = str(tmp_path / "early")
    proc = _start(out, ["train.steps=100000"])
    deadline = time.monotonic() + 300
    while len([p for p in _processes_with(out)]) < 6:  # launcher, torchrun and 4 workers exist (importing torch)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.02)
    code, lines = _ctrl_c(proc, out)
    assert code == 130, lines
    assert lines[1:] == ["megashard run: stopped during start-up, before the first step; no checkpoint was saved: "
                         "rerun the same command to start again"], lines


# ---------------------------------------------------------------------------------------------- no restart
def test_an_error_a_restart_cannot_fix_does_not_burn_a_torchrun_restart(second_model_copy, tmp_path):
    """torchrun started directly (no launcher check): the workers find the checkpoint of another model."""
    out = second_model_copy
    ck = os.path.join(out, "checkpoints")
    from megashard.train.config import JobConfig
    from megashard.launch.launcher import _write_config

    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "default.yaml"),
                              ["parallel.tp=1", "launch.nproc_per_node=2", "train.steps=8", f"checkpoint.dir={ck}",
                               f"train.out_dir={tmp_path / 'direct'}"] + QUIET)
    cfg = str(tmp_path / "config.yaml")
    _write_config(job, cfg)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "megashard.launch.agent", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "megashard.launch.worker", cfg],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, _explain(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"megashard run: error: the checkpoint to resume from, {ck}/step_00000004, holds another model: model.hidden: "
        "128 in the checkpoint, 64 here; to train this model, start it in another directory (train.out_dir=<new dir>) "
        "or here from scratch (train.resume=false checkpoint.move_aside=true), or load a checkpoint of this model "
        "(checkpoint.load_path=<dir>/step_<N>)",
        "megashard run: the job stopped on the error above; not restarted: a restart cannot fix it",
    ], _explain(p)
    assert _steps(ck) == [4]


# ---------------------------------------------------------------------------------------------- no processes
def _fake(root, step: int, run_id, created: float, hidden: int = 64) -> str:
    path = os.path.join(str(root), safety.checkpoint_dirname(step))
    os.makedirs(path)
    record = {"step": step, "job": {"model": {"hidden": hidden}}}
    if run_id is not None:
        record["run_id"] = run_id
    with open(os.path.join(path, safety.LAYOUT_FILE), "w") as f:
        json.dump(record, f)
    safety.write_marker(path, step, {}, "crc32")
    with open(os.path.join(path, safety.MARKER_FILE)) as f:
        marker = json.load(f)
    marker["created"] = created
    with open(os.path.join(path, safety.MARKER_FILE), "w") as f:
        json.dump(marker, f)
    return path


def test_retention_keeps_the_newest_of_this_run_and_never_the_one_just_written(tmp_path):
    old = [_fake(tmp_path, s, "old", created=100.0 + s) for s in (150, 200)]
    legacy = _fake(tmp_path, 300, None, created=50.0)
    mine = [_fake(tmp_path, s, "new", created=1000.0 + s) for s in (10, 20, 30)]
    assert safety.apply_retention(str(tmp_path), 2, run_id="new", protect=mine[-1]) == [mine[0]]
    assert _steps(str(tmp_path)) == [20, 30, 150, 200, 300]  # the other runs' checkpoints are untouched
    # Without a run id: the most recently written are kept (not the highest steps), and the one just written.
    just = _fake(tmp_path, 5, "x", created=2000.0)
    removed = safety.apply_retention(str(tmp_path), 1, protect=just)
    assert sorted(removed) == sorted(old + [legacy] + mine[1:]) and _steps(str(tmp_path)) == [5]


def test_messages_before_launch_name_the_way_out(tmp_path, capsys):
    from megashard import cli

    cfg = os.path.join(ROOT, "configs", "default.yaml")
    assert cli.main(["run", cfg, "parallel.tp=8", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "megashard run: error: world size 4 is not divisible by tp=8·cp=1·pp=1·dp_outer=1 = 8; valid products for "
        "this world: 1, 2, 4; or run 8 processes per node: launch.nproc_per_node=8\n")
    assert cli.main(["run", os.path.join(ROOT, "configs", "defualt.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megashard run: error: config file '{ROOT}/configs/defualt.yaml' does not exist (did you "
                          f"mean '{ROOT}/configs/default.yaml'?); the configs in {ROOT}/configs/ are: default.yaml, ")
    assert "pp.yaml" in err and err.count("\n") == 1
    # plan checks a job as run does (the same JobConfig.validate): what run would refuse is a warning line
    assert cli.main(["plan", cfg, "model.vocab_size=255"]) == 0
    out = capsys.readouterr()
    assert out.err == ("megashard plan: warning: `megashard run` would refuse this job: model.vocab_size=255 must "
                       "divide by parallel.tp=2 (each TP rank holds vocab/tp rows); pad it to 256\n")
    assert "tp" in out.out
    assert cli.main(["plan", cfg, "model.vocab_size=255", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_refuses"].startswith("`megashard run` would refuse this job: model.")
    assert cli.main(["plan", cfg, "--world-size", "8", "parallel.tp=8"]) == 0
    assert capsys.readouterr().err == ("megashard plan: warning: `megashard run` would refuse this job at world size "
                                       "8: model.heads=4 must divide by parallel.tp=8; valid tp: 1, 2, 4\n")
    assert cli.main(["run", cfg, "model.vocab_size=255", "--dry-run"]) == 2  # what plan warned of
    assert "model.vocab_size=255 must divide by parallel.tp=2" in capsys.readouterr().err
    assert cli.main(["run", cfg, "checkpoint.move_aside=true", f"train.out_dir={tmp_path}", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("megashard run: error: checkpoint.move_aside=true moves an earlier run's "
                                              "checkpoints aside for a fresh start: add train.resume=false")
