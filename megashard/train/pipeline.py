"""Pipeline parallelism of the training job on PyTorch's engine (``torch.distributed.pipelining``).

    model = PipelineModel(parts)                 # this rank's stage modules (megashard.models.stages decides which)
    pipe = Pipeline(job, state, model)           # PipelineStage per part over state.group("pp"); PyTorch's schedule
    loss = pipe.step(x, y)                       # forward + backward of every microbatch; this dp rank's mean loss

Each part is a :class:`~megashard.models.gpt.model.GPT` built for one :class:`~megashard.models.stages.StageSpec`
(embeddings on the first stage; final norm, LM head and loss on the last) and sharded with FSDP2 by
:func:`~megashard.models.parallelize.parallelize`. The schedule (``train.pipeline_schedule``) splits this rank's
``[B/dp, s/cp]`` batch into ``train.microbatches`` microbatches; each microbatch loss is a token mean and the
schedule divides the gradients by the number of microbatches, so the gradient is that of the mean loss — the
same as one process on the whole batch. Tied embeddings: the first and last stage each hold ``embed.weight``;
their gradients are summed over the state's embedding group (``embd``) before the optimizer step (Megatron's rule), so
the copies stay equal. A stage whose peer never answers fails after ``parallel.timeout`` seconds with a
:class:`~megashard.errors.PipelineError` naming the stage, the schedule and the step.
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megashard._compat import pipeline_stage_class
from megashard.errors import PipelineError
from megashard.models.stages import PIPELINE_SCHEDULES, schedule_is_multi

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["PipelineModel", "Pipeline", "embedding_group"]


class PipelineModel(nn.Module):
    """The stage modules of this rank as one model whose parameter names are the global ones (no part prefix).

    ``named_parameters()`` yields every part's parameters under the names a single-process model has
    (``blocks.5.attn.qkv.weight``), so checkpoints, the optimizer and the gradient norm see one model.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self.parts:
            yield from part.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, *args: Any) -> Any:  # pragma: no cover - a pipeline runs through Pipeline.step
        raise RuntimeError("a PipelineModel runs through megashard.train.pipeline.Pipeline.step, not model(...)")


def embedding_group(state: ParallelState) -> Optional[dist.ProcessGroup]:
    """The state's ``embd`` group (the first and last stage of this rank's pipeline, Megatron's embedding group), or
    ``None`` on ranks outside it (middle stages)."""
    return state.group("embd") if state.in_group("embd") else None


