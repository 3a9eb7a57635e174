"""The ranks' recorded calls checked against each other: what would hang (or silently go wrong) before it runs.

    result = check_traces(traces)          # rank -> RankTrace, from megashard.rehearse.rehearse_job / the script runner
    print(result.text())                   # "OK: 64 ranks, 37 groups, 1,472 calls checked: ..." or the findings

Three checks, in the order a finding is reported:

1. **every member of a group issues the same collectives in the same order**: the n-th collective of each member on
   a group has the same operation, dtype and shape (only the order and the group where the shape depends on data:
   ``all_to_all`` with split sizes, object collectives); a member whose calls on the group end early, or a rank that
   ended with an error, is named with what it did instead;
2. **every send has its receive**: the k-th send from rank s to rank d against d's k-th receive from s (dtype and
   shape too);
3. **no wait-for cycle**: the ranks' calls replayed together — a synchronous collective waits for every member, a
   receive for its send, a send and an asynchronous call for nobody — until every rank is through; ranks left
   waiting in a cycle (rank 0 in tp's #1 for rank 1, which waits in world's #1 for rank 0) are a deadlock.

Plus what the recorder noted on a call: a collective on a group of another layout than the current one (a
``pg_collection`` of another grid).

Every finding names the ranks, the operation (``all_reduce float32[4096] on dp [0, 2] #12``) and the source line
that issued it, in the hang doctor's words (:mod:`megashard.doctor.diagnose`).
"""
from __future__ import annotations

import re

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megashard.doctor.diagnose import ranks_text
from megashard.rehearse.recorder import CallRecord, GroupInfo, RankTrace

__all__ = ["CheckResult", "Finding", "check_traces"]

#: Python functions that start the same collective (the same kernel on the same communicator).
_SAME_OP = {"all_gather_single": "all_gather_into_tensor", "all_gather_tensor": "all_gather_into_tensor",
            "all_gather_tensor_autograd": "all_gather_into_tensor",
            "all_gather_single_autograd": "all_gather_into_tensor",
            "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
            "reduce_scatter_single_autograd": "reduce_scatter_tensor",
            "all_to_all_single_autograd": "all_to_all_single"}
MAX_FINDINGS = 8


@dataclass
class Finding:
    """One problem: ``kind`` (``mismatch``, ``unmatched``, ``deadlock``, ``wrong_grid``, ``error``) and its line."""

    kind: str
    line: str
    ranks: list[int] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)


@dataclass
class CheckResult:
    """What :func:`check_traces` found, and what it checked."""

    ranks: int
    groups: int
    calls: int
    collectives: int
    p2p: int
    data_dependent: int
    findings: list[Finding] = field(default_factory=list)
    data_dependent_ops: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        def n(count: int, word: str) -> str:
            return f"{count:,} {word}{'' if count == 1 else 's'}"

        what = (f"{n(self.ranks, 'rank')}, {n(self.groups, 'group')}, {n(self.calls, 'call')} "
                f"({n(self.collectives, 'collective')}, {self.p2p:,} point-to-point)")
        if self.data_dependent:
            what += (f"; {self.data_dependent:,} with shapes that depend on data, not checkable "
                     f"({', '.join(self.data_dependent_ops)}): their order and group checked")
        return what

    def text(self) -> str:
        """``OK: ...`` or ``FAILED: ...`` and one line per finding (the first :data:`MAX_FINDINGS`)."""
        if self.ok:
            return (f"OK: {self.summary()}: every group's members issue the same calls in the same order, every "
                    "send has its receive, and no rank waits for another in a cycle")
        lines = [f"FAILED: {len(self.findings)} problem{'s' if len(self.findings) != 1 else ''} in "
                 f"{self.summary()}"]
        lines += [f"  {f.line}" for f in self.findings[:MAX_FINDINGS]]
        if len(self.findings) > MAX_FINDINGS:
            lines.append(f"  ... and {len(self.findings) - MAX_FINDINGS} more")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "ranks": self.ranks, "groups": self.groups, "calls": self.calls,
                "collectives": self.collectives, "p2p": self.p2p, "data_dependent": self.data_dependent,
                "findings": [{"kind": f.kind, "line": f.line, "ranks": f.ranks, "sites": f.sites}
                             for f in self.findings]}


def _gname(info: Optional[GroupInfo], key: str) -> str:
    if info is None:
        return key
    return f"{info.name} {ranks_text(info.ranks)}"


