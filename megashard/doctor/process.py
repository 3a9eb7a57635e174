"""The processes around a rank: whether a peer's process on this host is gone or stopped, and this process being
stopped by its launcher (SIGTERM) — what the doctor writes before it goes (:mod:`megashard.doctor.watch`)."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

__all__ = ["ENDED", "TermHook", "note_dead_peers", "pid_dead", "pid_state", "pid_stopped"]


def pid_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` on this host (``/proc/<pid>/stat``: R, S, D, T stopped, Z zombie, …),
    None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return None


def pid_dead(pid: int) -> bool:
    """Whether process ``pid`` on this host is gone (or a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it exists
        return False
    return pid_state(pid) in ("Z", "X")


def pid_stopped(pid: int) -> bool:
    """Whether process ``pid`` on this host is stopped (SIGSTOP, SIGTSTP, a debugger)."""
    return pid_state(pid) in ("T", "t")


ENDED = ("exited", "failed", "terminated")
"""Record states of a rank whose doctor ended: its process left (``exited``), failed, or was stopped by a signal
(``terminated``: SIGTERM, how launchers stop workers)."""


class TermHook:
    """On SIGTERM (how torchrun stops the workers once one died, or a world ends) call ``on_term()`` first, then do
    what the handler before did — by default end by the signal, exit code -15 as without the hook. Installed only
    from the main thread and only over a Python-level handler or the default; :meth:`remove` puts the previous one
    back. (A main thread blocked inside a C++ call runs the handler when the call returns: a peer that died makes
    gloo's call return at once.)"""

    def __init__(self, on_term: Callable[[], None]):
        self.on_term = on_term
        self.prev: Any = None
        self.installed = False

    def install(self) -> "TermHook":
        import signal

        if threading.current_thread() is not threading.main_thread():
            return self
        try:
            prev = signal.getsignal(signal.SIGTERM)
            if prev is None:  # installed outside Python: leave it alone
                return self
            signal.signal(signal.SIGTERM, self._handle)
        except (ValueError, OSError):
            return self
        self.prev, self.installed = prev, True
        return self

    def remove(self) -> None:
        import signal

        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        self.installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self.prev)
        except (ValueError, OSError):
            pass

    def _handle(self, signum: int, frame: Any) -> Any:
        import signal

        try:
            self.on_term()
        except Exception:  # noqa: BLE001 - the signal's own effect comes first
            pass
        prev = self.prev
        if callable(prev):
            return prev(signum, frame)
        if prev == signal.SIG_IGN:
            return None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end by the signal, as without the hook (exit code -15)
        os.kill(os.getpid(), signal.SIGTERM)
        return None


def note_dead_peers(board: Any) -> bool:
    """The ranks of this host whose process is gone, with the last line of their entry slots, into ``board.dead``
    (no store: this may run while the job is being stopped). Whether any is new."""
    new = False
    for r in board.local_ranks():
        if r in board.dead:
            continue
        pid, line = board.read(r)
        if pid is not None and pid_dead(pid):
            board.dead[r] = {"pid": pid, "entry": line}
            new = True
    return new
