"""The training loop of ``megashard run``: one function, :func:`train`, run by every process.

    result = train(JobConfig.from_yaml("configs/default.yaml"))   # under torchrun (or any initialised world)

Per step: lr from the schedule, RNG re-seeded from (seed, step), this rank's batch, forward and
backward through the TP layers and FSDP2, gradient clipping with the norm reduced over the right
groups (:func:`clip_grad_norm`), AdamW, the global loss averaged over the data-parallel ranks,
metrics/progress on rank 0, a checkpoint every ``checkpoint.interval`` steps. A run resumes from the
newest complete checkpoint of its checkpoint directory that verifies (or the one ``checkpoint.load_step`` /
``checkpoint.load_path`` names).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from megashard.state.devices import current_device
from megashard.train.clip import clip_grad_norm
from megashard.train.config import JobConfig

if TYPE_CHECKING:
    from megashard.state import ParallelState

__all__ = ["train", "TrainResult", "clip_grad_norm", "lr_at", "build", "full_parameters", "full_gradients",
           "job_fingerprint"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    start_step: int
    """Step the run started after (0, or the step of the checkpoint it resumed from)."""
    final_step: int
    """Last step trained."""
    losses: dict[int, float] = field(default_factory=dict)
    """step → global mean loss (identical on every rank)."""
    grad_norms: dict[int, float] = field(default_factory=dict)
    """step → global gradient norm before clipping."""
    valid_losses: dict[int, float] = field(default_factory=dict)
    """step → validation loss (mean over ``train.eval_batches`` batches and every data-parallel rank)."""
    seconds: float = 0.0
    """Wall time of the training steps (excluding set-up)."""
    tokens_per_s: float = 0.0
    """Average global throughput of this run's steps."""
    out_dir: str = ""
    """The run's output directory."""
    checkpoint_blocked_s: dict[int, float] = field(default_factory=dict)
    """step → seconds the loop waited for that step's checkpoint (``checkpoint.async``: staging only, plus waiting for
    the previous background save if it still ran)."""
    checkpoint_end_wait_s: float = 0.0
    """``checkpoint.async``: seconds the end of training waited for the last background save."""


# ---------------------------------------------------------------------------------------------- schedule
def lr_at(step: int, job: JobConfig) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then cosine/linear decay to ``min_lr`` (or constant)."""
    o, total = job.optim, job.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.schedule == "linear":
        return o.lr + (o.min_lr - o.lr) * progress
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------- collectives
def _all_reduce(t: torch.Tensor, state: ParallelState, name: str) -> None:
    if state.size(name) > 1:
        dist.all_reduce(t, group=state.group(name))


# ---------------------------------------------------------------------------------------------- building
def build(job: JobConfig, state: ParallelState) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The parallelized model (initialised from the seed) and its AdamW, for the current layout.

    With ``pp > 1`` the model is a :class:`~megashard.train.pipeline.PipelineModel` of this rank's stages
    (:func:`megashard.models.stages.stage_specs`), each sharded with FSDP2 on its own.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from megashard.models.gpt.model import GPT, ModelGroups, init_parameters
    from megashard.models.parallelize import parallelize

    dtype = _DTYPES[job.train.dtype]
    param_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # bf16: fp32 master weights, bf16 compute
    groups = ModelGroups.from_state(state)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else None
    device = current_device(state.device_type)

    def make(stage: Any = None) -> torch.nn.Module:
        m = GPT(job.model, groups, ffn_hidden=job.ffn_hidden, moe_layers=job.moe_layers(), dtype=param_dtype,
                device=device, stage=stage)
        init_parameters(m, job.parallel.seed, groups)
        if job.train.compile:  # each block's body; FSDP's hooks stay outside (megashard.models.compile)
            from megashard.models.compile import compile_blocks

            compile_blocks(m, job.train.compile_backend)
        return m

    pp = state.size("pp")
    if pp > 1:
        from megashard.train.pipeline import PipelineModel
        from megashard.models.stages import stage_specs

        specs = stage_specs(job.model.layers, state.rank_in("pp"), pp, state.sizes.vpp or 1, job.train.pipeline_schedule)
        parts = [make(spec) for spec in specs]
        for part in parts:
            parallelize(part, state, mp_policy=mp, reshard_after_forward=job.train.reshard_between_microbatches)
        model: torch.nn.Module = PipelineModel(parts)
    else:
        model = parallelize(make(), state, mp_policy=mp)
    if job.model.init_from is not None:  # Hugging Face weights instead of the seeded init (each rank its slices)
        from megashard.train.hf_io import load_init_from

        load_init_from(model, job, state)
    from megashard.train.optim import build_optimizer

    optimizer = build_optimizer(model, job.optim)
    return model, optimizer


def full_parameters(model: torch.nn.Module, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter as the full global tensor (on every rank; collective). For tests and exports."""
    from megashard.models.parallelize import global_dtensor, local_tensor
    from megashard.tensors.uneven.gather import full_tensor

    # Stages hold different parameters; the pp axis of each global DTensor is Replicate, so full_tensor()
    # communicates within the stage only. The stages' dicts are then shared over pp.
    out = {n: full_tensor(global_dtensor(local_tensor(p.detach()), p, state)) for n, p in model.named_parameters()}
    return _merge_over_pp(out, state)


