"""Stragglers: which ranks arrive last at the collectives, how often, and by how much.

Every rank's ledger sums, per step and group, the time its main thread was blocked in collectives (synchronous calls,
``Work.wait()``, a functional collective's first use: :meth:`megashard.doctor.ledger.Ledger.set_step`). In a
collective every member waits for the last one to arrive, so the rank that arrives last waits least:

- **per group** (what the report lists): at step ``s`` the *last* rank of group ``g`` is the one that waited least
  there, *by* how much less than the median of the others (what they spent waiting for it);
- **who causes it** (what names a straggler): a rank's *busy* time — the step's duration minus all its waiting — is
  what it spends on its own work. A slow rank is busy longer than its *peers* (the ranks that do the same work: one
  pipeline stage, :data:`~megashard.doctor.ledger.REPLICA_NAMES`); a rank that is late only because it waited for the
  slow one is not. Each rank's *lateness* at a step is its busy time minus the median of its peers', as a share of
  the step. Differences of durations on each rank's own clock: no clock is compared across hosts.

A rank is **named** a straggler when, over the steps analysed (at least :data:`MIN_STEPS`, the newest
:data:`WINDOW`),

1. its lateness is significantly positive: a one-sided Wilcoxon signed-rank test, p < :data:`ALPHA` (exact below
   :data:`EXACT_BELOW` steps). With no straggler the ranks are exchangeable, so a rank's lateness is symmetric about 0 however loaded
   the machine is: random delays of random ranks at random steps do not pass; and
2. it matters: its median lateness is at least :data:`MIN_SHARE` of the step (a rank always a few µs late — rank 0
   writing the metrics — is not named).
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Any, Iterable, Mapping, Optional

__all__ = ["ALPHA", "MIN_SHARE", "MIN_STEPS", "WINDOW", "Stragglers", "wilcoxon_greater"]

ALPHA = 1e-3
MIN_SHARE = 0.10
MIN_STEPS = 10
WINDOW = 256
EXACT_BELOW = 25


def wilcoxon_greater(values: Iterable[float]) -> float:
    """One-sided p-value of the Wilcoxon signed-rank test that ``values`` are centred above 0 (zeros dropped; exact
    for fewer than 25 values without ties, the normal approximation with tie correction otherwise — conservative in
    the far tail, and a few ms of Python at most)."""
    x = [v for v in values if v != 0]
    n = len(x)
    if n == 0:
        return 1.0
    order = sorted(range(n), key=lambda i: abs(x[i]))
    ranks = [0.0] * n
    i = 0
    ties = 0.0
    while i < n:
        j = i
        while j + 1 < n and abs(x[order[j + 1]]) == abs(x[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    w_plus = sum(r for r, v in zip(ranks, x) if v > 0)
    if n < EXACT_BELOW and ties == 0:
        total = n * (n + 1) // 2
        counts = [0] * (total + 1)  # counts[s]: subsets of {1..n} with rank sum s
        counts[0] = 1
        for r in range(1, n + 1):
            for s in range(total, r - 1, -1):
                counts[s] += counts[s - r]
        return sum(counts[math.ceil(w_plus - 1e-9):]) / 2 ** n
    mean = n * (n + 1) / 4
    sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24 - ties / 48)
    z = (w_plus - mean - 0.5) / sd if sd > 0 else 0.0
    return 0.5 * math.erfc(z / math.sqrt(2))


class _Group:
    def __init__(self, name: str, ranks: tuple[int, ...]):
        self.name, self.ranks = name, ranks
        self.steps = 0
        self.last_count: collections.Counter = collections.Counter()
        self.lateness: dict[int, collections.deque] = {r: collections.deque(maxlen=WINDOW) for r in ranks}
        self.share: dict[int, collections.deque] = {r: collections.deque(maxlen=WINDOW) for r in ranks}
        # (lateness, share) of a member at the steps it was the last: what it was late by when it was (never < 0)
        self.as_last: dict[int, collections.deque] = {r: collections.deque(maxlen=WINDOW) for r in ranks}

    def label(self) -> str:
        return f"{self.name} {_ranks(self.ranks)}"

    def add(self, values: Mapping[int, float], tau: float, most: bool) -> Optional[tuple[int, float]]:
        """One step: each member's value (its wait in the group, or its busy time); the *last* is the member with the
        least (``most``: the most) and each member's lateness is its distance from the median of the others."""
        self.steps += 1
        sign = 1.0 if most else -1.0
        last = max(self.ranks, key=lambda r: (sign * values[r], -r))
        for r in self.ranks:
            late = sign * (values[r] - statistics.median(values[o] for o in self.ranks if o != r))
            self.lateness[r].append(late)
            self.share[r].append(late / tau)
        self.last_count[last] += 1
        self.as_last[last].append((self.lateness[last][-1], self.share[last][-1]))
        return last, self.lateness[last][-1]

    def row(self) -> dict[str, Any]:
        """The member last most often and by how much: the median of what it was late by *at the steps it was the
        last* — over all steps the median would mix in the steps where others were later (negative lags)."""
        top, count = max(self.last_count.items(), key=lambda kv: (kv[1], -kv[0]))
        lags = self.as_last[top] or [(0.0, 0.0)]
        return {"group": self.label(), "steps": self.steps, "rank": top, "last": count,
                "lag_ms": round(max(0.0, statistics.median(x for x, _ in lags)) * 1e3, 3),
                "share": round(max(0.0, statistics.median(y for _, y in lags)), 4)}

    def named(self) -> list[dict[str, Any]]:
        out = []
        for r in self.ranks:
            share = list(self.share[r])
            if len(share) < MIN_STEPS:
                continue
            med = statistics.median(share)
            if med >= MIN_SHARE:
                p = wilcoxon_greater(share)
                if p < ALPHA:
                    out.append({"rank": r, "peers": self.label(), "steps": len(share), "last": self.last_count[r],
                                "lag_ms": round(statistics.median(self.lateness[r]) * 1e3, 3),
                                "share": round(med, 4), "p": float(f"{p:.3g}")})
        return out


