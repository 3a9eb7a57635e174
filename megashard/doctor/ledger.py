"""The doctor's in-memory bookkeeping of one process: which collectives it started on which group, and which are open.

Nothing here touches the store or the network: :class:`Ledger` is what every intercepted collective updates (a
counter and one small list per call), and :meth:`Ledger.record` is the snapshot the background thread publishes
(:mod:`megashard.doctor.watch`) and writes to ``<out_dir>/doctor/rank_<r>.json``.

A group is known by a key every member computes alike, ``<name>:<first rank>`` (the groups of one name partition the
ranks, so its first rank tells them apart): ``tp:4`` is the tp group of ranks 4, 5. On a group the ledger counts

- collectives: the n-th collective a rank *starts* on a group is ``#n`` there (the same n on every member, since
  members issue a group's collectives in the same order) — a peer whose count is below n never reached ``#n``;
- point-to-point operations per peer: the k-th send to rank p is matched by p's k-th receive from this rank.

Each call also carries its *signature* (``all_reduce float32[4]``: the operation and the dtype and shape of its
tensor), so that members of one call that disagree are named rank by rank, and the time every synchronous call took:
summed per group and step (:meth:`Ledger.set_step`), the wait of each rank for the last one to arrive — what
:mod:`megashard.doctor.stragglers` compares across ranks.
"""
from __future__ import annotations

import collections
import itertools
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

__all__ = ["Call", "GroupTrack", "Ledger", "describe_call", "STEP_LOG", "PUBLISHED_STEPS"]

STEP_LOG = 10000
"""Completed steps whose per-group waits a rank keeps (in memory and in its file): about 100 bytes each."""
PUBLISHED_STEPS = 32
"""Completed steps whose waits each published record carries (rank 0 compares them across ranks)."""
REPLICA_NAMES = ("tp_dp_cp", "tp_dp", "dp_cp", "dp", "world")
"""megashard's groups whose members do the same work (every rank of one pipeline stage; else its data-parallel
replicas; else everyone): the first of these a rank has is its *peers*, among which a straggler is one that spends
longer outside the collectives."""


@dataclass(eq=False)
class GroupTrack:
    """One registered process group: its names, global ranks and this rank's counters on it."""

    pg: Any
    names: tuple[str, ...]
    ranks: tuple[int, ...]
    key: str
    seq: int = 0
    """Collectives started on this group by this rank (the last one is ``#seq``)."""
    sent: dict[int, int] = field(default_factory=dict)
    """peer (global rank) -> point-to-point sends started to it."""
    recvd: dict[int, int] = field(default_factory=dict)
    """peer (global rank) -> point-to-point receives started from it."""
    cuda: bool = False
    """NCCL (a CUDA communicator): a synchronous call has only been enqueued when it returns."""
    wait_s: float = 0.0
    """Seconds this rank spent in synchronous collectives on this group during the current step."""
    waits: int = 0
    """Synchronous collectives timed in the current step."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(eq=False, slots=True)
class Call:
    """One collective (or a batch of point-to-point operations) this rank started on a registered group."""

    track: GroupTrack
    op: str
    seq: int
    """``#seq`` on the group for a collective; for point-to-point, the group's collective count when it started."""
    t0: float
    """time.monotonic() when it started."""
    step: int
    p2p: tuple[tuple[str, int, int], ...] = ()
    """Point-to-point parts: (``send``/``recv``, peer global rank, k-th with that peer)."""
    work: Any = None
    """The Work (or list of Works) of an asynchronous call; finished when every one ``is_completed()``."""
    cid: int = 0
    sig: str = ""
    """``float32[4]``: dtype and shape of the call's tensor (empty for object and barrier calls)."""
    entry: int = 0
    """This rank's count of calls started when it started this one."""

    def summary(self, now: float | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"group": self.track.key, "name": self.track.name, "op": self.op, "seq": self.seq,
                             "step": self.step}
        if self.sig:
            d["sig"] = self.sig
        if self.p2p:
            d["p2p"] = [list(p) for p in self.p2p]
        if now is not None:
            d["age_s"] = round(now - self.t0, 3)
        return d


