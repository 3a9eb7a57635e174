"""The call each rank is entering, kept where it survives the rank: a small shared-memory file per rank.

A rank can die (gloo aborts it, SIGKILL, a segfault) microseconds after entering a collective, long before its next
publication to the store. So on entry to every call the main thread writes the call (:meth:`Ledger.entry_line
<megashard.doctor.ledger.Ledger.entry_line>`, ~60 bytes) into its own memory-mapped file — about a microsecond, no
system call, no network — in a directory of the run on this host (``/dev/shm/megashard-doctor-<run>/``, else the
temporary directory); when the call returns it flips one byte, the line's first: ``E`` the main thread is inside the
call, ``R`` it returned (finished), ``A`` it returned with the call still in flight (``async_op``, a functional
collective not yet waited on) — so a rank that stops after a call returned is not said to be inside it. The file
outlives the process:

- peers on the same host read it directly when they diagnose a hang;
- for peers on other hosts, every rank's background thread looks at the files of the other ranks of its host once per
  interval: when a rank's process is gone, it publishes that rank's last entry to the store (``at/<rank>``), once.

The rank that published a dead rank's entry removes its file; every rank removes its own at the end; rank 0 removes
the directories of earlier runs whose processes are all gone (stopped by torchrun's signals). A whole host
that goes down takes its files with it: its ranks are then named from their last published records (the
hang doctor's interval), as before.
"""
from __future__ import annotations

import mmap
import os
import re
import tempfile
import time
from typing import Any, Optional

__all__ = ["EntryBoard", "HEADER", "SIZE", "sweep", "INSIDE", "RETURNED", "IN_FLIGHT"]

SIZE = 1024
HEADER = 64  # "<pid>\n", then the state byte and the newest entry line from this offset
INSIDE, RETURNED, IN_FLIGHT = ord("E"), ord("R"), ord("A")
"""The state byte (the entry line's first character): the main thread is inside the call; it returned and the call
finished; it returned and the call is still in flight."""


def _base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def sweep(base: str) -> int:
    """Remove the entry directories of earlier runs on this host whose every process is gone (torchrun stops the
    workers of a failed job with signals: they leave their files). Returns how many were removed."""
    from megashard.processes import pid_alive

    removed = 0
    try:
        names = [n for n in os.listdir(base) if n.startswith("megashard-doctor-")]
    except OSError:
        return 0
    for name in names:
        d = os.path.join(base, name)
        try:
            if time.time() - os.stat(d).st_mtime < 60:  # new: its ranks may still be creating their files
                continue
            files = os.listdir(d)
            pids = []
            for f in files:
                with open(os.path.join(d, f), "rb") as fh:
                    head = fh.read(HEADER).split(b"\n", 1)[0]
                pids.append(int(head) if head.isdigit() else -1)
            if any(pid_alive(p) for p in pids if p > 0):
                continue
            for f in files:
                os.unlink(os.path.join(d, f))
            os.rmdir(d)
            removed += 1
        except OSError:  # another process is creating or removing it: leave it
            continue
    return removed


class EntryBoard:
    """This rank's entry file (written by :meth:`write`) and the reading of the other ranks' on this host."""

    def __init__(self, run: str, rank: int, create: bool = True):
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:80] or "run"
        self.dir = os.path.join(_base(), f"megashard-doctor-{safe}")
        self.rank = rank
        self.path = os.path.join(self.dir, f"rank_{rank}")
        self.covered: set[int] = set()  # dead local ranks whose entry this rank published
        self.dead: dict[int, dict] = {}  # those ranks: {"pid", "entry" (their last line, or None)}, for this rank's file
        self._mm: Optional[mmap.mmap] = None
        if not create:
            return
        if rank == 0:
            sweep(os.path.dirname(self.dir))
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, SIZE)
                self._mm = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
            self._mm[:HEADER] = f"{os.getpid()}\n".encode().ljust(HEADER, b"\0")
        except (OSError, ValueError):  # no shared memory here: entries go unpublished (the record still is)
            self._mm = None

    @classmethod
    def reader(cls, run: str) -> "EntryBoard":
        """The entry files of run ``run`` on this host, to read only (``megashard doctor`` after the fact)."""
        return cls(run, -1, create=False)

    def write(self, line: str, state: int = INSIDE) -> None:
        """The call this rank starts, or waits on (the main thread; about a microsecond): ``state`` + ``line``."""
        mm = self._mm
        if mm is not None:
            data = line.encode("utf-8", "replace")[: SIZE - HEADER - 2] + b"\n"
            mm[HEADER + 1:HEADER + 1 + len(data)] = data
            mm[HEADER] = state

    def mark(self, state: int) -> None:
        """The call written last returned (:data:`RETURNED`, :data:`IN_FLIGHT`): one byte, ~0.1 µs."""
        mm = self._mm
        if mm is not None:
            mm[HEADER] = state

    def read(self, rank: int) -> tuple[Optional[int], Optional[str]]:
        """``(pid, newest entry line)`` of ``rank``'s file on this host (the line with its state byte first, as
        :func:`~megashard.doctor.ledger.parse_entry` reads it), or ``(None, None)`` when it has none."""
        try:
            with open(os.path.join(self.dir, f"rank_{rank}"), "rb") as f:
                data = f.read(SIZE)
        except OSError:
            return None, None
        head, body = data[:HEADER].split(b"\n", 1)[0], data[HEADER:].split(b"\n", 1)[0]
        pid = int(head) if head.isdigit() else None
        return pid, (body.decode("utf-8", "replace") if body and b"\0" not in body else None)

    def local_ranks(self) -> list[int]:
        """The other ranks of this run with a file on this host."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(int(n[5:]) for n in names if n.startswith("rank_") and n[5:].isdigit() and int(n[5:]) != self.rank)

    def cover_dead(self, store: Any, dead: Any) -> list[int]:
        """Publish to ``store`` (``at/<rank>``) the last entry of every local rank whose process ``dead(pid)`` says is
        gone, once each; returns the ranks published now."""
        out = []
        for r in self.local_ranks():
            if r in self.covered:
                continue
            pid, line = self.read(r)
            if pid is None or not dead(pid):
                continue
            self.covered.add(r)
            self.dead[r] = {"pid": pid, "entry": line}
            if line:
                try:
                    store.set(f"at/{r}", line)
                    out.append(r)
                except Exception:  # noqa: BLE001 - the store's host went away: the file stays for local readers
                    continue
            try:  # published (or empty): the dead rank's file is not needed any more
                os.unlink(os.path.join(self.dir, f"rank_{r}"))
            except OSError:
                pass
        return out

    def close(self) -> None:
        """Unmap and remove this rank's file (and the run's directory once it is empty)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
        for path in (self.path,):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:  # another rank's file is still there
            pass
