"""From a hung call and the peers' records to a finding: which ranks never reached it, and what they do instead.

Pure functions over the records of :meth:`megashard.doctor.ledger.Ledger.record` (as published in the store, merged
with the call each rank published on entry, or written to ``<out_dir>/doctor/rank_<r>.json``): the live doctor
(:mod:`megashard.doctor.watch`) and ``megashard doctor RUN_DIR`` (:mod:`megashard.cli.doctor`) print the same words.

A member *reached* collective ``#n`` of a group when its count of collectives started there is ≥ n; a peer
reached the k-th receive from this rank when it started ≥ k sends to it (and the other way round). A member that
reached it but sends no heartbeat is named too: it died (or hangs in code that holds the GIL) inside the call. The
members that reached the call are compared: different operations, dtypes or shapes are named rank by rank. A chain
of ranks each waiting for the next that comes back to one of them is a deadlock (:mod:`megashard.doctor.waitfor`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from megashard.doctor.ledger import describe_call, signature

__all__ = ["ENDED", "NO_HEARTBEAT", "call_of", "deadlock_text", "diagnose", "doing_text", "finding_line",
           "inside_call", "mismatch_text", "ranks_text", "reached"]

NO_HEARTBEAT = "no heartbeat: dead or stuck in user code"
ENDED = ("exited", "failed", "terminated")  # record states of a rank whose doctor ended (as watch.ENDED)


def ranks_text(ranks: Iterable[int]) -> str:
    r = list(ranks)
    shown = ", ".join(map(str, r[:16])) + (f", … ({len(r)} ranks)" if len(r) > 16 else "")
    return f"[{shown}]"


def call_of(rec: Optional[Mapping[str, Any]], call: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The rank's own summary of collective ``call`` (same group and number) among its open calls, or None."""
    for c in (rec or {}).get("open") or []:
        if isinstance(c, Mapping) and c.get("group") == call["group"] and c.get("seq") == call["seq"] \
                and not c.get("p2p"):
            return c
    return None


def _where(c: Mapping[str, Any]) -> str:
    return describe_call(c) + (f" ({c['sig']})" if c.get("sig") else "")


