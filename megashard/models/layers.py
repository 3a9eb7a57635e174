"""Megatron-style tensor-parallel layers over megashard's ``tp`` group.

Parameters are plain local tensors holding this rank's TP slice (Megatron style) and carry the TP
attributes of :mod:`megashard.tensors.tp_attrs` (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``), so FSDP2 can shard them further over the data-parallel mesh and checkpoints
know how to place them. Collectives run through autograd functions:

==================  ==========================  ============================
function            forward                     backward
==================  ==========================  ============================
``copy_to_tp``      identity                    all-reduce (sum) over tp
``reduce_from_tp``  all-reduce (sum) over tp    identity
``gather_from_tp``  all-gather last dim         keep own slice
``gather_seq``      all-gather dim 1 (over cp)  reduce-scatter (sum)
==================  ==========================  ============================

Every parameter records its *global* shape and how to initialise it (:func:`init_spec`), so
:func:`megashard.models.gpt.model.init_parameters` can draw the full tensor from the seed on every rank and
keep this rank's slice: the initial model does not depend on the layout.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megashard.tensors.tp_attrs import set_tensor_model_parallel_attributes

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "gather_seq",
    "vocab_parallel_cross_entropy",
    "init_spec",
    "group_size",
    "group_rank",
]


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 for ``None`` (no communication at all)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed reduce_scatter_tensor (deprecated there); both are public.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there, with a FutureWarning); both are public.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0, in group-rank order: ``[n·d0, ...]``."""
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x.contiguous(), group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group``, this rank's ``1/n`` slice along dim 0: ``[d0/n, ...]``."""
    n = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter(out, x.contiguous(), group)
    return out


# ---------------------------------------------------------------------------------------------- collectives
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n, dim=-1)[r].contiguous(), None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 1 (the sequence) over the cp group; backward sums and scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x.transpose(0, 1), group).transpose(0, 1)  # sequence first: the gather concatenates dim 0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return reduce_scatter_dim0(g.transpose(0, 1), ctx.group).transpose(0, 1), None


def copy_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Megatron's ``f``: identity forward, gradient all-reduced over ``group`` (input of a column-parallel layer)."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Megatron's ``g``: partial sums all-reduced forward, identity backward (output of a row-parallel layer)."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate the last dim over ``group``; backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate dim 1 ([batch, seq, ...]) over ``group`` (context parallel); backward reduce-scatters."""
    return x if group_size(group) == 1 else _GatherSeq.apply(x, group)


# ---------------------------------------------------------------------------------------------- init specs
def init_spec(param: torch.Tensor, kind: str, std: float = 0.0, global_shape: Optional[tuple[int, ...]] = None) -> None:
    """Record how ``param`` is initialised: ``kind`` is "normal" (mean 0, ``std``), "zeros" or "ones".

    ``global_shape`` is the unsharded shape (default: the local shape, i.e. not TP-split).
    """
    if kind not in ("normal", "zeros", "ones"):
        raise ValueError(f"init kind {kind!r} is not one of normal, zeros, ones")
    param._init = (kind, float(std))
    param._global_shape = tuple(global_shape) if global_shape is not None else tuple(param.shape)


def _tp_param(local_shape: tuple[int, ...], global_shape: tuple[int, ...], dim: Optional[int], dtype, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device))
    if dim is None:
        set_tensor_model_parallel_attributes(p, False, -1, 1)
    else:
        set_tensor_model_parallel_attributes(p, True, dim, 1)
    p._global_shape = tuple(global_shape)
    return p


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        # Checked by the job config first; this is the last line of defence for direct users.
        from megashard.errors import ConfigError

        raise ConfigError(f"{what}={n} must be divisible by the tensor-parallel size {d}")
    return n // d


# ---------------------------------------------------------------------------------------------- layers
class _TPLinear(nn.Module):
    """``y = x Aᵀ + b`` with the weight ``A [out, in]`` split over tp along ``split_dim`` (0: output features,
    1: input features); the bias ``[out]`` is split with the output features, else replicated."""

    def __init__(self, in_features: int, out_features: int, group: Optional[dist.ProcessGroup], split_dim: int,
                 bias: bool, init_std: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        local = [out_features, in_features]
        local[split_dim] = _divide(local[split_dim], group_size(group), ("out_features", "in_features")[split_dim])
        self.weight = _tp_param(tuple(local), (out_features, in_features), split_dim, dtype, device)
        init_spec(self.weight, "normal", init_std, (out_features, in_features))
        if bias:
            self.bias = _tp_param((local[0],), (out_features,), 0 if split_dim == 0 else None, dtype, device)
            init_spec(self.bias, "zeros", global_shape=(out_features,))
        else:
            self.register_parameter("bias", None)


class ColumnParallelLinear(_TPLinear):
    """``y = x Aᵀ + b`` with ``A`` split by rows (output features) over tp: each rank computes ``out/tp`` features.

    Args:
        in_features, out_features: global sizes; ``out_features`` must divide by the tp size.
        group: the tp process group (``None`` = no tensor parallelism).
        bias: add a bias (split like the output features).
        gather_output: all-gather the output features (else each rank keeps its ``[..., out/tp]`` slice).
        init_std: std of the normal weight init.

    Shapes: input ``[..., in_features]`` replicated over tp; output ``[..., out/tp]`` (or ``[..., out]``).
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[dist.ProcessGroup], *, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device: Any = None) -> None:
        super().__init__(in_features, out_features, group, 0, bias, init_std, dtype, device)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(_TPLinear):
    """``y = x Aᵀ + b`` with ``A`` split by columns (input features) over tp; partial sums all-reduced.

    Input ``[..., in/tp]`` (already split, e.g. a column-parallel output); output ``[..., out]``
    replicated over tp. The bias is not split and is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[dist.ProcessGroup], *, bias: bool = True,
                 init_std: float = 0.02, dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__(in_features, out_features, group, 1, bias, init_std, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over tp; tokens outside a rank's range give zeros, then all-reduce.

    Input ``[...]`` token ids (replicated over tp); output ``[..., dim]`` replicated.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Optional[dist.ProcessGroup], *,
                 init_std: float = 0.02, dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
        self.group = group
        tp, r = group_size(group), group_rank(group)
        local = _divide(num_embeddings, tp, "vocab_size")
        self.vocab_start, self.vocab_end = r * local, (r + 1) * local
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _tp_param((local, embedding_dim), (num_embeddings, embedding_dim), 0, dtype, device)
        init_spec(self.weight, "normal", init_std, (num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


# ---------------------------------------------------------------------------------------------- loss
class _VocabParallelCE(torch.autograd.Function):
    """Cross entropy of logits split over tp on the last dim (Megatron's ``vocab_parallel_cross_entropy``)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        local_v = logits.shape[-1]
        ctx.dtype = logits.dtype
        start = dist.get_rank(group) * local_v
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
        mx = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(mx)
        outside = (target < start) | (target >= start + local_v)
        idx = (target - start).masked_fill(outside, 0)
        picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([picked, sum_exp])  # one all-reduce for both sums
        dist.all_reduce(both, group=group)
        picked, sum_exp = both[0], both[1]
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, idx, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        softmax, idx, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, idx.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        grad.sub_(onehot).mul_(g.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Per-token loss ``[...]`` of ``logits [..., vocab/tp]`` (this rank's vocabulary slice) against ``target [...]``."""
    if group_size(group) == 1:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss in float32, as the parallel path computes it
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target, group)


def scaled_std(std: float, num_layers: int) -> float:
    """Megatron's init of output projections: ``std / sqrt(2 · layers)``."""
    return std / math.sqrt(2.0 * num_layers)
