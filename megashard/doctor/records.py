"""The files the ranks left (``<run dir>/doctor/rank_<r>.json``), checked, sorted by run, and merged into one table.

    attempts = read_attempts("runs/default")      # one Attempt per world (torchrun attempt, elastic round) of the job
    for a in attempts.kept: print(format_table(summarize(a.records)))

Every record carries the identity of its world (``run``: agreed by the ranks of one torchrun attempt or elastic
rendezvous round through the store; ``world``: its number in the job, which names the directory; ``job``: shared by
every launcher and restart of one launch; ``launch``; ``attempt``: the rank's torchrun restart count; ``started``:
when that rank's doctor started). A directory may also hold an earlier job's files (an 8-rank run's ``rank_4.json``
… ``rank_7.json`` after a 4-rank run wrote ``rank_0`` … ``rank_3``): only the newest job's records are read, one
table per world, the others are counted. Every file is checked field by field before it is used; a damaged one is
named (file, key, expected type) and skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megashard.doctor.diagnose import diagnose, ranks_text
from megashard.doctor.ledger import describe_call
from megashard.errors import ConfigError
from megashard.readers import SMALL, read_json

__all__ = ["Attempt", "RunRecords", "attempt_dirs", "check_record", "read_attempts", "read_run_dir", "summarize",
           "format_table"]

_NUM = (int, float)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, _NUM) and not isinstance(v, bool)


def _check_call(c: Any, where: str) -> Optional[str]:
    if not isinstance(c, dict):
        return f"{where} must be an object (a call: group, op, seq), found {type(c).__name__}"
    for key, ok, kind in (("group", lambda v: isinstance(v, str), "a string"),
                          ("op", lambda v: isinstance(v, str), "a string"),
                          ("seq", _is_int, "an integer")):
        if key not in c:
            return f"{where}: key '{key}' is missing ({kind})"
        if not ok(c[key]):
            return f"{where}: key '{key}' must be {kind}, found {c[key]!r}"
    if "ranks" in c and not (isinstance(c["ranks"], list) and all(_is_int(r) for r in c["ranks"])):
        return f"{where}: key 'ranks' must be a list of integers"
    if c.get("p2p") and not (isinstance(c["p2p"], list) and all(
            isinstance(p, list) and len(p) == 3 and p[0] in ("send", "recv") and _is_int(p[1]) and _is_int(p[2])
            for p in c["p2p"])):
        return f"{where}: key 'p2p' must be a list of [send|recv, peer, count]"
    for key in ("sig", "name"):
        if key in c and not isinstance(c[key], str):
            return f"{where}: key '{key}' must be a string"
    if "age_s" in c and not _is_num(c["age_s"]):
        return f"{where}: key 'age_s' must be a number"
    return None


def _check_finding(f: Any, where: str) -> Optional[str]:
    bad = _check_call(f, where)
    if bad:
        return bad
    for key, ok, kind in (("rank", _is_int, "an integer"), ("name", lambda v: isinstance(v, str), "a string"),
                          ("ranks", lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
                          ("culprits", lambda v: isinstance(v, list), "a list")):
        if key not in f:
            return f"{where}: key '{key}' is missing ({kind})"
        if not ok(f[key]):
            return f"{where}: key '{key}' must be {kind}, found {f[key]!r}"
    for i, c in enumerate(f["culprits"]):
        if not (isinstance(c, dict) and _is_int(c.get("rank")) and isinstance(c.get("reached"), bool)
                and isinstance(c.get("doing"), str)):
            return f"{where}.culprits[{i}] must be an object with rank (integer), reached (true/false), doing (string)"
    return None


def check_record(rec: Any) -> Optional[str]:
    """What is wrong with a doctor record (``key 'groups' must be an object …``), or None when it can be used."""
    if not isinstance(rec, dict):
        return f"not a doctor record: a JSON object is expected, found {type(rec).__name__}"
    for key, ok, kind in (("rank", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                          ("world_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
                          ("groups", lambda v: isinstance(v, dict), "an object (group -> counters)")):
        if key not in rec:
            return f"key '{key}' is missing ({kind})"
        if not ok(rec[key]):
            return f"key '{key}' must be {kind}, found {rec[key]!r:.60}"
    if rec["rank"] >= rec["world_size"]:
        return f"key 'rank' ({rec['rank']}) must be below 'world_size' ({rec['world_size']})"
    for key, value in rec["groups"].items():
        if not isinstance(value, dict) or not _is_int(value.get("seq", 0)):
            return f"key 'groups.{key}' must be an object with an integer 'seq'"
        for counter in ("sent", "recvd"):
            c = value.get(counter, {})
            if not isinstance(c, dict) or not all(_is_int(n) for n in c.values()):
                return f"key 'groups.{key}.{counter}' must be an object (peer -> integer)"
    for key, ok, kind in (("run", lambda v: isinstance(v, str), "a string"),
                          ("launch", lambda v: v is None or isinstance(v, str), "a string or null"),
                          ("job", lambda v: v is None or isinstance(v, str), "a string or null"),
                          ("world", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                          ("attempt", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                          ("started", _is_num, "a number (seconds since the epoch)"),
                          ("time", _is_num, "a number (seconds since the epoch)"),
                          ("state", lambda v: isinstance(v, str), "a string"),
                          ("reason", lambda v: isinstance(v, str), "a string"),
                          ("step", _is_int, "an integer"), ("beat", _is_int, "an integer"),
                          ("moves", _is_int, "an integer"),
                          ("pid", _is_int, "an integer"), ("host", lambda v: isinstance(v, str), "a string"),
                          ("idle_s", _is_num, "a number"), ("open", lambda v: isinstance(v, list), "a list"),
                          ("findings", lambda v: isinstance(v, list), "a list"),
                          ("last", lambda v: v is None or isinstance(v, dict), "an object or null"),
                          ("waits", lambda v: v is None or isinstance(v, dict), "an object or null")):
        if key in rec and not ok(rec[key]):
            return f"key '{key}' must be {kind}, found {rec[key]!r:.60}"
    for i, c in enumerate(rec.get("open") or []):
        bad = _check_call(c, f"open[{i}]")
        if bad:
            return bad
    for key in ("last", "inside"):
        if rec.get(key):
            bad = _check_call(rec[key], key)
            if bad:
                return bad
    if "inside" in rec and rec["inside"] is not None and not isinstance(rec["inside"], dict):
        return f"key 'inside' must be an object (a call) or null, found {rec['inside']!r:.60}"
    dead = rec.get("dead_peers")
    if dead is not None and not (isinstance(dead, dict) and all(
            str(k).isdigit() and isinstance(v, dict) and _is_int(v.get("pid")) and
            (v.get("entry") is None or isinstance(v.get("entry"), str)) for k, v in dead.items())):
        return "key 'dead_peers' must be an object (rank -> {pid: integer, entry: string or null})"
    for i, f in enumerate(rec.get("findings") or []):
        bad = _check_finding(f, f"findings[{i}]")
        if bad:
            return bad
    w = rec.get("waits")
    if w:
        n = len(w["steps"]) if isinstance(w.get("steps"), list) and all(map(_is_int, w["steps"])) else -1
        lists = [w.get("dt"), *(w["w"].values() if isinstance(w.get("w"), dict) else [None])]
        if n < 0 or any(not isinstance(v, list) or len(v) != n or not all(map(_is_num, v)) for v in lists):
            return "key 'waits' must hold 'steps' (integers), 'dt' and per group 'w' (numbers), lists of one length"
    if "group_ranks" in rec and not isinstance(rec["group_ranks"], dict):
        return f"key 'group_ranks' must be an object (group -> ranks), found {rec['group_ranks']!r:.60}"
    if rec.get("peers") is not None and not isinstance(rec["peers"], str):
        return f"key 'peers' must be a string (a group key) or null, found {rec['peers']!r:.60}"
    return None


def _check_path(function: str, path: object) -> str:
    """``path`` as a str, or ConfigError naming ``function`` (a number or None is not a directory)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{function}: path={path!r:.60} (type {type(path).__name__}) must be a directory path (str)")
    return os.fspath(path)


def attempt_dirs(path: str) -> list[tuple[str, str]]:
    """``(label, directory)`` of every world that may have left records under run directory ``path``: ``doctor/``
    (the first world of a job) and ``doctor/restart_<k>/`` (world k: after a torchrun restart, or an elastic job's
    new world), in order."""
    path = _check_path("attempt_dirs", path)
    d = os.path.join(path, "doctor")
    if not os.path.isdir(d):
        return [("records", path)] if os.path.isdir(path) else []
    out = [("first attempt", d)]
    restarts = [n for n in os.listdir(d) if n.startswith("restart_") and n[8:].isdigit()]
    out += [(f"restart {n[8:]}", os.path.join(d, n)) for n in sorted(restarts, key=lambda n: int(n[8:]))]
    return out


def read_run_dir(path: str) -> tuple[dict[int, dict], list[tuple[str, str]]]:
    """Every usable record in ``path`` (``path/doctor/`` if there is one): rank -> record, of any run; and
    ``(file, problem)`` of every file that is damaged or not a doctor record."""
    path = _check_path("read_run_dir", path)
    d = os.path.join(path, "doctor")
    if not os.path.isdir(d):
        d = path
    records: dict[int, list[dict]] = {}
    bad: list[tuple[str, str]] = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        path_ = os.path.join(d, name)
        try:  # a FIFO, device or huge file in its place is named, never opened for reading (it would block)
            rec = read_json(path_, "record", limit=SMALL)
        except ConfigError as e:
            bad.append((path_, str(e).split(f"{path_}: ", 1)[-1]))
            continue
        problem = check_record(rec)
        if problem is None and name[5:-5].isdigit() and int(name[5:-5]) != rec["rank"]:
            problem = f"key 'rank' is {rec['rank']} in the file of rank {name[5:-5]}"
        if problem:
            bad.append((path_, problem))
            continue
        records.setdefault(rec["rank"], []).append(rec)
    return {r: max(v, key=_started) for r, v in records.items()}, bad


