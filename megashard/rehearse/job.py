"""One rank of ``megashard run``'s training job, rehearsed without peers: its parallel state on the ``fake`` backend,
the model, optimizer and batches built as the job builds them, and training steps through the job's own
:meth:`TrainRun.step <megashard.train.loop.TrainRun.step>`.

    body = JobRank(job, world_size=64)                    # a callable body(rank, recorder) for the Broker
    ctx = body.context                                    # in the rank's process: RankContext (state, model, ...)

What differs from the real job, and why (:func:`rehearsal_job`): the ``fake`` backend on the CPU (no peer, no
device); synthetic batches of the job's shapes instead of its corpus (the values do not matter, the shapes do);
no ``torch.compile`` (a compiled block's collectives would be invisible, its eager twin issues the same ones); no
files written, no checkpoint read, no hang doctor, no progress bar, no injected failure. The values are garbage (the
fake backend moves no data): nothing in a step branches on them except the pipeline's probe and warm-up vote,
whose small messages travel through the rehearsal's mailbox (:mod:`megashard.rehearse.broker`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

from megashard.train.config import JobConfig

__all__ = ["JobRank", "RankContext", "RankHooks", "rehearsal_job"]


@dataclass
class RankContext:
    """What the hooks of a rehearsed rank see (in the rank's process)."""

    rank: int
    world_size: int
    job: JobConfig
    """The rehearsal's copy of the job (:func:`rehearsal_job`)."""
    state: Any = None
    """The rank's :class:`~megashard.state.ParallelState` (on the fake backend)."""
    model: Any = None
    optimizer: Any = None
    run: Any = None
    """The :class:`~megashard.train.loop.TrainRun` whose ``step`` is rehearsed (``run.pipe``, ``run.data``, ...)."""
    recorder: Any = None
    """The rank's :class:`~megashard.rehearse.recorder.Recorder` (``recorder.trace.calls`` so far)."""
    step: int = -1
    """The 0-based step running (or last run)."""
    extra: dict = field(default_factory=dict)
    """Free room for the hooks."""


@dataclass
class RankHooks:
    """What a caller runs inside a rehearsed rank's process (each optional; closures are fine: the rank's process is
    a fork of the caller's).

    - ``after_build(ctx)``: after the model, optimizer, batches (and pipeline) are built, before the first step;
    - ``around_step(ctx)``: a context manager entered around every step (e.g. a ``TorchDispatchMode``);
    - ``result(ctx)``: after the last step; its (picklable) return value comes back as ``RankTrace.result``.
    """

    after_build: Optional[Callable[[RankContext], None]] = None
    around_step: Optional[Callable[[RankContext], ContextManager]] = None
    result: Optional[Callable[[RankContext], Any]] = None


def rehearsal_job(job: JobConfig, steps: int = 1, exact: bool = False) -> JobConfig:
    """The job as a rehearsal runs it (see the module docstring): the same model, layout, batch and schedule.
    ``exact`` (:mod:`megashard.rehearse.exact`: values matter) keeps the job's own synthetic data, whose tokens the
    real job trains on."""
    import copy

    job = copy.deepcopy(job)
    job.parallel = dataclasses.replace(job.parallel, backend="fake", device="cpu")
    need = max(64, job.train.global_batch * (steps + 1))
    if not (exact and job.data.source == "synthetic"):
        job.data = dataclasses.replace(job.data, source="synthetic", path=None, blend=None, prepare_inputs=None,
                                       valid_fraction=0.0, num_sequences=need)
    job.train = dataclasses.replace(job.train, compile=False, doctor=False, progress=False, plot=False,
                                    fail_at_step=None, eval_interval=0)
    job.model = dataclasses.replace(job.model, init_from=None)
    return job


class JobRank:
    """``body(rank, recorder)`` for :class:`~megashard.rehearse.broker.Broker`: one rank of ``job`` in a world of
    ``world_size``, ``warmup + steps`` steps (every call recorded; ``exact``: see :func:`rehearsal_job`)."""

    def __init__(self, job: JobConfig, world_size: int, *, steps: int = 1, warmup: int = 0,
                 hooks: Optional[RankHooks] = None, exact: bool = False):
        self.job = rehearsal_job(job, steps + warmup, exact)
        self.sizes = self.job.validate(world_size)  # in the caller: a bad layout is one line before any fork
        self.world_size = world_size
        self.steps, self.warmup = steps, warmup
        self.hooks = hooks or RankHooks()
        self.context: Optional[RankContext] = None
        preload(self.sizes.pp > 1)

    def __call__(self, rank: int, recorder: Any) -> Any:
        import torch.distributed as dist

        import megashard.state as ms
        from megashard._compat import fake_store, pipelines_infer_shapes_on_fake
        from megashard.state.rng import model_parallel_manual_seed
        from megashard.train.build import build
        from megashard.train.loop import job_fingerprint

        job = self.job
        ctx = self.context = RankContext(rank, self.world_size, job, recorder=recorder)
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=self.world_size)
        pipelines_infer_shapes_on_fake()  # torch 2.15's schedules: shapes inferred through the rehearsal's messages
        recorder.install()
        ctx.state = state = ms.initialize(job.parallel, agree_on=job_fingerprint(job))
        model_parallel_manual_seed(job.parallel.seed)
        ctx.model, ctx.optimizer = build(job, state)
        ctx.run = _train_run(job, state, ctx.model, ctx.optimizer, self.sizes)
        if self.hooks.after_build is not None:
            self.hooks.after_build(ctx)
        for step in range(self.warmup + self.steps):
            ctx.step = step
            if self.hooks.around_step is not None:
                with self.hooks.around_step(ctx):
                    ctx.run.step(step)
            else:
                ctx.run.step(step)
        return self.hooks.result(ctx) if self.hooks.result is not None else None


