"""The checkpoint-directory lock on real files and real processes (megashard.train.ckptlock).

Live holders are refused in one line naming host and pid; stale ones (a dead pid on this host, a reused
pid, an old heartbeat from another host, an unreadable file) are taken over with a note; the same job
joins its launcher's lock or takes over its own earlier attempt's silently; concurrent takers of one stale
lock end with exactly one winner; the heartbeat moves the file's time; release removes only our own lock.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from megashard.errors import CheckpointLockedError
from megashard.train import ckptlock
from megashard.train.ckptlock import LOCK_NAME, CheckpointLock, check_free, read_holder
from megashard.launch.lifeline import hostname, process_start_time


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write(directory, **record) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    base = {"host": hostname(), "pid": os.getpid(), "job": "old", "job_id": "old-id", "owner": "rank0",
            "pid_start": process_start_time(os.getpid()), "taken": time.time()}
    with open(path, "w") as f:
        json.dump({**base, **record}, f)
    return path


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    d = str(tmp_path / "ckpt")
    t0 = time.time()
    lock = CheckpointLock.acquire(d, job="default", job_id="j1")
    h = read_holder(d)
    # its age in seconds since it was taken: no older than this test's own clock says (not a speed bound)
    assert (h.host, h.pid, h.job, h.job_id, h.owner) == (hostname(), os.getpid(), "default", "j1", "rank0")
    assert lock.created and lock.note is None and 0 <= h.age_s <= time.time() - t0 + 0.01, (h.age_s, time.time() - t0)
    lock.release()
    assert not os.path.exists(os.path.join(d, LOCK_NAME))
    lock.release()  # twice is fine


def test_a_live_holder_is_refused_in_one_line(tmp_path):
    d = str(tmp_path)
    held = CheckpointLock.acquire(d, job="first", job_id="j1", owner="launcher")
    with pytest.raises(CheckpointLockedError) as e:
        CheckpointLock.acquire(d, job="second", job_id="j2")
    msg = str(e.value)
    assert f"is in use by job 'first' on host {hostname()} (pid {os.getpid()}, since " in msg
    assert f"delete {os.path.join(d, LOCK_NAME)}" in msg and "train.out_dir" in msg and "\n" not in msg
    with pytest.raises(CheckpointLockedError):
        check_free(d, "j2")
    assert check_free(d, "j1") is None  # the same job is not refused
    held.release()
    assert check_free(d, "j2") is None


def test_a_dead_holder_on_this_host_is_taken_over_with_a_note(tmp_path):
    d = str(tmp_path)
    pid, taken = _dead_pid(), time.time() - 3600
    _write(d, pid=pid, pid_start=None, job="crashed", taken=taken)
    assert check_free(d, "new").pid == pid  # stale: returned, not refused
    lock = CheckpointLock.acquire(d, job="default", job_id="new")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(taken))
    assert lock.note == f"took over the lock of {d} from job 'crashed' on host {hostname()} (pid {pid}, since {since}): " \
                        "its process is gone"
    assert read_holder(d).job_id == "new"
    lock.release()


def test_a_reused_pid_is_stale(tmp_path):
    d = str(tmp_path)
    start = process_start_time(os.getpid())
    if start is None:
        pytest.skip("no process start times on this OS")
    _write(d, pid_start=start - 5.0)  # our pid, but another process's start time
    lock = CheckpointLock.acquire(d, job="default", job_id="new")
    assert lock.note.endswith("its process is gone")
    lock.release()


def test_another_host_is_judged_by_its_heartbeat(tmp_path):
    d = str(tmp_path)
    path = _write(d, host="other-node", pid=1)
    with pytest.raises(CheckpointLockedError, match=r"on host other-node \(pid 1, .*heartbeat \d+ s ago; a lock from "
                                                    r"another host is live until its heartbeat is 300 s old"):
        CheckpointLock.acquire(d, job="default", job_id="new")
    old = time.time() - ckptlock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    lock = CheckpointLock.acquire(d, job="default", job_id="new")
    assert "on host other-node (pid 1" in lock.note and "no heartbeat for 36" in lock.note
    lock.release()


def test_an_unreadable_lock_file_counts_until_its_heartbeat_is_old(tmp_path):
    d = str(tmp_path)
    path = os.path.join(d, LOCK_NAME)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointLockedError, match="<unreadable lock file>"):
        CheckpointLock.acquire(d, job="default", job_id="new")
    old = time.time() - ckptlock.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    lock = CheckpointLock.acquire(d, job="default", job_id="new")
    assert lock.created and "<unreadable lock file>" in lock.note
    lock.release()


def test_the_same_job_joins_its_launcher_and_replaces_its_earlier_attempt(tmp_path):
    d = str(tmp_path)
    launcher = CheckpointLock.acquire(d, job="default", job_id="run-7", owner="launcher")
    rank0 = CheckpointLock.acquire(d, job="default", job_id="run-7")  # a worker of that launcher
    assert not rank0.created and rank0.note is None
    rank0.release()
    assert read_holder(d).owner == "launcher"  # left to the launcher
    launcher.release()
    # A torchrun restart (same run id) finds its earlier rank 0's lock, even on another host: taken over silently.
    _write(d, host="other-node", pid=1, job_id="run-8")
    again = CheckpointLock.acquire(d, job="default", job_id="run-8")
    assert again.created and again.note is None and read_holder(d).host == hostname()
    again.release()
    assert read_holder(d) is None


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    d = str(tmp_path)
    lock = CheckpointLock.acquire(d, job="default", job_id="mine")
    _write(d, job_id="someone-else")  # e.g. deleted by hand and re-taken by another job
    lock.release()
    assert read_holder(d).job_id == "someone-else"


def test_the_heartbeat_refreshes_the_file_time(tmp_path, monkeypatch):
    monkeypatch.setattr(ckptlock, "HEARTBEAT_S", 0.05)
    d = str(tmp_path)
    lock = CheckpointLock.acquire(d, job="default", job_id="j")
    path = os.path.join(d, LOCK_NAME)
    os.utime(path, (1_000_000, 1_000_000))
    deadline = time.time() + 120  # a hang guard: how soon the heartbeat comes is not timed
    while os.stat(path).st_mtime < 2_000_000 and time.time() < deadline:
        time.sleep(0.02)
    assert os.stat(path).st_mtime > time.time() - 60
    lock.release()


def _take(directory: str, i: int, q, go) -> None:
    q.put(("ready", i, ""))
    go.wait(60)
    try:
        lock = CheckpointLock.acquire(directory, job=f"taker{i}", job_id=f"t{i}")
        q.put(("won", i, lock.note))
        time.sleep(3.0)  # hold it while the others look
        lock.release()
    except CheckpointLockedError as e:
        q.put(("refused", i, str(e)))


def test_concurrent_takers_of_a_stale_lock_have_one_winner(tmp_path):
    d = str(tmp_path)
    _write(d, pid=_dead_pid(), pid_start=None, job="crashed")
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_take, args=(d, i, q, go)) for i in range(4)]
    for p in procs:
        p.start()
    assert [q.get(timeout=120)[0] for _ in procs] == ["ready"] * 4
    go.set()  # all at once
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    won = [r for r in results if r[0] == "won"]
    assert len(won) == 1, results
    assert "job 'crashed'" in won[0][2] and "its process is gone" in won[0][2]
    assert all(f"job 'taker{won[0][1]}'" in r[2] for r in results if r[0] == "refused"), results
    assert sorted(os.listdir(d)) == []  # no lock and no leftovers after the winner released
