"""A small GPT (or Llama-style, ``model.arch: llama``) built from megashard's tensor-parallel layers.

    model = GPT(job.model, groups=ModelGroups.from_state(state), dtype=torch.float32)
    init_parameters(model, seed=1234, groups=groups)     # layout-independent initial values
    loss = model(inputs, targets)                        # mean token loss of this rank's tokens

Per block (pre-LayerNorm): ``x + Attention(LN(x))`` then ``x + MLP(LN(x))``. Attention: fused QKV
column-parallel projection (rows ordered head by head, so a contiguous TP split gives each rank whole
heads), scaled-dot-product attention (its dropout inside the model-parallel RNG fork), row-parallel
output projection. MLP: column-parallel ``hidden → ffn``, GELU, row-parallel ``ffn → hidden`` — or an
MoE layer (:mod:`megashard.models.moe`). Embedding: vocabulary-parallel; LM head: column-parallel with
a vocabulary-parallel cross entropy (the logits are never gathered); ``model.tie_embeddings`` uses the
embedding table as the head's weight. With context parallelism each rank holds a contiguous chunk of the
sequence and all-gathers keys and values over ``cp``. ``arch: llama`` swaps in RMSNorm, rotary positions
and a SwiGLU MLP without biases (:mod:`megashard.models.llama.blocks`).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megashard.tensors.tp_attrs import get_mcore_tensor_parallel_partition_dim, set_tensor_model_parallel_attributes
from megashard.models.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_seq,
    group_rank,
    group_size,
    init_spec,
    scaled_std,
    vocab_parallel_cross_entropy,
)
from megashard.models.config import ModelConfig, default_ffn_hidden

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.models.stages import StageSpec

__all__ = ["GPT", "ModelGroups", "init_parameters", "param_init_seed", "default_ffn_hidden"]


@dataclass
class ModelGroups:
    """The process groups the model communicates over (``None`` = axis of size 1, no communication)."""

    tp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    expt_tp: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_state(cls, state: ParallelState) -> "ModelGroups":
        """Groups of a :class:`megashard.state.ParallelState`, taken as Megatron modules take theirs: through its
        ``pg_collection()`` (axes of size 1 become ``None``)."""
        return cls.from_pg_collection(state.pg_collection(megatron=False))  # no megatron-core import in the job

    @classmethod
    def from_pg_collection(cls, pgs: Any) -> "ModelGroups":
        """Groups of a Megatron ``ProcessGroupCollection`` (``pgs.tp``, ``pgs.cp``, ``pgs.ep``,
        ``pgs.expt_tp``; size 1 -> ``None``)."""
        def g(pg: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
            return pg if pg is not None and pg.size() > 1 else None

        return cls(tp=g(pgs.tp), cp=g(pgs.cp), ep=g(pgs.ep), expt_tp=g(pgs.expt_tp))


def _replicated(p: nn.Parameter, kind: str, std: float = 0.0) -> nn.Parameter:
    set_tensor_model_parallel_attributes(p, False, -1, 1)
    init_spec(p, kind, std)
    return p


def _norm(cfg: ModelConfig, dtype: torch.dtype, device: Any) -> nn.Module:
    """LayerNorm (``gpt``) or RMSNorm (``llama``) over the hidden dim, replicated over tp."""
    if cfg.arch == "llama":
        from megashard.models.llama.blocks import RMSNorm

        return RMSNorm(cfg.hidden, cfg.norm_eps, dtype, device)
    ln = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, dtype=dtype, device=device)
    _replicated(ln.weight, "ones")
    _replicated(ln.bias, "zeros")
    return ln


class Attention(nn.Module):
    """Causal multi-head self-attention; heads split over tp, sequence over cp. ``[b, s/cp, h] -> [b, s/cp, h]``."""

    def __init__(self, cfg: ModelConfig, groups: ModelGroups, dtype: torch.dtype, device: Any,
                 rotary: Optional[Any] = None) -> None:
        super().__init__()
        h = cfg.hidden
        self.groups, self.rotary = groups, rotary
        self.local_heads = cfg.heads // group_size(groups.tp)
        self.head_dim = h // cfg.heads
        self.dropout = cfg.dropout
        bias = cfg.arch == "gpt"
        self.qkv = ColumnParallelLinear(h, 3 * h, groups.tp, bias=bias, init_std=cfg.init_std, dtype=dtype, device=device)
        self.proj = RowParallelLinear(h, h, groups.tp, bias=bias, init_std=scaled_std(cfg.init_std, cfg.layers),
                                      dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=3)  # [b, s, heads/tp, head_dim]
        if self.rotary is not None:  # global positions of this cp chunk, before k is gathered over cp
            start = group_rank(self.groups.cp) * s
            q, k = self.rotary.apply(q, start), self.rotary.apply(k, start)
        mask, causal = None, True
        cp = group_size(self.groups.cp)
        if cp > 1:
            k, v = gather_seq(k, self.groups.cp), gather_seq(v, self.groups.cp)
            q_pos = group_rank(self.groups.cp) * s + torch.arange(s, device=x.device)
            mask = torch.arange(k.shape[1], device=x.device)[None, :] <= q_pos[:, None]  # True = attend
            causal = False
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if p > 0:
            from megashard.state.rng import get_cuda_rng_tracker

            # Heads differ across TP ranks, so their dropout masks must too: the model-parallel stream.
            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """``hidden -> ffn`` (column-parallel), GELU, ``ffn -> hidden`` (row-parallel)."""

    def __init__(self, cfg: ModelConfig, ffn: int, groups: ModelGroups, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden, ffn, groups.tp, init_std=cfg.init_std, dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden, groups.tp, init_std=scaled_std(cfg.init_std, cfg.layers),
                                     dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; ``recompute`` reruns it in backward (megashard.state.recompute.checkpoint)."""

    def __init__(self, cfg: ModelConfig, ffn: int, moe: bool, groups: ModelGroups, dtype: torch.dtype, device: Any,
                 rotary: Optional[Any] = None) -> None:
        super().__init__()
        self.ln1 = _norm(cfg, dtype, device)
        self.attn = Attention(cfg, groups, dtype, device, rotary)
        self.ln2 = _norm(cfg, dtype, device)
        if moe:  # experts of the architecture's MLP kind (GELU or SwiGLU)
            from megashard.models.moe import MoE

            self.mlp: nn.Module = MoE(cfg, ffn, groups, dtype, device)
        elif cfg.arch == "llama":
            from megashard.models.llama.blocks import SwiGLU

            self.mlp = SwiGLU(cfg.hidden, ffn, cfg.layers, cfg.init_std, groups.tp, dtype, device)
        else:
            self.mlp = MLP(cfg, ffn, groups, dtype, device)
        self.dropout = cfg.dropout
        self.recompute, self.distribute_saved = cfg.recompute, cfg.distribute_saved_activations
        self.tp_group = groups.tp
        self.in_pipeline = False  # set by GPT for pipeline stages

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            from megashard.state.recompute import checkpoint, checkpoint_nonreentrant

            if self.in_pipeline:  # pipeline schedules differentiate with torch.autograd.grad
                return checkpoint_nonreentrant(self._body, x)

            distribute = self.distribute_saved and self.tp_group is not None
            return checkpoint(self._body, distribute, x, group=self.tp_group)
        return self._body(x)