def _what(c: Optional[CallRecord], gname: str, seq: int) -> str:
    if c is None:
        return "nothing"
    sig = f" {c.sig}" if c.sig else ""
    return f"{c.op}{sig} on {gname} #{seq}"


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}"


class _Index:
    """The traces, indexed: each rank's collectives per group (positions in its calls) and p2p per peer."""

    def __init__(self, traces: Mapping[int, RankTrace]):
        self.traces = traces
        self.groups: dict[str, GroupInfo] = {}
        self.coll: dict[str, dict[int, list[int]]] = defaultdict(dict)
        self.sends: dict[tuple[int, int], list[int]] = defaultdict(list)
        self.recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
        for r, t in traces.items():
            self.groups.update(t.groups)
            for i, c in enumerate(t.calls):
                if c.kind == "coll":
                    self.coll[c.group].setdefault(r, []).append(i)
                elif c.peer >= 0:
                    (self.sends if c.kind == "send" else self.recvs)[(r, c.peer) if c.kind == "send"
                                                                     else (c.peer, r)].append(i)

    def call(self, rank: int, i: int) -> CallRecord:
        return self.traces[rank].calls[i]

    def ended(self, rank: int) -> str:
        """How a rank's trace ended, for "doing instead"."""
        t = self.traces[rank]
        if t.status == "error":
            return f"it failed: {t.error}"
        if t.status == "blocked" and t.blocked is not None:
            src, k, _ = t.blocked
            if src >= 0 and not k:
                return f"it waits for rank {src}'s broadcast_object_list"
            return f"it waits for receive #{k} from rank {src}" if src >= 0 else t.blocked[2]
        return "its step ended"


def _key(c: CallRecord) -> tuple:
    op = _SAME_OP.get(c.op, c.op)
    return (op,) if c.data_dependent else (op, c.sig)


def _check_groups(ix: _Index) -> list[tuple[int, Finding]]:
    out = []
    for key, per_rank in ix.coll.items():
        info = ix.groups.get(key)
        members = [r for r in (info.ranks if info else sorted(per_rank)) if r in ix.traces]
        seqs = {r: per_rank.get(r, []) for r in members}
        n_max = max(len(s) for s in seqs.values())
        for n in range(n_max):
            calls = {r: (ix.call(r, s[n]) if n < len(s) else None) for r, s in seqs.items()}
            keys = {r: (_key(c) if c is not None else None) for r, c in calls.items()}
            if len(set(keys.values())) == 1:
                continue
            if all(calls[r] is None or keys[r] == next(k for k in keys.values() if k is not None)
                   for r in members) and all(ix.traces[r].status != "ok" for r in members if calls[r] is None):
                break  # only ranks that failed or wait in a receive are missing: a consequence, named elsewhere
            gname = _gname(info, key)
            by: dict[Any, list[int]] = defaultdict(list)
            for r in members:
                by[keys[r]].append(r)
            parts, sites = [], []
            for k, ranks in sorted(by.items(), key=lambda kv: (kv[0] is None, len(kv[1]))):
                c = calls[ranks[0]]
                if c is None:
                    ends = {ix.ended(r) for r in ranks}
                    why = ends.pop() if len(ends) == 1 else "their calls end"
                    parts.append(f"{_rank_list(ranks)}: nothing (no collective #{n + 1} there: {why})")
                else:
                    parts.append(f"{_rank_list(ranks)}: {_what(c, gname, n + 1)} ({c.site})")
                    sites.append(c.site)
            line = f"mismatched calls on {gname} #{n + 1}: " + "; ".join(parts)
            first = min(seqs[r][n] if n < len(seqs[r]) else len(ix.traces[r].calls) for r in members)
            out.append((first, Finding("mismatch", line, members, sites)))
            break  # the first divergence of each group: later ones follow from it
    return out


_SIG = re.compile(r"^(\w+)\[([\d, ]*)\](?:×(\d+))?$")


def _same_buffer(send: str, recv: str) -> bool:
    """A send and its receive pair up when they move as many elements of one dtype: a point-to-point moves a buffer,
    so a scalar sent into a one-element tensor (torch 2.11's pipeline stages do so) is not a hang."""
    if send == recv:
        return True
    a, b = _SIG.match(send), _SIG.match(recv)
    if a is None or b is None:
        return False

    def numel(m: Any) -> int:
        n = int(m.group(3) or 1)
        for d in m.group(2).split(","):
            n *= int(d) if d.strip() else 1
        return n

    return a.group(1) == b.group(1) and numel(a) == numel(b)


