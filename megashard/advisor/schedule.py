"""The order in which one pipeline rank runs its forwards and backwards: PyTorch's schedules, restated without torch.

    rank_actions("1f1b", pp=4, vpp=1, mb=8, r=1)    # [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ...]

Each action is ``(kind, local_stage, microbatch)``: ``kind`` ``F`` (forward), ``B`` (full backward; zbv: the input
backward) or ``W`` (zbv's weight backward), ``local_stage`` the rank's stage (0 … vpp-1; stage
``local_stage · pp + r`` of the model), ``microbatch`` 0 … mb-1. The memory model (:mod:`megashard.advisor.memory`)
walks this list to know which microbatches' activations are alive at every moment and which gradients exist
already, for any microbatch count, vpp and schedule.

- ``gpipe`` (``ScheduleGPipe``): every forward, then every backward in the same order;
- ``1f1b`` (``Schedule1F1B``): ``min(mb, pp - r)`` forwards, then a backward and a forward in turn, then the rest of
  the backwards;
- ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``): PyTorch's warm-up ``(vpp - 1) · per_round + 2 · (pp - 1 - r)``
  forwards (at most ``vpp · mb``), microbatches in rounds of ``per_round = mb / max(1, mb // pp)`` per stage, then
  one forward and one backward in turn, then the backwards (``_get_1f1b_rank_ops``);
- ``zbv`` (``ScheduleZBVZeroBubble``, two stages in a V): its forwards, input backwards (``B``) and weight backwards
  (``W``) in order; a microbatch's graph lives until its W, which the cool-down defers (:func:`_zbv`).

``tests/test_advisor.py::test_schedule_orders_are_pytorchs`` compares these lists with PyTorch's own for many sizes.
"""
from __future__ import annotations

Action = tuple[str, int, int]


def rank_actions(schedule: str, pp: int, vpp: int, mb: int, r: int) -> list[Action]:
    """The forwards and backwards pipeline rank ``r`` runs in one step, in order (module docstring)."""
    if pp == 1:
        out: list[Action] = []
        for m in range(mb):  # gradient accumulation: each microbatch's backward right after its forward
            out += [("F", 0, m), ("B", 0, m)]
        return out
    if schedule == "gpipe":
        return [("F", 0, m) for m in range(mb)] + [("B", 0, m) for m in range(mb)]
    if schedule == "1f1b" or vpp <= 1:
        warm = min(mb, pp - r)
        out = [("F", 0, m) for m in range(warm)]
        f, b = warm, 0
        while b < mb:
            out.append(("B", 0, b))
            b += 1
            if f < mb:
                out.append(("F", 0, f))
                f += 1
        return out
    if schedule == "zbv":
        return _zbv(pp, mb, r)
    return _interleaved(pp, vpp, mb, r)


def _interleaved(pp: int, vpp: int, mb: int, r: int) -> list[Action]:
    rounds = max(1, mb // pp)
    per_round = mb // rounds
    warmup = min((vpp - 1) * per_round + 2 * (pp - 1 - r), mb * vpp)
    total = vpp * mb
    fwd_bwd = total - warmup

    def fwd_stage(step: int) -> int:
        return (step // per_round) % vpp

    def bwd_stage(step: int) -> int:
        return vpp - 1 - ((step - warmup) // per_round) % vpp

    f_next = [0] * vpp
    b_next = [0] * vpp
    out: list[Action] = []
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            s = fwd_stage(op)
            out.append(("F", s, f_next[s]))
            f_next[s] += 1
        if op >= warmup:
            s = bwd_stage(op)
            out.append(("B", s, b_next[s]))
            b_next[s] += 1
    return out


def _zbv(pp: int, mb: int, r: int) -> list[Action]:
    """PyTorch's ScheduleZBVZeroBubble order for rank r (its stages r and 2·pp-1-r are local 0 and 1): ``B`` is the
    input backward (``I``), ``W`` the weight backward. Warm-up and steady state run each W right after its I; the
    cool-down runs r pairs of I without W, then I and W of local stage 0 in turn, then the W still owed."""
    n = max(2 * pp - 1, mb)
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - r) - 1):
        out.append(("F", 0, f0))
        f0 += 1
    for _ in range(r):
        out += [("F", 1, f1), ("F", 0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - r):
        out += [("F", 1, f1), ("B", 1, b1), ("W", 1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(("F", 0, f0))
            f0 += 1
        out += [("B", 0, b0), ("W", 0, b0), ("F", 1, f1), ("B", 1, b1), ("W", 1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [("B", 0, b0), ("B", 1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - r):
        out += [("B", 0, b0), ("W", 0, w0)]
        b0 += 1
        w0 += 1
    out += [("W", 1, m) for m in range(w1, b1)] + [("W", 0, m) for m in range(w0, b0)]
    return [a for a in out if a[2] < mb]


def alive_peak(actions: list[Action], vpp: int) -> list[int]:
    """The most microbatches whose forward ran and backward has not (zbv: whose weight backward has not), per local
    stage, at any moment."""
    weighted = {(v, m) for kind, v, m in actions if kind == "W"}
    alive = [0] * vpp
    best = [0] * vpp
    for kind, v, m in actions:
        if kind == "F":
            alive[v] += 1
        elif kind == "W" or (v, m) not in weighted:
            alive[v] -= 1
        best[v] = max(best[v], alive[v])
    return best


def local_neighbours(schedule: str, pp: int, vpp: int, r: int) -> tuple[list[bool], list[bool]]:
    """Per local stage of rank r: whether its previous and its next stage run on this rank too (zbv's V turns on rank
    pp - 1: its stage pp - 1 hands stage pp its output in memory, and gets the input gradient back the same way)."""
    prev, nxt = [False] * vpp, [False] * vpp
    if schedule == "zbv" and pp > 1 and r == pp - 1:
        nxt[0] = prev[1] = True
    return prev, nxt
