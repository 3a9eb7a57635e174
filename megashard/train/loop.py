"""The training loop of ``megashard run``: one function, :func:`train`, run by every process.

    result = train(JobConfig.from_yaml("configs/default.yaml"))   # under torchrun (or any initialised world)

Per step: lr from the schedule, RNG re-seeded from (seed, step), this rank's batch, forward and
backward through the TP layers and FSDP2, gradient clipping with the norm reduced over the right
groups (:func:`clip_grad_norm`), AdamW, the global loss averaged over the data-parallel ranks,
metrics/progress on rank 0, a checkpoint every ``checkpoint.interval`` steps (or seconds, decided by every rank
together). A run resumes from the newest complete checkpoint of its checkpoint directory that verifies (or the one
``checkpoint.load_step`` / ``checkpoint.load_path`` names), in whatever world it was started in: an elastic job
re-derives its layout for each world (:mod:`megashard.train.elastic`), and each start says what changed since the
previous start of the same job (:mod:`megashard.train.world`).

``MEGASHARD_PAUSE_FILE`` (tests and benchmarks of elastic runs only): while this file exists, every rank waits before
its next step — a test holds a world at a step of its choosing while nodes leave and join.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from megashard.state.devices import current_device
from megashard.train.build import build, full_gradients, full_parameters
from megashard.train.clip import clip_grad_norm
from megashard.train.config import JobConfig
from megashard.train.result import TrainResult
from megashard.train.schedule import lr_at

if TYPE_CHECKING:
    from megashard.state import ParallelState

__all__ = ["train", "TrainRun", "TrainResult", "clip_grad_norm", "lr_at", "build", "full_parameters", "full_gradients",
           "job_fingerprint"]


# ---------------------------------------------------------------------------------------------- collectives
def _all_reduce(t: torch.Tensor, state: ParallelState, name: str) -> None:
    if state.size(name) > 1:
        dist.all_reduce(t, group=state.group(name))


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

    (An elastic job with ``launch.recovery: live`` under megashard's agent trains with
    :func:`megashard.train.live.train_live` instead: across world changes, in the same processes.)
    """
    run = TrainRun(job)
    lost = False
    try:
        run.start()
        run.resume()
        for step in range(run.result.start_step, job.train.steps):
            run.step(step)
            run.save(step + 1)
        return run.end(on_end)
    except BaseException as e:
        from megashard.processes import is_peer_loss

        lost = isinstance(e, Exception) and is_peer_loss(e)
        raise
    finally:
        from megashard.processes import quiet_stderr

        with quiet_stderr(lost):  # torch's C++ warnings of a store whose host died (~50 lines each): the agent says it
            run.close()



