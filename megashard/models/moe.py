"""A mixture-of-experts MLP with experts spread over megashard's ``ep`` group (all-to-all token dispatch).

Every rank routes its tokens (top-k of a softmax router, gate weights renormalised); with tensor parallelism
each tp rank takes its ``1/tp`` share of the (replicated) tokens — the expert layout folds over the same
ranks as attention's tp/cp/dp. Each (token, choice) pair goes by ``all_to_all_single`` over ``ep`` to the rank
holding its expert (uneven splits, exchanged first: gloo supports them on CPU), the ``E/ep`` local experts run,
the outputs come back the same way and are weighted and summed per token (Megatron's all-to-all dispatcher,
no capacity factor, no dropped tokens). Expert parameters carry ``_expert_parallel = True`` and
``allreduce = False`` (Megatron's mark); the loop shards them with FSDP over ``expt_dp`` and scales
their gradients so that they average over all data-parallel ranks, like the dense ones.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megashard.tensors.tp_attrs import set_tensor_model_parallel_attributes
from megashard.models.layers import all_gather_dim0, group_rank, group_size, init_spec, reduce_scatter_dim0, scaled_std
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
                  dtype: torch.dtype, device: Any, etp_dim: Optional[int] = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape_local, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(p, False, -1, 1)
    init_spec(p, kind, std, shape_global)
    p._expert_parallel = True
    p.allreduce = False
    if etp_dim is not None:
        p._expert_tp_dim = etp_dim  # split over expt_tp along this dim (the expert's ffn dim)
    return p


class _FirstRankOnly(torch.autograd.Function):
    """``x`` on rank 0 of ``group``, zeros elsewhere (a term the following reduce-scatter must count once); the
    gradient passes to every rank unchanged (their incoming gradients are identical)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return x.clone() if dist.get_rank(group) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None


