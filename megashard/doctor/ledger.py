"""The doctor's in-memory bookkeeping of one process: which collectives it started on which group, and which are open.

Nothing here touches the store or the network: :class:`Ledger` is what every intercepted collective updates (a
counter and one small list per call), and :meth:`Ledger.record` is the snapshot the background thread publishes
(:mod:`megashard.doctor.watch`) and writes to ``<out_dir>/doctor/rank_<r>.json``.

A group is known by a key every member computes alike, ``<name>:<first rank>`` (the groups of one name partition the
ranks, so its first rank tells them apart): ``tp:4`` is the tp group of ranks 4, 5. On a group the ledger counts

- collectives: the n-th collective a rank *starts* on a group is ``#n`` there (the same n on every member, since
  members issue a group's collectives in the same order) — a peer whose count is below n never reached ``#n``;
- point-to-point operations per peer: the k-th send to rank p is matched by p's k-th receive from this rank.
"""
from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

__all__ = ["Call", "GroupTrack", "Ledger", "describe_call"]


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

    def summary(self, now: float | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"group": self.track.key, "name": self.track.name, "op": self.op, "seq": self.seq,
                             "step": self.step}
        if self.p2p:
            d["p2p"] = [list(p) for p in self.p2p]
        if now is not None:
            d["age_s"] = round(now - self.t0, 3)
        return d


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
        self.open: dict[int, Call] = {}  # calls started and not known to be finished (the async ones until polled)
        self.held: dict[int, Call] = {}  # id(Work) -> its open call (the Work is held in call.work, so ids stay unique)
        self.last: Optional[Call] = None  # the newest finished call
        self.last_end = time.monotonic()
        self.step = 0
        self._ids = itertools.count(1)

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
        return t

    def forget_groups(self) -> None:
        """Drop every reference to a process group (before the groups are destroyed)."""
        for t in self.by_key.values():
            t.pg = None
        self.tracks.clear()
        self.open.clear()
        self.held.clear()

    # ------------------------------------------------------------------ calls (the fast path)
    def begin(self, track: GroupTrack, op: str, p2p: tuple[tuple[str, int], ...] = ()) -> Call:
        if p2p:
            parts = []
            for direction, peer in p2p:
                counts = track.sent if direction == "send" else track.recvd
                k = counts[peer] = counts.get(peer, 0) + 1
                parts.append((direction, peer, k))
            call = Call(track, op, track.seq, time.monotonic(), self.step, tuple(parts), cid=next(self._ids))
        else:
            track.seq += 1
            call = Call(track, op, track.seq, time.monotonic(), self.step, cid=next(self._ids))
        self.open[call.cid] = call
        return call

    def hold(self, call: Call, work: Any) -> None:
        """An asynchronous call stays open on its Work (or list of Works) until they are waited on or polled."""
        call.work = work
        for w in work if isinstance(work, list) else [work]:
            self.held[id(w)] = call

    def waited(self, work: Any) -> None:
        """``work.wait()`` returned: drop it, and close its call once none of its Works is left."""
        call = self.held.pop(id(work), None)
        if call is None:
            return
        w = call.work
        rest = [x for x in w if x is not work] if isinstance(w, list) else []
        call.work = rest or None  # a new list: the background poll may be reading the old one
        if not rest:
            self.end(call)

    def end(self, call: Call) -> None:
        self.open.pop(call.cid, None)
        if self.last is None or call.t0 >= self.last.t0:
            self.last = call
        self.last_end = time.monotonic()

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
                self.held.pop(id(x), None)
            call.work = None
            self.end(call)

    def oldest_open(self) -> Optional[Call]:
        calls = list(self.open.values())
        return min(calls, key=lambda c: c.t0) if calls else None

    # ------------------------------------------------------------------ snapshot
    def record(self, beat: int) -> dict[str, Any]:
        """What peers (and ``megashard doctor``) need to know about this rank: counters per group, open and last
        calls, step, liveness (host, pid, heartbeat count)."""
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
        return {
            "rank": self.rank, "world_size": self.world_size, "host": self.host, "pid": self.pid, "beat": beat,
            "time": time.time(), "step": self.step, "groups": groups,
            "open": [dict(c.summary(now), ranks=list(c.track.ranks)) for c in open_calls[:4]],
            "last": self.last.summary() if self.last is not None else None,
            "idle_s": round(now - self.last_end, 3) if not open_calls else 0.0,
        }