def signature(c: Optional[dict[str, Any]]) -> str:
    """``all_reduce float32[4]``: what a call summary says the rank called (its op, with its tensor's dtype and shape
    when known)."""
    if not c:
        return "nothing"
    return f"{c.get('op', '?')} {c['sig']}" if c.get("sig") else str(c.get("op", "?"))


def describe_call(c: Optional[dict[str, Any]]) -> str:
    """``all_reduce #7 on tp`` / ``recv #3 from rank 4 on pp`` for a call summary (as published)."""
    if not c:
        return "no collective yet"
    if c.get("p2p"):
        parts = [f"{d} #{k} {'to' if d == 'send' else 'from'} rank {p}" for d, p, k in c["p2p"][:3]]
        more = f" (+{len(c['p2p']) - 3})" if len(c["p2p"]) > 3 else ""
        return f"{', '.join(parts)}{more} on {c.get('name', c['group'])}"
    return f"{c['op']} #{c['seq']} on {c.get('name', c['group'])}"


class Ledger:
    """What this process started and finished on its registered groups (in memory; updated by the interceptors)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.tracks: dict[int, GroupTrack] = {}  # id(process group) -> its track (the default group also under 0)
        self.by_key: dict[str, GroupTrack] = {}
        self.by_pg_name: dict[str, GroupTrack] = {}  # torch's group name -> track (functional collectives name groups)
        self.open: dict[int, Call] = {}  # calls started and not known to be finished (the async ones until polled)
        self.held: dict[int, Call] = {}  # id(Work) -> its open call (the Work is held in call.work, so ids stay unique)
        self.last: Optional[Call] = None  # the newest finished call
        self.last_end = time.monotonic()
        self.step = 0
        self.entries = 0  # calls started (the entry published on each call carries it: newer than a record or not)
        self.moves = 0  # the main thread's moves into and out of calls (the entry slot's and the record's clock)
        self.inside: Optional[Call] = None  # the call the main thread is in now (started, or waited on), or None
        self._ids = itertools.count(1)
        self.identity: dict[str, Any] = {}  # run, launch, attempt, started: set by the Doctor
        self.step_log: collections.deque = collections.deque(maxlen=STEP_LOG)  # (step, seconds, {group key: wait s})
        self._step_t0: Optional[float] = None

    # ------------------------------------------------------------------ groups
    def register(self, pg: Any, name: str, ranks: Sequence[int], *, default: bool = False,
                 cuda: bool = False) -> GroupTrack:
        """Track ``pg`` (``name``, global ``ranks``); a group registered again under another name keeps its first
        name (e.g. ``dp_cp`` and ``hsdp`` are one communicator) and gains the alias."""
        t = self.tracks.get(id(pg))
        if t is not None and t.pg is pg:
            if name not in t.names:
                t.names = t.names + (name,)
            if default:
                self.tracks[0] = t  # group=None means it too
            return t
        ranks = tuple(int(r) for r in ranks)
        key = "world" if default else f"{name}:{ranks[0]}"
        # The default group is called "world" whatever megashard names share it (with tp=4 on 4 ranks, tp, tp_dp,
        # mp, ... are all the default group: the doctor cannot tell which name the caller used).
        t = GroupTrack(pg, ("world", name) if default and name != "world" else (name,), ranks, key, cuda=cuda)
        self.tracks[id(pg)] = t
        if default:
            self.tracks[0] = t
        self.by_key[key] = t
        pg_name = getattr(pg, "group_name", None)
        if isinstance(pg_name, str) and pg_name:
            self.by_pg_name[pg_name] = t
        return t

    def forget_groups(self) -> None:
        """Drop every reference to a process group (before the groups are destroyed)."""
        for t in self.by_key.values():
            t.pg = None
        self.tracks.clear()
        self.by_pg_name.clear()
        self.open.clear()
        self.held.clear()

    # ------------------------------------------------------------------ calls (the fast path)
    def begin(self, track: GroupTrack, op: str, p2p: tuple[tuple[str, int], ...] = (), sig: str = "") -> Call:
        self.entries += 1
        if p2p:
            parts = []
            for direction, peer in p2p:
                counts = track.sent if direction == "send" else track.recvd
                k = counts[peer] = counts.get(peer, 0) + 1
                parts.append((direction, peer, k))
            call = Call(track, op, track.seq, time.monotonic(), self.step, tuple(parts), cid=next(self._ids), sig=sig,
                        entry=self.entries)
        else:
            track.seq += 1
            call = Call(track, op, track.seq, time.monotonic(), self.step, cid=next(self._ids), sig=sig,
                        entry=self.entries)
        self.open[call.cid] = call
        return call

    def hold(self, call: Call, work: Any) -> None:
        """An asynchronous call stays open on its Work (or list of Works; or probes of a functional collective's
        outputs, known by their ``keys``) until they are waited on or polled."""
        call.work = work
        for w in work if isinstance(work, list) else [work]:
            for key in getattr(w, "keys", None) or (id(w),):
                self.held[key] = call

    def waited(self, work: Any) -> None:
        """``work.wait()`` (or ``wait_tensor(output)``) returned: drop it, and close its call once none of its Works
        is left."""
        call = self.held.pop(id(work), None)
        if call is None:
            return
        w = call.work
        key = id(work)
        rest = [x for x in w if x is not work and key not in (getattr(x, "keys", None) or ())] \
            if isinstance(w, list) else []
        for x in w if isinstance(w, list) else [w]:
            if x is not work and key in (getattr(x, "keys", None) or ()):
                for k in x.keys:
                    self.held.pop(k, None)
        call.work = rest or None  # a new list: the background poll may be reading the old one
        if not rest:
            self.end(call)

    def end(self, call: Call, sync: bool = False) -> None:
        """``call`` finished; ``sync``: it was a synchronous call that returned just now, so its duration is this
        rank's wait for the last member to arrive (plus the transfer): counted for the straggler report."""
        now = time.monotonic()
        self.open.pop(call.cid, None)
        if self.last is None or call.t0 >= self.last.t0:
            self.last = call
        self.last_end = now
        if sync:
            t = call.track
            t.wait_s += now - call.t0
            t.waits += 1

    def blocked(self, key: int, seconds: float) -> None:
        """The main thread was blocked ``seconds`` in ``wait()`` on the Work (or output) ``key`` of an asynchronous
        call: time spent waiting for peers, counted like a synchronous call's."""
        call = self.held.get(key)
        if call is not None:
            call.track.wait_s += seconds
            call.track.waits += 1

    def peers_key(self) -> Optional[str]:
        """The group key of this rank's peers (:data:`REPLICA_NAMES`), or None."""
        for name in REPLICA_NAMES:
            for t in self.by_key.values():
                if name in t.names and len(t.ranks) > 1:
                    return t.key
        return None

    # ------------------------------------------------------------------ steps (the straggler report's input)
    def set_step(self, step: int) -> None:
        """The training step changes to ``step``: the step just ended goes to :attr:`step_log` with its duration and
        this rank's summed wait in synchronous collectives on each group."""
        if step == self.step and self._step_t0 is not None:
            return
        now = time.monotonic()
        tracks = list(self.by_key.values())
        if self._step_t0 is not None:
            self.step_log.append((self.step, now - self._step_t0, {t.key: t.wait_s for t in tracks if t.waits}))
        for t in tracks:
            t.wait_s, t.waits = 0.0, 0
        self.step, self._step_t0 = step, now

    def published_waits(self, last: int = PUBLISHED_STEPS) -> Optional[dict[str, Any]]:
        """The newest ``last`` completed steps as published: ``{"steps": [...], "dt": [µs], "w": {group key: [µs]}}``
        (a group absent from a step waited 0 µs there); the whole log when ``last`` is 0; None before any step."""
        n = len(self.step_log)
        # the newest ``last`` without copying the whole log (indexing near a deque's end is cheap)
        log = [self.step_log[i] for i in range(max(0, n - last), n)] if last else list(self.step_log)
        if not log:
            return None
        keys = sorted({k for _, _, w in log for k in w})
        return {"steps": [s for s, _, _ in log], "dt": [round(dt * 1e6) for _, dt, _ in log],
                "w": {k: [round(w.get(k, 0.0) * 1e6) for _, _, w in log] for k in keys}}

    def poll(self, on_failed: Any = None) -> None:
        """Close the asynchronous calls whose Works completed (the background thread calls this); a Work that
        completed with an error (gloo's timeout, a lost peer) is handed to ``on_failed(call)`` first."""
        for call in list(self.open.values()):
            w = call.work
            if w is None:
                continue
            works = w if isinstance(w, list) else [w]
            try:
                done = all(x.is_completed() for x in works)
            except RuntimeError:
                done = True
            if not done:
                continue
            failed = False
            for x in works:
                try:
                    failed = failed or x.exception() is not None  # (is_success() is deprecated and warns)
                except Exception:  # noqa: BLE001 - a Work that cannot say: count it as failed
                    failed = True
            if failed and on_failed is not None:
                on_failed(call)
            for x in works:
                for k in getattr(x, "keys", None) or (id(x),):
                    self.held.pop(k, None)
            call.work = None
            self.end(call)

    def oldest_open(self) -> Optional[Call]:
        calls = list(self.open.values())
        return min(calls, key=lambda c: c.t0) if calls else None

    # ------------------------------------------------------------------ snapshot
    def record(self, beat: int, waits: int = PUBLISHED_STEPS) -> dict[str, Any]:
        """What peers (and ``megashard doctor``) need to know about this rank: counters per group, open and last
        calls, step, liveness (host, pid, heartbeat count), its run, the groups' ranks and the waits of the newest
        ``waits`` completed steps (0: all it kept)."""
        now = time.monotonic()
        groups = {}
        for key, t in self.by_key.items():
            g: dict[str, Any] = {"seq": t.seq}
            if t.sent:
                g["sent"] = {str(p): n for p, n in t.sent.items()}
            if t.recvd:
                g["recvd"] = {str(p): n for p, n in t.recvd.items()}
            groups[key] = g
        open_calls = sorted(self.open.values(), key=lambda c: c.t0)
        if len(open_calls) > 4:  # the oldest (what a peer may wait for) and the newest (where this rank is blocked)
            open_calls = open_calls[:3] + open_calls[-1:]
        return {
            **self.identity,
            "rank": self.rank, "world_size": self.world_size, "host": self.host, "pid": self.pid, "beat": beat,
            "time": time.time(), "step": self.step, "entries": self.entries, "moves": self.moves,
            "inside": dict(self.inside.summary(now), ranks=list(self.inside.track.ranks)) if self.inside else None,
            "groups": groups,
            "open": [dict(c.summary(now), ranks=list(c.track.ranks)) for c in open_calls],
            "last": self.last.summary() if self.last is not None else None,
            "idle_s": round(now - self.last_end, 3) if self.inside is None else 0.0,
            "group_ranks": {key: compact_ranks(t.ranks) for key, t in self.by_key.items()},
            "peers": self.peers_key(),
            "waits": self.published_waits(waits),
        }

    def entry_line(self, call: Call) -> str:
        """What is published on entry to ``call`` (``at/<rank>``): ``entries:moves:step|group|op|seq|sig|p2p`` — a
        rank that dies inside the call within a publication interval is still seen to have reached it. (The entry
        slot puts its state byte before it: :mod:`megashard.doctor.board`.)"""
        p2p = ",".join(f"{d}:{p}:{k}" for d, p, k in call.p2p) if call.p2p else ""
        return f"{call.entry}:{self.moves}:{call.step}|{call.track.key}|{call.op}|{call.seq}|{call.sig}|{p2p}"