def full_gradients(model: torch.nn.Module, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the full global tensor (on every rank; collective). For tests."""
    from megashard.models.parallelize import global_dtensor, local_tensor
    from megashard.tensors.uneven.gather import full_tensor

    out = {n: full_tensor(global_dtensor(local_tensor(p.grad.detach()), p, state))
           for n, p in model.named_parameters() if p.grad is not None}
    return _merge_over_pp(out, state)


def _merge_over_pp(out: dict[str, torch.Tensor], state: ParallelState) -> dict[str, torch.Tensor]:
    if state.size("pp") == 1:
        return out
    parts: list[Any] = [None] * state.size("pp")
    dist.all_gather_object(parts, {k: v.cpu() for k, v in out.items()}, group=state.group("pp"))
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Any, batches: int, state: ParallelState, pipe: Any = None) -> float:
    """Mean loss over validation batches ``0 .. batches-1`` (each rank its slice), averaged over dp·cp ranks."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=data.device)
    for k in range(batches):
        x, y = data.valid_batch(k)
        total += (pipe.eval_loss(x, y) if pipe is not None else model(x, y)).detach().to(torch.float64)
    model.train()
    # A forward without backward leaves the modules that keep their parameters gathered after forward (the last
    # block, the root: reshard_after_forward=False) unsharded: shard them again, or the next checkpoint would read
    # full tensors as local shards.
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    _all_reduce(total, state, "dp_cp")
    return float(total) / (batches * state.size("dp") * state.size("cp"))


# ---------------------------------------------------------------------------------------------- the loop
def _forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> torch.Tensor:
    """Forward and backward of this rank's batch in ``microbatches`` equal chunks (gradient accumulation: the
    gradient of the mean of the chunks' mean losses; FSDP reduces once, after the last chunk)."""
    if microbatches == 1:
        loss = model(x, y)
        loss.backward()
        return loss.detach()
    total = None
    for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(i == microbatches - 1)
        loss = model(xm, ym)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    # Divide the summed gradients once, as the pipeline schedules do (scale_grads): auxiliary losses attached to
    # activations are averaged over the microbatches with the LM loss.
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(microbatches)
    return total / microbatches


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def train(job: JobConfig, *, on_end: Optional[Callable[[torch.nn.Module, ParallelState], None]] = None) -> TrainResult:
    """Run the job on the current world (initialising torch.distributed from torchrun's environment if needed).

    ``on_end(model, state)`` is called on every rank after the last step, before teardown (tests use it
    to compare parameters). Returns a :class:`TrainResult` on every rank.
    """
    import megashard.state as ms
    from megashard.progress import ProgressBar
    from megashard.state.rng import model_parallel_manual_seed
    from megashard.train.checkpointing import resume_checkpoint, save_checkpoint
    from megashard.train.data import Batches
    from megashard.train.metrics import MetricsWriter, plot_loss, read_metrics
    from megashard.models.parallelize import finish_expert_grads

    ms.init_distributed(job.parallel)
    # Every rank must run the same job: checked in the first collective, before any other group exists.
    agree_on = job_fingerprint(job)
    own_state = not ms.is_initialized()
    if own_state:
        state = ms.initialize(job.parallel, agree_on=agree_on)  # resolves the parallel section: once
    else:
        from megashard.state.agreement import check_ranks_agree, fingerprint

        check_ranks_agree(fingerprint(job.parallel, agree_on), timeout=job.parallel.timeout)
        state = ms.get_parallel_state()
    rank = dist.get_rank()
    t = job.train
    lock = saver = doc = None
    finished = False
    try:
        doc = _start_doctor(job, state)
        if own_state:
            sizes = job.validate(sizes=state.sizes)  # the rest of the job, against the state's sizes
        else:  # someone else's state: the job's own sizes must be the state's
            sizes = job.validate(dist.get_world_size())
            if state.sizes != sizes:
                from megashard.errors import ConfigError

                raise ConfigError(f"megashard is already initialised with another layout ({state!r}) than the job's "
                                  f"parallel section ({sizes.as_dict()}); call megashard.destroy() first or use the "
                                  "same sizes")
        if rank == 0:
            lock = _hold_checkpoint_dir(job)
        seed = job.parallel.seed
        model_parallel_manual_seed(seed)
        model, optimizer = build(job, state)
        ckpt_root = job.checkpoint_dir
        # newest that verifies, or the requested one; run_id: what this run's checkpoints record (and prune)
        found, start, run_id = resume_checkpoint(job, model, optimizer, state)
        if found is not None and rank == 0:
            from megashard.train.startpoint import read_record, resumed_line

            print(resumed_line(job, found, start, read_record(found), sizes), file=sys.stderr, flush=True)
        data = Batches(job.data, job.model, t.global_batch, seed, dp_rank=state.rank_in("dp"), dp_size=sizes.dp,
                       cp_rank=state.rank_in("cp"), cp_size=sizes.cp, device=current_device(state.device_type))
        out_dir = job.out_dir
        writer = None
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            writer = MetricsWriter(os.path.join(out_dir, "metrics.jsonl"), resume_step=start)
        bar = ProgressBar(t.steps, start, enabled=t.progress and rank == 0, log_interval=t.log_interval)
        params = list(model.parameters())
        pipe = None
        if sizes.pp > 1:
            from megashard.train.pipeline import Pipeline

            pipe = Pipeline(job, state, model)
        microbatches = job.microbatches(sizes.pp)
        tokens_per_step = t.global_batch * job.model.seq_len
        result = TrainResult(start_step=start, final_step=start, out_dir=out_dir)
        dp_cp = sizes.dp * sizes.cp
        if job.checkpoint.async_save:  # checkpoint.async: written in the background, one save in flight
            from megashard.checkpoint.async_save import AsyncSaver

            saver = AsyncSaver()
        model.train()
        t_start = time.perf_counter()
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            if doc is not None:
                doc.ledger.set_step(step + 1)  # the step being trained, as metrics.jsonl numbers it
            lr = lr_at(step, job)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Dropout masks depend on (seed, step) only: a resumed run draws what the original drew.
            model_parallel_manual_seed(seed + 7919 * (step + 1))
            x, y = data.batch(step)
            loss = pipe.step(x, y, step) if pipe is not None else _forward_backward(model, x, y, microbatches)
            finish_expert_grads(model, state)
            norm = clip_grad_norm(params, job.optim.grad_clip, state)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # Every rank's loss is the mean over its tokens: the mean over dp·cp ranks is the global mean.
            lsum = loss.detach().to(torch.float64 if loss.dtype == torch.float64 else torch.float32).clone()
            _all_reduce(lsum, state, "dp_cp")
            # One device-to-host copy for both numbers (each float() would wait for the device on its own).
            if lsum.dtype == norm.dtype and lsum.device == norm.device:
                lsum_f, norm_f = torch.stack([lsum, norm]).tolist()
            else:
                lsum_f, norm_f = float(lsum), float(norm)
            gloss = lsum_f / dp_cp
            dt = time.perf_counter() - t0
            done = step + 1
            result.losses[done], result.grad_norms[done], result.final_step = gloss, norm_f, done
            record = {"step": done, "loss": gloss, "lr": lr, "grad_norm": norm_f, "tokens": tokens_per_step,
                      "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "time": time.time()}
            if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
                record["valid_loss"] = result.valid_losses[done] = evaluate(model, data, t.eval_batches, state, pipe)
                if rank == 0:
                    bar.finish()  # a line of its own below the bar (which goes on on the next line)
                    print(f"megashard run: step {done}: validation loss {record['valid_loss']:.4f}", file=sys.stderr,
                          flush=True)
            if writer is not None:
                if doc is not None and doc.straggler_report is not None:  # rank 0's doctor compares the waits
                    record["stragglers"] = doc.straggler_report
                writer.write(record)
            bar.update(done, gloss, tokens_per_step * (done - start) / (time.perf_counter() - t_start))
            if t.fail_at_step == done and rank == t.fail_rank and _restart_count() == 0:
                bar.close()
                print(f"\nmegashard run: rank {rank}: injected failure after step {done} (train.fail_at_step)",
                      file=sys.stderr, flush=True)
                os._exit(1)
            last = done == t.steps
            if (job.checkpoint.interval and done % job.checkpoint.interval == 0) or (last and job.checkpoint.save_final):
                t_save = time.perf_counter()
                save_checkpoint(ckpt_root, done, model, optimizer, state, consumed_samples=done * t.global_batch,
                                keep=job.checkpoint.keep, job=job.to_dict(), saver=saver, run_id=run_id)
                result.checkpoint_blocked_s[done] = time.perf_counter() - t_save
        bar.close()
        if saver is not None:  # the end of training waits for the last background save (and reports its error)
            saver, pending = None, saver
            t_save = time.perf_counter()
            pending.close()
            result.checkpoint_end_wait_s = time.perf_counter() - t_save
        result.seconds = time.perf_counter() - t_start
        steps_run = result.final_step - start
        result.tokens_per_s = tokens_per_step * steps_run / result.seconds if steps_run and result.seconds > 0 else 0.0
        if on_end is not None:
            on_end(model, state)
        if writer is not None:
            writer.close()
            _report(job, result, read_metrics(writer.path), plot_loss)
        # The orderly end: every rank waits here until rank 0 has written its report and plot, so no rank tears its
        # groups down while another still runs (then the worker ends its groups: end_distributed).
        _final_barrier(job.parallel.timeout)
        finished = True
        return result
    finally:
        if doc is not None:  # first: its file, and torch's functions back before the groups go
            import megashard.doctor

            megashard.doctor.disable("exit" if finished else "failure")
        if saver is not None:  # an error interrupted training: let the save in flight finish (or fail) first
            try:
                saver.close()
            except Exception as e:  # noqa: BLE001 - the error that interrupted training is the one to report
                print(f"megashard run: rank {rank}: {e}", file=sys.stderr, flush=True)
        if lock is not None:
            lock.release()
        if own_state:
            ms.destroy()


def _start_doctor(job: JobConfig, state: ParallelState) -> Any:
    """The hang doctor of this rank (``train.doctor``) over the state's groups, writing to the run directory; None
    when it is off, on one rank, or already enabled by the caller's script (which then owns it)."""
    if not job.train.doctor or dist.get_world_size() == 1:
        return None
    import megashard.doctor

    if megashard.doctor.current() is not None:
        return None
    return megashard.doctor.enable(state, timeout=job.parallel.timeout, out_dir=job.out_dir)


def _final_barrier(timeout: float) -> None:
    """A barrier of every rank on the default group, given up after ``timeout`` seconds (parallel.timeout)."""
    from datetime import timedelta

    if dist.get_world_size() > 1:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout))