def _started(rec: Mapping[str, Any]) -> float:
    return float(rec.get("started", rec.get("time", 0.0)))


@dataclass
class Attempt:
    """The records of one world (one run id: every rank of one torchrun attempt or elastic rendezvous round)."""

    label: str
    directory: str
    records: dict[int, dict]
    started: float


@dataclass
class RunRecords:
    """What ``megashard doctor`` read: the worlds of the current job, oldest first (the last one is the newest), and
    what it left aside."""

    kept: list[Attempt] = field(default_factory=list)
    other_runs: dict[str, list[int]] = field(default_factory=dict)
    """run id -> ranks of its records that were ignored (another job's or launch's, earlier)."""
    damaged: list[tuple[str, str]] = field(default_factory=list)
    """(file, problem) of every file skipped."""


def _job_of(rec: Mapping[str, Any]) -> Optional[str]:
    """What the worlds of one job share: ``job`` (every launcher and restart of one launch), else ``launch``."""
    return rec.get("job") or rec.get("launch")


def read_attempts(run_dir: str) -> RunRecords:
    """The records of the newest job in ``run_dir``, one :class:`Attempt` per world (run id) of it, with the rest
    counted.

    Records are grouped by their run id, whatever directory holds them (records written before the ranks of one world
    agreed on a directory, e.g. by each node's own restart count, are grouped right too); the job is the newest
    record's, and every world of it is kept, each diagnosed alone: an earlier world's hang is never merged into the
    current world's table. Without a job id (a script started without a launcher) only the newest world is kept."""
    run_dir = _check_path("read_attempts", run_dir)
    out = RunRecords()
    runs: dict[str, dict[int, dict]] = {}
    where: dict[str, tuple[str, str]] = {}
    for label, d in attempt_dirs(run_dir):
        records, bad = read_run_dir(d)
        out.damaged += bad
        for rank, rec in records.items():
            run = str(rec.get("run"))
            if rank not in runs.setdefault(run, {}) or _started(rec) > _started(runs[run][rank]):
                runs[run][rank] = rec
            where.setdefault(run, (label, d))
    if not runs:
        return out
    first = {run: min(map(_started, recs.values())) for run, recs in runs.items()}
    newest = max(runs, key=lambda run: max(map(_started, runs[run].values())))
    job = next((_job_of(r) for r in runs[newest].values() if _job_of(r)), None)
    for run in sorted(runs, key=lambda k: first[k]):
        recs = runs[run]
        mine = run == newest or (job is not None and any(_job_of(r) == job for r in recs.values()))
        if mine:
            label, d = where[run]
            out.kept.append(Attempt(label, d, dict(sorted(recs.items())), first[run]))
        else:
            out.other_runs.setdefault(run, []).extend(sorted(recs))
    return out


