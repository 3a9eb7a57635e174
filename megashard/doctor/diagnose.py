"""From a hung call and the peers' records to a finding: which ranks never reached it, and what they do instead.

Pure functions over the records of :meth:`megashard.doctor.ledger.Ledger.record` (as published in the store or
written to ``<out_dir>/doctor/rank_<r>.json``): the live doctor (:mod:`megashard.doctor.watch`) and ``megashard
doctor RUN_DIR`` (:mod:`megashard.cli.doctor`) print the same words.

A member *reached* collective ``#n`` of a group when its count of collectives started there is ≥ n; a peer
reached the k-th receive from this rank when it started ≥ k sends to it (and the other way round). A member that
reached it but sends no heartbeat is named too: it died (or hangs in code that holds the GIL) inside the call.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Optional

from megashard.doctor.ledger import describe_call

__all__ = ["NO_HEARTBEAT", "attempt_dirs", "diagnose", "format_table", "read_run_dir", "summarize"]

NO_HEARTBEAT = "no heartbeat: dead or stuck in user code"


def _ranks_text(ranks: Iterable[int]) -> str:
    r = list(ranks)
    shown = ", ".join(map(str, r[:16])) + (f", … ({len(r)} ranks)" if len(r) > 16 else "")
    return f"[{shown}]"


def _doing(rec: Optional[Mapping[str, Any]], alive: Optional[bool]) -> str:
    """What a rank does instead, from its record."""
    if rec is None:
        return f"{NO_HEARTBEAT} (no record: it never published one)"
    last = rec.get("last")
    where = f"last: {describe_call(last)}, step {rec.get('step', '?')}"
    if rec.get("state") in ("exited", "failed"):
        return f"its process {'ended' if rec['state'] == 'exited' else 'failed'} ({where})"
    if alive is False:  # a record without a collective is the one published at start: nothing newer came
        return f"{NO_HEARTBEAT} ({where})" if last else f"{NO_HEARTBEAT}; no record since it started"
    opened = rec.get("open") or []
    if opened:
        c = opened[0]
        return f"waiting in {describe_call(c)} for {c.get('age_s', 0):.1f} s (step {rec.get('step', '?')})"
    return f"{where}; in user code for {rec.get('idle_s', 0):.1f} s"


def _reached(call: Mapping[str, Any], me: int, peer: int, rec: Mapping[str, Any]) -> bool:
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
             alive: Mapping[int, Optional[bool]], waited_s: float) -> dict[str, Any]:
    """The finding of rank ``me`` about ``call`` (a call summary) on a group of global ``members``: for a collective
    every other member is checked, for point-to-point its peers. ``records``: rank -> published record (None: none
    found); ``alive``: rank -> heartbeat seen (None: unknown). Returns a JSON-able dict with ``line``."""
    members = list(members)
    peers = sorted({p for _, p, _ in call["p2p"]}) if call.get("p2p") else [r for r in members if r != me]
    culprits = []
    for r in peers:
        rec = records.get(r)
        live = alive.get(r)
        reached = rec is not None and _reached(call, me, r, rec)
        if reached and (live is not False or rec.get("state") in ("exited", "failed")):
            continue  # it is in the call too (or gave up on it, as this rank does)
        culprits.append({"rank": r, "reached": reached, "alive": live if rec is not None else False,
                         "doing": _doing(rec, live), "step": rec.get("step") if rec else None})
    finding = {"rank": me, "group": call["group"], "name": call.get("name", call["group"]), "ranks": members,
               "op": call["op"], "seq": call["seq"], "step": call.get("step"), "p2p": call.get("p2p") or [],
               "waited_s": round(waited_s, 1), "culprits": culprits}
    finding["line"] = finding_line(finding)
    return finding


def finding_line(f: Mapping[str, Any]) -> str:
    """The one line a waiting rank prints."""
    what = describe_call({"group": f["group"], "name": f"{f['name']} {_ranks_text(f['ranks'])}", "op": f["op"],
                          "seq": f["seq"], "p2p": f.get("p2p")})
    head = f"megashard doctor: rank {f['rank']} waits in {what} (step {f.get('step')}) for {f['waited_s']:.1f} s"
    parts = []
    for c in f["culprits"]:
        if c["reached"]:
            parts.append(f"rank {c['rank']} reached it but sends {c['doing']}")
        else:
            parts.append(f"rank {c['rank']} never reached it ({c['doing']})")
    if not parts:
        who = "the peer" if f.get("p2p") else "every rank of the group"
        parts.append(f"{who} reached it and is alive: mismatched arguments (shapes, dtypes, ops) or a transport "
                     "problem")
    return f"{head}: {'; '.join(parts)}"


# ---------------------------------------------------------------------------------------------- after the fact
def attempt_dirs(path: str) -> list[tuple[str, str]]:
    """``(label, directory)`` of every attempt that left records under run directory ``path``: ``doctor/`` (the
    first attempt) and ``doctor/restart_<k>/`` (after torchrun restart k), in order."""
    d = os.path.join(path, "doctor")
    if not os.path.isdir(d):
        return [("records", path)] if os.path.isdir(path) else []
    out = [("first attempt", d)]
    restarts = [n for n in os.listdir(d) if n.startswith("restart_") and n[8:].isdigit()]
    out += [(f"restart {n[8:]}", os.path.join(d, n)) for n in sorted(restarts, key=lambda n: int(n[8:]))]
    return out


def read_run_dir(path: str) -> tuple[dict[int, dict], list[str]]:
    """The records ranks left in ``path/doctor/rank_<r>.json`` (or ``path`` itself holding them): rank -> record,
    and the names of files that could not be read."""
    d = os.path.join(path, "doctor")
    if not os.path.isdir(d):
        d = path
    records: dict[int, dict] = {}
    bad: list[str] = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                rec = json.load(f)
            records[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            bad.append(os.path.join(d, name))
    return records, bad


def summarize(records: Mapping[int, Mapping]) -> dict[str, Any]:
    """The hangs the ranks found, merged across ranks: one row per (group, operation), with every rank that waited
    and every rank named as not reaching it (first description wins), plus ranks that left no record."""
    rows: dict[tuple, dict[str, Any]] = {}
    for rank in sorted(records):
        for f in records[rank].get("findings") or _after_the_fact(rank, records):
            key: tuple = (f["group"], f["op"], f["seq"])
            if f.get("p2p"):  # point-to-point: one row per waiting rank (its peers differ)
                key = (f["group"], f["op"], f["rank"])
            row = rows.setdefault(key, {"group": f["group"], "name": f["name"], "ranks": f["ranks"], "op": f["op"],
                                        "seq": f["seq"], "p2p": f.get("p2p") or [], "step": f.get("step"),
                                        "waiting": [], "culprits": {}})
            row["waiting"].append(f["rank"])
            for c in f["culprits"]:
                row["culprits"].setdefault(c["rank"], c)
    world = max((int(r.get("world_size", 0)) for r in records.values()), default=0)
    return {"rows": list(rows.values()), "world_size": world, "ranks": sorted(records),
            "no_record": [r for r in range(world) if r not in records]}


def _after_the_fact(rank: int, records: Mapping[int, Mapping]) -> list[dict[str, Any]]:
    """A rank stopped inside a call before its own report (e.g. stopped by torchrun after a peer died): the finding
    from the files the ranks left — a rank without a file counts as dead, one whose doctor ended as gone."""
    rec = records[rank]
    opened = rec.get("open") or []
    if rec.get("reason") == "exit" or not opened or not opened[0].get("ranks"):
        return []
    call = opened[0]
    peers = {p for _, p, _ in call["p2p"]} if call.get("p2p") else set(call["ranks"]) - {rank}
    alive = {r: False if r not in records or records[r].get("state") in ("exited", "failed") else None for r in peers}
    return [diagnose(call, call["ranks"], rank, records, alive, float(call.get("age_s", 0.0)))]


def format_table(summary: Mapping[str, Any]) -> str:
    """The table ``megashard doctor`` prints: group, operation, step, waiting ranks, and the ranks that never reached
    it with what they did instead."""
    rows = summary["rows"]
    if not rows:
        return "no hang recorded: no rank waited longer than parallel.timeout in a collective"
    head = ("GROUP", "OPERATION", "STEP", "WAITING RANKS", "NOT REACHED BY (doing instead)")
    table = []
    for row in rows:
        group = f"{row['name']} {_ranks_text(row['ranks'])}"
        op = (describe_call({"group": row["group"], "name": "", "op": row["op"], "seq": row["seq"],
                             "p2p": row["p2p"]}).rsplit(" on ", 1)[0])
        culprits = sorted(row["culprits"].values(), key=lambda c: c["rank"])
        first = True
        for c in culprits or [{"rank": None}]:
            if c["rank"] is None:
                why = "every rank reached it and is alive (mismatched arguments or transport)"
            else:
                why = f"rank {c['rank']}: {'reached it, ' if c['reached'] else ''}{c['doing']}"
            cells = (group, op, str(row["step"]), ", ".join(map(str, sorted(row["waiting"])))) if first else ("",) * 4
            table.append((*cells, why))
            first = False
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in [head, *table]]
    return "\n".join(line.rstrip() for line in lines)
