"""Who waits for whom: the wait-for graph of the ranks' records, and the cycle in it that is a deadlock.

A rank blocked in a call waits for every member (peer, for point-to-point) of that call that has not reached it; when
such a rank is itself blocked in another call, the chain goes on. A chain that comes back to a rank already on it is
a deadlock: no rank of the cycle can ever go on (rank 0 in an all-reduce on ``tp`` waits for rank 1, which waits in a
barrier on ``dp`` for rank 0). Pure functions over published records
(:meth:`megashard.doctor.ledger.Ledger.record`); the live doctor passes ``fetch`` to read more ranks from the store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from megashard.doctor.diagnose import reached

__all__ = ["blocked_in", "blockers", "find_cycle"]


def blocked_in(rec: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The call a rank is blocked in: its newest open call (the main thread waits there; older open calls are
    asynchronous ones still in flight), or None when it is in none or its process ended."""
    if not rec or rec.get("state") in ("exited", "failed", "terminated"):
        return None
    if "inside" in rec:  # the record says where the main thread is (an asynchronous call in flight blocks nothing)
        return rec["inside"] if isinstance(rec["inside"], Mapping) else None
    opened = [c for c in rec.get("open") or [] if isinstance(c, Mapping)]
    return opened[-1] if opened else None


MAX_DEPTH = 256  # a longer chain is followed no further (records of thousands of ranks: bounded work)


def _reached(call: Mapping[str, Any], me: int, peer: int, rec: Mapping[str, Any]) -> bool:
    try:
        return reached(call, me, peer, rec)
    except (TypeError, ValueError, KeyError):
        return False


def blockers(rank: int, call: Mapping[str, Any], records: Mapping[int, Optional[Mapping[str, Any]]]) -> list[int]:
    """The members of ``call`` (rank ``rank``'s call) whose records say they never reached it (no record: unknown,
    left out). A call without its members' list (published on entry only) names only point-to-point peers."""
    if call.get("p2p"):
        peers = sorted({int(p) for _, p, _ in call["p2p"]})
    else:
        peers = [int(r) for r in call.get("ranks") or [] if int(r) != rank]
    return [p for p in peers if records.get(p) is not None and not _reached(call, rank, p, records[p])]


def find_cycle(start: int, records: Mapping[int, Optional[Mapping[str, Any]]],
               fetch: Optional[Callable[[list[int]], Mapping[int, Optional[Mapping[str, Any]]]]] = None,
               limit: int = 64) -> list[dict[str, Any]]:
    """A wait-for cycle reachable from rank ``start``, as hops ``{"rank", "call", "for"}`` (each rank, the call it is
    blocked in and the rank of the cycle it waits for there), or [] when there is none. ``fetch(ranks)`` reads the
    records of ranks not in ``records`` (at most ``limit`` ranks in all)."""
    known: dict[int, Optional[Mapping[str, Any]]] = dict(records)
    fetched = 0

    def record(r: int) -> Optional[Mapping[str, Any]]:
        nonlocal fetched
        if r not in known and fetch is not None and fetched < limit:
            fetched += 1
            known.update(fetch([r]))
        return known.get(r)

    path: list[int] = []
    calls: dict[int, Mapping[str, Any]] = {}
    done: set[int] = set()

    def visit(r: int) -> list[dict[str, Any]]:
        call = blocked_in(record(r))
        if call is None or len(path) >= MAX_DEPTH:
            done.add(r)
            return []
        if not call.get("ranks") and not call.get("p2p"):
            for c in (known.get(r) or {}).get("open") or []:  # an entered call: its group's ranks from the same group
                if isinstance(c, Mapping) and c.get("group") == call.get("group") and c.get("ranks"):
                    call = dict(call, ranks=c["ranks"])
                    break
        path.append(r)
        calls[r] = call
        for nxt in blockers(r, call, {p: record(p) for p in _members(call, r)}):
            if nxt in path:
                cycle = path[path.index(nxt):]
                return [{"rank": a, "call": dict(calls[a]), "for": cycle[(i + 1) % len(cycle)]}
                        for i, a in enumerate(cycle)]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        done.add(r)
        return []

    return visit(start)


def _members(call: Mapping[str, Any], me: int) -> list[int]:
    if call.get("p2p"):
        return sorted({int(p) for _, p, _ in call["p2p"]})
    return [int(r) for r in call.get("ranks") or [] if int(r) != me]