# ---------------------------------------------------------------------------------------------- the table
def summarize(records: Mapping[int, Mapping], followed: bool = False) -> dict[str, Any]:
    """The hangs the ranks found, merged across ranks: one row per (group, operation), with every rank that waited
    and every rank named as not reaching it (first description wins), plus ranks that left no record (a record
    written at start and never again counts as none: the process was killed), and the ranks that died with no rank
    waiting for them (``deaths``: killed inside a call while the launcher stopped the others; from their entry slots
    on this host, or what a survivor wrote of them).

    ``followed``: a later world of the same job exists (an elastic membership change, a restart). A world that ended
    so — or whose ranks ended it on purpose (reason ``world_change``) — ended in a planned way: its rows whose every
    named rank was lost (died, no heartbeat, ended) and its deaths are not hangs but the change (``world_end``);
    a row that names a live rank (waiting elsewhere, in its own code, mismatched) stays a hang."""
    if not isinstance(records, Mapping):
        raise ConfigError(f"summarize: records={records!r:.60} must be a mapping rank -> record (what read_run_dir "
                          "returns first)")
    from megashard.doctor.endings import deaths, lost_ranks, planned_end
    from megashard.doctor.waitfor import find_cycle

    live = {r: rec for r, rec in records.items() if rec.get("reason") != "start"}
    written = set(live)
    live.update(lost_ranks(records, live))
    rows: dict[tuple, dict[str, Any]] = {}
    for rank in sorted(live):
        for f in live[rank].get("findings") or _after_the_fact(rank, live):
            key: tuple = (f["group"], f["seq"])  # members in different operations at one number: one row
            if f.get("p2p"):  # point-to-point: one row per waiting rank (its peers differ)
                key = (f["group"], f["op"], f["rank"])
            row = rows.setdefault(key, {"group": f["group"], "name": f["name"], "ranks": f["ranks"], "op": f["op"],
                                        "seq": f["seq"], "p2p": f.get("p2p") or [], "step": f.get("step"),
                                        "waiting": [], "culprits": {}, "mismatch": {}, "deadlock": []})
            row["waiting"].append(f["rank"])
            if f["op"] not in row["op"].split("/"):
                row["op"] = "/".join(sorted(row["op"].split("/") + [f["op"]]))
            for c in f["culprits"]:
                row["culprits"].setdefault(c["rank"], c)
            if isinstance(f.get("mismatch"), dict):
                row["mismatch"].update({str(k): str(v) for k, v in f["mismatch"].items()})
            if not row["deadlock"] and isinstance(f.get("deadlock"), list):
                row["deadlock"] = f["deadlock"]
    for row in rows.values():
        if not row["deadlock"]:
            row["deadlock"] = find_cycle(min(row["waiting"]), live)
    world = max((int(r.get("world_size", 0)) for r in records.values()), default=0)
    named = {c for row in rows.values() for c in row["culprits"]}
    died = deaths(live, exclude=named)
    out = {"rows": list(rows.values()), "deaths": died, "world_end": [], "planned": False, "world_size": world,
           "ranks": sorted(records), "no_record": [r for r in range(world) if r not in written],
           "started_only": sorted(r for r in records if r not in written)}
    if followed or any(rec.get("reason") == "world_change" for rec in records.values()):
        planned_end(out)
    return out


def _after_the_fact(rank: int, records: Mapping[int, Mapping]) -> list[dict[str, Any]]:
    """A rank stopped inside a call before its own report (e.g. stopped by torchrun after a peer died): the finding
    from the files the ranks left — a rank without a file counts as dead, one whose doctor ended as gone. Nothing when
    the launcher stopped this rank (SIGTERM) and every rank it waited for was stopped alike: an orderly stop of the
    whole world (a world change, an interrupted job), not a hang."""
    from megashard.doctor.diagnose import ENDED, inside_call

    rec = records[rank]
    opened = rec.get("open") or []
    call = inside_call(rec) if "inside" in rec else (opened[0] if opened else None)
    if rec.get("reason") == "exit" or not call or not call.get("ranks"):
        return []
    peers = {p for _, p, _ in call["p2p"]} if call.get("p2p") else set(call["ranks"]) - {rank}
    if rec.get("state") == "terminated" and all((records.get(p) or {}).get("state") == "terminated" for p in peers):
        return []
    alive = {r: False if r not in records or records[r].get("state") in ENDED else None for r in peers}
    gone = {r for r in peers if (records.get(r) or {}).get("reason") == "died"}
    f = diagnose(call, call["ranks"], rank, records, alive, float(call.get("age_s", 0.0)), gone)
    if rec.get("state") == "terminated" and not f["culprits"] and not f["mismatch"]:
        return []  # stopped by the launcher inside a call every member was in: cut short, not hung
    return [f]


def format_table(summary: Mapping[str, Any]) -> str:
    """The table ``megashard doctor`` prints: group, operation, step, waiting ranks, and the ranks that never reached
    it with what they did instead; mismatched calls and deadlocks on lines of their own below it."""
    from megashard.doctor.diagnose import deadlock_text, mismatch_text

    if not isinstance(summary, Mapping) or not isinstance(summary.get("rows"), list):
        raise ConfigError(f"format_table: summary={summary!r:.60} must be what summarize() returns")

    from megashard.doctor.endings import world_end_lines

    rows = list(summary["rows"])
    notes = []
    for d in summary.get("deaths") or []:  # killed while no rank waited for it: the launcher stopped the others
        others = "; ".join(f"rank {o}: {w}" for o, w in d["others"].items())
        if d["call"] and d["ranks"]:  # inside a call: a row of its own, the others' whereabouts with it
            c = d["call"]
            rows.append({"group": c["group"], "name": c.get("name", c["group"]), "ranks": d["ranks"], "op": c["op"],
                         "seq": c["seq"], "p2p": c.get("p2p") or [], "step": d["step"], "waiting": [], "first": d["rank"],
                         "culprits": {d["rank"]: {"rank": d["rank"], "reached": True, "doing": d["doing"]},
                                      **{o: {"rank": o, "reached": False, "doing": w}
                                         for o, w in d["others"].items() if o in d["ranks"]}}})
        else:
            notes.append(f"rank {d['rank']}: {d['doing']}" + (f"; then {others}" if others else ""))
    if not rows:
        lines = notes + world_end_lines(summary)
        return "\n".join(["no hang recorded: no rank waited longer than parallel.timeout in a collective", *lines])
    head = ("GROUP", "OPERATION", "STEP", "WAITING RANKS", "NOT REACHED BY (doing instead)")
    table = []
    for row in rows:
        group = f"{row['name']} {ranks_text(row['ranks'])}"
        op = (describe_call({"group": row["group"], "name": "", "op": row["op"], "seq": row["seq"],
                             "p2p": row["p2p"]}).rsplit(" on ", 1)[0])
        culprits = sorted(row["culprits"].values(), key=lambda c: (c["rank"] != row.get("first"), c["rank"]))
        first = True
        for c in culprits or [{"rank": None}]:
            if c["rank"] is None:
                why = ("every rank reached it, with different calls" if row.get("mismatch") else
                       "every rank reached it and is alive (mismatched arguments or transport)")
            else:
                why = f"rank {c['rank']}: {'reached it, ' if c['reached'] else ''}{c['doing']}"
            waiting = ", ".join(map(str, sorted(row["waiting"]))) or "-"  # "-": a rank died, none waited for it
            cells = (group, op, str(row["step"]), waiting) if first else ("",) * 4
            table.append((*cells, why))
            first = False
        if row.get("mismatch"):
            notes.append(f"{group} {op}: mismatched calls: {mismatch_text(row['mismatch'])}")
        if row.get("deadlock"):  # one line per cycle, from its lowest rank (each member found the same cycle)
            cycle = row["deadlock"]
            i = min(range(len(cycle)), key=lambda j: cycle[j]["rank"])
            text = f"deadlock: {deadlock_text(cycle[i:] + cycle[:i])}"
            if text not in notes:
                notes.append(text)
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in [head, *table]]
    return "\n".join([line.rstrip() for line in lines] + notes + world_end_lines(summary))