class Experts(nn.Module):
    """This rank's ``E/ep`` experts, stacked, their ffn dim split over ``expt_tp``. ``gpt``: GELU MLPs,
    ``w1 [E/ep, h, ffn/etp]``, ``b1 [E/ep, ffn/etp]``, ``w2 [E/ep, ffn/etp, h]``, ``b2 [E/ep, h]`` (replicated over
    expt_tp; counted on its rank 0). ``llama``: SwiGLU without biases, ``w1`` (gate) and ``w3`` (up)
    ``[E/ep, h, ffn/etp]``, ``w2`` (down). With ``expt_tp > 1`` the output is a partial sum over expt_tp."""

    def __init__(self, cfg: ModelConfig, ffn: int, ep_size: int, ep_rank: int, dtype: torch.dtype, device: Any,
                 etp_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        E, h = cfg.num_experts, cfg.hidden
        n = E // ep_size
        self.first = ep_rank * n  # global id of the first local expert
        self.etp_group = etp_group
        f = ffn // group_size(etp_group)
        std2 = scaled_std(cfg.init_std, cfg.layers)
        self.swiglu = cfg.arch == "llama"
        self.w1 = _expert_param((n, h, f), (E, h, ffn), "normal", cfg.init_std, dtype, device, 2)
        if self.swiglu:
            self.w3 = _expert_param((n, h, f), (E, h, ffn), "normal", cfg.init_std, dtype, device, 2)
        else:
            self.b1 = _expert_param((n, f), (E, ffn), "zeros", 0.0, dtype, device, 1)
        self.w2 = _expert_param((n, f, h), (E, ffn, h), "normal", std2, dtype, device, 1)
        if not self.swiglu:
            self.b2 = _expert_param((n, h), (E, h), "zeros", 0.0, dtype, device)

    def forward(self, tokens: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``tokens [T, h]``, ``choice [T, k]`` global expert ids, ``gate [T, k]`` -> ``[T, h]`` weighted outputs."""
        out = torch.zeros_like(tokens)
        b2 = None
        if not self.swiglu:
            b2 = _FirstRankOnly.apply(self.b2, self.etp_group) if group_size(self.etp_group) > 1 else self.b2
        for e in range(self.w1.shape[0]):
            # Every local expert runs, also on zero tokens, so every rank produces a gradient for every
            # expert parameter (FSDP's reduce-scatter needs them all).
            tok, slot = (choice == self.first + e).nonzero(as_tuple=True)
            x = tokens[tok]
            if self.swiglu:
                y = (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]
            else:
                y = F.gelu(x @ self.w1[e] + self.b1[e]) @ self.w2[e] + b2[e]
            out = out.index_add(0, tok, y * gate[tok, slot].unsqueeze(-1))
        return out


class _ScatterToTP(torch.autograd.Function):
    """This rank's ``1/tp`` slice of rows of a tensor replicated over tp; backward all-gathers the slices' gradients
    (so the replicated input gets the same, complete gradient on every tp rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim=0)[r].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return all_gather_dim0(g, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """All-gather of rows over tp (the inverse of :class:`_ScatterToTP`); backward keeps this rank's rows of the
    (replicated, identical) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n, dim=0)[r].contiguous(), None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits over ``group``; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` whose backward sums too: for a value every rank of ``group`` then uses identically."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _AttachAux(torch.autograd.Function):
    """Identity on ``x`` whose backward also starts the backward of the auxiliary loss ``aux`` (gradient 1): the
    load-balancing loss joins the gradient without joining the returned LM loss (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=g.device)


class MoE(nn.Module):
    """Top-k routed experts over the ``ep`` group. ``[b, s, h] -> [b, s, h]``.

    Tokens are replicated over tp; each tp rank dispatches its ``1/tp`` share of them (parallel folding: the
    expert layout re-partitions the same ranks), by all-to-all over ``ep`` to the ranks that hold the chosen
    experts, and the weighted outputs return the same way and are all-gathered over tp. With
    ``model.moe_aux_loss_coeff > 0`` the router's load-balancing loss (Megatron's, per sequence:
    ``coeff · E · Σ_e f_e · P_e`` with ``f_e`` the share of the sequence's token choices routed to ``e`` and
    ``P_e`` its mean router probability, averaged over sequences; cp chunks summed) adds to the gradient.
    """

    def __init__(self, cfg: ModelConfig, ffn: int, groups: Any, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.group, self.tp, self.cp, self.etp = groups.ep, groups.tp, groups.cp, groups.expt_tp
        self.top_k, self.num_experts = cfg.moe_top_k, cfg.num_experts
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.router, False, -1, 1)
        init_spec(self.router, "normal", cfg.init_std)
        self.experts = Experts(cfg, ffn, group_size(groups.ep), group_rank(groups.ep), dtype, device, groups.expt_tp)

    def aux_loss(self, probs: torch.Tensor, choice: torch.Tensor, b: int) -> torch.Tensor:
        """Per-sequence load-balancing loss of ``probs [b·s, E]`` and ``choice [b·s, k]`` (this cp chunk)."""
        E = self.num_experts
        p = probs.view(b, -1, E)
        counts = F.one_hot(choice.reshape(b, -1), E).sum(dim=1).to(p.dtype)  # [b, E] choices per expert
        sums = torch.cat([p.sum(dim=1), counts, torch.full((b, 1), float(p.shape[1]), dtype=p.dtype,
                                                             device=p.device)], dim=1)
        if group_size(self.cp) > 1:  # whole sequences: sum the cp chunks
            sums = _AllReduceSum.apply(sums, self.cp)
        psum, cnt, tokens = sums[:, :E], sums[:, E:2 * E].detach(), sums[:, 2 * E:]
        f = cnt / (tokens * self.top_k)
        P = psum / tokens
        return self.aux_coeff * E * (f * P).sum(dim=1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(F.linear(tokens, self.router), dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        aux = self.aux_loss(probs, choice, x.shape[0]) if self.aux_coeff > 0 and self.training else None
        tp = group_size(self.tp)
        if tp > 1:  # each tp rank dispatches its share of the (replicated) tokens
            tokens, gate = _ScatterToTP.apply(tokens, self.tp), _ScatterToTP.apply(gate, self.tp)
            choice = choice.chunk(tp, dim=0)[group_rank(self.tp)]
        etp = group_size(self.etp)
        if etp > 1:  # the expt_tp group runs its ranks' tokens together, each rank its slice of every expert
            tokens, gate = _Dim0.apply(tokens, self.etp, True), _Dim0.apply(gate, self.etp, True)
            choice = all_gather_dim0(choice, self.etp)
        out = self._dispatch(tokens, choice, gate) if group_size(self.group) > 1 else self.experts(tokens, choice, gate)
        if etp > 1:  # partial sums over the ffn slices: summed, and each rank keeps its own tokens' rows
            out = _Dim0.apply(out, self.etp, False)
        if tp > 1:
            out = _GatherRows.apply(out, self.tp)
        out = out.view_as(x)
        return _AttachAux.apply(out, aux) if aux is not None else out

    def _dispatch(self, tokens: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """All-to-all over ``ep``: every (token, choice) pair to the rank of its expert, outputs back, weighted."""
        T, k = choice.shape
        n_local = self.experts.w1.shape[0]
        ep = group_size(self.group)
        flat = choice.reshape(-1)                                   # [T·k] expert of each pair
        order = torch.argsort(flat, stable=True)                    # grouped by expert, hence by ep rank
        rows = order // k                                           # token of each sorted pair
        send = torch.bincount(flat[order] // n_local, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)        # how many pairs come from each rank
        send_l, recv_l = send.tolist(), recv.tolist()
        x_in = _AllToAll.apply(tokens[rows], send_l, recv_l, self.group)
        ids = _all_to_all(flat[order].unsqueeze(1), send_l, recv_l, self.group).squeeze(1)
        ones = torch.ones((ids.shape[0], 1), dtype=tokens.dtype, device=tokens.device)
        y = self.experts(x_in, ids.unsqueeze(1), ones)              # [received pairs, h], unweighted
        y = _AllToAll.apply(y, recv_l, send_l, self.group)          # back, in the sorted order
        w = gate.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, rows, y * w)
