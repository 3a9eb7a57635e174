"""The hang doctor of one process: a background thread that publishes this rank's record and names missing ranks.

    doctor = Doctor(timeout=600.0, out_dir="runs/job")
    doctor.register_state(state)          # the ParallelState's groups (and the default group as ``world``)
    doctor.start()                        # wraps torch.distributed's collectives (megashard.doctor.intercept)
    ...
    doctor.stop()                         # writes <out_dir>/doctor/rank_<r>.json, puts torch's functions back

The fast path is the ledger (:mod:`megashard.doctor.ledger`): in-memory counters. Every ``interval`` seconds the
thread closes the asynchronous calls that completed and publishes this rank's record to the store the default group
was created with (a ``PrefixStore`` over a cloned client connection, so it never waits behind the main thread's store
traffic): one ``set`` of a small JSON per interval, its ``beat`` counting up while the process lives.

Only on suspicion does a rank read its peers: when a call has been open for ``timeout / 2`` it reads the records of
the group's members (and remembers their heartbeats); when it is still open after ``timeout`` — or when torch raises
from it first (gloo's own timeout, a peer that died) — it reads them again, decides which members never reached the
call and which sent no heartbeat since (a dead process; on the same host also a vanished pid), prints one line
(:func:`megashard.doctor.diagnose.finding_line`) to stderr once, and writes its file.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any, Iterable, Optional

from megashard.doctor import intercept
from megashard.doctor.board import IN_FLIGHT, RETURNED, EntryBoard
from megashard.doctor.diagnose import diagnose
from megashard.doctor.identity import default_interval, record_dir, run_identity
from megashard.doctor.ledger import PUBLISHED_STEPS, Call, Ledger, parse_entry, with_entry
from megashard.doctor.process import ENDED, TermHook, note_dead_peers, pid_dead, pid_stopped
from megashard.doctor.stragglers import Stragglers
from megashard.doctor.waitfor import find_cycle

__all__ = ["Doctor", "default_interval", "record_dir", "run_identity"]

STORE_PREFIX = "megashard_doctor"


class Doctor:
    """Watches this process's collectives on registered groups; see the module docstring.

    Args:
        timeout: seconds after which an open call is a hang (``parallel.timeout``).
        out_dir: the run directory; files go to ``<out_dir>/doctor/rank_<r>.json`` (None: no files), in a later world
            of the job (a torchrun restart, an elastic job's new world: number k > 0, agreed by its ranks) to
            ``<out_dir>/doctor/restart_<k>/``, so that the records of the world that hung are kept.
        interval: seconds between publications (default :func:`default_interval`).
        store: a ``torch.distributed.Store`` (default: the default group's, cloned).
        stream: where the line goes (default stderr).
    """

    def __init__(self, timeout: float, out_dir: Optional[str] = None, *, interval: Optional[float] = None,
                 store: Any = None, stream: Optional[IO[str]] = None):
        import torch.distributed as dist

        self.timeout = float(timeout)
        self.interval = float(interval) if interval else default_interval(self.timeout)
        self.out_dir = out_dir
        self.stream = stream
        self.ledger = Ledger(dist.get_rank(), dist.get_world_size())
        if store is None:
            from megashard._compat import default_store

            store = default_store()
        try:
            store = store.clone()  # its own connection: never behind the main thread's store requests
        except Exception:  # noqa: BLE001 - a store without clone (FakeStore, older torch): share the connection
            pass
        self.store = dist.PrefixStore(STORE_PREFIX, store)
        self.ledger.identity = run_identity(self.store)
        # The call this rank enters, in shared memory (megashard.doctor.board): ~1 µs on the main thread, and it
        # survives the process — peers on this host read it, and publish it to the store for the others if it died.
        self.board = EntryBoard(str(self.ledger.identity["run"]), self.ledger.rank)
        # Rank 0 compares the ranks' waits (the straggler report: megashard.doctor.stragglers), in this thread.
        self.stragglers: Optional[Stragglers] = Stragglers() if self.ledger.rank == 0 else None
        self.straggler_report: Optional[dict[str, Any]] = None
        """The newest straggler report (rank 0; what metrics.jsonl carries), replaced whole after each reading."""
        self.findings: list[dict[str, Any]] = []
        self.beat = 0
        self.cpu_s = 0.0
        """CPU seconds the doctor's background thread used so far (what it costs besides the per-call counting)."""
        self.state = "running"
        self._snap: dict[int, tuple[float, dict[int, Optional[dict]]]] = {}  # call id -> (when, records read then)
        self._reported: set[int] = set()  # ids of calls open when this rank last reported a hang
        self._declined: set[str] = set()  # torch's names of groups a functional collective used and not adopted
        self._term = TermHook(self._on_terminate)  # SIGTERM: this rank's record first (installed by start)
        self._writes = 0
        self._lock = threading.Lock()  # one report at a time (thread and main thread)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ set-up
    def register(self, pg: Any, name: str, ranks: Optional[Iterable[int]] = None) -> None:
        """Watch the collectives on ``pg`` (``ranks``: its global ranks, default asked from torch). Every rank may
        call it: on a rank that is not a member (``new_group`` gave it ``GroupMember.NON_GROUP_MEMBER``, or ``ranks``
        leaves it out) there is nothing to watch, since that rank makes no call on the group."""
        import torch.distributed as dist

        from megashard.errors import ConfigError

        if not isinstance(name, str) or not name.strip() or "|" in name:
            raise ConfigError(f"doctor.register(name={name!r}): the group's name must be a non-empty string without "
                              "'|' (it names the group in the doctor's lines, e.g. 'mine')")
        if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
            return
        if not isinstance(pg, dist.ProcessGroup):
            raise ConfigError(f"doctor.register(pg={pg!r:.80}): a torch.distributed.ProcessGroup is expected (what "
                              "torch.distributed.new_group returns)")
        if ranks is None:
            ranks = dist.get_process_group_ranks(pg)
        try:
            ranks = [int(r) for r in ranks]
        except (TypeError, ValueError):
            raise ConfigError(f"doctor.register(ranks={ranks!r:.80}): the group's global ranks (integers) are "
                              "expected") from None
        if self.ledger.rank not in ranks:
            return
        if len(ranks) > 1:
            self.ledger.register(pg, name, ranks, cuda="nccl" in str(dist.get_backend(pg)))

    def register_state(self, state: Any) -> None:
        """Watch every group of a :class:`~megashard.state.ParallelState` (by megashard's names) and the default
        group (as ``world``)."""
        import torch.distributed as dist

        world = dist.group.WORLD
        for name, pg in state.named_groups().items():
            if pg is world:  # a megashard name for the whole world (e.g. dp on a pure data-parallel job)
                self.ledger.register(pg, name, range(dist.get_world_size()), default=True,
                                     cuda="nccl" in str(dist.get_backend()))
            else:
                self.register(pg, name, state.ranks(name))
        self.ledger.register(world, "world", range(dist.get_world_size()), default=True,
                             cuda="nccl" in str(dist.get_backend()))

    def adopt_functional(self, key: str, group: Any) -> Optional[Any]:
        """The track of the group a functional collective runs on (torch's name ``key``) when the doctor was not told
        of it — a DeviceMesh of the user's own: DTensor's redistribution on its ``tp`` axis — registered now under the
        mesh axis's name (else ``group``); None when it cannot be resolved (then it goes unseen). Every member adopts
        it at its first functional call there, so the members count the group's calls alike from then on."""
        if key in self._declined:
            return None
        import torch.distributed as dist

        from megashard._compat import functional_group

        try:
            pg, axis = functional_group(group)
            ranks = dist.get_process_group_ranks(pg) if isinstance(pg, dist.ProcessGroup) else None
        except Exception:  # noqa: BLE001 - not resolvable here: unseen, as before
            pg, axis, ranks = None, None, None
        if not ranks or self.ledger.rank not in ranks:
            self._declined.add(key)
            return None
        track = self.ledger.tracks.get(id(pg))
        if track is not None and track.pg is pg:
            self.ledger.by_pg_name[key] = track
            return track
        name = axis if isinstance(axis, str) and axis.strip() and "|" not in axis else "group"
        track = self.ledger.register(pg, name, ranks, cuda="nccl" in str(dist.get_backend(pg)))
        self.ledger.by_pg_name[key] = track
        return track

    def start(self) -> "Doctor":
        intercept.install(self)
        self._publish()
        self.write("start", waits=1)  # this rank of this run started: a rank killed later leaves at least this
        self._term.install()
        self._thread = threading.Thread(target=self._run, name="megashard-doctor", daemon=True)
        self._thread.start()
        return self

    # ------------------------------------------------------------------ stopped by the launcher
    def _on_terminate(self) -> None:
        """SIGTERM (:class:`~megashard.doctor.process.TermHook`): this rank's record first — where the main thread is,
        and the dead ranks of this host with the call their entry slots name — before the signal takes effect."""
        if self.state == "running":
            self.state = "terminated"
            note_dead_peers(self.board)
            self.write("terminated")

    def stop(self, reason: str = "exit") -> None:
        """Stop watching: the thread ends, the final record is published and written, torch's functions are back and
        no process group is referenced any more. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)
        self._thread = None
        self._term.remove()
        self.state = "exited" if reason in ("exit", "world_change") else "failed"
        intercept.uninstall()
        try:
            self.ledger.poll()
        except RuntimeError:
            pass
        self._publish()
        self.write(reason)
        self.ledger.forget_groups()
        self.board.close()

    def entered(self, call: Call) -> None:
        """The main thread starts ``call`` (before torch runs it), or waits on it (``Work.wait``, ``wait_tensor``):
        written to this rank's shared-memory entry slot, so that a rank that dies or stops inside a call is seen
        inside it, even within a publication interval of entering it."""
        ledger = self.ledger
        ledger.moves += 1
        ledger.inside = call
        self.board.write(ledger.entry_line(call))

    def returned(self, call: Call, in_flight: bool = False) -> None:
        """The main thread is back in the caller's code from ``call`` (``in_flight``: the call goes on, an
        ``async_op``): one byte of the entry slot (~0.1 µs), so a rank that stops after a call returned is said to be
        in its own code, not inside the call."""
        ledger = self.ledger
        ledger.moves += 1
        ledger.inside = None
        self.board.mark(IN_FLIGHT if in_flight else RETURNED)

    # ------------------------------------------------------------------ the background thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.ledger.poll(self.report)
                self._publish()
                self._check()
                before = len(self.board.dead)
                self.board.cover_dead(self.store, pid_dead)  # a dead rank of this host: its entry for the others
                if len(self.board.dead) > before:  # in this rank's file too: the launcher may stop it any moment
                    self.write("peer_died")
                if self.stragglers is not None:
                    self._compare_waits()
            except Exception as e:  # noqa: BLE001 - the doctor must never take a job down
                self._say(f"megashard doctor: rank {self.ledger.rank}: watcher error: {type(e).__name__}: {e}")
            self.cpu_s = time.thread_time()  # this thread's own CPU time

    def _check(self) -> None:
        call = self.ledger.oldest_open()
        if call is None:
            self._snap.clear()
            return
        age = time.monotonic() - call.t0
        if age >= self.timeout / 2 and call.cid not in self._snap:
            self._publish()  # peers reading now see this rank's open call
            self._snap[call.cid] = (time.monotonic(), self._read(self._peers_of(call)))
        if age >= self.timeout:
            self.report(call)

    def _publish(self) -> None:
        self.beat += 1
        rec = self.ledger.record(self.beat)
        rec["state"] = self.state
        try:
            self.store.set(f"rec/{self.ledger.rank}", json.dumps(rec, separators=(",", ":")))
        except Exception:  # noqa: BLE001 - the store's host went away: nothing to publish to
            pass

    def _compare_waits(self) -> None:
        """Rank 0: every rank's newest published waits into the straggler statistics (one multi-key read)."""
        keys = [f"rec/{r}" for r in range(self.ledger.world_size)]
        try:
            values = self.store.multi_get(keys) if self.store.check(keys) else [self._get(k) for k in keys]
        except Exception:  # noqa: BLE001 - no multi_get in this store: one key at a time
            values = [self._get(k) for k in keys]
        run = self.ledger.identity.get("run")
        for r, value in enumerate(values):
            try:
                rec = json.loads(value) if value is not None else None
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("run") in (None, run):
                self.stragglers.add_record(r, rec, analyse=False)
        before = self.stragglers.steps
        self.stragglers.analyse(trim=True)
        if self.stragglers.steps != before:  # new steps: a new report (the test costs a few ms of Python)
            self.straggler_report = self.stragglers.metrics()

    def _read(self, ranks: Iterable[int]) -> dict[int, Optional[dict]]:
        """The peers' records, each merged with the call it published on entry when that is newer
        (:func:`~megashard.doctor.ledger.with_entry`); None for a rank without one (or with another run's)."""
        out: dict[int, Optional[dict]] = {}
        run = self.ledger.identity.get("run")
        for r in ranks:
            rec = self._get(f"rec/{r}")
            try:
                rec = json.loads(rec) if rec is not None else None
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or (run and rec.get("run") not in (None, run)):
                out[r] = None
                continue
            pid, line = self.board.read(r)  # on this host: its own entry file; else what a survivor published
            out[r] = with_entry(rec, parse_entry(line if line is not None else self._get(f"at/{r}")))
        return out

    def _get(self, key: str) -> Optional[bytes]:
        try:
            return self.store.get(key) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - unreachable store (its host died): unknown
            return None

    def _peers_of(self, call: Call) -> list[int]:
        if call.p2p:
            return sorted({p for _, p, _ in call.p2p if p >= 0})
        return [r for r in call.track.ranks if r != self.ledger.rank]

    # ------------------------------------------------------------------ diagnosis
    def on_error(self, call: Call, exc: BaseException) -> None:
        """A wrapped call raised: a timeout or a lost peer is a hang to report (other errors are the caller's)."""
        if isinstance(exc, RuntimeError) and self._thread is not None:
            try:
                self.report(call, quick=True)
            except Exception:  # noqa: BLE001 - never mask the collective's own error
                pass

    def report(self, call: Call, quick: bool = False) -> Optional[dict[str, Any]]:
        """Diagnose ``call`` (once per hang), print its line and write this rank's file; returns the finding.

        ``quick``: torch raised from the call (its timeout, a lost peer); the same diagnosis (:meth:`_examine`), which
        waits at most ``2 · interval + 0.5`` s for fresh records when there was no read on suspicion."""
        with self._lock:
            if call.cid in self._reported:
                return None
            self._reported = set(self.ledger.open) | {call.cid}
            waited = time.monotonic() - call.t0
            self._publish()  # peers diagnosing now see this call open
            # first what this rank knows (the process may be stopped while it waits for peers; torchrun stops the
            # survivors within 0.1 s of a worker's death): small, the step log comes with the final write
            self.write("hang", waits=PUBLISHED_STEPS)
            records, alive, gone = self._examine(self._peers_of(call), self._snap.get(call.cid))
            cycle = []
            waiting = {r: rec for r, rec in records.items() if rec is not None and alive.get(r) is not False}
            if any(rec.get("open") for rec in waiting.values()):  # a live peer waits elsewhere: a cycle?
                here = dict(call.summary(), ranks=list(call.track.ranks))  # this rank waits here, whatever else
                mine = dict(self.ledger.record(self.beat), open=[here], inside=here)
                cycle = find_cycle(self.ledger.rank, {**records, **{r: None for r in records if r not in waiting},
                                                      self.ledger.rank: mine}, fetch=self._read)
            finding = diagnose(call.summary(), call.track.ranks, self.ledger.rank, records, alive, waited, gone,
                               deadlock=cycle)
            self.findings.append(finding)
            self._say(finding["line"])
            self.write("hang")
            return finding

    def _examine(self, peers: list[int], snap: Optional[tuple[float, dict]]) -> tuple[dict, dict, set]:
        """The peers' records, fresh, and whether each is alive: a live peer publishes a newer record (a higher beat)
        than the first read within ``2 · interval + 0.5`` s; one that does not — or whose pid is gone on this host,
        or whose doctor ended — is not. The first read is the one on suspicion when there was one (then usually no
        waiting at all), else one taken now. Returns the records, rank -> alive, and the ranks whose process is gone
        from this host."""
        if snap is None:
            snap = (time.monotonic(), self._read(peers))
        first = snap[1]
        deadline = snap[0] + 2 * self.interval + 0.5
        records: dict[int, Optional[dict]] = {}
        alive: dict[int, Optional[bool]] = {}
        gone: set[int] = set()
        waiting = list(peers)
        while True:
            for r, rec in self._read(waiting).items():
                if rec is not None:
                    records[r] = rec
            still = []
            for r in waiting:
                before, now = first.get(r), records.get(r)
                if now is not None and (before is None or int(now.get("beat", 0)) > int(before.get("beat", 0))):
                    alive[r] = True
                elif now is not None and now.get("state") in ENDED:
                    alive[r] = False
                elif now is not None and now.get("host") == self.ledger.host and pid_dead(int(now.get("pid", -1))):
                    alive[r] = False
                    gone.add(r)
                else:
                    still.append(r)
            waiting = still
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(min(0.2, self.interval / 2))
        for r in waiting:  # no newer record before the deadline: no heartbeat
            if records.get(r) is None:
                records[r] = first.get(r)  # the store may be gone: what was read first
            alive[r] = False if records.get(r) is not None else None
            rec = records.get(r)
            if rec is not None and rec.get("host") == self.ledger.host and pid_stopped(int(rec.get("pid", -1))):
                records[r] = dict(rec, proc="stopped")  # SIGSTOP (or a debugger): said so, not "dead or stuck"
        for r, rec in records.items():  # a process that ended is not alive, whatever its last beat
            if rec is not None and rec.get("state") in ENDED:
                alive[r] = False
        return records, alive, gone

    def _say(self, line: str) -> None:
        stream = self.stream or sys.stderr
        try:
            # one write of the line and its newline: print() writes them apart, and the ranks of a host share stderr
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ files
    def write(self, reason: str, waits: int = 0) -> Optional[str]:
        """Write what this rank knows to ``<out_dir>/doctor/rank_<r>.json`` (atomically; with the waits of the newest
        ``waits`` steps, 0: all kept); returns the path."""
        if not self.out_dir:
            return None
        rec = self.ledger.record(self.beat, waits=waits)
        rec.update(state=self.state, reason=reason, timeout=self.timeout, findings=self.findings)
        if self.straggler_report is not None:
            rec["stragglers"] = self.straggler_report
        if self.board.dead:  # ranks of this host seen dead, with the call their entry slots name
            rec["dead_peers"] = {str(r): dict(v) for r, v in sorted(self.board.dead.items())}
        d = record_dir(self.out_dir, self.ledger.identity.get("world"))  # the same for every rank of this world
        path = os.path.join(d, f"rank_{self.ledger.rank}.json")
        self._writes += 1  # a name of its own per write: the thread, a signal handler and the main thread may overlap
        try:
            os.makedirs(d, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{self._writes}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(rec, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:
            self._say(f"megashard doctor: rank {self.ledger.rank}: cannot write {path}: {e.strerror or e}")
            return None
        return path
