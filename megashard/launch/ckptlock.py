"""One job per checkpoint directory: a lock file that names its holder.

    lock = CheckpointLock.acquire("runs/default/checkpoints", job="default", owner="launcher")
    ...                       # the job runs; a thread refreshes the lock's heartbeat
    lock.release()

The lock is the file ``<checkpoint dir>/.megashard.lock`` (JSON: host, pid and its start time, job name,
job id, owner, time taken), created atomically. Who holds it:

- ``megashard run`` on a single node takes it before writing anything and releases it when torchrun ends,
  so the workers and every torchrun restart run under it;
- the job's rank 0 (:func:`megashard.train.loop.train`) takes it when no launcher of the same job holds
  it (a multi-node run, plain torchrun, a script) and releases it at the end. A lock of the *same job*
  (same job id: ``MEGASHARD_JOB_ID`` from the launcher, else torchrun's run id) is never a conflict, so
  torchrun's restarts do not lock themselves out.

**When a lock is stale** (taken over with a one-line note) — the rule:

- same host: its process is gone (no such pid, or a pid since reused: another start time);
- another host: its heartbeat — the file's modification time, refreshed every :data:`HEARTBEAT_S`
  seconds by the holder — is older than :data:`STALE_AFTER_S` seconds (hosts must agree on the time
  within that margin). A younger lock from another host counts as live.

A live lock of another job raises :class:`~megashard.errors.CheckpointLockedError` naming the holder.
Locks are created with an atomic hard link (create-with-content) and stale ones removed only under a
short-lived ``.takeover`` mutex file, so of several jobs taking over one stale lock exactly one wins.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from megashard.errors import CheckpointLockedError
from megashard.launch.lifeline import hostname, pid_alive, process_start_time

__all__ = ["LOCK_NAME", "HEARTBEAT_S", "STALE_AFTER_S", "LockHolder", "CheckpointLock", "read_holder",
           "check_free", "job_id_from_env"]

LOCK_NAME = ".megashard.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
TAKEOVER_ABANDONED_S = 10.0


def job_id_from_env() -> Optional[str]:
    """The id shared by every process and restart of this job: the launcher's ``MEGASHARD_JOB_ID``, else
    torchrun's ``TORCHELASTIC_RUN_ID``; None outside a launched job."""
    return os.environ.get("MEGASHARD_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


@dataclass
class LockHolder:
    """What a lock file says about its holder (plus ``age_s``, the heartbeat's age when read)."""

    host: str
    pid: int
    job: str
    job_id: str
    owner: str = "rank0"
    """``launcher`` (``megashard run``) or ``rank0`` (the job's rank 0)."""
    pid_start: Optional[float] = None
    taken: float = 0.0
    """When the lock was taken (seconds since the epoch)."""
    age_s: float = field(default=0.0, compare=False)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.taken)) if self.taken else "?"
        return f"job '{self.job}' on host {self.host} (pid {self.pid}, since {when})"

    def stale_reason(self) -> Optional[str]:
        """Why the holder is gone (see the module's rule), or None while it counts as live."""
        if self.host == hostname():
            return None if pid_alive(self.pid, self.pid_start) else "its process is gone"
        if self.age_s > STALE_AFTER_S:
            return f"no heartbeat for {self.age_s:.0f} s (> {STALE_AFTER_S:.0f} s)"
        return None


def _lock_path(directory: str) -> str:
    return os.path.join(directory, LOCK_NAME)


def read_holder(directory: str) -> Optional[LockHolder]:
    """The holder of ``directory``'s lock, or None if it has none. An unreadable lock file reads as a
    holder on an unknown host (stale once its heartbeat is old)."""
    path = _lock_path(directory)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        age = time.time() - os.stat(path).st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        d = json.loads(text)
        holder = LockHolder(host=str(d["host"]), pid=int(d["pid"]), job=str(d.get("job", "?")),
                            job_id=str(d.get("job_id", "")), owner=str(d.get("owner", "rank0")),
                            pid_start=d.get("pid_start"), taken=float(d.get("taken", 0.0)))
    except (ValueError, KeyError, TypeError):
        holder = LockHolder(host="<unreadable lock file>", pid=0, job="?", job_id="")
    holder.age_s = max(0.0, age)
    return holder


def _refusal(directory: str, holder: LockHolder) -> CheckpointLockedError:
    rule = "" if holder.host == hostname() else (
        f", heartbeat {holder.age_s:.0f} s ago; a lock from another host is live until its heartbeat is "
        f"{STALE_AFTER_S:.0f} s old")
    return CheckpointLockedError(
        f"checkpoint directory {directory} is in use by {holder.describe()}{rule}: let that job finish or stop "
        f"it, or give this run another train.out_dir or checkpoint.dir (if that job is gone, delete "
        f"{_lock_path(directory)})")


