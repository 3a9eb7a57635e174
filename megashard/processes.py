"""Who a process is: this host's name, and whether a pid still names the same live process.

Used by the checkpoint-directory lock (:mod:`megashard.train.ckptlock`: who holds it, and is it stale) and by the
lifelines of :mod:`megashard.launch.lifeline` (is the parent still there). Plain Python, no torch.
"""
from __future__ import annotations

import os
import sys
import socket
from typing import Optional

__all__ = ["EXIT_PEER_LOST", "hostname", "is_peer_loss", "pid_alive", "process_start_time", "quiet_stderr"]


def pid_alive(pid: int, start_time: Optional[float] = None) -> bool:
    """Whether process ``pid`` lives on this host (and, when ``start_time`` is given and the OS tells, is the
    same process: a recycled pid has another start time). A zombie — a process that ended and that no parent has
    reaped yet, e.g. a SIGKILLed worker whose launcher died with it — is gone: it holds nothing and never runs again."""
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
    fields = _stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):  # zombie or dead: signal 0 still reaches it
        return False
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and abs(now - start_time) > 1e-6:
            return False
    return True


def _stat_fields(pid: int) -> list[str]:
    """The fields of Linux ``/proc/<pid>/stat`` after ``pid (comm)`` (field 3 on: the state first), or [] elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return []
    # The command name (field 2) may contain spaces and parentheses: fields after the last ')' are plain.
    return stat[stat.rfind(")") + 2:].split()


def process_start_time(pid: int) -> Optional[float]:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc/<pid>/stat`` field 22), or None elsewhere.

    Only compared for equality: it tells a live process from a later one that got the same pid.
    """
    try:
        return float(_stat_fields(pid)[19])  # field 22 overall = index 19 after "pid (comm)"
    except (IndexError, ValueError):
        return None


def hostname() -> str:
    """This host's name as other hosts of the job see it in a lock file."""
    return socket.gethostname()


def quiet_stderr(quiet: bool):
    """A context in which file descriptor 2 (stderr of Python and of torch's C++ code) goes nowhere, if ``quiet``."""
    import contextlib

    @contextlib.contextmanager
    def muted():
        sys.stderr.flush()
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)

    return muted() if quiet else contextlib.nullcontext()


EXIT_PEER_LOST = 75
"""Exit code of a worker whose collective failed because another worker died (EX_TEMPFAIL): its agent
(megashard.launch.agent, which re-exports it) treats it as a membership change, not a failure."""

#: Substrings (lower case) of gloo / NCCL / TCPStore errors raised when a peer process went away.

_PEER_LOSS = ("connection reset by peer", "connection closed by peer", "broken pipe", "failed to recv",
              "remote process exited", "communicator was aborted", "ncclremoteerror", "socket closed")


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a peer process went away."""
    import torch.distributed as dist

    from megashard.errors import PeerLostError

    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (PeerLostError, getattr(dist, "DistNetworkError", ()))):
            return True
        text = str(e).lower()
        if any(s in text for s in _PEER_LOSS):
            return True
        e = e.__cause__ or e.__context__
    return False