class Stragglers:
    """The straggler statistics of a job, fed with every rank's records (published, or from its file).

    :meth:`add_record` takes a rank's groups (``group_ranks``), its peers group (``peers``) and its waits
    (``{"steps", "dt", "w"}``); a step is analysed once every rank has given it.
    """

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}  # per group: who waited least (arrived last)
        self.peers: dict[str, _Group] = {}  # per peers group: who was busy longest (the cause)
        self._members: set[int] = set()
        self._pending: dict[int, dict[int, tuple[float, dict[str, float]]]] = {}  # step -> rank -> (dt, waits)
        self._done: set[int] = set()
        self.newest_step: Optional[int] = None
        self.steps = 0
        self.per_step: collections.deque = collections.deque(maxlen=WINDOW)  # (step, peers key, rank, late s, share)

    # ------------------------------------------------------------------ input
    def ensure_group(self, key: str, ranks: Iterable[int], peers: bool = False) -> None:
        """Analyse group ``key`` (global ``ranks``; a group of one rank is left out); ``peers``: also as a peers
        group."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) < 2:
            return
        name = key.rsplit(":", 1)[0] if ":" in key else key
        if key not in self.groups:
            self.groups[key] = _Group(name, ranks)
            self._members |= set(ranks)
        if peers and key not in self.peers:
            self.peers[key] = _Group(name, ranks)

    def add_record(self, rank: int, rec: Mapping[str, Any], analyse: bool = True) -> None:
        """A rank's record: its groups, its peers, then its waits (``analyse``: the steps complete now)."""
        from megashard.doctor.ledger import expand_ranks

        for key, spec in (rec.get("group_ranks") or {}).items():
            if isinstance(key, str):
                self.ensure_group(key, expand_ranks(spec), peers=key == rec.get("peers"))
        waits = rec.get("waits")
        if not isinstance(waits, Mapping):
            return
        steps, dts, w = waits.get("steps") or [], waits.get("dt") or [], waits.get("w") or {}
        for i, step in enumerate(steps):
            if step in self._done or i >= len(dts):
                continue
            row = {k: v[i] / 1e6 for k, v in w.items() if isinstance(v, list) and i < len(v)}
            self._pending.setdefault(int(step), {})[int(rank)] = (dts[i] / 1e6, row)
        if analyse:
            self.analyse(trim=True)

    def analyse(self, trim: bool = False) -> None:
        """Analyse every step all ranks have given; ``trim``: forget the oldest steps some rank never gave (a live
        reader samples the published steps and may miss some of a rank's)."""
        n = len(self._members)
        for step in sorted(self._pending):
            got = self._pending[step]
            if len(got) < n or any(r not in got for r in self._members):
                continue
            self._analyse(step, got)
            del self._pending[step]
            self._done.add(step)
            self.newest_step = step if self.newest_step is None else max(self.newest_step, step)
        if trim and len(self._pending) > 4 * WINDOW:
            for step in sorted(self._pending)[:-WINDOW]:
                del self._pending[step]

    def _analyse(self, step: int, got: Mapping[int, tuple[float, dict]]) -> None:
        tau = statistics.median(dt for dt, _ in got.values())
        if tau <= 0:
            return
        self.steps += 1
        for key, g in self.groups.items():
            waits = {r: got[r][1].get(key, 0.0) for r in g.ranks}
            if any(waits.values()):  # the group waited at this step
                g.add(waits, tau, most=False)
        busy = {r: dt - sum(w.values()) for r, (dt, w) in got.items()}
        for key, g in self.peers.items():
            last, late = g.add({r: busy[r] for r in g.ranks}, tau, most=True)
            self.per_step.append((step, key, last, late, late / tau))

    # ------------------------------------------------------------------ output
    def group_rows(self) -> list[dict[str, Any]]:
        """Per group: the rank that arrived last most often, in how many steps, and by how much (its median
        lateness over the window, in ms and as a share of the step)."""
        return [g.row() for g in self.groups.values() if g.steps]

    def named(self) -> list[dict[str, Any]]:
        """Every straggler named (see the module docstring): rank, its peers, steps, how often it was the last of
        its peers, its median lateness (ms, share of the step) and the test's p-value."""
        out = [n for g in self.peers.values() for n in g.named()]
        return sorted(out, key=lambda n: n["rank"])

    def newest(self) -> Optional[dict[str, Any]]:
        """The newest step analysed: the rank busy longest relative to its peers, and by how much."""
        rows = [p for p in self.per_step if p[0] == self.newest_step]
        if not rows:
            return None
        step, key, rank, late, share = max(rows, key=lambda p: p[4])
        return {"step": step, "rank": rank, "peers": self.peers[key].label(), "lag_ms": round(late * 1e3, 3),
                "share": round(share, 4)}

    def metrics(self) -> Optional[dict[str, Any]]:
        """What a line of metrics.jsonl carries: the newest step analysed (its last rank and by how much) and the
        stragglers named so far."""
        newest = self.newest()
        if newest is None:
            return None
        return {"step": newest["step"], "last": newest, "named": self.named()}

    def report(self) -> dict[str, Any]:
        """Everything: steps analysed, per group, per step (the newest :data:`WINDOW`), the stragglers named."""
        return {"steps": self.steps, "newest_step": self.newest_step, "groups": self.group_rows(),
                "per_step": [{"step": s, "rank": r, "peers": self.peers[k].label(), "lag_ms": round(late * 1e3, 3),
                              "share": round(sh, 4)} for s, k, r, late, sh in self.per_step],
                "named": self.named(), "rule": {"alpha": ALPHA, "min_share": MIN_SHARE, "min_steps": MIN_STEPS,
                                                "window": WINDOW}}


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    shown = ", ".join(map(str, list(ranks)[:8])) + (f", … ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f"[{shown}]"


def from_records(records: Mapping[int, Mapping[str, Any]]) -> Stragglers:
    """The statistics of a run from the ranks' files (each holds its whole step log)."""
    s = Stragglers()
    for rank, rec in sorted(records.items()):
        s.add_record(rank, rec, analyse=False)
    s.analyse()
    return s


def format_report(s: Stragglers, top_steps: int = 5) -> str:
    """What ``megashard doctor RUN_DIR`` prints about stragglers: per group the rank that arrived last most often and
    by how much, the stragglers named (or that none is), and the steps where one rank was latest."""
    if not s.steps:
        return "stragglers: no step to compare (the job never called megashard.doctor.set_step)"
    lines = [f"stragglers: {s.steps} step(s) compared, up to step {s.newest_step} (a rank is named when it is busy "
             f"longer than its peers by a median >= {MIN_SHARE:.0%} of the step, Wilcoxon p < {ALPHA:g})"]
    rows = s.group_rows()
    if rows:
        head = ("GROUP", "STEPS", "LAST MOST OFTEN", "LATE BY (median)")
        table = [(r["group"], str(r["steps"]), f"rank {r['rank']} in {r['last']} ({r['last'] / r['steps']:.0%})",
                  f"{r['lag_ms']:.1f} ms ({r['share']:.1%} of the step)") for r in rows]
        widths = [max(len(t[i]) for t in [head, *table]) for i in range(3)]
        for t in [head, *table]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(t[:3], widths)) + "  " + t[3])
    named = s.named()
    for n in named:
        lines.append(f"straggler: rank {n['rank']}: busy {n['lag_ms']:.1f} ms per step longer than its peers "
                     f"{n['peers']} ({n['share']:.0%} of the step; the last of them in {n['last']} of {n['steps']} "
                     f"steps; p = {n['p']:.2g})")
    if not named:
        lines.append("no straggler named")
    who = {n["rank"] for n in named}
    worst = sorted((p for p in s.per_step if p[2] in who), key=lambda p: -p[4])[:top_steps]
    if worst and named:
        lines.append("latest steps: " + "; ".join(f"step {st} rank {r} +{late * 1e3:.1f} ms ({sh:.0%})"
                                                  for st, _, r, late, sh in sorted(worst)))
    return "\n".join(lines)
