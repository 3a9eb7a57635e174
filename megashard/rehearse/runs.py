"""The rehearsal of a job's ranks: :func:`rehearse_job` (every rank, or some) and :func:`rehearse_rank` (one), each
rank in a process of its own (:class:`~megashard.rehearse.broker.Broker`) running :class:`~megashard.rehearse.job.JobRank`."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from megashard.rehearse.broker import Broker
from megashard.rehearse.job import JobRank, RankHooks
from megashard.rehearse.recorder import RankTrace

__all__ = ["rank_order", "rehearse_job", "rehearse_rank"]


def rank_order(sizes: Any, ranks: Optional[Iterable[int]] = None) -> list[int]:
    """``ranks`` (default every rank) ordered pipeline by pipeline: the stages of one pipeline one after another, so
    that a stage waiting for its neighbour's message finds it soon (and few ranks wait at a time)."""
    from megashard.layout import RankLayout

    layout = RankLayout(sizes)
    wanted = set(range(layout.world_size) if ranks is None else ranks)
    out: list[int] = []
    if sizes.pp > 1:
        for group in sorted(layout.groups("pp")):
            out += [r for r in group if r in wanted]
    else:
        out = sorted(wanted)
    return out


def rehearse_job(job: Any, world_size: int, ranks: Optional[Iterable[int]] = None, *, steps: int = 1,
                 warmup: int = 0, hooks: Optional[RankHooks] = None, jobs: Optional[int] = None,
                 progress: Optional[Callable[[int, int], None]] = None, exact: bool = False) -> dict[int, RankTrace]:
    """Rehearse ``warmup + steps`` training steps of ``ranks`` (default all) of ``job``
    (:class:`~megashard.train.config.JobConfig`) in a world of ``world_size``; returns rank -> :class:`RankTrace`
    (also of the pipeline peers a rank needed). ConfigError, before any process starts, for a layout the job
    refuses. ``exact``: every rank, its collectives answered with values (:mod:`megashard.rehearse.exact`)."""
    body = JobRank(job, world_size, steps=steps, warmup=warmup, hooks=hooks, exact=exact)
    order = rank_order(body.sizes, None if exact else ranks)
    return Broker(body, world_size, order, jobs=jobs, progress=progress, exact=exact).run()


def rehearse_rank(job: Any, rank: int, world_size: int, *, steps: int = 1, warmup: int = 0,
                  hooks: Optional[RankHooks] = None, jobs: Optional[int] = None) -> RankTrace:
    """:func:`rehearse_job` of one rank: its :class:`RankTrace` (``result``: what ``hooks.result`` returned there).
    Pipeline peers whose messages it needs are rehearsed too (their hooks run as well; their traces are dropped)."""
    from megashard.errors import ConfigError

    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rehearse_rank(rank={rank!r}): a rank in 0..{world_size - 1} is expected")
    return rehearse_job(job, world_size, [rank], steps=steps, warmup=warmup, hooks=hooks, jobs=jobs)[rank]
