"""Peak memory per rank of the example job in one layout: plain arithmetic over :class:`~megashard.advisor.shape.JobShape`.

    est = estimate_memory(shape, sizes, recompute=False)
    est.peak, est.parts, est.phase, est.rank     # bytes; the largest rank's breakdown; where its peak is

It counts what ``megashard run`` really keeps (docs/advisor.md has every formula):

- **state**: fp32 (or float64) master parameters, their gradients and AdamW's two moments, each FSDP-sharded:
  dense tensors over ``dp_shard · cp`` (HSDP replicas over ``dp_outer`` hold the same shards), experts over
  ``expt_dp / dp_outer``; FSDP2 splits dim 0 into ceil(dim0 / n) rows, so a rank holds rank 0's (largest) share;
- **gathered**: the unsharded parameters FSDP2 all-gathers in the compute dtype — the root module (embeddings,
  head) for the whole forward and backward, one block (plus the next, prefetched) at a time, the blocks FSDP never
  reshards after forward (the last; all on a one-rank mesh) until their backward, and the last all-gather's buffer
  FSDP holds at the end of forward; a pipeline stage keeps all of its blocks gathered for the step
  (``train.reshard_between_microbatches: false``), and gradient accumulation (pipeline or ``train.microbatches >
  1``) keeps every unsharded gradient until the last microbatch;
- **activations**: the tensors each block saves for backward (:func:`block_activation`: cp's gathered keys and
  values, MoE pairs up to the routing-imbalance bound ``JobShape.moe_imbalance``), per microbatch, times the
  microbatches in flight (1 without a pipeline; ``pp - r`` on pipeline rank r under 1F1B, all under GPipe, the
  warm-up depth under interleaved schedules), a pipeline's last stage also its logits; with ``model.recompute``
  only each block's input plus one block being recomputed;
- **logits**: the vocabulary-parallel cross entropy's softmax, its gradient and a scratch copy (3 · tokens · vocab/tp
  floats at the start of backward);
- **transients**: the optimizer step's scratch copy (foreach AdamW's ``sqrt(v)``: one fp32 copy of the shard),
  the pipeline's receive buffers, the synthetic data.

The peak is the largest of these moments: the end of forward / start of backward, the start and the end
(reduce-scatter) of each block's backward, an MoE block's experts' backward (every stacked expert weight's gradient
at full size — ``select_backward`` of ``w[e]`` — plus a new one and their sum), and the optimizer step
(:func:`estimate_memory`). No torch import, no process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megashard.advisor.shape import JobShape, block_params, numel, root_params, sharded_numel

#: Bytes of an fp32 scalar the CPU kernels keep per token (LayerNorm mean / rstd, log-sum-exp …).
F32 = 4


@dataclass
class MemoryEstimate:
    """Peak bytes of the largest rank and what they are made of."""

    peak: int
    rank: int
    """Pipeline rank whose peak is largest (0 without a pipeline)."""
    phase: str
    """Where that peak is: ``forward end``, ``backward block i``, ``optimizer step``."""
    parts: dict[str, int] = field(default_factory=dict)
    """Bytes by kind at the peak: params, grads, optimizer, gathered, activations, logits, transient, data."""
    activation_per_block: int = 0
    """Bytes the rank's first block saves for one microbatch without recompute."""
    activation_kept_per_block: int = 0
    """What it keeps between forward and backward in this layout (with recompute: its input only)."""
    inflight: int = 1
    """Microbatches whose activations one rank holds at once (pipeline rank ``rank``)."""
    largest_moe_shard: int = 0
    """Bytes of one MoE block's expert parameters on this rank after ep / expt_tp / FSDP (0 without experts)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Bytes at every moment the estimate weighs (``forward end``, ``backward block i``, ``optimizer step``)."""


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


def inflight_microbatches(s: JobShape, pp: int, vpp: int, r: int, mb: int) -> float:
    """Microbatches whose activations pipeline rank r holds at once, in units of all of its stages' activations
    for one microbatch (a fraction under interleaved schedules, where each unit is one virtual stage's)."""
    if pp == 1:
        return 1
    sched = s.schedule
    if sched == "gpipe":
        return mb
    if sched == "1f1b":
        return min(mb, pp - r)
    # interleaved_1f1b / zbv: PyTorch's warm-up depth (vpp - 1) · mb_per_round + 2 · (pp - 1 - r) virtual-stage
    # forwards, plus the one in flight; each holds one of the rank's vpp stages
    per_round = mb // max(1, mb // pp)
    return min(mb * vpp, (vpp - 1) * per_round + 2 * (pp - 1 - r) + 1) / vpp


