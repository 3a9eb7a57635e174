"""The job's AdamW, stepped on the local shards of its DTensor parameters.

FSDP2 (and DTensor-based TP) make every parameter, gradient and optimizer state a DTensor. ``torch.optim.AdamW``
with ``foreach=True`` then sends each of its ~12 foreach ops per parameter group through DTensor's Python
dispatch (sharding propagation, wrapping of the outputs): most of the optimizer's host time on a small model.
:class:`LocalShardAdamW` runs the very same foreach (or fused) implementation on the local tensors instead:
AdamW is elementwise and a parameter, its gradient and its states share one placement, so the update of every
local element is the one DTensor computes, bitwise. The state stays DTensors, so ``state_dict()`` and
checkpoints are unchanged. A parameter whose gradient has another placement (never so under FSDP2) makes its
group take the DTensor path.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.adam import adam as _adam

from megashard._compat import adam_init_group

__all__ = ["LocalShardAdamW", "build_optimizer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _same_layout(p: torch.Tensor, g: torch.Tensor) -> bool:
    if not hasattr(p, "_local_tensor"):
        return not hasattr(g, "_local_tensor")
    return hasattr(g, "_local_tensor") and g.placements == p.placements and g.device_mesh == p.device_mesh


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` updates the local shards of DTensor parameters directly (same
    arguments, same results, same ``state_dict``; see the module docstring)."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = adam_init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            if all(_same_layout(p, g) for p, g in zip(params, grads)):
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
                    [_local(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
            beta1, beta2 = group["betas"]
            _adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=True,
            )
        return loss


def build_optimizer(model: torch.nn.Module, optim: Any, *, local_shards: bool = True) -> torch.optim.Optimizer:
    """The job's AdamW (``foreach``): weight decay on matrices (global rank ≥ 2), none on vectors.

    Args:
        optim: the job's :class:`~megashard.train.sections.OptimConfig`.
        local_shards: :class:`LocalShardAdamW` (default), else stock ``torch.optim.AdamW`` on the DTensors (the
            reference the tests compare with; identical results, more host time).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if len(getattr(p, "_global_shape", p.shape)) >= 2 else no_decay).append(p)
    cls = LocalShardAdamW if local_shards else torch.optim.AdamW
    return cls([{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
               lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=True)
