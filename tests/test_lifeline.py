"""Processes die with their parent (prctl on Linux, the portable watchdog), also when the parent died first.

Real processes: a parent starts a child that arms its lifeline and sleeps for an hour; the parent exits; the child
must be gone long before its sleep could end (a hang guard of minutes, not a speed bound: how fast it goes is not
timed). The child's pid comes back through the parent's stdout.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megashard.launch.lifeline import die_with_parent, pid_alive, process_start_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

CHILD = textwrap.dedent("""
    import sys, time
    from megashard.launch.lifeline import die_with_parent
    print(die_with_parent(method=sys.argv[1], interval=0.1), flush=True)
    time.sleep(3600)
""")
PARENT = textwrap.dedent("""
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    method = child.stdout.readline().strip()   # the lifeline is armed
    print(child.pid, method, flush=True)
    os._exit(0)                                # die without waiting for the child
""")


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return not pid_alive(pid)


# A hang guard: the children sleep an hour, so one gone within this was ended by its lifeline, not by its sleep.
GUARD_S = 300


def _wait_gone(pid: int) -> None:
    t0 = time.monotonic()
    while not _gone(pid):
        if time.monotonic() - t0 > GUARD_S:
            os.kill(pid, 9)
            pytest.fail(f"process {pid} still runs {GUARD_S} s after its parent died")
        time.sleep(0.05)


@pytest.mark.parametrize("method", ["prctl", "watchdog"] if sys.platform.startswith("linux") else ["watchdog"])
def test_child_dies_with_its_parent(method):
    out = subprocess.run([sys.executable, "-c", PARENT, CHILD, method], capture_output=True, text=True, env=ENV,
                         timeout=60)
    pid_s, used = out.stdout.split()
    assert used == method, out
    _wait_gone(int(pid_s))


def test_parent_that_died_before_the_lifeline_was_armed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: the "expected parent" of a child re-parented before arming
    code = f"from megashard.launch.lifeline import die_with_parent; die_with_parent({dead.pid}); import time; time.sleep(3600)"
    p = subprocess.run([sys.executable, "-c", code], env=ENV, timeout=GUARD_S)
    assert p.returncode == -15  # SIGTERM at once (a finished sleep would exit 0; an unarmed lifeline times out)


def test_expected_parent_alive_elsewhere_is_not_a_death():
    # An inherited pid variable that names some other live process (here: the test itself) must not kill the child.
    code = (f"from megashard.launch.lifeline import die_with_parent; print(die_with_parent({os.getpid()}))")
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() in ("prctl", "watchdog")


def test_pid_alive_tells_a_reused_pid_by_its_start_time():
    me = os.getpid()
    assert pid_alive(me) and pid_alive(me, process_start_time(me))
    start = process_start_time(me)
    if start is not None:  # Linux: another start time = another process with the same pid
        assert not pid_alive(me, start + 1)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid) and not pid_alive(0) and not pid_alive(-1)


def test_a_zombie_is_not_alive():
    """A process that ended and is not reaped yet (a SIGKILLed rank whose parent died with it, before init reaps
    it) answers signal 0, but holds nothing: a lock it held is stale (the CI failure of test_checkpoint_async.py)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while not os.path.exists(f"/proc/{p.pid}/stat") or _state(p.pid) != "Z":
        if time.monotonic() > deadline or not os.path.exists("/proc/self/stat"):
            p.wait()
            pytest.skip("no /proc here, or the child never became a zombie")
        time.sleep(0.05)
    try:
        os.kill(p.pid, 0)  # a zombie still answers signal 0 ...
        assert not pid_alive(p.pid) and not pid_alive(p.pid, process_start_time(p.pid))  # ... but is gone
    finally:
        p.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
