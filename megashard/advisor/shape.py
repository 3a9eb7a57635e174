"""What the advisor needs to know of a job: the model's sizes, the batch and the precision, as plain numbers.

:class:`JobShape` is read from a :class:`~megashard.train.config.JobConfig` (:meth:`JobShape.from_job`) and lists
the parameters of the example model (:mod:`megashard.models.gpt.model`) per module, with their tensor-parallel local
shapes (:func:`block_params`, :func:`root_params`): the same shapes ``GPT`` allocates, computed without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megashard.models.config import default_ffn_hidden

#: Bytes per element of ``train.dtype`` (the compute / activation dtype).
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


@dataclass(frozen=True)
class JobShape:
    """The numbers of a job that decide its memory and time (no parallel sizes: those are the candidate's)."""

    arch: str = "gpt"
    vocab: int = 256
    seq: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    num_experts: int = 0
    moe_every: int = 2
    top_k: int = 1
    tie: bool = False
    dropout: float = 0.0
    global_batch: int = 16
    microbatches: int | None = None
    micro_batch_size: int | None = None
    """``train.micro_batch_size``: sequences per microbatch (the microbatches follow from dp) when microbatches is
    None."""
    dtype: str = "float32"
    schedule: str = "1f1b"
    reshard_between_microbatches: bool = False
    synthetic_sequences: int = 0
    """Sequences of synthetic data every rank holds in memory (int64; 0 for memory-mapped data)."""
    branching: int = 4
    """``data.branching``: successors of each token in the synthetic data's Markov chain (its set-up's tables)."""
    moe_imbalance: float = 1.1
    """The routing-imbalance bound of MoE memory: the busiest ep rank's experts receive at most this multiple of
    the even share of routed (token, expert) pairs (1: perfectly balanced; the worst case is
    ``ep · min(top_k, experts/ep) / top_k``, every token of the ep group sending to one rank). An upper bound only for
    routings within it: a load-balancing loss (``model.moe_aux_loss_coeff``) keeps a trained router there."""

    @classmethod
    def from_job(cls, job: Any) -> "JobShape":
        m, t, d = job.model, job.train, job.data
        return cls(arch=m.arch, vocab=m.vocab_size, seq=m.seq_len, hidden=m.hidden, layers=m.layers, heads=m.heads,
                   ffn=m.ffn_hidden or default_ffn_hidden(m), num_experts=m.num_experts,
                   moe_every=m.moe_every, top_k=m.moe_top_k, tie=m.tie_embeddings, dropout=m.dropout,
                   global_batch=t.global_batch, microbatches=t.microbatches,
                   micro_batch_size=t.micro_batch_size, dtype=t.dtype,
                   schedule=t.pipeline_schedule, reshard_between_microbatches=t.reshard_between_microbatches,
                   synthetic_sequences=d.num_sequences if d.source == "synthetic" else 0, branching=d.branching,
                   moe_imbalance=default_moe_imbalance(m.moe_top_k))

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation element (train.dtype)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        """Bytes of a stored parameter element: fp32 master weights under bf16 (FSDP's mixed precision)."""
        return 4 if self.dtype == "bfloat16" else DTYPE_BYTES[self.dtype]

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    def mb(self, pp: int, dp: int | None = None) -> int:
        """Microbatches per step and data-parallel rank: train.microbatches; else global_batch / (dp ·
        micro_batch_size) when that is set (as :meth:`JobConfig.microbatches`); else pp."""
        if self.microbatches is not None:
            return self.microbatches
        if self.micro_batch_size and dp:
            return max(1, self.global_batch // (dp * self.micro_batch_size))
        return pp


def default_moe_imbalance(top_k: int) -> float:
    """The routing-imbalance bound MoE memory assumes unless given (``--moe-imbalance``): 1.1 for top-k ≥ 2, 1.3 for
    top-1 — a token's pairs all go to one rank, nothing averages over its choices; measured with fresh routers on the
    held-out jobs of tests/test_advisor_memory.py (the busiest of 4 ep ranks, top-1: 1.25)."""
    return 1.3 if top_k == 1 else 1.1


def block_params(s: JobShape, tp: int, moe: bool, ep: int = 1, expt_tp: int = 1) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(dense, expert)`` parameters of one block as ``(dim0, rest)`` local shapes after the tp / ep / expt_tp split.

    ``dim0`` is the dim FSDP shards (rows); ``rest`` the product of the other dims.
    """
    h, f = s.hidden, s.ffn
    bias = s.arch == "gpt"
    norm = [(h, 1), (h, 1)] if bias else [(h, 1)]  # LayerNorm weight + bias, RMSNorm weight
    dense = norm + norm + [(3 * h // tp, h), (h, h // tp)]  # ln1, ln2, qkv, proj
    if bias:
        dense += [(3 * h // tp, 1), (h, 1)]
    expert: list[tuple[int, int]] = []
    if moe:
        E = s.num_experts // ep
        fe = f // expt_tp
        dense.append((s.num_experts, h))  # router, replicated
        if bias:
            expert += [(E, h * fe), (E, fe), (E, fe * h), (E, h)]
        else:
            expert += [(E, h * fe), (E, h * fe), (E, fe * h)]
    elif bias:
        dense += [(f // tp, h), (f // tp, 1), (h, f // tp), (h, 1)]
    else:
        dense += [(f // tp, h), (f // tp, h), (h, f // tp)]
    return dense, expert


def root_params(s: JobShape, tp: int, first: bool, last: bool) -> list[tuple[int, int]]:
    """The parameters outside the blocks on a stage: embeddings (first), position table (gpt, first), final norm and
    head (last; a tied model's last stage holds a copy of the embedding table instead)."""
    h, V = s.hidden, s.vocab // tp
    out: list[tuple[int, int]] = []
    if first or (last and s.tie):
        out.append((V, h))
    if first and s.arch == "gpt":
        out.append((s.seq, h))
    if last:
        out += [(h, 1), (h, 1)] if s.arch == "gpt" else [(h, 1)]
        if not s.tie:
            out.append((V, h))
    return out


def numel(shapes: list[tuple[int, int]]) -> int:
    return sum(a * b for a, b in shapes)


def sharded_numel(shapes: list[tuple[int, int]], n: int) -> int:
    """Elements this rank stores when FSDP2 shards every tensor's dim 0 over ``n`` ranks (ceil(dim0 / n) rows; the
    largest shard, rank 0's)."""
    if n == 1:
        return numel(shapes)
    return sum(-(-a // n) * b for a, b in shapes)