def _train_run(job: JobConfig, state: Any, model: Any, optimizer: Any, sizes: Any) -> Any:
    """A :class:`~megashard.train.loop.TrainRun` ready for ``step()``: what :meth:`TrainRun.resume` sets up, without
    the checkpoint, the world record, the metrics file and the progress bar."""
    import time
    import types

    import torch.distributed as dist

    from megashard.progress import ProgressBar
    from megashard.state.devices import current_device
    from megashard.train.data import Batches
    from megashard.train.loop import TrainRun
    from megashard.train.result import TrainResult

    run = TrainRun.__new__(TrainRun)
    run.job, run.state, run.own_state = job, state, True
    run.rank = dist.get_rank()
    run.lock = run.saver = run.doc = None
    run.finished = False
    run.model, run.optimizer, run.sizes = model, optimizer, sizes
    run.world = types.SimpleNamespace(world_size=dist.get_world_size(), nodes=[])
    run.change = None
    run.state_from = "none"  # what the first step reports: no checkpoint, no live copy
    run.run_id = "rehearsal"
    run.data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                       dp_size=sizes.dp, cp_rank=state.rank_in("cp"), cp_size=sizes.cp,
                       device=current_device(state.device_type))
    run.writer = None
    run.peak, run.flops_per_token = None, 0.0  # no MFU in a rehearsal
    run.bar = ProgressBar(job.train.steps, 0, enabled=False)
    run.params = list(model.parameters())
    run.pipe = None
    if sizes.pp > 1:
        from megashard.train.pipeline import Pipeline

        run.pipe = Pipeline(job, state, model)
    run.microbatches = job.microbatches(sizes.pp, sizes.dp)
    run.tokens_per_step = job.train.global_batch * job.model.seq_len
    run.result = TrainResult(start_step=0, final_step=0, out_dir=job.out_dir)
    run.schedule = None
    run.pause_file = None
    model.train()
    run.t_start = time.perf_counter()
    return run


def preload(pipeline: bool = False) -> None:
    """Import what every rank's process needs before the ranks are forked: each fork then starts with it (importing
    FSDP, DTensor and the pipelining package costs seconds per process otherwise)."""
    import torch._dynamo  # noqa: F401  (FSDP imports it on its first parameter)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import megashard.models.gpt.model  # noqa: F401
    import megashard.models.parallelize  # noqa: F401
    import megashard.progress  # noqa: F401
    import megashard.state  # noqa: F401
    import megashard.train.build  # noqa: F401
    import megashard.train.data  # noqa: F401
    import megashard.train.loop  # noqa: F401
    from megashard._compat import fake_store

    fake_store()  # registers the fake backend
    if pipeline:
        import torch.distributed.pipelining  # noqa: F401

        import megashard.train.pipeline  # noqa: F401
