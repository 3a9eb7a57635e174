"""A mixture-of-experts MLP with experts spread over megashard's ``ep`` group (all-gather token dispatch).

Every rank routes its own tokens (top-k of a softmax router, gate weights renormalised), then the
tokens, gates and choices of the ``ep`` group are all-gathered; each rank runs its ``E/ep`` local
experts on the tokens routed to them and a reduce-scatter returns every token's weighted sum to its
owner. This is Megatron's all-gather dispatcher: equal-size collectives (gloo-friendly), no
capacity factor, no dropped tokens. Expert parameters carry ``_expert_parallel = True`` and
``allreduce = False`` (Megatron's mark); the loop shards them with FSDP over ``expt_dp`` and scales
their gradients so that they average over all data-parallel ranks, like the dense ones.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megashard.tensors.tp_attrs import set_tensor_model_parallel_attributes
from megashard.train.layers import all_gather_dim0, group_rank, group_size, init_spec, reduce_scatter_dim0, scaled_std
from megashard.train.sections import ModelConfig

__all__ = ["MoE", "Experts"]


class _Dim0(torch.autograd.Function):
    """All-gather (``gather=True``) or reduce-scatter along dim 0 over ``group``; backward is the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return all_gather_dim0(x, group) if gather else reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return (reduce_scatter_dim0(g, ctx.group) if ctx.gather else all_gather_dim0(g, ctx.group)), None, None


def _expert_param(shape_local: tuple[int, ...], shape_global: tuple[int, ...], kind: str, std: float,
                  dtype: torch.dtype, device: Any) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape_local, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(p, False, -1, 1)
    init_spec(p, kind, std, shape_global)
    p._expert_parallel = True
    p.allreduce = False
    return p


class Experts(nn.Module):
    """This rank's ``E/ep`` experts (GELU MLPs), stacked: ``w1 [E/ep, h, ffn]``, ``w2 [E/ep, ffn, h]``."""

    def __init__(self, cfg: ModelConfig, ffn: int, ep_size: int, ep_rank: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        E, h = cfg.num_experts, cfg.hidden
        n = E // ep_size
        self.first = ep_rank * n  # global id of the first local expert
        std2 = scaled_std(cfg.init_std, cfg.layers)
        self.w1 = _expert_param((n, h, ffn), (E, h, ffn), "normal", cfg.init_std, dtype, device)
        self.b1 = _expert_param((n, ffn), (E, ffn), "zeros", 0.0, dtype, device)
        self.w2 = _expert_param((n, ffn, h), (E, ffn, h), "normal", std2, dtype, device)
        self.b2 = _expert_param((n, h), (E, h), "zeros", 0.0, dtype, device)

    def forward(self, tokens: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``tokens [T, h]``, ``choice [T, k]`` global expert ids, ``gate [T, k]`` -> ``[T, h]`` weighted outputs."""
        out = torch.zeros_like(tokens)
        for e in range(self.w1.shape[0]):
            # Every local expert runs, also on zero tokens, so every rank produces a gradient for every
            # expert parameter (FSDP's reduce-scatter needs them all).
            tok, slot = (choice == self.first + e).nonzero(as_tuple=True)
            y = F.gelu(tokens[tok] @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]
            out = out.index_add(0, tok, y * gate[tok, slot].unsqueeze(-1))
        return out


class MoE(nn.Module):
    """Top-k routed experts over the ``ep`` group. ``[b, s, h] -> [b, s, h]``."""

    def __init__(self, cfg: ModelConfig, ffn: int, groups: Any, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.group = groups.ep
        self.top_k = cfg.moe_top_k
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.router, False, -1, 1)
        init_spec(self.router, "normal", cfg.init_std)
        self.experts = Experts(cfg, ffn, group_size(groups.ep), group_rank(groups.ep), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(F.linear(tokens, self.router), dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        if group_size(self.group) > 1:
            tokens, gate = _Dim0.apply(tokens, self.group, True), _Dim0.apply(gate, self.group, True)
            all_choice = all_gather_dim0(choice, self.group)
            out = _Dim0.apply(self.experts(tokens, all_choice, gate), self.group, False)
        else:
            out = self.experts(tokens, choice, gate)
        return out.view_as(x)
