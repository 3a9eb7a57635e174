"""Certify a layout's memory: one training step of the rank that peaks, run without peers, its live bytes counted.

    peaks = trace_memory(job, world_size=64, pp_ranks=[0])      # [TracedPeak(rank=0, pp_rank=0, peak=..., ...)]

The fast model (:mod:`megashard.advisor.memory`) ranks hundreds of layouts; the ones a user will run are then
*traced*: the rank runs the job's own build and ``TrainRun.step`` on the ``fake`` backend
(:mod:`megashard.rehearse`: no peer, no device, the rank's real CPU tensors in the job's dtypes), and
:class:`~megashard.advisor.live_bytes.LiveBytes` counts the bytes of its live tensor storages exactly as the tests and
``benchmarks/advisor.py`` measure a real gloo run: a warm-up step, then the peak of the second step (the steady
state, the optimizer's state present), plus the synthetic data the job holds (``num_sequences · (seq + 1)`` tokens;
the rehearsal makes a smaller set of its own); on a CPU job, each reduce-scatter also holds a copy of its input
while it runs, as gloo does. With experts over ep > 1 ranks values decide memory (the tokens a rank's experts receive
follow every peer's routing): there every rank of the world is rehearsed together, its collectives carrying the
values the real backend gives (:mod:`megashard.rehearse.exact`), and the largest rank's peak is the traced one —
while the world has at most ``EXACT_MAX_RANKS`` (8) ranks and their steps fit :data:`TRACE_SECONDS` and
:func:`trace_budget`. A larger one is traced one rank alone, without its peers' tokens (``TracedPeak.partial``: the
modelled figure, with its routing-imbalance bound, decides). A GPU job is traced with the CPU kernels (what CUDA
kernels save can differ; docs/advisor.md).

The rehearsal allocates what the rank allocates and computes what it computes: a layout is traced only when its
modelled peak fits this machine (:func:`trace_budget`), the two steps of the ranks it runs take at most
:data:`TRACE_SECONDS` on this CPU (:func:`trace_seconds`: a 1B-parameter model's step is minutes of CPU time), and
the tracing of one ``--suggest`` has not yet spent :data:`TRACE_TOTAL_SECONDS`; the report says which were traced and
how long it took.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class TracedPeak:
    """The traced peak of one rank."""

    rank: int
    pp_rank: int
    peak: Optional[int]
    """Bytes (None when the rehearsal failed)."""
    op: str = ""
    """The op after which the peak was reached."""
    seconds: float = 0.0
    error: Optional[str] = None
    partial: bool = False
    """MoE with ep > 1 traced without values (a world of more than ``EXACT_MAX_RANKS`` ranks, or too costly to
    rehearse whole): the fake backend delivers no peer's tokens, so the pairs this rank's experts receive are
    missing; the modelled figure (with the routing-imbalance bound) decides for such a layout."""
    exact: bool = False
    """Every rank of the world was rehearsed, its collectives carrying values (:mod:`megashard.rehearse.exact`);
    ``rank`` is the one that peaks."""


def trace_budget() -> int:
    """Bytes a trace may allocate here: half of this machine's available memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    from megashard.advisor.machine import host_ram

    return host_ram() // 4


#: The most CPU time a layout's trace may take here (seconds, by :func:`trace_seconds`); longer ones are not traced.
TRACE_SECONDS = 30.0
#: The most wall time the traces of one ``--suggest`` may take (seconds): once spent, the layouts left are not traced
#: and the modelled figure decides (issue 41's goal: the top 5 traced in under 60 s on 2 cores).
TRACE_TOTAL_SECONDS = 60.0


def trace_seconds(shape: Any, world_size: int, flops_per_s: float) -> float:
    """About how long tracing a layout takes on this CPU: its rank's two steps (warm-up and measured), each about
    ``6 · parameters · tokens / world_size`` FLOPs (forward and backward of the rank's share), at ``flops_per_s``."""
    from megashard.advisor.shape import block_params, numel, root_params

    params = numel(root_params(shape, 1, True, True))
    for layer in range(shape.layers):
        dense, expert = block_params(shape, 1, shape.is_moe(layer))
        params += numel(dense) + numel(expert) * min(shape.top_k, max(shape.num_experts, 1)) // max(
            shape.num_experts, 1)
    flops = 6.0 * params * shape.global_batch * shape.seq / max(world_size, 1)
    return 2 * flops / max(flops_per_s, 1.0)


def pp_rank_ranks(sizes: Any, pp_ranks: list[int]) -> list[int]:
    """The global rank of each pipeline rank in ``pp_ranks`` whose other coordinates are all 0 (FSDP's largest shard,
    rank 0 of every group)."""
    from megashard.layout import RankLayout

    layout = RankLayout(sizes)
    out = []
    for r in pp_ranks:
        for g in range(sizes.world_size):
            if layout.coords(g).get("pp", 0) == r and all(v == 0 for k, v in layout.coords(g).items() if k != "pp"):
                out.append(g)
                break
    return out


