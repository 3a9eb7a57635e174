"""Gradient clipping by the global L2 norm of a model sharded over TP, FSDP, experts and pipeline stages.

:func:`clip_grad_norm` is the training loop's (grouped ``torch._foreach_norm`` over the local shards, no host
sync, one foreach multiply per dtype); :func:`clip_grad_norm_reference` is the same arithmetic written one
parameter at a time, kept as the readable definition that tests compare the fast path with.

Which group each parameter's squared norm is summed over (each element counted exactly once): TP-split
parameters (``tp``) over ``tp`` then ``dp_shard_cp``; TP-replicated ones (``rep``) over ``dp_shard_cp`` only
(every TP rank holds the same copy); HSDP replicas (``dp_outer``) hold identical gradients and are not summed;
experts (``expert``) over ``ep`` (different experts) and the expert shard axis (FSDP shards), their ffn slices
(``expert_tp``) first over ``expt_tp``. Pipeline stages hold different parameters: the sum is then reduced over
``pp``, with the last stage's copy of a tied embedding left out (it equals the first stage's, which is counted).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megashard.state import ParallelState

__all__ = ["clip_grad_norm", "clip_grad_norm_reference", "norm_kind"]

_KINDS = ("tp", "rep", "expert", "expert_tp")


def _all_reduce(t: torch.Tensor, state: ParallelState, name: str) -> None:
    if state.size(name) > 1:
        dist.all_reduce(t, group=state.group(name))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor: the stored shard (no autograd op)


def norm_kind(p: torch.Tensor) -> str:
    """The reduction kind of parameter ``p``'s squared gradient norm: ``tp``, ``rep``, ``expert`` or ``expert_tp``."""
    if getattr(p, "_expert_parallel", False):
        return "expert_tp" if getattr(p, "_expert_tp_dim", None) is not None else "expert"
    return "tp" if getattr(p, "tensor_model_parallel", False) else "rep"


def _norm_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def _reduce(sq: dict[str, torch.Tensor], has_experts: bool, state: ParallelState) -> torch.Tensor:
    """The global squared norm from this rank's per-kind sums (the all-reduces of the module docstring)."""
    _all_reduce(sq["tp"], state, "tp")
    dense = sq["tp"] + sq["rep"]
    _all_reduce(dense, state, "dp_shard_cp")
    _all_reduce(sq["expert_tp"], state, "expt_tp")
    expert = sq["expert"] + sq["expert_tp"]
    if has_experts:
        from megashard.models.parallelize import expert_shard_axis

        _all_reduce(expert, state, "ep")
        _all_reduce(expert, state, expert_shard_axis(state))  # expert HSDP replicas are not summed
    total = dense + expert
    _all_reduce(total, state, "pp")
    return total


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, state: ParallelState) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (0 = only measure); returns the norm before clipping
    (a 0-dim tensor on the parameters' device, float32, or float64 if any parameter is).

    Per kind one ``torch._foreach_norm`` over the local shards; the scale factor stays on the device (no host
    sync) and multiplies every local gradient in one ``torch._foreach_mul_`` per dtype. Agrees with
    :func:`clip_grad_norm_reference` to rounding (the per-tensor sums of squares are taken in another order);
    the clipped gradients are bitwise equal for the same norm.
    """
    dtype = _norm_dtype(params)
    device = next((p.device for p in params), torch.device("cpu"))
    by_kind: dict[str, list[torch.Tensor]] = {k: [] for k in _KINDS}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    has_experts = False
    for p in params:
        has_experts = has_experts or getattr(p, "_expert_parallel", False)
        if p.grad is None:
            continue
        g = _local(p.grad)
        by_dtype.setdefault(g.dtype, []).append(g)
        if g.numel() and not getattr(p, "_tied_copy", False):
            by_kind[norm_kind(p)].append(g)
    sq = {}
    for k, gs in by_kind.items():
        if gs:  # the sum of the squared per-tensor norms (taken in ``dtype``)
            sq[k] = torch.stack(torch._foreach_norm(gs, 2, dtype=dtype)).square().sum()
        else:
            sq[k] = torch.zeros((), dtype=dtype, device=device)
    norm = _reduce(sq, has_experts, state).sqrt()
    if max_norm > 0 and by_dtype:
        # The reference's host arithmetic, on the device: coef = max_norm / (norm + 1e-6) in float64, applied only
        # when < 1 (a NaN norm leaves the gradients alone, as there); multiplying by 1.0 changes no value.
        n64 = norm.to(torch.float64)
        coef = torch.div(torch.full((), max_norm, dtype=torch.float64, device=n64.device), n64 + 1e-6)
        coef = torch.where(coef < 1.0, coef, torch.ones_like(coef))
        for dt, gs in by_dtype.items():
            torch._foreach_mul_(gs, coef.to(dt))
    return norm


def clip_grad_norm_reference(params: list[torch.nn.Parameter], max_norm: float,
                             state: ParallelState) -> torch.Tensor:
    """:func:`clip_grad_norm` one parameter at a time (the readable definition; slow: two ops per parameter and a
    host sync). Same reductions, same return value up to rounding."""
    dtype = _norm_dtype(params)
    device = next((p.device for p in params), torch.device("cpu"))
    sq = {k: torch.zeros((), dtype=dtype, device=device) for k in _KINDS}
    grads = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads.append(p.grad)
        if g.numel() == 0 or getattr(p, "_tied_copy", False):
            continue
        sq[norm_kind(p)] += g.detach().to(dtype).pow(2).sum()
    has_experts = any(getattr(p, "_expert_parallel", False) for p in params)
    norm = _reduce(sq, has_experts, state).sqrt()
    if max_norm > 0:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm
