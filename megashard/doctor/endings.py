"""How a world ended, after the fact: the ranks that died without a word (and where), and whether the world's end
was planned — a world change, an orderly stop — rather than a hang (:func:`megashard.doctor.records.summarize`).

A rank killed with SIGKILL writes nothing after its start record, and a launcher stops the others within a second
(torchrun checks its workers every 0.1 s), often before any of them waited long enough to report. What is left:

- the dead rank's **entry slot** (:mod:`megashard.doctor.board`), in shared memory on its host: the call its main
  thread was in, or the call it returned from last;
- what its **survivors** wrote of it: every rank's background thread notes the ranks of its host whose process is
  gone (with their slots' last line, ``dead_peers`` in its file), and a rank stopped by SIGTERM writes its file
  first (:class:`megashard.doctor.process.TermHook`).

A world is **followed** when a later world of the same job left records (an elastic membership change, a torchrun
restart; or survivors re-forming a world in-process, whose ranks end the old world's records with reason
``world_change``). Such a world ended in a planned way: what its ranks found about ranks that were lost (died, no
heartbeat, ended) is the change, not a hang; a finding that names a live rank (waiting elsewhere, in its own code,
a mismatched call) stays a hang.
"""
from __future__ import annotations

import socket
from typing import Any, Mapping

from megashard.doctor.diagnose import doing_text, inside_call

__all__ = ["deaths", "lost_ranks", "planned_end"]


def lost_ranks(records: Mapping[int, Mapping], live: Mapping[int, Mapping]) -> dict[int, dict]:
    """Ranks that left only their start record but whose last move is known — from their entry slot on this host
    (no survivor removed it: torchrun stopped them all at once), else from a survivor's ``dead_peers`` (the same
    process: its pid): their start record with that entry, marked ``reason: died``."""
    from megashard.doctor.board import EntryBoard
    from megashard.doctor.ledger import parse_entry, with_entry

    seen: dict[int, dict] = {}  # rank -> {"pid", "entry"} from the survivors' files
    for rec in live.values():
        for r, v in (rec.get("dead_peers") or {}).items():
            if str(r).isdigit() and isinstance(v, Mapping) and isinstance(v.get("entry"), str):
                seen.setdefault(int(r), dict(v))
    out: dict[int, dict] = {}
    host = socket.gethostname()
    for r, rec in records.items():
        if r in live or not isinstance(rec.get("run"), str):
            continue
        line = None
        if rec.get("host") == host:
            pid, mine = EntryBoard.reader(rec["run"]).read(r)
            line = mine if pid == rec.get("pid") else None
        if line is None and r in seen and seen[r].get("pid") == rec.get("pid"):
            line = seen[r]["entry"]
        entry = parse_entry(line)
        if entry is not None:
            out[r] = dict(with_entry(dict(rec), entry), state="failed", reason="died")
    return out


def deaths(live: Mapping[int, Mapping], exclude: Any = ()) -> list[dict[str, Any]]:
    """The ranks that died (:func:`lost_ranks`) and that no finding names (``exclude``): each with where it was
    (``call``: the call its main thread was inside, else None) and the words for it, and what every other rank of the
    world was doing when it ended (``others``: rank -> words)."""
    out = []
    for r in sorted(live):
        rec = live[r]
        if rec.get("reason") != "died" or r in exclude:
            continue
        inside = inside_call(rec)
        others = {o: doing_text(live[o], None) for o in sorted(live) if o != r and live[o].get("reason") != "died"}
        # its start record's step is old: the world's step then is the survivors' (the entry slot has none)
        step = max([int(v.get("step", 0)) for v in live.values() if isinstance(v.get("step"), int)], default=None)
        out.append({"rank": r, "call": dict(inside) if inside else None, "step": step,
                    "ranks": _group_ranks(rec, inside), "doing": doing_text(rec, False, gone=True), "others": others})
    return out


def _group_ranks(rec: Mapping[str, Any], call: Any) -> list[int]:
    from megashard.doctor.ledger import expand_ranks

    if not isinstance(call, Mapping):
        return []
    return expand_ranks((rec.get("group_ranks") or {}).get(call.get("group")))


def planned_end(summary: dict[str, Any]) -> None:
    """Move the rows of a world that ended in a planned way whose every named rank was lost, and its deaths, to
    ``world_end``; mark the summary ``planned``."""
    summary["planned"] = True
    kept, ended = [], []
    for row in summary["rows"]:
        culprits = list(row["culprits"].values())
        lost = culprits and all(c.get("alive") is False or _lost_words(c.get("doing", "")) for c in culprits)
        if lost and not row.get("mismatch") and not row.get("deadlock"):
            ended.append(row)
        else:
            kept.append(row)
    summary["rows"] = kept
    summary["world_end"] = ended + [{"death": d} for d in summary["deaths"]]
    summary["deaths"] = []


def _lost_words(doing: str) -> bool:
    """A description that says the rank's process is gone or its doctor ended (not alive, whatever ``alive``)."""
    return doing.startswith(("its process ", "no heartbeat", "stopped by a signal"))


def world_end_lines(summary: Mapping[str, Any]) -> list[str]:
    """What ``megashard doctor`` prints for a world that ended in a planned way: each rank it lost, and who waited
    for it where."""
    from megashard.doctor.diagnose import ranks_text
    from megashard.doctor.ledger import describe_call

    lost: dict[int, str] = {}
    waited: dict[int, list[str]] = {}
    for item in summary.get("world_end") or []:
        if "death" in item:
            lost.setdefault(item["death"]["rank"], item["death"]["doing"])
            continue
        where = describe_call({"group": item["group"], "name": f"{item['name']} {ranks_text(item['ranks'])}",
                               "op": item["op"], "seq": item["seq"], "p2p": item.get("p2p")})
        for c in item["culprits"].values():
            lost.setdefault(c["rank"], c["doing"])
            waited.setdefault(c["rank"], []).append(
                f"{'rank' if len(item['waiting']) == 1 else 'ranks'} {', '.join(map(str, sorted(item['waiting'])))} "
                f"in {where}")
    if not lost:
        return []
    lines = [f"the world ended in a world change, not a hang: rank(s) {', '.join(map(str, sorted(lost)))} lost; "
             "the job went on in a new world"]
    for r in sorted(lost):
        by = f"; waited for by {'; '.join(waited[r])}" if waited.get(r) else ""
        lines.append(f"  rank {r}: {lost[r]}{by}")
    return lines