def exact_wanted(job: Any, sizes: Any, world_size: int) -> bool:
    """Whether ``job``'s trace must run every rank with values (:mod:`megashard.rehearse.exact`): experts over
    ep > 1 ranks (what a rank's experts receive follows every peer's routing) in a world of at most
    :data:`~megashard.rehearse.exact.EXACT_MAX_RANKS` ranks."""
    from megashard.rehearse.exact import EXACT_MAX_RANKS

    return job.model.num_experts > 0 and sizes.ep > 1 and world_size <= EXACT_MAX_RANKS


def trace_memory(job: Any, world_size: int, pp_ranks: Optional[list[int]] = None,
                 jobs: Optional[int] = None, exact: Optional[bool] = None) -> list[TracedPeak]:
    """The traced peak of each pipeline rank in ``pp_ranks`` (default: every pipeline rank) of ``job`` (a
    :class:`~megashard.train.config.JobConfig` with the layout's overrides) in a world of ``world_size`` ranks: its
    first rank's (FSDP's largest shard), or with ``exact`` (default :func:`exact_wanted`) the largest of all its
    ranks, every rank of the world rehearsed with values. One process per rank, forked (``jobs`` at a time). The
    caller must not have torch.distributed initialised."""
    from megashard.layout import RankLayout
    from megashard.rehearse import RankHooks, rehearse_job

    sizes = job.validate(world_size)
    pp_ranks = list(range(sizes.pp)) if pp_ranks is None else pp_ranks
    exact = exact_wanted(job, sizes, world_size) if exact is None else exact
    ranks = pp_rank_ranks(sizes, pp_ranks)
    from megashard.advisor.host import token_bytes

    data = (job.data.num_sequences * (job.model.seq_len + 1) * token_bytes(job.model.vocab_size)
            if job.data.source == "synthetic" else 0)
    from megashard.advisor.machine import job_device

    gloo = job_device(job.parallel) == "cpu"
    hooks = RankHooks(after_build=lambda ctx: _after_build(ctx, gloo), around_step=_around_step, result=_result)
    t0 = time.perf_counter()
    traces = rehearse_job(job, world_size, ranks=ranks, steps=1, warmup=1, hooks=hooks, jobs=jobs, exact=exact)
    seconds = time.perf_counter() - t0
    layout = RankLayout(sizes)
    out = []
    for r, first in zip(pp_ranks, ranks):
        mine = [g for g in sorted(traces) if layout.coords(g).get("pp", 0) == r] if exact else [first]
        bad = [traces.get(g) for g in mine if traces.get(g) is None or traces[g].status != "ok"
               or traces[g].result is None]
        if bad or not mine:
            t = bad[0] if bad else None
            why = (t.error or t.status) if t is not None else "not run"
            out.append(TracedPeak(first, r, None, seconds=seconds, error=str(why).strip().splitlines()[-1][:200]))
            continue
        g = max(mine, key=lambda g: traces[g].result[0])
        peak, op = traces[g].result[:2]
        # values decide only with experts over ep ranks; an exact rehearsal that met a collective it cannot answer
        # (every one the job and DTensor use is answered) is as partial as a rank traced alone
        partial = job.model.num_experts > 0 and sizes.ep > 1 and (not exact or any(traces[x].result[2] for x in mine))
        out.append(TracedPeak(g, r, peak + data, op, traces[g].seconds or seconds, partial=partial, exact=exact))
    return out


class _Live:
    """Entered at the warm-up step, left after the measured one: one LiveBytes over both steps (its peak is taken
    after the first optimizer step)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        if self.ctx.step == 0:
            self.ctx.extra["live"].__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx.step == 1 or exc[0] is not None:
            self.ctx.extra["live"].__exit__(*exc)


def _after_build(ctx: Any, gloo: bool) -> None:
    from megashard.advisor.live_bytes import LiveBytes

    if gloo:
        _gloo_reduce_scatter_copies()
    live = LiveBytes(warmup_steps=1)
    live.adopt(list(ctx.model.parameters()) + list(ctx.model.buffers()))
    ctx.extra["live"] = live


def _gloo_reduce_scatter_copies() -> None:
    """In the rank's (forked) process: ``reduce_scatter_tensor`` allocates a copy of its input while it runs, as gloo
    does on a CPU job (measured: FSDP2's reduce-scatter on gloo holds one more input-sized buffer during the call;
    the fake backend, which moves nothing, does not)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def wrap(orig: Any) -> Any:
        def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            copy = torch.empty_like(inp) if isinstance(inp, torch.Tensor) else None
            if copy is not None:
                copy.copy_(inp)
            try:
                return orig(*args, **kwargs)
            finally:
                del copy

        return reduce_scatter

    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP2 calls the latter from torch 2.13 on
        orig = getattr(c10d, name, None) or getattr(dist, name, None)
        if orig is not None:
            new = wrap(orig)
            for mod in (c10d, dist):
                if hasattr(mod, name):
                    setattr(mod, name, new)