def inside_call(rec: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The call the rank's main thread was in at its newest record or entry slot (None: in its own code). Records
    of an older doctor, which do not say, are read as before: the newest call it started and did not finish."""
    if "inside" in rec:
        return rec["inside"] if isinstance(rec["inside"], Mapping) else None
    opened = rec.get("open") or []
    return rec.get("entered") or (opened[-1] if opened else None)


def _since(rec: Mapping[str, Any]) -> str:
    """``since all_reduce #3 on world returned (step 3)``: where a rank in its own code came from."""
    last = rec.get("returned") or rec.get("last")
    step = (last or {}).get("step", rec.get("step"))
    step = f" (step {step})" if step is not None else ""
    return f"since {describe_call(last)} returned{step}" if last else f"before its first collective{step}"


def doing_text(rec: Optional[Mapping[str, Any]], alive: Optional[bool], gone: bool = False) -> str:
    """What a rank does instead (or where it stopped), from its record."""
    if rec is None:
        return f"{NO_HEARTBEAT} (no record: it never published one)"
    last = rec.get("last")
    where = f"last: {describe_call(last)}, step {rec.get('step', '?')}"
    opened = rec.get("open") or []
    inside = inside_call(rec)
    knows = "inside" in rec  # a record that says whether the main thread was in a call (else: an older doctor's)
    state = rec.get("state")
    if gone and rec.get("reason") == "died":  # known only from its entry slot: its doctor never ended
        state = None
    if state in ("exited", "failed"):
        verb = "ended" if state == "exited" else "failed"
        if inside:
            return f"its process {verb} inside {describe_call(inside)}"
        return f"its process {verb} in its own code {_since(rec)}" if knows and last else f"its process {verb} ({where})"
    if state == "terminated":  # a signal (SIGTERM: the launcher stops the workers once one died)
        return (f"stopped by a signal (SIGTERM) inside {_where(inside)}" if inside
                else f"stopped by a signal (SIGTERM) in its own code {_since(rec)}")
    if alive is False:
        if rec.get("proc") == "stopped":  # SIGSTOP, SIGTSTP or a debugger, seen on this host
            return (f"its process is stopped (SIGSTOP) inside {_where(inside)}" if inside
                    else f"its process is stopped (SIGSTOP) in its own code {_since(rec)}")
        if inside:  # it is in a call it never finished, then stopped: it died (or hangs) inside it
            return (f"its process died inside {_where(inside)} (crashed, aborted or killed)" if gone
                    else f"no heartbeat since it entered {_where(inside)}: died or stuck inside it")
        if knows and last:
            return (f"its process ended without its final record (os._exit, a crash or a kill) in its own code "
                    f"{_since(rec)}" if gone else
                    f"no heartbeat, in its own code {_since(rec)}: stuck (a held GIL?) or dead")
        if gone:
            return f"its process died ({where})" if last else "its process died before its first collective"
        # a record without a collective is the one published at start: nothing newer came
        return f"{NO_HEARTBEAT} ({where})" if last else f"{NO_HEARTBEAT}; no record since it started"
    if knows and inside:
        age = f" for {inside['age_s']:.1f} s" if isinstance(inside.get("age_s"), (int, float)) else ""
        return f"waiting in {describe_call(inside)}{age} (step {rec.get('step', '?')})"
    if knows and not inside:
        flight = f", {describe_call(opened[0])} in flight" if opened else ""
        return f"{where}; in user code for {rec.get('idle_s', 0):.1f} s{flight}"
    if opened:
        c = opened[0]
        age = f" for {c['age_s']:.1f} s" if isinstance(c.get("age_s"), (int, float)) else ""
        return f"waiting in {describe_call(c)}{age} (step {rec.get('step', '?')})"
    return f"{where}; in user code for {rec.get('idle_s', 0):.1f} s"


def reached(call: Mapping[str, Any], me: int, peer: int, rec: Mapping[str, Any]) -> bool:
    """Whether ``peer`` (its record ``rec``) started ``call`` of rank ``me``: its count on the group is at least the
    call's number (point-to-point: it started as many matching operations with ``me``)."""
    g = (rec.get("groups") or {}).get(call["group"]) or {}
    if not call.get("p2p"):
        return int(g.get("seq", 0)) >= int(call["seq"])
    ok = True
    for direction, p, k in call["p2p"]:
        if p != peer:
            continue
        counter = g.get("sent" if direction == "recv" else "recvd") or {}
        ok = ok and int(counter.get(str(me), 0)) >= int(k)
    return ok


def diagnose(call: Mapping[str, Any], members: Iterable[int], me: int, records: Mapping[int, Optional[Mapping]],
             alive: Mapping[int, Optional[bool]], waited_s: float, gone: Iterable[int] = (),
             deadlock: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """The finding of rank ``me`` about ``call`` (a call summary) on a group of global ``members``: for a collective
    every other member is checked, for point-to-point its peers. ``records``: rank -> published record (None: none
    found); ``alive``: rank -> heartbeat seen (None: unknown); ``gone``: ranks whose process is known to be gone;
    ``deadlock``: the wait-for cycle through this call, if one was found. Returns a JSON-able dict with ``line``."""
    members = list(members)
    gone = set(gone)
    peers = sorted({p for _, p, _ in call["p2p"]}) if call.get("p2p") else [r for r in members if r != me]
    culprits = []
    for r in peers:
        rec = records.get(r)
        live = alive.get(r)
        got_there = rec is not None and reached(call, me, r, rec)
        if got_there and (live is not False or rec.get("state") in ENDED) and not (
                rec.get("state") in ENDED and call_of(rec, call) is not None):
            continue  # it is in the call too (or gave up on it, as this rank does)
        culprits.append({"rank": r, "reached": got_there, "alive": live if rec is not None else False,
                         "doing": doing_text(rec, live, r in gone), "step": rec.get("step") if rec else None})
    mismatch: dict[int, str] = {}
    if not call.get("p2p"):
        sigs = {me: signature(call)}
        for r in peers:
            theirs = call_of(records.get(r), call)
            if theirs is not None:
                sigs[r] = signature(theirs)
        if len(set(sigs.values())) > 1:
            mismatch = dict(sorted(sigs.items()))
    finding = {"rank": me, "group": call["group"], "name": call.get("name", call["group"]), "ranks": members,
               "op": call["op"], "seq": call["seq"], "step": call.get("step"), "p2p": call.get("p2p") or [],
               "sig": call.get("sig", ""), "waited_s": round(waited_s, 1), "culprits": culprits,
               "mismatch": {str(r): s for r, s in mismatch.items()}, "deadlock": deadlock or []}
    finding["line"] = finding_line(finding)
    return finding


def mismatch_text(mismatch: Mapping[str, str]) -> str:
    """``rank 0: all_reduce float32[4]; ranks 1, 3: all_gather float32[8]`` (ranks that called alike together)."""
    by_sig: dict[str, list[int]] = {}
    for r, s in sorted(mismatch.items(), key=lambda kv: int(kv[0])):
        by_sig.setdefault(s, []).append(int(r))
    parts = []
    for s, ranks in by_sig.items():
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}: {s}")
    return "; ".join(parts)


def deadlock_text(cycle: list[Mapping[str, Any]]) -> str:
    """``rank 0 waits in all_reduce #1 on tp for rank 1, which waits in barrier #1 on dp for rank 0``."""
    parts = []
    for i, hop in enumerate(cycle):
        head = f"rank {hop['rank']}" if i == 0 else "which"
        parts.append(f"{head} waits in {describe_call(hop['call'])} for rank {hop['for']}")
    return ", ".join(parts)


def finding_line(f: Mapping[str, Any]) -> str:
    """The one line a waiting rank prints."""
    what = describe_call({"group": f["group"], "name": f"{f['name']} {ranks_text(f['ranks'])}", "op": f["op"],
                          "seq": f["seq"], "p2p": f.get("p2p")})
    head = f"megashard doctor: rank {f['rank']} waits in {what} (step {f.get('step')}) for {f['waited_s']:.1f} s"
    parts = []
    if f.get("deadlock"):
        parts.append(f"deadlock: {deadlock_text(f['deadlock'])}")
    for c in f["culprits"]:
        if c["reached"]:
            doing = c["doing"]
            if doing.startswith(NO_HEARTBEAT):
                parts.append(f"rank {c['rank']} reached it but sends {doing}")
            else:
                parts.append(f"rank {c['rank']} reached it; {doing}")
        else:
            parts.append(f"rank {c['rank']} never reached it ({c['doing']})")
    if f.get("mismatch"):
        parts.append(f"mismatched calls: {mismatch_text(f['mismatch'])}")
    elif not parts:
        who = "the peer" if f.get("p2p") else "every rank of the group"
        same = "" if f.get("p2p") else f" with the same call ({signature(f)})"
        parts.append(f"{who} reached it{same} and is alive: mismatched arguments the doctor does not compare "
                     "(reduce ops, split sizes, peers) or a transport problem")
    return f"{head}: {'; '.join(parts)}"