class TrainRun:
    """One run of a job on this rank, in the order :func:`train` follows: joining (the constructor), :meth:`start`,
    :meth:`resume`, per step :meth:`step` then :meth:`save`, :meth:`end`, and :meth:`close` (always, last: it lets go
    of what the run holds, also after an error)."""

    def __init__(self, job: JobConfig) -> None:
        """Join the world and the parallel state. Every rank must run the same job: checked in the first collective,
        before any other group exists."""
        import megashard.state as ms
        from megashard.train.usage import HostMemory

        self.host_memory = HostMemory.start()  # the baseline of this rank's peak RSS growth: before groups, model, data
        ms.init_distributed(job.parallel)
        agree_on = job_fingerprint(job)
        import dataclasses

        self.job = dataclasses.replace(job)  # a copy: the run resolves its schedule into its own job.optim (resume)
        self.own_state = not ms.is_initialized()
        """True when this run made the parallel state (and so destroys it at the end)."""
        if self.own_state:
            self.state: ParallelState = ms.initialize(job.parallel, agree_on=agree_on)  # resolves the parallel section: once
        else:
            from megashard.state.agreement import check_ranks_agree, fingerprint

            check_ranks_agree(fingerprint(job.parallel, agree_on), timeout=job.parallel.timeout)
            self.state = ms.get_parallel_state()
        self.rank = dist.get_rank()
        self.lock: Any = None  # rank 0's hold on the checkpoint directory
        self.saver: Any = None  # checkpoint.async: the background saver
        self.doc: Any = None  # the hang doctor this run enabled
        self.loggers: Any = None  # rank 0's TensorBoard / W&B
        self.finished = False

    def start(self) -> None:
        """The rest of the job validated against the layout, rank 0's claim of the run directory and hold on the
        checkpoint directory, the hang doctor, and the model and its optimizer built from the seed."""
        from megashard.state.rng import model_parallel_manual_seed

        job, state = self.job, self.state
        if self.own_state:
            self.sizes = job.validate(sizes=state.sizes)  # the rest of the job, against the state's sizes
        else:  # someone else's state: the job's own sizes must be the state's
            self.sizes = job.validate(dist.get_world_size())
            if state.sizes != self.sizes:
                from megashard.errors import ConfigError

                raise ConfigError(f"megashard is already initialised with another layout ({state!r}) than the job's "
                                  f"parallel section ({self.sizes.as_dict()}); call megashard.destroy() first or use "
                                  "the same sizes")
        if self.rank == 0:
            from megashard.outputs import check_owned, claim_dir

            # megashard's own directories (the run directory created and marked; one holding files of the user's is
            # refused: the launcher checked them before any process started, this is the same rule for jobs started
            # without it). The checkpoint directory is recognised by its own entries (step_<N>/, the lock).
            claim_dir(job.out_dir, "run", "train.out_dir=")
            check_owned("checkpoint.dir=", job.checkpoint_dir, "checkpoints")
            self.lock = _hold_checkpoint_dir(job)
        # Every rank's doctor writes <out_dir>/doctor/: only once rank 0 has claimed (made and marked) the run directory,
        # which it refuses when it already holds files it did not make
        _barrier(job.parallel.timeout)
        self.doc = _start_doctor(job, state)
        model_parallel_manual_seed(job.parallel.seed)
        self.model, self.optimizer = build(job, state)

    def resume(self, live_step: Optional[int] = None) -> None:
        """From the newest checkpoint that verifies (or the requested one), then what the steps from its step on
        need: the batches, rank 0's metrics and progress bar, the pipeline schedule, the background saver. The clock
        of the training steps starts here. ``live_step``: the model and optimizer already hold the state of this step
        (live recovery restored it from memory, :mod:`megashard.train.live`): no checkpoint is read."""
        from megashard.progress import ProgressBar
        from megashard.train.checkpointing import resume_checkpoint
        from megashard.train.data import Batches
        from megashard.train.metrics import MetricsWriter

        from megashard.train.world import World

        job, state, sizes, t = self.job, self.state, self.sizes, self.job.train
        self.world = World.gather(state, sizes)  # every rank's node: what a later start compares with
        before = World.previous(job) if self.rank == 0 else None  # the previous start of this job, if any
        # run_id: what this run's checkpoints record (and prune); the previous start's when the job goes on
        if live_step is None:
            found, start, self.run_id = resume_checkpoint(job, self.model, self.optimizer, state,
                                                          run_id=(before or {}).get("run_id"))
        else:  # the previous world's run goes on (rank 0 may be another process now: world.json has its id)
            from megashard.train.startpoint import plan_resume

            box = [((before or {}).get("run_id") or plan_resume(job, None).run_id) if self.rank == 0 else None]
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(box, src=0)
            found, start, self.run_id = None, live_step, box[0]
        self.state_from = "memory" if live_step is not None else "checkpoint" if found is not None else "none"
        self.change: Any = None
        if self.rank == 0 and before is not None:  # a restart or a new world: nodes, world and layout, steps redone
            self.change = self.world.compare(job, before, start)
            for line in self.change.lines():  # none for a restart in the same world (torchrun's line said it)
                print(line, file=sys.stderr, flush=True)
        # The learning-rate schedule: the checkpoint's unless optim.override_schedule (every rank reads the same record)
        from megashard.train.schedule import Schedule, resume_schedule
        from megashard.train.startpoint import read_record

        record = read_record(found) if found is not None else None
        lr_schedule, schedule_line = resume_schedule(job, record, start) if found is not None else (Schedule.of(job), None)
        lr_schedule.apply(job)  # decay_steps resolved: what this run's checkpoints record
        if self.rank == 0:
            redone = self.change.redone_text() if self.change is not None else ""
            if live_step is not None:
                print(f"megashard run: re-formed in place (no restart): state of step {start} from the memory of the "
                      f"surviving ranks{redone}", file=sys.stderr, flush=True)
            elif found is not None:
                from megashard.train.startpoint import resumed_line

                print(resumed_line(job, found, start, record, sizes) + redone, file=sys.stderr, flush=True)
            elif self.change is not None:
                print(f"megashard run: started from step 0 (no checkpoint yet){redone}", file=sys.stderr, flush=True)
            if schedule_line:
                print(schedule_line, file=sys.stderr, flush=True)
            self.world.write(job, self.run_id, start)
        self.data = Batches(job.data, job.model, t.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                            dp_size=sizes.dp, cp_rank=state.rank_in("cp"), cp_size=sizes.cp,
                            device=current_device(state.device_type))
        out_dir = job.out_dir
        from megashard.train.usage import device_peak, model_flops_per_token, model_params, parameter_count

        params = model_params(self.model, state)  # a collective of the pp group when pp > 1
        self.result_params, self.flops_per_token = parameter_count(params), model_flops_per_token(params, job)
        self.writer: Any = None
        self.peak: Any = None
        if self.rank == 0:
            from megashard.train.loggers import Loggers

            self.peak = device_peak(job, current_device(state.device_type))  # the denominator of MFU (CPU: measured)
            self.loggers = Loggers(job, start)
            self.writer = MetricsWriter(os.path.join(out_dir, "metrics.jsonl"), resume_step=start,
                                        loggers=self.loggers if self.loggers.active else None)
        # every node of an elastic job shows progress (a node that joined later would say nothing else): its local rank 0
        shows = self.rank == 0 or (job.launch.elastic and os.environ.get("LOCAL_RANK") == "0")
        self.bar = ProgressBar(t.steps, start, enabled=t.progress and shows, log_interval=t.log_interval)
        self.params = list(self.model.parameters())
        self.pipe: Any = None
        if sizes.pp > 1:
            from megashard.train.pipeline import Pipeline

            self.pipe = Pipeline(job, state, self.model)
        self.microbatches = job.microbatches(sizes.pp, sizes.dp)
        self.tokens_per_step = t.global_batch * job.model.seq_len
        self.result = TrainResult(start_step=start, final_step=start, out_dir=out_dir, parameters=self.result_params,
                                  model_flops_per_token=self.flops_per_token)
        if job.checkpoint.async_save:  # checkpoint.async: written in the background, one save in flight
            from megashard.checkpoint.async_save import AsyncSaver

            self.saver = AsyncSaver()
        from megashard.train.checkpointing import SaveSchedule

        self.schedule = SaveSchedule(job, state)
        self.pause_file = os.environ.get("MEGASHARD_PAUSE_FILE") or None
        self.model.train()
        self.t_start = time.perf_counter()

    def step(self, step: int) -> None:
        """Train 0-based ``step``: lr, RNG, batch, forward and backward, clipping, AdamW, the global loss; its
        metrics, validation (when due) and progress."""
        from megashard.models.parallelize import finish_expert_grads
        from megashard.state.rng import model_parallel_manual_seed

        job, state, t, result, model = self.job, self.state, self.job.train, self.result, self.model
        while self.pause_file is not None and os.path.exists(self.pause_file):  # tests: hold the world here
            time.sleep(0.05)
        t0 = time.perf_counter()
        if self.doc is not None:
            self.doc.ledger.set_step(step + 1)  # the step being trained, as metrics.jsonl numbers it
        lr = lr_at(step, job)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks depend on (seed, step) only: a resumed run draws what the original drew.
        model_parallel_manual_seed(job.parallel.seed + 7919 * (step + 1))
        x, y = self.data.batch(step)
        pipe = self.pipe
        loss = pipe.step(x, y, step) if pipe is not None else _forward_backward(model, x, y, self.microbatches)
        finish_expert_grads(model, state)
        norm = clip_grad_norm(self.params, job.optim.grad_clip, state)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank's loss is the mean over its tokens: the mean over dp·cp ranks is the global mean.
        lsum = loss.detach().to(torch.float64 if loss.dtype == torch.float64 else torch.float32).clone()
        _all_reduce(lsum, state, "dp_cp")
        # One device-to-host copy for both numbers (each float() would wait for the device on its own).
        if lsum.dtype == norm.dtype and lsum.device == norm.device:
            lsum_f, norm_f = torch.stack([lsum, norm]).tolist()
        else:
            lsum_f, norm_f = float(lsum), float(norm)
        gloss = lsum_f / (self.sizes.dp * self.sizes.cp)
        dt = time.perf_counter() - t0
        done = step + 1
        result.losses[done], result.grad_norms[done], result.final_step = gloss, norm_f, done
        tokens, world = self.tokens_per_step, self.world.world_size
        record = {"step": done, "loss": gloss, "lr": lr, "grad_norm": norm_f, "tokens": tokens,
                  "tokens_per_s": tokens / dt, "step_time_s": dt, "time": time.time(), "world_size": world,
                  "tokens_per_s_per_device": tokens / dt / world,
                  "model_tflops_per_device": self.flops_per_token * tokens / dt / world / 1e12}
        if self.peak is not None and self.peak.tflops:
            record["mfu"] = record["model_tflops_per_device"] / self.peak.tflops
        if self.change is not None and done == result.start_step + 1:  # the first step after a restart or a change
            record["world_change"] = self.change.record(record["time"], dt)
            record["world_change"]["state_from"] = self.state_from  # memory, checkpoint (read) or none (step 0)
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
            record["valid_loss"] = result.valid_losses[done] = evaluate(model, self.data, t.eval_batches, state, pipe)
            if self.rank == 0:
                self.bar.finish()  # a line of its own below the bar (which goes on on the next line)
                print(f"megashard run: step {done}: validation loss {record['valid_loss']:.4f}", file=sys.stderr,
                      flush=True)
        if self.writer is not None:
            if self.doc is not None and self.doc.straggler_report is not None:  # rank 0's doctor compares the waits
                record["stragglers"] = self.doc.straggler_report
            self.writer.write(record)
        self.bar.update(done, gloss, tokens * (done - result.start_step) / (time.perf_counter() - self.t_start),
                        lr=lr, grad_norm=norm_f, step_time=dt)
        if t.fail_at_step == done and self.rank == t.fail_rank and _restart_count() == 0:
            self.bar.close()
            print(f"\nmegashard run: rank {self.rank}: injected failure after step {done} (train.fail_at_step)",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def save(self, done: int) -> None:
        """The checkpoint of step ``done`` when one is due (every ``checkpoint.interval`` steps or seconds — decided by
        every rank together —, and the last step with ``checkpoint.save_final``); records how long the loop was
        blocked."""
        from megashard.train.checkpointing import save_checkpoint

        job = self.job
        if self.schedule.due(done):
            t_save = time.perf_counter()
            save_checkpoint(job.checkpoint_dir, done, self.model, self.optimizer, self.state,
                            consumed_samples=done * job.train.global_batch, keep=job.checkpoint.keep,
                            job=job.to_dict(), saver=self.saver, run_id=self.run_id)
            self.schedule.saved()
            blocked = self.result.checkpoint_blocked_s[done] = time.perf_counter() - t_save
            if self.rank == 0:
                from megashard.checkpoint.safety import checkpoint_dirname
                from megashard.train.startpoint import _short

                self.bar.finish()  # a line of its own below the bar
                path = _short(os.path.join(job.checkpoint_dir, checkpoint_dirname(done)))
                how = (f"staged in {blocked:.1f} s, written in the background" if self.saver is not None
                       else f"{blocked:.1f} s")
                print(f"megashard run: step {done}: checkpoint {path} ({how})", file=sys.stderr, flush=True)

    def end(self, on_end: Optional[Callable[[torch.nn.Module, ParallelState], None]] = None) -> TrainResult:
        """After the last step: the last background save waited for, the throughput, ``on_end``, rank 0's report,
        and the orderly end (every rank at the final barrier)."""
        from megashard.train.metrics import print_summary, read_metrics

        result = self.result
        self.bar.close()
        if self.saver is not None:  # the end of training waits for the last background save (and reports its error)
            self.saver, pending = None, self.saver
            t_save = time.perf_counter()
            pending.close()
            result.checkpoint_end_wait_s = time.perf_counter() - t_save
        result.seconds = time.perf_counter() - self.t_start
        steps_run = result.final_step - result.start_step
        result.tokens_per_s = (self.tokens_per_step * steps_run / result.seconds
                               if steps_run and result.seconds > 0 else 0.0)
        if on_end is not None:
            on_end(self.model, self.state)
        from megashard.train.usage import gather_usage

        result.usage = gather_usage(result, self.flops_per_token, self.world.world_size, self.peak, self.host_memory,
                                    current_device(self.state.device_type))  # collective: every rank's memory peaks
        if self.writer is not None:
            self.writer.close()
            from megashard.train.metrics import write_summary

            write_summary(self.job, result)
            if self.loggers is not None:
                self.loggers.summary(result.usage, result.final_step)
            print_summary(self.job, result, read_metrics(self.writer.path))
            self.world.write(self.job, self.run_id, result.final_step, ended=True)  # the next start is a new launch
        # The orderly end: every rank waits here until rank 0 has written its report and plot, so no rank tears its
        # groups down while another still runs (then the worker ends its groups: end_distributed).
        _barrier(self.job.parallel.timeout)
        self.finished = True
        return result

    def close(self) -> None:
        """Let go of what the run holds, in this order: the hang doctor, a background save in flight (after an
        error), the checkpoint directory's lock, rank 0's loggers, the parallel state this run made."""
        if self.doc is not None:  # first: its file, and torch's functions back before the groups go
            import megashard.doctor

            megashard.doctor.disable("exit" if self.finished else "failure")
        if self.saver is not None:  # an error interrupted training: let the save in flight finish (or fail) first
            try:
                self.saver.close()
            except Exception as e:  # noqa: BLE001 - the error that interrupted training is the one to report
                print(f"megashard run: rank {self.rank}: {e}", file=sys.stderr, flush=True)
        if self.lock is not None:
            self.lock.release()
        if self.loggers is not None:
            loggers, self.loggers = self.loggers, None
            loggers.close(ok=self.finished)
        if self.own_state:
            import megashard.state as ms

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


def _barrier(timeout: float) -> None:
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
