"""What one block, the head and the loss save for backward, per microbatch: plain arithmetic over
:class:`~megashard.advisor.shape.JobShape` (docs/advisor.md, "Memory per rank"). Checked exactly against the model in
one process (tests/test_advisor_memory.py: ``test_saved_activations_are_exact`` and its neighbours)."""
from __future__ import annotations

import math

from megashard.advisor.shape import JobShape

#: Bytes of an fp32 scalar the CPU kernels keep per token (LayerNorm mean / rstd, log-sum-exp …).
F32 = 4


def block_activation(s: JobShape, t: int, tp: int, moe: bool, ep: int = 1, expt_tp: int = 1,
                     seq_local: int | None = None, cp: int = 1) -> int:
    """Bytes one block saves for backward for ``t`` tokens on this rank (``[b, s/cp]`` flattened).

    ``gpt``: block input, LayerNorm outputs (2 · t·h) and their mean/rstd, the input of the second LayerNorm (t·h),
    the fused QKV output (3 · t·h/tp: q, k, v are views of it), attention output (t·h/tp; SDPA returns it in the
    projection's layout), attention log-sum-exp (t · heads/tp, fp32), fc1 and GELU outputs (2 · t·ffn/tp).
    ``llama``: RMSNorm keeps its input, normalised input and output (t·h each; under bf16 an fp32 copy instead of the
    input), SDPA the rotated q and k (2 · t·h/tp) besides v's QKV storage, the cos / sin tables cast per call, SwiGLU
    four t·ffn/tp tensors. MoE blocks replace the
    MLP by the router's probabilities and, per routed (token, expert) pair, the expert's input, output and hidden
    activations (pairs = t·top_k/tp, spread evenly over the ep ranks).
    """
    e = s.act_bytes
    h, a = s.hidden, s.heads // tp
    gpt = s.arch == "gpt"
    upcast = not gpt and e != F32  # RMSNorm computes in fp32: it keeps the fp32 copy, not the bf16 input
    norm_in = 0 if upcast else t * h * e  # the norm's input (the residual stream), kept by the norm
    if gpt:
        norm = t * h * e + 2 * t * F32
    else:
        norm = 2 * t * h * e + t * F32 + (t * h * F32 if upcast else 0)
    attn = (3 + 1) * t * h // tp * e + t * a * F32  # qkv; SDPA output (its [b, s, heads, d] layout: no copy)
    if not gpt:  # rotated q and k (SDPA's inputs) and the cos / sin tables cast to the dtype, twice
        attn += 2 * t * h // tp * e + 4 * (seq_local or s.seq) * (h // s.heads) * e
    if cp > 1:
        # SDPA keeps the keys and values all-gathered over cp (cp · t tokens each) and the causal mask of this chunk
        # as an additive float tensor [s/cp, s]; llama's q is the rotated copy and v its gathered copy, so the QKV
        # output is no longer kept there (measured: one t·h/tp more than q's rotated copy stays, the rotary's)
        local = seq_local or s.seq // cp
        attn += 2 * cp * t * h // tp * e + local * local * cp * e
        if not gpt:
            attn -= 3 * t * h // tp * e
    out = norm_in + norm + attn + norm_in + norm  # ln1 (input, output), attention, ln2 (input, output)
    if moe:
        # pairs arrive from every ep rank: the busiest rank gets up to the imbalance bound's share
        out += t * s.num_experts * e + t * s.top_k * (8 + 2 * e)  # router softmax, top-k ids and gates
        out += moe_pairs(s, t, tp, ep, expt_tp) * moe_pair_bytes(s, expt_tp)
    else:
        f = s.ffn // tp
        out += (2 if gpt else 4) * t * f * e
    return out


def moe_pairs(s: JobShape, t: int, tp: int, ep: int = 1, expt_tp: int = 1) -> int:
    """(token, expert) pairs the busiest ep rank's experts run for ``t`` tokens: ``t · top_k / tp`` per rank, times
    expt_tp (its group runs its ranks' tokens together), times the routing-imbalance bound with ``ep > 1``."""
    pairs = t * s.top_k // tp * expt_tp
    return math.ceil(pairs * s.moe_imbalance) if ep > 1 else pairs


def moe_pair_bytes(s: JobShape, expt_tp: int = 1) -> int:
    """Bytes one routed pair keeps for backward: the expert's input and output, its hidden activations (gpt: fc1 and
    GELU; llama: gate, SiLU, up, product), the output the gate weight multiplies, index tensors."""
    e, h, f = s.act_bytes, s.hidden, s.ffn // expt_tp
    return (2 * h + (2 if s.arch == "gpt" else 4) * f) * e + 3 * 8 + h * e


def head_activation(s: JobShape, t: int, tp: int, stage_output: bool = False) -> tuple[int, int]:
    """``(saved, backward_peak_extra)`` bytes of the last stage's final norm, head and loss for ``t`` tokens.

    Saved: the last block's output, the final norm's tensors and the softmax (fp32, t · vocab/tp). At the start of
    backward its gradient and a one-hot (or nll) scratch tensor of the same size join it, and a bf16 copy of the
    gradient under bf16.
    """
    e, h, V = s.act_bytes, s.hidden, s.vocab // tp
    upcast = s.arch != "gpt" and e != F32
    norm = t * h * e + 2 * t * F32 if s.arch == "gpt" else 2 * t * h * e + t * F32 + (t * h * F32 if upcast else 0)
    logits = t * V * F32
    saved = (0 if upcast else t * h * e) + norm + logits + t * 9  # + target ids and the out-of-range mask (tp > 1)
    if stage_output:  # a pipeline's last stage: the schedule keeps its output (the logits) until its backward
        saved += t * V * e
    extra = 2 * t * V * F32 + (t * V * e if e != F32 else 0)
    return saved, extra


def weight_grad_inputs(s: JobShape, t: int, tp: int, moe: bool, ep: int = 1, expt_tp: int = 1) -> int:
    """Bytes of one block's gradients that a split backward (zbv: ``stage_backward_input``) keeps for its weight step:
    the gradient at the output of every op with a weight (the param groups' intermediates), held from the input
    backward until the weight backward. Both norms' outputs, the QKV output (3 · t·h/tp), the projection's output (the
    residual stream's gradient), the block's output (the MLP's last linear's), and the MLP's first linear(s)
    (gpt: fc1; llama: gate and up; MoE, by the same rule but not measured: the router's logits and each routed pair's
    expert output and hidden). Measured at the peak of zbv jobs (gpt fp32 and bf16, llama; docs/advisor.md)."""
    e, h = s.act_bytes, s.hidden
    out = (4 * t * h + 3 * t * h // tp) * e
    if moe:
        f = s.ffn // expt_tp
        out += t * s.num_experts * e + moe_pairs(s, t, tp, ep, expt_tp) * (h + (1 if s.arch == "gpt" else 2) * f) * e
    else:
        out += (1 if s.arch == "gpt" else 2) * t * (s.ffn // tp) * e
    return out


def head_weight_grad_inputs(s: JobShape, t: int, tp: int) -> int:
    """What the last stage's final norm and head add to :func:`weight_grad_inputs`: the norm output's gradient and the
    logits' (the head's output; under bf16 the bf16 copy the head's weight gradient is computed from)."""
    return t * s.hidden * s.act_bytes + t * (s.vocab // tp) * s.act_bytes