class GPT(nn.Module):
    """The model: ``forward(ids, targets) -> mean loss`` over this rank's tokens (``ids``, ``targets``: ``[b, s/cp]``).

    ``stage`` (a :class:`~megashard.models.stages.StageSpec`) builds one pipeline stage instead: the embeddings only
    on the first, the final norm and LM head only on the last (plus a copy of a tied embedding table), and the
    blocks ``stage.layers`` under their global names (``blocks.<i>``).
    """

    def __init__(self, cfg: ModelConfig, groups: Optional[ModelGroups] = None, *, ffn_hidden: Optional[int] = None,
                 moe_layers: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, device: Any = None,
                 stage: Optional["StageSpec"] = None) -> None:
        super().__init__()
        groups = groups or ModelGroups()
        self.cfg, self.groups, self.stage = cfg, groups, stage
        ffn = ffn_hidden or cfg.ffn_hidden or default_ffn_hidden(cfg)
        moe_layers = moe_layers or []
        first = stage is None or stage.is_first
        last = stage is None or stage.is_last
        self.is_first, self.is_last = first, last
        layers = range(cfg.layers) if stage is None else stage.layers
        # The last stage of a pipeline keeps its own copy of a tied embedding table (Megatron's shared embedding):
        # same name, same init, gradients all-reduced over the embedding group, so the copies stay equal.
        if first or (last and cfg.tie_embeddings):
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, groups.tp, init_std=cfg.init_std,
                                                dtype=dtype, device=device)
            if not first:
                self.embed.weight._tied_copy = True  # counted once by the gradient norm (on the first stage)
        rotary = None
        if cfg.arch == "llama":
            from megashard.models.llama.blocks import Rotary

            rotary = Rotary(cfg.hidden // cfg.heads, cfg.seq_len, cfg.rope_theta, device=device)
        elif first:
            self.pos = _replicated(nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, dtype=dtype, device=device)),
                                   "normal", cfg.init_std)
        # Keyed by the global block index, so parameter names ("blocks.5.attn.qkv.weight") are the same in every
        # pipeline split (checkpoints load across splits).
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, ffn, i in moe_layers, groups, dtype, device, rotary) for i in layers}
        )
        for block in self.blocks.values():
            block.in_pipeline = stage is not None
        self.head = None
        if last:
            self.ln_f = _norm(cfg, dtype, device)
            if not cfg.tie_embeddings:
                self.head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, groups.tp, bias=False,
                                                 init_std=cfg.init_std, dtype=dtype, device=device)

    def forward(self, inp: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``inp``: token ids ``[b, s/cp]`` (first stage) or hidden states ``[b, s/cp, h]``. Returns the mean loss
        if ``targets`` is given (last stage), else the logits ``[b, s/cp, vocab/tp]`` (last stage, for a pipeline
        schedule's loss function) or the hidden states (other stages)."""
        if self.is_first:
            s = inp.shape[1]
            x = self.embed(inp)
            if self.cfg.arch == "gpt":
                start = group_rank(self.groups.cp) * s
                x = x + self.pos[start: start + s]
            x = F.dropout(x, self.cfg.dropout, self.training)
        else:
            x = inp
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        h = self.ln_f(x)
        if self.head is None:  # tied: the vocabulary-parallel embedding table is the column-parallel head weight
            logits = F.linear(copy_to_tp(h, self.groups.tp), self.embed.weight)
        else:
            logits = self.head(h)  # [b, s, vocab/tp]
        if targets is None:
            return logits
        return self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of ``logits [b, s, vocab/tp]`` against ``targets [b, s]`` (vocabulary-parallel)."""
        return vocab_parallel_cross_entropy(logits, targets, self.groups.tp).mean()


# ---------------------------------------------------------------------------------------------- init
def param_init_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s full-tensor init: a function of the seed and the name only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _slice_cuts(p: torch.Tensor, groups: ModelGroups) -> list[tuple[int, int, int]]:
    """``[(dim, n, r), ...]``: this rank's part of the full tensor as successive ``chunk(n, dim)[r]``: the expert slice
    (dim 0 over ep, then the ffn dim over expt_tp), then the TP slice (partition dim over tp)."""
    cuts = []
    if getattr(p, "_expert_parallel", False):
        cuts.append((0, group_size(groups.ep), group_rank(groups.ep)))
        etp_dim = getattr(p, "_expert_tp_dim", None)
        if etp_dim is not None:
            cuts.append((etp_dim, group_size(groups.expt_tp), group_rank(groups.expt_tp)))
    dim = get_mcore_tensor_parallel_partition_dim(p)
    if dim is not None:
        cuts.append((dim, group_size(groups.tp), group_rank(groups.tp)))
    return cuts


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, groups: Optional[ModelGroups] = None) -> None:
    """Initialise every parameter so that the *global* model depends on ``seed`` only, not on the layout.

    For each parameter the full tensor (its ``_global_shape``) is drawn in float64 from a private
    generator seeded by :func:`param_init_seed`, and this rank's expert/TP slice is copied in. Call
    before ``fully_shard``. The full tensor is drawn in row blocks (:func:`megashard.models.init_slices.local_normal`:
    the same values), so the peak extra memory is this rank's slice plus one block of 8 MiB, not a full parameter.
    """
    from megashard.models.init_slices import local_normal, slice_ranges

    groups = groups or getattr(model, "groups", None) or ModelGroups()
    for name, p in _named_params(model):
        kind, std = getattr(p, "_init", ("normal", 0.02))
        shape = getattr(p, "_global_shape", tuple(p.shape))
        cuts = _slice_cuts(p, groups)
        if kind == "normal":
            g = torch.Generator().manual_seed(param_init_seed(seed, name))
            local = local_normal(shape, cuts, std, g)
        else:
            local = (torch.zeros if kind == "zeros" else torch.ones)([b - a for a, b in slice_ranges(shape, cuts)],
                                                                     dtype=torch.float64)
        if tuple(local.shape) != tuple(p.shape):
            raise RuntimeError(f"{name}: local slice {tuple(local.shape)} of global {shape} does not fit {tuple(p.shape)}")
        p.copy_(local.to(dtype=p.dtype))


def _named_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    yield from model.named_parameters()
