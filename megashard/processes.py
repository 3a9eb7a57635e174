"""Who a process is: this host's name, and whether a pid still names the same live process.

Used by the checkpoint-directory lock (:mod:`megashard.train.ckptlock`: who holds it, and is it stale) and by the
lifelines of :mod:`megashard.launch.lifeline` (is the parent still there). Plain Python, no torch.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

__all__ = ["hostname", "pid_alive", "process_start_time"]


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