def check_free(directory: str, job_id: Optional[str] = None) -> Optional[LockHolder]:
    """Raise :class:`CheckpointLockedError` if a live job other than ``job_id`` holds ``directory``;
    return the stale holder (to be taken over) or None."""
    holder = read_holder(directory)
    if holder is None or (job_id and holder.job_id == job_id):
        return None
    if holder.stale_reason() is None:
        raise _refusal(directory, holder)
    return holder


class CheckpointLock:
    """A held lock: refreshes its heartbeat in a daemon thread; :meth:`release` removes the file."""

    def __init__(self, directory: str, holder: LockHolder, *, created: bool, note: Optional[str] = None):
        self.directory, self.holder, self.created, self.note = directory, holder, created, note
        self.path = _lock_path(directory)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if created:
            self._thread = threading.Thread(target=self._beat, name="megashard-ckpt-lock", daemon=True)
            self._thread.start()

    @classmethod
    def acquire(cls, directory: str, *, job: str, job_id: Optional[str] = None, owner: str = "rank0",
                pid: Optional[int] = None) -> "CheckpointLock":
        """Take the lock of ``directory`` (created if missing) for job ``job`` / ``job_id``.

        A lock of the same ``job_id`` is joined when the job's live launcher holds it (``created`` is then
        False and :meth:`release` leaves the file alone), else taken over silently (an earlier attempt of
        this job, e.g. before a torchrun restart). A stale lock of another job is taken over, with
        :attr:`note` saying whose it was. A live one raises :class:`CheckpointLockedError`.
        """
        pid = os.getpid() if pid is None else pid
        me = LockHolder(host=hostname(), pid=pid, job=job, job_id=job_id or f"{hostname()}:{pid}", owner=owner,
                        pid_start=process_start_time(pid), taken=time.time())
        os.makedirs(directory, exist_ok=True)
        for _ in range(200):  # rounds of losing races against other takers (each waits 50 ms at most)
            holder = read_holder(directory)
            if holder is not None:
                same_job = holder.job_id == me.job_id
                reason = holder.stale_reason()
                if same_job and holder.owner == "launcher" and reason is None:
                    return cls(directory, holder, created=False)  # the job's launcher holds it for the run
                if not same_job and reason is None:
                    raise _refusal(directory, holder)
                note = None if same_job else f"took over the lock of {directory} from {holder.describe()}: {reason}"
                # (same job: a lock of this job's earlier attempt, e.g. before a torchrun restart: taken over silently)
                if _take_over(directory, holder, me):
                    return cls(directory, me, created=True, note=note)
                continue  # someone else is taking it over: look again
            if os.path.exists(_lock_path(directory) + ".takeover"):
                time.sleep(0.05)  # a taker is between removing a stale lock and creating its own: let it finish
                continue
            if _create(_lock_path(directory), me):
                return cls(directory, me, created=True)
        raise _refusal(directory, read_holder(directory) or me)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if this process created it and it is still ours."""
        self._stop.set()
        if not self.created:
            return
        self.created = False
        holder = read_holder(self.directory)
        if holder is not None and holder.job_id == self.holder.job_id and holder.pid == self.holder.pid:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _create(path: str, holder: LockHolder) -> bool:
    """Create ``path`` with ``holder``'s record atomically; False if it exists."""
    record = {k: v for k, v in asdict(holder).items() if k != "age_s"}
    tmp = f"{path}.{holder.pid}.{time.monotonic_ns()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    try:
        os.link(tmp, path)  # fails if path exists: create-with-content in one step
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        return True
    finally:
        os.remove(tmp)


def _identity(h: Optional[LockHolder]) -> Optional[tuple]:
    return None if h is None else (h.host, h.pid, h.job_id, h.taken)


def _take_over(directory: str, stale: LockHolder, me: LockHolder) -> bool:
    """Replace the lock file by ``me``'s if it still is ``stale``'s; True when ``me`` holds the lock now.

    Removal and creation happen under one short-lived mutex (``<lock>.takeover``, created exclusively), so a
    fresh lock is never removed by a late taker and the taker that removed the stale lock is the one that gets
    it (with its note); creation stays the atomic link of :func:`_create`. False: look again."""
    path = _lock_path(directory)
    mutex = path + ".takeover"
    try:
        fd = os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - os.stat(mutex).st_mtime > TAKEOVER_ABANDONED_S:
                os.remove(mutex)  # left by a taker that died midway
        except OSError:
            pass
        time.sleep(0.05)
        return False
    os.close(fd)
    try:
        if _identity(read_holder(directory)) != _identity(stale):
            return False  # already taken over (or released) by someone else
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return _create(path, me)
    finally:
        os.remove(mutex)