def _check_p2p(ix: _Index) -> list[tuple[int, Finding]]:
    out = []
    for pair in sorted(set(ix.sends) | set(ix.recvs)):
        s, d = pair
        if s not in ix.traces or d not in ix.traces:
            continue
        sends, recvs = ix.sends.get(pair, []), ix.recvs.get(pair, [])
        for k in range(max(len(sends), len(recvs))):
            sc = ix.call(s, sends[k]) if k < len(sends) else None
            rc = ix.call(d, recvs[k]) if k < len(recvs) else None
            if sc is not None and rc is not None:
                if sc.data_dependent or rc.data_dependent or _same_buffer(sc.sig, rc.sig):
                    continue
                gname = _gname(ix.groups.get(sc.group), sc.group)
                line = (f"mismatched point-to-point on {gname}: rank {s} sends #{k + 1} to rank {d}: {sc.op} {sc.sig} "
                        f"({sc.site}); rank {d} receives it as {rc.op} {rc.sig} ({rc.site})")
                out.append((sends[k], Finding("mismatch", line, [s, d], [sc.site, rc.site])))
            elif sc is not None:
                gname = _gname(ix.groups.get(sc.group), sc.group)
                line = (f"unmatched send on {gname}: rank {s} sends #{k + 1} to rank {d} ({sc.op} {sc.sig}, {sc.site}); "
                        f"rank {d} receives only {len(recvs)} from rank {s} ({ix.ended(d)})")
                out.append((sends[k], Finding("unmatched", line, [s, d], [sc.site])))
            else:
                gname = _gname(ix.groups.get(rc.group), rc.group)
                line = (f"unmatched receive on {gname}: rank {d} receives #{k + 1} from rank {s} ({rc.op} {rc.sig}, "
                        f"{rc.site}); rank {s} sends only {len(sends)} to rank {d} ({ix.ended(s)})")
                out.append((recvs[k], Finding("unmatched", line, [d, s], [rc.site])))
            break
    return out


def _check_waits(ix: _Index) -> list[Finding]:
    """Replay every rank's calls together (module docstring, check 3); a deadlock cycle, if the ranks get stuck."""
    ranks = sorted(ix.traces)
    # per rank: (kind, group key or peer, n or k, blocking) for each call
    plan: dict[int, list[tuple]] = {}
    for r in ranks:
        seen: dict[str, int] = defaultdict(int)
        sent: dict[int, int] = defaultdict(int)
        got: dict[int, int] = defaultdict(int)
        steps = []
        for c in ix.traces[r].calls:
            if c.kind == "coll":
                seen[c.group] += 1
                steps.append(("coll", c.group, seen[c.group], not c.async_op))
            elif c.kind == "send" and c.peer >= 0:
                sent[c.peer] += 1
                steps.append(("send", c.peer, sent[c.peer], False))
            elif c.kind == "recv" and c.peer >= 0:
                got[c.peer] += 1
                steps.append(("recv", c.peer, got[c.peer], not c.async_op))
            else:
                steps.append(("none", None, 0, False))
        plan[r] = steps
    pos = {r: 0 for r in ranks}
    reached: dict[tuple[str, int], set[int]] = defaultdict(set)
    posted: dict[tuple[int, int], int] = defaultdict(int)
    coll_wait: dict[tuple[str, int], set[int]] = defaultdict(set)
    recv_wait: dict[tuple[int, int], int] = {}
    members = {key: [m for m in (info.ranks if info else ()) if m in ix.traces] for key, info in ix.groups.items()}
    work = list(ranks)
    while work:
        r = work.pop()
        steps = plan[r]
        while pos[r] < len(steps):
            kind, what, n, blocking = steps[pos[r]]
            if kind == "coll":
                here = reached[(what, n)]
                here.add(r)
                need = members.get(what) or [r]
                if len(here) >= len(need):
                    for w in coll_wait.pop((what, n), ()):
                        pos[w] += 1
                        work.append(w)
                elif blocking:
                    coll_wait[(what, n)].add(r)
                    break
            elif kind == "send":
                posted[(r, what)] += 1
                w = recv_wait.get((r, what))
                if w is not None and plan[w][pos[w]][2] <= posted[(r, what)]:
                    del recv_wait[(r, what)]
                    pos[w] += 1
                    work.append(w)
            elif kind == "recv" and blocking and posted[(what, r)] < n:
                recv_wait[(what, r)] = r
                break
            pos[r] += 1
    stuck = {r for r in ranks if pos[r] < len(plan[r])}
    if not stuck:
        return []
    return [_deadlock(ix, plan, pos, reached, posted, stuck)]