def compact_ranks(ranks: Sequence[int]) -> Any:
    """``[first, stride, count]`` for ranks in arithmetic progression (every group megashard makes), else the
    list itself: a record names the ranks of a world group of 10⁴ ranks in a few bytes."""
    r = list(ranks)
    if len(r) > 2:
        stride = r[1] - r[0]
        if stride > 0 and all(b - a == stride for a, b in zip(r, r[1:])):
            return {"first": r[0], "stride": stride, "count": len(r)}
    return r


def expand_ranks(spec: Any) -> list[int]:
    """The ranks :func:`compact_ranks` wrote ([] for anything else)."""
    if isinstance(spec, dict):
        try:
            first, stride, count = int(spec["first"]), int(spec["stride"]), int(spec["count"])
        except (KeyError, TypeError, ValueError):
            return []
        return list(range(first, first + stride * count, stride)) if count > 0 and stride > 0 else []
    if isinstance(spec, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in spec):
        return list(spec)
    return []


def parse_entry(text: Any) -> Optional[dict[str, Any]]:
    """The call published on entry (:meth:`Ledger.entry_line`) as ``{"entries": n, "call": summary}``; None when
    ``text`` is not one (damaged, or another program's key)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str):
        return None
    state = "E"  # a line without its state byte (written by an older doctor): entered
    if text[:1] in ("E", "R", "A"):
        state, text = text[0], text[1:]
    head, _, rest = text.partition("|")
    entries, _, moves = head.partition(":")
    moves, _, step = moves.partition(":")
    fields = rest.rsplit("|", 4)  # a group key may hold "|" (a user's name): split the rest from the right
    if len(fields) != 5 or not entries.isdigit() or not fields[2].isdigit() or (moves and not moves.isdigit()) \
            or (step and not step.lstrip("-").isdigit()):
        return None
    group, op, seq, sig, p2p = fields
    call: dict[str, Any] = {"group": group, "name": group.rsplit(":", 1)[0] if ":" in group else group, "op": op,
                            "seq": int(seq)}
    if sig:
        call["sig"] = sig
    if step:
        call["step"] = int(step)
    if p2p:
        try:
            call["p2p"] = [[d, int(p), int(k)] for d, p, k in (x.split(":") for x in p2p.split(","))]
        except ValueError:
            return None
    # the main thread's moves: one more once it returned (the record it publishes counts that move too)
    return {"entries": int(entries), "moves": int(moves) + (state != "E") if moves else None, "state": state,
            "call": call}


def with_entry(rec: Optional[dict[str, Any]], entry: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A rank's published record updated with its entry slot (:func:`parse_entry`) when the slot is newer (the main
    thread moved into or out of a call after the record: a higher ``moves``; for records of an older doctor, a higher
    ``entries``): its counters then include the call, and

    - state ``E``: the main thread is inside the call (started it, or waits on it): the call is its newest open one,
      and ``inside`` (also ``entered``: whether it finished is unknown);
    - ``R``: it returned and finished: ``last``, and ``inside`` is None (the rank is in its own code since);
    - ``A``: it returned with the call in flight (``async_op``): still open, ``inside`` None."""
    if rec is None or entry is None:
        return rec
    if entry.get("moves") is not None and isinstance(rec.get("moves"), int):
        if entry["moves"] <= rec["moves"]:
            return rec
    elif entry["entries"] <= int(rec.get("entries") or 0):
        return rec
    state = entry.get("state", "E")
    call = dict(entry["call"])
    rec = dict(rec, groups={k: dict(v) for k, v in (rec.get("groups") or {}).items()},
               entries=max(entry["entries"], int(rec.get("entries") or 0)))
    if entry.get("moves") is not None:
        rec["moves"] = entry["moves"]
    if isinstance(call.get("step"), int) and call["step"] > int(rec.get("step") or 0):
        rec["step"] = call["step"]
    g = rec["groups"].setdefault(call["group"], {"seq": 0})
    if call.get("p2p"):
        for direction, peer, k in call["p2p"]:
            field_ = "sent" if direction == "send" else "recvd"
            counts = dict(g.get(field_) or {})
            counts[str(peer)] = max(int(counts.get(str(peer), 0)), k)
            g[field_] = counts
    else:
        g["seq"] = max(int(g.get("seq", 0)), call["seq"])
    opened = [c for c in rec.get("open") or [] if (c.get("group"), c.get("seq"), c.get("op"), c.get("p2p")) !=
              (call["group"], call["seq"], call["op"], call.get("p2p"))]
    if state == "E":
        call["entered"] = True
        rec["open"] = opened + [call]  # the newest call last: open[0] stays the oldest
        rec["entered"] = rec["inside"] = call
    else:
        rec.pop("entered", None)
        rec["inside"] = None
        rec["returned"] = call
        rec["open"] = opened + [call] if state == "A" else opened
        if state == "R":
            rec["last"] = call
    return rec
