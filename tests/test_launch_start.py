"""Hangs before the first collective, named by ``megashard run`` (megashard.launch.startwatch).

Two real launches of the default job (CPU, gloo): one worker stuck importing (a sitecustomize that makes rank 1's
import of ``megashard.train.loop`` hang, as a hung file system would) — the launcher names rank 1, what it is stuck in
and that rank 0 waits for it, within the timeout, and the job ends with one line per rank, no traceback; and a
2-node job whose second node never starts — the launcher says its rendezvous waits with 1 of 2 nodes joined. Plus the
line itself from marks and stacks written by hand.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megashard.launch.startwatch import describe, innermost_frame
from tests._helpers import sigint_as_in_a_terminal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 10.0
STUCK = '''import os, sys, time
if os.environ.get("LOCAL_RANK") == "1" and os.environ.get("MEGASHARD_START_DIR"):
    class _StuckImport:
        def find_spec(self, name, path=None, target=None):
            if name == "megashard.train.loop":
                time.sleep(300)  # a rank stuck importing
            return None
    sys.meta_path.insert(0, _StuckImport())
'''
JOB = ["train.steps=2", "launch.max_restarts=0", "train.progress=false", "train.plot=false", "checkpoint.interval=0",
       "checkpoint.save_final=false", "parallel.tp=1", "parallel.dp_shard=2", f"parallel.timeout={T:g}"]


def _run(tmp_path, overrides, extra_path="") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, ROOT) if p), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-c", "import sys; from megashard.cli import main; sys.exit(main(sys.argv[1:]))", "run",
           os.path.join(ROOT, "configs", "default.yaml"), *JOB, f"train.out_dir={tmp_path / 'job'}", *overrides]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_terminal)  # the test's Ctrl-C reaches it however pytest started


def _lines_until(proc: subprocess.Popen, marker: str, deadline_s: float) -> tuple[list[str], float]:
    """stderr lines up to and including the first containing ``marker`` (and when it came, time.monotonic())."""
    lines = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines, time.monotonic()
    raise AssertionError(f"no line with {marker!r} within {deadline_s} s:\n" + "\n".join(lines[-30:]))


@pytest.mark.long
def test_a_rank_stuck_importing_is_named_by_the_launcher(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STUCK)
    proc = _run(tmp_path, ["launch.nproc_per_node=2"], extra_path=str(site))
    try:
        head, t_run = _lines_until(proc, "megashard run: default: 2 processes", 300)
        lines, t_line = _lines_until(proc, "megashard run: start-up: ", 300)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = lines[-1]
    assert line.startswith(f"megashard run: start-up: after {T:g} s (parallel.timeout), 1 of 2 local rank(s) did not "
                           "reach init_process_group: rank 1 (local rank 1, pid "), line
    assert ": stuck importing for " in line and f"(at {site / 'sitecustomize.py'}:6 in find_spec)" in line, line
    assert line.endswith("; rank 0 waits in init_process_group for it") or "rank 0 (local rank 0" in line, line
    err = "\n".join(lines + rest.splitlines())
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # rank 0's store timeout is one line
    assert "megashard run: rank 0: init_process_group failed: " in err, err[-3000:]


@pytest.mark.long
def test_a_node_that_never_starts_is_named_by_the_launcher(tmp_path):
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    proc = _run(tmp_path, ["launch.nnodes=2", "launch.node_rank=0", f"launch.rdzv_endpoint=localhost:{port}",
                           "launch.nproc_per_node=1"])
    try:
        _, t_run = _lines_until(proc, "megashard run: default: 2 processes (2 node(s) × 1)", 300)
        lines, t_line = _lines_until(proc, "megashard run: start-up: ", 300)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = lines[-1]
    assert line.startswith(f"megashard run: start-up: after {T:g} s (parallel.timeout) no worker of this node started: "
                           f"torchrun's rendezvous at localhost:{port} still waits: 1 of 2 node(s) joined ("), line
    assert proc.returncode == 130


def test_the_line_from_marks_and_stacks(tmp_path):
    d = str(tmp_path)
    now = 1000.0
    me = os.getpid()
    marks = {0: {"local_rank": 0, "rank": 4, "pid": me, "phase": "init", "time": now - 3, "attempt": 0},
             1: {"local_rank": 1, "rank": 5, "pid": me, "phase": "started", "time": now - 9.5, "attempt": 0},
             2: {"local_rank": 2, "rank": 6, "pid": me, "phase": "joined", "time": now - 2, "attempt": 0},
             3: {"local_rank": 3, "rank": 7, "pid": 2 ** 22 + 7, "phase": "imported", "time": now - 9, "attempt": 0}}
    (tmp_path / "rank_1.stack").write_text(
        'Timeout (0:00:07)!\nThread 0x00007f (most recent call first):\n'
        '  File "/data/model_zoo/big.py", line 12 in <module>\n'
        '  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed\n'
        '  File "/work/megashard/launch/worker.py", line 40 in main\n')
    line = describe(marks, 5, 10.0, d, now)
    assert line == ("start-up: after 10 s (parallel.timeout), 3 of 5 local rank(s) did not reach init_process_group: "
                    f"rank 5 (local rank 1, pid {me}): stuck importing for 9.5 s (at /data/model_zoo/big.py:12 in "
                    "<module>); rank 7 (local rank 3, pid 4194311): its process ended during start-up (after "
                    "'imported'); local rank 4: no sign of life (it never reached megashard's worker: stuck in "
                    "Python's start-up, e.g. a sitecustomize or an unreachable file system, or never started); rank 4 "
                    "waits in init_process_group for them"), line
    marks[1]["phase"] = marks[3]["phase"] = "joined"
    assert describe(marks, 4, 10.0, d, now) is None  # rank 4 in init_process_group and alive: nobody is missing
    assert innermost_frame("Thread 0x1 (most recent call first):\n  File \"/a.py\", line 3 in f\n") == "/a.py:3 in f"


def test_each_world_of_an_elastic_job_is_watched(tmp_path, monkeypatch):
    """A new world of an elastic job starts its workers again with the same torchrun restart count (a node joined: no
    failure); its start-up is watched anew, by the rendezvous round megashard's agent gives the workers. Before, the
    first world's report closed the watch for the restart count, and a rank stuck in the second world went unnamed."""
    import json

    from megashard._compat import RENDEZVOUS_ROUND_ENV
    from megashard.launch import startwatch

    assert startwatch.ROUND_ENV == RENDEZVOUS_ROUND_ENV  # the worker's marks use it without importing torch
    d = str(tmp_path)
    monkeypatch.setenv(startwatch.DIR_ENV, d)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(RENDEZVOUS_ROUND_ENV, "3")
    for local in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("RANK", str(local))
        startwatch.mark("joined")
    assert {m["attempt"] for m in startwatch.read_marks(d).values()} == {3}
    said: list = []
    watch = startwatch.StartWatch(d, 2, 0.4, say=said.append)
    watch.start()
    try:
        time.sleep(1.0)  # the first world's due time passes: everyone joined, nothing to say
        assert said == []
        now = time.time()
        for local, phase in ((0, "init"), (1, "started")):  # the next world (round 5): local rank 1 stuck importing
            with open(os.path.join(d, f"rank_{local}.json"), "w", encoding="utf-8") as f:
                json.dump({"local_rank": local, "rank": local, "pid": os.getpid(), "phase": phase, "time": now,
                           "attempt": 5}, f)
        deadline = time.monotonic() + 120  # a hang guard, not a speed bound
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
        watch.join(timeout=5)
    assert len(said) == 1 and "1 of 2 local rank(s) did not reach init_process_group: rank 1 (local rank 1" in said[0]
    assert ": stuck importing for " in said[0] and said[0].endswith("rank 0 waits in init_process_group for it")
