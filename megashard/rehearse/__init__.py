"""Rehearsals: one training step of any rank of a layout, without its peers, on the ``fake`` backend — every
collective and point-to-point call it issues recorded (group, peers, dtype, shape, order, source line).

    from megashard.rehearse import rehearse_job, rehearse_rank, RankHooks
    traces = rehearse_job(job, world_size=64)              # rank -> RankTrace, every rank of the layout
    trace = rehearse_rank(job, rank=5, world_size=64,      # one rank (and the pipeline peers it needs)
                          hooks=RankHooks(around_step=lambda ctx: MyDispatchMode(), result=lambda ctx: ...))

Each rank runs in a process forked from the caller's (:mod:`~megashard.rehearse.broker`), ``jobs`` at a time, so
world sizes of hundreds run on a laptop. Modules: ``recorder`` (what a rank calls), ``runs`` (:func:`rehearse_job`, :func:`rehearse_rank`), ``broker`` (the processes and
the mailbox of point-to-point messages), ``job`` (a rank of ``megashard run``'s job), ``script`` (a rank of a user's
script), ``compare`` (the ranks' calls checked against each other:
:func:`~megashard.rehearse.compare.check_traces`), ``before_launch`` (``megashard run``'s check),
``suggest_check`` (``plan --suggest --check-collectives``), ``works``, ``exact`` (every rank together, collectives
carrying values: ``rehearse_job(..., exact=True)``). See docs/rehearse.md.
"""
from __future__ import annotations

from megashard.rehearse.broker import Broker, default_jobs
from megashard.rehearse.job import JobRank, RankContext, RankHooks, rehearsal_job
from megashard.rehearse.recorder import CallRecord, GroupInfo, RankTrace, Recorder
from megashard.rehearse.runs import rank_order, rehearse_job, rehearse_rank

__all__ = ["Broker", "CallRecord", "GroupInfo", "JobRank", "RankContext", "RankHooks", "RankTrace", "Recorder",
           "default_jobs", "rank_order", "rehearsal_job", "rehearse_job", "rehearse_rank"]