class Pipeline:
    """PyTorch pipeline stages and schedule for this rank's :class:`PipelineModel` parts."""

    def __init__(self, job: JobConfig, state: ParallelState, model: PipelineModel) -> None:
        from torch.distributed import pipelining

        self.job, self.state, self.model = job, state, model
        self.schedule_name = job.train.pipeline_schedule
        self.group = state.group("pp")
        self.pp, self.pp_rank = state.size("pp"), state.rank_in("pp")
        self.microbatches = job.microbatches(state.size("pp"), state.size("dp"))
        self.timeout = float(job.parallel.timeout)
        parts = list(model.parts)
        device = next(parts[0].parameters()).device
        stage_cls = pipeline_stage_class()
        self.stages = [stage_cls(part, part.stage.index, part.stage.num_stages, device, group=self.group)
                       for part in parts]
        self.stage_ids = [part.stage.index for part in parts]
        self.has_first = any(p.stage.is_first for p in parts)
        self.has_last = any(p.stage.is_last for p in parts)
        last = next((p for p in parts if p.stage.is_last), None)
        loss_fn = last.loss if last is not None else _no_loss
        cls = getattr(pipelining.schedules, PIPELINE_SCHEDULES[self.schedule_name])
        if schedule_is_multi(self.schedule_name):
            self.schedule = cls(self.stages, self.microbatches, loss_fn=loss_fn, scale_grads=True)
        else:
            self.schedule = cls(self.stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=True)
        self.tied = [p for n, p in model.named_parameters() if n == "embed.weight"] if job.model.tie_embeddings else []
        self.embd = embedding_group(state) if self.tied else None
        self._probed = False

    # ------------------------------------------------------------------ naming
    def where(self) -> str:
        """``"stage 1 of 4 (pp rank 1, global rank 3)"``: what a timeout or failure names."""
        n = self.stages[0].num_stages
        ids = ", ".join(map(str, self.stage_ids))
        return (f"stage{'s' if len(self.stage_ids) > 1 else ''} {ids} of {n} (pp rank {self.pp_rank} of {self.pp}, "
                f"global rank {dist.get_rank()})")

    def _fail(self, what: str, step: Optional[int], e: BaseException) -> PipelineError:
        at = f" in step {step + 1}" if step is not None else ""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
        why = (f"a peer stage did not answer within parallel.timeout={self.timeout:g} s" if timed_out
               else f"{type(e).__name__}: {msg}")
        return PipelineError(f"pipeline {self.schedule_name} {what}{at} failed on {self.where()}: {why}")

    # ------------------------------------------------------------------ probe
    def probe(self) -> None:
        """Exchange one tensor with each neighbouring pp rank (isend/irecv, waited with ``parallel.timeout``).

        Runs before the first step: a stage whose neighbour cannot be reached fails here, naming itself, instead
        of hanging inside the schedule.
        """
        if self._probed or self.pp == 1:
            return
        ranks = self.state.ranks("pp")
        nxt, prv = ranks[(self.pp_rank + 1) % self.pp], ranks[(self.pp_rank - 1) % self.pp]
        out = torch.full((1,), float(self.pp_rank), device=self.stages[0].device)
        got = torch.empty_like(out)
        try:
            works = [dist.isend(out, nxt, group=self.group), dist.irecv(got, prv, group=self.group)]
            for w in works:
                w.wait(timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise self._fail("probe", None, e) from None
        if int(got.item()) != (self.pp_rank - 1) % self.pp:
            raise PipelineError(f"pipeline probe on {self.where()}: got pp rank {int(got.item())}'s tensor, expected "
                                f"pp rank {(self.pp_rank - 1) % self.pp}'s")
        self._probed = True

    # ------------------------------------------------------------------ steps
    def _run(self, fn: Any, x: torch.Tensor, y: torch.Tensor, step: Optional[int], what: str) -> torch.Tensor:
        self.probe()
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        try:
            fn(*args, target=y if self.has_last else None, losses=losses if self.has_last else None)
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 - a torch/gloo error becomes one line naming the stage
            raise self._fail(what, step, e) from e
        if self.has_last:
            return torch.stack([t.detach() for t in losses]).mean()
        return torch.zeros((), dtype=torch.float64, device=x.device)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: Optional[int] = None) -> torch.Tensor:
        """Forward and backward of this rank's batch ``x, y [B/dp, s/cp]``; returns this dp rank's mean loss on
        every pp rank (a float64 scalar). Gradients of tied embedding copies are summed over ``embd``."""
        loss = self._run(self.schedule.step, x, y, step, "step")
        self.sync_tied_grads()
        return self._share_loss(loss)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only; this dp rank's mean loss on every pp rank."""
        return self._share_loss(self._run(self.schedule.eval, x, y, None, "eval"))

    def _share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every pp rank (a sum over pp where the other ranks add zero)."""
        out = loss.to(torch.float64).clone() if self.has_last else torch.zeros((), dtype=torch.float64,
                                                                                device=loss.device)
        dist.all_reduce(out, group=self.group)
        return out

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding copies (first and last stage) over the embedding group."""
        if not self.tied:
            return
        grads = [p.grad for p in self.tied if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        total = local[0].clone()
        for g in local[1:]:  # both copies on this rank (zbv): add them here
            total += g
        if self.embd is not None and dist.get_world_size(self.embd) > 1:
            dist.all_reduce(total, group=self.embd)
        for g in local:
            g.copy_(total)


def _no_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
    raise RuntimeError("only the last stage computes the loss")