def job_fingerprint(job: JobConfig) -> dict[str, Any]:
    """Every field of the job but ``parallel`` (compared by the parallel state) as dotted keys: what all ranks
    must agree on. ``launch.node_rank`` differs per node by design and is left out."""
    out: dict[str, Any] = {"name": job.name}
    for section, values in job.to_dict().items():
        if section != "parallel":
            out.update({f"{section}.{k}": v for k, v in values.items() if (section, k) != ("launch", "node_rank")})
    return out


def _hold_checkpoint_dir(job: JobConfig) -> Any:
    """Rank 0's lock of the checkpoint directory (:mod:`megashard.train.ckptlock`): joined when the job's
    launcher holds it, taken (over, with a note, if stale) otherwise; raises if another live job holds it."""
    from megashard.train.ckptlock import CheckpointLock, job_id_from_env

    lock = CheckpointLock.acquire(job.checkpoint_dir, job=job.name, job_id=job_id_from_env())
    if lock.note:
        print(f"megashard run: note: {lock.note}", file=sys.stderr, flush=True)
    return lock


def _report(job: JobConfig, result: TrainResult, records: list, plot: Callable) -> None:
    """Rank 0's summary at the end: final loss, throughput, outputs, the loss plot."""
    out = result.out_dir
    msg = [f"megashard run: {job.name}: "]
    if result.final_step == result.start_step:
        msg.append(f"nothing to do, already at step {result.final_step} of {job.train.steps} "
                   f"(checkpoint in {job.checkpoint_dir}); raise train.steps to train on")
    else:
        valid = result.valid_losses.get(result.final_step)
        msg.append(f"step {result.final_step}, loss {result.losses[result.final_step]:.4f}, "
                   + (f"validation loss {valid:.4f}, " if valid is not None else "") +
                   f"{result.tokens_per_s:,.0f} tokens/s over {result.seconds:.1f} s")
    lines = ["".join(msg), f"  metrics: {os.path.join(out, 'metrics.jsonl')}"]
    if job.train.plot:
        png = os.path.join(out, "loss.png")
        note = plot(records, png, title=f"{job.name}: loss")
        lines.append(f"  {note}" if note else f"  loss curve: {png}")
    lines.append(f"  checkpoints: {job.checkpoint_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)
