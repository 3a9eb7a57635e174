"""Processes that die with their parent, and whether a process is alive: the OS-specific bits of ``megashard run``.

    die_with_parent(expected_parent=launcher_pid)   # first thing in torchrun's process and in every worker

torchrun starts each worker in a session of its own, so killing ``megashard run``'s process group misses
the workers: without a lifeline they are re-parented to PID 1 and train on, unattended. Each process of a
job therefore asks to be signalled when its parent exits:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through libc — the kernel sends the signal the moment the
  parent exits, however it dies (SIGKILL included);
- elsewhere (or when prctl fails): a daemon thread that polls ``os.getppid()`` every second and sends the
  signal when the parent changes.

Either way the parent may already have died before the lifeline was armed; ``expected_parent`` (passed
down in the environment by the parent) closes that window: a parent pid that differs from the expected
one, while the expected process is gone, means the parent is dead — the signal is sent at once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

__all__ = ["die_with_parent", "pid_alive", "process_start_time", "hostname", "env_pid"]

_PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL_S = 1.0


def _prctl_pdeathsig(sig: int) -> bool:
    """Arm the kernel's parent-death signal; False where that is not available (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, sig: int, interval: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os.kill(os.getpid(), sig)
    time.sleep(10.0)  # a handler that swallowed the signal: leave anyway
    os._exit(128 + int(sig))


def die_with_parent(expected_parent: Optional[int] = None, sig: int = signal.SIGTERM, *,
                    method: str = "auto", interval: float = WATCHDOG_INTERVAL_S) -> str:
    """Make this process receive ``sig`` when its parent process exits; returns the method used.

    Args:
        expected_parent: the parent's pid as the parent knows it (e.g. from an environment variable);
            ``None`` = whatever ``os.getppid()`` is now. If the parent already died before this call,
            ``sig`` is sent immediately.
        sig: the signal (SIGTERM: the default action ends a Python process at once; torchrun stops its
            workers on it).
        method: ``"auto"`` (prctl on Linux, else the watchdog), ``"prctl"`` or ``"watchdog"``.
        interval: seconds between the watchdog's checks.
    Returns:
        ``"prctl"`` or ``"watchdog"``.
    """
    parent = os.getppid()
    used = "prctl" if method in ("auto", "prctl") and _prctl_pdeathsig(sig) else "watchdog"
    if used == "watchdog":
        threading.Thread(target=_watch_parent, args=(parent, int(sig), interval), name="megashard-lifeline",
                         daemon=True).start()
    if expected_parent and parent != expected_parent and not pid_alive(expected_parent):
        os.kill(os.getpid(), sig)  # the parent died before the lifeline was armed (we were re-parented)
    return used


def env_pid(name: str) -> Optional[int]:
    """The pid stored in environment variable ``name``, or None."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def pid_alive(pid: int, start_time: Optional[float] = None) -> bool:
    """Whether process ``pid`` exists on this host (and, when ``start_time`` is given and the OS tells, is
    the same process: a recycled pid has another start time)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    except OSError:
        return False
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and abs(now - start_time) > 1e-6:
            return False
    return True


def process_start_time(pid: int) -> Optional[float]:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc/<pid>/stat`` field 22), or None elsewhere.

    Only compared for equality: it tells a live process from a later one that got the same pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: fields after the last ')' are plain.
    rest = stat[stat.rfind(")") + 2:].split()
    try:
        return float(rest[19])  # field 22 overall = index 19 after "pid (comm)"
    except (IndexError, ValueError):
        return None


def hostname() -> str:
    """This host's name as other hosts of the job see it in a lock file."""
    return socket.gethostname()