def _stages_of(s: JobShape, pp: int, vpp: int, r: int) -> list[tuple[bool, bool, list[int]]]:
    from megashard.models.stages import stage_specs  # pure Python (no torch)

    if pp == 1:
        return [(True, True, list(range(s.layers)))]
    return [(st.is_first, st.is_last, list(st.layers)) for st in stage_specs(s.layers, r, pp, vpp, s.schedule)]


def estimate_memory(s: JobShape, sz: Any, recompute: bool = False, distribute_saved: bool = False) -> MemoryEstimate:
    """Peak bytes per rank of ``s`` in the layout ``sz`` (a :class:`~megashard.config.ResolvedSizes` or anything with
    tp, cp, pp, vpp, dp, dp_outer, dp_shard, ep, expt_tp, expt_dp), for every pipeline rank; the largest wins."""
    best: MemoryEstimate | None = None
    pp, vpp = sz.pp, (sz.vpp or 1)
    ranks = range(pp) if pp <= 16 else sorted({0, 1, pp // 2, pp - 2, pp - 1})
    for r in ranks:
        est = _estimate_rank(s, sz, r, recompute, distribute_saved)
        if best is None or est.peak > best.peak:
            best = est
    assert best is not None
    return best


def _estimate_rank(s: JobShape, sz: Any, r: int, recompute: bool, distribute_saved: bool) -> MemoryEstimate:
    tp, cp, pp, vpp = sz.tp, sz.cp, sz.pp, (sz.vpp or 1)
    ep, etp = sz.ep, sz.expt_tp
    n_dense = sz.dp_shard * cp  # FSDP shard group of dense parameters
    n_expert = max(1, sz.expt_dp // sz.dp_outer)  # expert FSDP shard group (inside an HSDP replica)
    pb, e = s.param_bytes, s.act_bytes
    mb = s.mb(pp)
    b_micro = s.global_batch // (sz.dp * mb)
    t = b_micro * s.seq // cp  # tokens per microbatch on this rank

    stages = _stages_of(s, pp, vpp, r)
    dense: list[tuple[int, int]] = []
    expert: list[tuple[int, int]] = []
    blocks: list[tuple[int, int]] = []  # (unsharded dense numel, unsharded expert numel) per block, forward order
    acts: list[int] = []  # bytes saved per block per microbatch
    expert_big: list[int] = []  # elements of each block's largest expert tensor (0: a dense block)
    expert_n: list[int] = []  # how many expert tensors of that size (gpt: w1, w2; llama: w1, w3, w2)
    pairs_of: list[int] = []  # routed pairs of each block's experts per microbatch (0: a dense block)
    moe_shard = 0
    first = any(st[0] for st in stages)
    last = any(st[1] for st in stages)
    root = []
    for is_first, is_last, layers in stages:
        root += root_params(s, tp, is_first, is_last)
        for i in layers:
            moe = s.is_moe(i)
            d, x = block_params(s, tp, moe, ep, etp)
            dense += d
            expert += x
            blocks.append((numel(d), numel(x)))
            expert_big.append(max((a * b for a, b in x), default=0))
            expert_n.append(sum(a * b == expert_big[-1] for a, b in x))
            pairs_of.append(moe_pairs(s, t, tp, ep, etp) if moe else 0)
            acts.append(block_activation(s, t, tp, moe, ep, etp, s.seq // cp, cp))
            if x:
                moe_shard = max(moe_shard, sharded_numel(x, n_expert) * pb)
    dense += root
    shard = sharded_numel(dense, n_dense) + sharded_numel(expert, n_expert)
    n_tensors = len(dense) + len(expert)
    params = shard * pb
    grads = shard * pb
    optim = 2 * shard * pb + n_tensors * F32  # exp_avg, exp_avg_sq, and a step counter per tensor
    data = s.synthetic_sequences * (s.seq + 1) * 8
    ce = e  # the dtype FSDP gathers parameters in (bf16 under mixed precision, else the master dtype)
    root_u = numel(root) * ce
    head_saved, head_extra = head_activation(s, t, tp, pp > 1) if last else (0, 0)
    embed_saved = t * 8 if first else 0  # the embedding keeps the token ids

    if recompute:
        kept = [t * s.hidden * e // (tp if distribute_saved and pp == 1 else 1) for _ in acts]
        # one block recomputed at a time in backward: its saved tensors and its recomputed output, whose gradient the
        # rerun's backward starts from
        rerun = (max(acts) + t * s.hidden * e) if acts else 0
    else:
        kept, rerun = acts, 0
    per_mb = sum(kept) + head_saved + embed_saved
    inflight = inflight_microbatches(s, pp, vpp, r, mb)
    if pp > 1:
        # Every stage of the rank (two or more under interleaved schedules) has its own buffers: a non-first one
        # receives its input into a buffer per microbatch (its first block's saved input), a non-last one a gradient
        # buffer per microbatch, and keeps its output for backward.
        act = t * s.hidden * e
        bufs = sum((0 if st_first else mb * act) + (0 if st_last else mb * act) for st_first, st_last, _ in stages)
        per_mb += sum((0 if st_last else act) - (0 if st_first else act) for st_first, st_last, _ in stages)
    else:
        bufs = 0
    act_total = int(per_mb * inflight)

    state = params + optim + data
    phases: dict[str, tuple[int, dict[str, int]]] = {}
    # optimizer step: gradients and one scratch copy of the shard (foreach sqrt of exp_avg_sq)
    phases["optimizer step"] = (state + grads + shard * pb + bufs,
                                {"grads": grads, "transient": shard * pb + bufs})
    block_u = [(d + x) * ce for d, x in blocks]
    block_g = [(d + x) * max(ce, 4 if ce == 2 else ce) for d, x in blocks]  # grads reduced in fp32 under bf16
    accumulate = pp > 1 or mb > 1  # unsharded gradients kept until the last microbatch
    gathered_all = pp > 1 and not s.reshard_between_microbatches
    all_u = sum(block_u) + root_u
    # the start of a block's backward: its output's gradient, the MLP's hidden gradients, the last weight's gradient
    f_loc = s.ffn // (etp if any(x for _, x in blocks) else tp)
    start_bwd = (t * s.hidden + 2 * t * f_loc) * e + s.hidden * f_loc * pb
    if s.arch != "gpt" and e != F32:
        # an RMSNorm computing in fp32 under bf16 differentiates in fp32: its input's gradient, x² and the scaled
        # terms (three [t, h] fp32 tensors) at once, twice the bytes of the bf16 tensors around it
        start_bwd += 3 * t * s.hidden * F32
    # end of forward / start of backward: every saved activation plus the loss's gradients (blocks resharded)
    n = len(blocks)
    if gathered_all:
        kept_u = [block_u[i] for i in range(n)]
    else:
        # FSDP reshards a block after its forward only where its mesh (HSDP replicas included) has more than one
        # rank, and never the last block (its backward comes next; megashard.models.parallelize)
        mesh_d, mesh_x = n_dense * sz.dp_outer, n_expert * sz.dp_outer
        kept_u = [(0 if mesh_d > 1 and i < n - 1 else blocks[i][0] * ce)
                  + (0 if mesh_x > 1 and i < n - 1 else blocks[i][1] * ce) for i in range(n)]
    g_fwd = all_u if gathered_all else root_u + sum(kept_u)
    # FSDP2 keeps the last all-gather's output buffer (``comm_ctx.all_gather_state``) until the next all-gather: at the
    # end of forward that is the last block's (its experts' when it is an MoE block: a unit of its own), and when
    # that unit is the experts, the first backward all-gather comes only after their backward (their prefetch is a
    # no-op: they were never resharded).
    ag_buf, ag_into_bwd = 0, False
    if not gathered_all and blocks:
        d_last, x_last = blocks[-1]
        if x_last and n_expert > 1:
            ag_buf, ag_into_bwd = x_last * ce, True
        elif n_dense > 1:
            ag_buf = d_last * ce
    phases["forward end"] = (state + g_fwd + ag_buf + act_total + head_extra + bufs,
                             {"gathered": g_fwd, "activations": act_total, "logits": head_extra,
                              "transient": bufs + ag_buf})
    # backward of block i (last to first): at its start every earlier activation is alive; at its end its unsharded
    # gradients and the reduce-scatter's copy of them (later blocks' gradients are sharded already)
    head_g = (numel(root_params(s, tp, False, True)) if last else 0) * pb  # final norm and head: first gradients
    done_grads = 0
    for i in range(n - 1, -1, -1):
        if gathered_all:
            g = all_u
        else:  # this block, the prefetched next, and the earlier blocks never resharded (blocks resharded after backward)
            g = root_u + block_u[i] + (block_u[i - 1] if i > 0 else 0) + sum(kept_u[:max(0, i - 1)])
        before = int((per_mb - sum(kept[i + 1:]) - head_saved) * inflight) + rerun  # activations of blocks <= i
        after = int((per_mb - sum(kept[i:]) - head_saved) * inflight)
        if accumulate:
            # every unsharded gradient until the last microbatch, the stage's embeddings and head included
            grads_start = grads_end = sum(block_g) + numel(root) * max(ce, 4 if ce == 2 else ce)
        else:
            grads_start = head_g + done_grads
            # experts index their stacked weights (w1[e]): each expert's gradient arrives as a full-size tensor
            # (select_backward) summed into the weight's, so one more of the largest is alive meanwhile
            grads_end = head_g + done_grads + 2 * block_g[i] + expert_big[i] * max(ce, 4 if ce == 2 else ce)
        held = ag_buf if ag_into_bwd and i == n - 1 else 0
        gb = max(ce, 4 if ce == 2 else ce)  # a gradient element's bytes (fp32 under bf16)
        # the block's backward begins by prefetching the next block, which releases the held all-gather buffer; an MoE
        # block's MLP gradients come in the experts' moment below (its start has only the output's gradient)
        prefetch = block_u[i - 1] if i > 0 and not gathered_all else 0
        held = max(0, held - prefetch)
        start = start_bwd if not pairs_of[i] else t * s.hidden * e
        a_total = state + g + before + start + grads_start + bufs + held
        b_total = state + g + after + grads_end + bufs
        moments = [(a_total, f"backward block {i}", {"gathered": g, "activations": before + start,
                                                     "grads": grads_start, "transient": bufs + held}),
                   (b_total, f"backward block {i} (reduce-scatter)", {"gathered": g, "activations": after,
                                                                      "grads": grads_end, "transient": bufs})]
        if pairs_of[i]:
            # the experts' backward, one expert after another (the first one's activations freed): each stacked
            # weight's gradient builds up as a full-size tensor (select_backward of w[e]) that the next expert's is
            # summed into out of place, so every weight's running sum plus a new one and their sum are alive; beside
            # them the output's gradient, the pairs' gradients received and scattered back, one expert's hidden one.
            # The held all-gather buffer is gone: the block's backward began by prefetching the next block's.
            per_expert = pairs_of[i] // max(1, s.num_experts // ep)
            work = (expert_n[i] + 2) * expert_big[i] * gb
            grads_moe = (t * s.hidden + 2 * pairs_of[i] * s.hidden + per_expert * (s.ffn // etp)) * e
            c_act = before - per_expert * moe_pair_bytes(s, etp) + grads_moe
            moments.append((state + g + c_act + grads_start + work + bufs, f"backward block {i} (experts)",
                            {"gathered": g, "activations": c_act, "grads": grads_start + work, "transient": bufs}))
        total, name, parts_i = max(moments, key=lambda m: m[0])
        phases[name] = (total, parts_i)
        # its gradients are sharded now: dense ones over n_dense, experts over their own (maybe 1-rank) group
        done_grads += -(-blocks[i][0] * gb // max(1, n_dense)) + -(-blocks[i][1] * gb // max(1, n_expert))
    phase, (peak, parts) = max(phases.items(), key=lambda kv: kv[1][0])
    at = {k.replace(" (reduce-scatter)", "").replace(" (experts)", ""): v for k, (v, _) in phases.items()}
    full = {"params": params, "grads": 0, "optimizer": optim, "gathered": 0, "activations": 0, "logits": 0,
            "transient": 0, "data": data}
    full.update(parts)
    return MemoryEstimate(peak=int(peak), rank=r, phase=phase, parts=full,
                          activation_per_block=(acts[0] if acts else 0),
                          activation_kept_per_block=(kept[0] if kept else 0), inflight=math.ceil(inflight),
                          largest_moe_shard=moe_shard, phases=at)


def live_copies_bytes(s: JobShape, sz: Any, copies: int) -> int:
    """Host memory per rank that live recovery's copies take (``launch.recovery: live``,
    :mod:`megashard.train.memory_copies`): two generations (this step, the one before) of the largest rank's own
    parameter and optimizer shards and of ``copies`` (``checkpoint.memory_copies``) peers' shards."""
    est = estimate_memory(s, sz)
    return 2 * (1 + copies) * (est.parts.get("params", 0) + est.parts.get("optimizer", 0))