def _deadlock(ix: _Index, plan: dict, pos: dict, reached: dict, posted: dict, stuck: set) -> Finding:
    def waits_for(r: int) -> tuple[str, list[int]]:
        kind, what, n, _ = plan[r][pos[r]]
        c = ix.traces[r].calls[pos[r]]
        if kind == "coll":
            info = ix.groups.get(what)
            gname = _gname(info, what)
            missing = [m for m in (info.ranks if info else []) if m in ix.traces and m not in reached[(what, n)]]
            return f"{c.op} #{n} on {gname} ({c.site})", missing
        return f"{c.op} #{n} from rank {what} ({c.site})", [what]

    start = min(stuck)
    path: list[int] = []
    r: Optional[int] = start
    while r is not None and r not in path and r in stuck:
        path.append(r)
        _, missing = waits_for(r)
        r = next((m for m in missing if m in path), None)  # the shortest cycle: back to a rank on the path first
        if r is None:
            r = next((m for m in missing if m in stuck), None)
        if r is None:
            r = missing[0] if missing else None
    if r is not None and r in path:  # a cycle
        cycle = path[path.index(r):]
        hops = []
        for i, a in enumerate(cycle):
            where, _ = waits_for(a)
            head = f"rank {a}" if i == 0 else "which"
            hops.append(f"{head} waits in {where} for rank {cycle[(i + 1) % len(cycle)]}")
        return Finding("deadlock", "deadlock: " + ", ".join(hops), cycle,
                       [ix.traces[a].calls[pos[a]].site for a in cycle])
    where, missing = waits_for(start)
    others = ", ".join(f"rank {m} ({ix.ended(m) if m not in stuck else 'waits elsewhere'})" for m in missing[:4])
    return Finding("deadlock", f"rank {start} waits forever in {where}: never reached by {others or 'its peers'}",
                   [start, *missing[:4]], [ix.traces[start].calls[pos[start]].site])


def check_traces(traces: Mapping[int, RankTrace]) -> CheckResult:
    """Check the ranks' calls against each other (see the module docstring)."""
    ix = _Index(traces)
    calls = sum(len(t.calls) for t in traces.values())
    p2p = sum(1 for t in traces.values() for c in t.calls if c.kind != "coll")
    dd = [c for t in traces.values() for c in t.calls if c.data_dependent]
    result = CheckResult(len(traces), len(ix.groups), calls, calls - p2p, p2p, len(dd),
                         data_dependent_ops=sorted({c.op for c in dd}))
    found: list[tuple[int, Finding]] = []
    for r, t in traces.items():
        if t.status == "error":
            found.append((-1, Finding("error", f"rank {r} failed in its rehearsal: {t.error}", [r])))
    noted: dict[tuple, list[int]] = defaultdict(list)  # (note, op, sig, site) -> ranks; its first group
    first_group: dict[tuple, str] = {}
    for r, t in traces.items():
        for c in t.calls:
            if c.note:
                k = (c.note, c.op, c.sig, c.site)
                if r not in noted[k]:
                    noted[k].append(r)
                first_group.setdefault(k, c.group)
    for (note, op, sig, site), ranks in noted.items():
        gname = _gname(ix.groups.get(first_group[(note, op, sig, site)]), first_group[(note, op, sig, site)])
        found.append((-1, Finding("wrong_grid", f"{_rank_list(ranks)}: {op} {sig} on {gname}"
                                                f"{' (and the like on their groups)' if len(ranks) > 1 else ''}: "
                                                f"{note} ({site})", ranks, [site])))
    found += _check_p2p(ix)
    found += _check_groups(ix)
    order = {"error": 0, "wrong_grid": 1, "unmatched": 2, "mismatch": 3}
    found.sort(key=lambda x: order.get(x[1].kind, 4))
    result.findings = [f for _, f in found]
    if not any(f.kind in ("mismatch", "unmatched") for f in result.findings):
        result.findings += _check_waits(ix)
    return result