def _around_step(ctx: Any) -> Any:
    return _Live(ctx)


def _result(ctx: Any) -> tuple[int, str, list[str]]:
    """The rank's peak, the op it was reached after, and the collectives an exact rehearsal could not answer."""
    live = ctx.extra["live"]
    exchange = ctx.recorder.exchange if ctx.recorder is not None else None
    return live.peak, live.peak_op, sorted(exchange.unanswered) if exchange is not None else []


def certify(result: Any, doc: dict, name: str, top: int, log: Any = None, limit: int = 1 << 30) -> None:
    """Trace the best ``top`` layouts of ``result`` (a :class:`~megashard.advisor.search.Suggestion` of the job
    ``doc``, a YAML mapping with the user's overrides applied): each gets ``traced`` (the largest traced rank) and is
    moved to ``too_big`` when that exceeds the device memory — the traced figure decides "fits" — and the next
    layout is traced in its place. Layouts whose modelled peak exceeds ``limit`` bytes or :func:`trace_budget` are
    not traced (noted: the trace allocates them on this machine's CPU, and takes a CPU step's time).
    Layouts traced already count among the ``top`` and are not traced again (a second call after ``--calibrate``
    re-ranked them traces the new #1). Sets ``result.traced_count``, adds to ``result.trace_seconds`` (the time budget
    is the whole ``--suggest``'s) and ``result.trace_notes``."""
    from megashard.config import yamlfile
    from megashard.train.config import JobConfig

    from megashard.advisor.machine import measure_cpu_flops
    from megashard.advisor.shape import JobShape

    budget = min(limit, trace_budget())
    rate = measure_cpu_flops()
    t0 = time.perf_counter() - result.trace_seconds  # an earlier call's time counts against the same budget
    done: list[Any] = []
    i = 0

    def note(text: str) -> None:
        if text not in result.trace_notes:  # a second call meets the same layouts
            result.trace_notes.append(text)

    while len(done) < top and i < len(result.ranked):
        c = result.ranked[i]
        m = c.memory
        if c.traced is not None:
            done.append(c)
            i += 1
            continue
        if m.peak > budget:
            note(f"{c.label()}: not traced (modelled {m.peak / 2**30:.2f} GiB: more than {budget / 2**30:.2f} GiB, the "
                 "most a trace allocates here; --trace-limit)")
            i += 1
            continue
        job = JobConfig.from_dict(yamlfile.apply_overrides(doc, c.overrides()), name=name)
        # a pipeline's trace runs every stage (the sends of one feed the receives of the next), the others one rank
        # per traced pipeline rank; an exact one (MoE over ep ranks) every rank, each with its real tensors
        one = trace_seconds(JobShape.from_job(job), result.world_size, rate)
        cost = one * max(c.sizes["pp"], 1)
        exact = exact_wanted(job, job.validate(result.world_size), result.world_size)
        if exact and (one * result.world_size > TRACE_SECONDS or m.peak * result.world_size > budget):
            exact = False  # traced alone: partial, the modelled figure decides
        elif exact:
            cost = one * result.world_size
        if cost > TRACE_SECONDS:
            note(f"{c.label()}: not traced (its ranks' steps are about {cost:,.0f} s of this CPU's time, more than the "
                 f"{TRACE_SECONDS:g} s a trace may take; the modelled figure decides)")
            i += 1
            continue
        spent = time.perf_counter() - t0
        if spent + cost > TRACE_TOTAL_SECONDS:
            note(f"{c.label()}: not traced (the traces took {spent:.0f} s and this one would take about {cost:.0f} s "
                 f"more; one --suggest spends at most {TRACE_TOTAL_SECONDS:g} s on them: the modelled figure decides)")
            i += 1
            continue
        pp = c.sizes["pp"]
        pp_ranks = sorted({m.rank, 0, pp - 1})
        peaks = trace_memory(job, result.world_size, pp_ranks, exact=exact)
        good = [p for p in peaks if p.peak is not None]
        c.traced = max(good, key=lambda p: p.peak) if good else None
        c.trace_error = None if good else (peaks[0].error if peaks else "no rank traced")
        if log is not None:
            what = (f"{c.traced.peak / 2**20:.2f} MiB (rank {c.traced.rank}"
                    + ("; every rank rehearsed, collectives carrying values" if c.traced.exact else "")
                    + (", partial: traced alone" if c.traced.partial else "") + ")"
                    if c.traced else f"failed: {c.trace_error}")
            log(f"traced {c.label()}: {what}")
        if c.traced is not None and c.peak > result.device_memory:
            result.ranked.pop(i)
            result.too_big.append(c)
            result.too_big.sort(key=lambda x: x.memory.peak)
            continue
        done.append(c)
        i += 1
    result.traced_count = sum(c.traced is not None for c in result.ranked + result.too_big)
    result.trace_seconds = time.perf_counter() - t0
