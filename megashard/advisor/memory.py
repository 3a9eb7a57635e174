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
  FSDP holds at the end of forward, each padded to whole shards (n · ceil(dim0 / n) rows: one expert sharded over
  two ranks is gathered as two); a pipeline stage keeps all of its blocks gathered for the step
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
  the pipeline's receive buffers and the tensors it sent (kept with their sends' works until the step's end by
  GPipe, interleaved 1F1B and zbv), the synthetic data.

The peak is the largest of these moments: the end of forward / start of backward, the start and the end
(reduce-scatter) of each block's backward, an MoE block's experts' backward (every stacked expert weight's gradient
at full size — ``select_backward`` of ``w[e]`` — plus a new one and their sum), zbv's split backward (an input
backward keeps the whole graph and the gradients its weight backward needs, :func:`weight_grad_inputs`, until that
runs), and the optimizer step (:func:`estimate_memory`). No torch import, no process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megashard.advisor.activations import (  # noqa: F401 - re-exported (their old home)
    F32,
    block_activation,
    head_activation,
    head_weight_grad_inputs,
    moe_pair_bytes,
    moe_pairs,
    weight_grad_inputs,
)
from megashard.advisor.host import token_bytes
from megashard.advisor.schedule import alive_peak, local_neighbours, rank_actions
from megashard.advisor.shape import JobShape, block_params, numel, root_params, sharded_numel


@dataclass
class MemoryEstimate:
    """Peak bytes of the largest rank and what they are made of."""

    peak: int
    rank: int
    """Pipeline rank whose peak is largest (0 without a pipeline)."""
    phase: str
    """Where that peak is: ``forward end``, ``backward block i``, ``optimizer step``, zbv's ``input backward block i``,
    ``weight backward`` …"""
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
    mb = s.mb(pp, sz.dp)
    b_micro = s.global_batch // (sz.dp * mb)
    t = b_micro * s.seq // cp  # tokens per microbatch on this rank
    h = s.hidden

    stages = _stages_of(s, pp, vpp, r)
    dense: list[tuple[int, int]] = []
    expert: list[tuple[int, int]] = []
    blocks: list[tuple[int, int]] = []  # (unsharded dense numel, unsharded expert numel) per block, forward order
    padded: list[tuple[int, int]] = []  # the same as FSDP holds them gathered (padded to whole shards)
    acts: list[int] = []  # bytes saved per block per microbatch
    expert_big: list[int] = []  # elements of each block's largest expert tensor (0: a dense block)
    expert_n: list[int] = []  # how many expert tensors of that size (gpt: w1, w2; llama: w1, w3, w2)
    pairs_of: list[int] = []  # routed pairs of each block's experts per microbatch (0: a dense block)
    wgi: list[int] = []  # bytes of each block's gradients a split backward (zbv) holds for its weight step
    w_big: list[int] = []  # elements of each block's largest weight
    stage_of: list[int] = []  # the local stage of each block
    moe_shard = 0
    last = any(st[1] for st in stages)
    root = []
    for v, (is_first, is_last, layers) in enumerate(stages):
        root += root_params(s, tp, is_first, is_last)
        for i in layers:
            moe = s.is_moe(i)
            d, x = block_params(s, tp, moe, ep, etp)
            dense += d
            expert += x
            blocks.append((numel(d), numel(x)))
            # FSDP2 all-gathers every rank's padded shard (ceil(dim0 / n) rows) and its unsharded parameter is a view
            # of that padded storage: one expert over two ranks holds two experts' bytes
            padded.append((sharded_numel(d, n_dense) * n_dense, sharded_numel(x, n_expert) * n_expert))
            last_shapes = (d, x)
            expert_big.append(max((a * b for a, b in x), default=0))
            expert_n.append(sum(a * b == expert_big[-1] for a, b in x))
            pairs_of.append(moe_pairs(s, t, tp, ep, etp) if moe else 0)
            acts.append(block_activation(s, t, tp, moe, ep, etp, s.seq // cp, cp))
            wgi.append(weight_grad_inputs(s, t, tp, moe, ep, etp))
            w_big.append(max(a * b for a, b in d + x))
            stage_of.append(v)
            if x:
                moe_shard = max(moe_shard, sharded_numel(x, n_expert) * pb)
    dense += root
    shard = sharded_numel(dense, n_dense) + sharded_numel(expert, n_expert)
    n_tensors = len(dense) + len(expert)
    params = shard * pb
    grads = shard * pb
    optim = 2 * shard * pb + n_tensors * F32  # exp_avg, exp_avg_sq, and a step counter per tensor
    data = s.synthetic_sequences * (s.seq + 1) * token_bytes(s.vocab)  # rows in int16/int32 (train/data.py)
    ce = e  # the dtype FSDP gathers parameters in (bf16 under mixed precision, else the master dtype)
    gb = max(ce, 4 if ce == 2 else ce)  # a gradient element's bytes (reduced in fp32 under bf16)
    root_u = numel(root) * ce
    head_saved, head_extra = head_activation(s, t, tp, pp > 1) if last else (0, 0)
    act = t * h * e  # one [tokens, hidden] activation of a microbatch

    if recompute:
        kept = [t * h * e // (tp if distribute_saved and pp == 1 else 1) for _ in acts]
        # one block recomputed at a time in backward: its saved tensors and its recomputed output, whose gradient the
        # rerun's backward starts from
        rerun = [a + t * h * e for a in acts]
    else:
        kept, rerun = acts, [0] * len(acts)
    # activations one microbatch keeps on each local stage: its blocks', the head's (last), the token ids (first); in a
    # pipeline a non-last stage also keeps its output for backward, and a non-first one's input lives in a receive
    # buffer (counted with the buffers, below)
    stage_act = [0] * len(stages)
    for v, (st_first, st_last, _) in enumerate(stages):
        stage_act[v] = sum(k for k, sv in zip(kept, stage_of) if sv == v)
        stage_act[v] += (head_saved if st_last else 0) + (t * 8 if st_first else 0)
        if pp > 1:
            stage_act[v] += (0 if st_last else act) - (0 if st_first else act)
    # every stage of a pipeline rank has a receive buffer per microbatch: activations (non-first), gradients (non-last)
    bufs = sum((0 if a else mb * act) + (0 if b else mb * act) for a, b, _ in stages) if pp > 1 else 0

    state = params + optim + data
    n = len(blocks)
    block_u = [(d + x) * ce for d, x in padded]
    block_g = [(d + x) * gb for d, x in blocks]  # a block's unsharded gradients
    block_s = [-(-d * gb // max(1, n_dense)) + -(-x * gb // max(1, n_expert)) for d, x in blocks]  # ... sharded
    root_g = numel(root) * gb
    head_g = (numel(root_params(s, tp, False, True)) if last else 0) * gb  # final norm and head: first gradients
    gathered_all = pp > 1 and not s.reshard_between_microbatches
    all_u = sum(block_u) + root_u
    # the start of a block's backward: its output's gradient, the MLP's hidden gradients, the last weight's gradient
    f_loc = s.ffn // (etp if any(x for _, x in blocks) else tp)
    # (recompute: the block's backward runs on its recomputed tensors, which it frees as it goes: measured, the MLP's
    # second hidden gradient comes after the first hidden activation is gone)
    start_bwd = (t * h + (1 if recompute else 2) * t * f_loc) * e + h * f_loc * pb
    if s.arch != "gpt" and e != F32:
        # an RMSNorm computing in fp32 under bf16 differentiates in fp32: its input's gradient, x² and the scaled
        # terms (three [t, h] fp32 tensors) at once, twice the bytes of the bf16 tensors around it
        start_bwd += 3 * t * h * F32
    if gathered_all:
        kept_u = list(block_u)
    else:
        # FSDP reshards a block after its forward only where its mesh (HSDP replicas included) has more than one
        # rank, and never the last block (its backward comes next; megashard.models.parallelize)
        mesh_d, mesh_x = n_dense * sz.dp_outer, n_expert * sz.dp_outer
        kept_u = [(0 if mesh_d > 1 and i < n - 1 else padded[i][0] * ce)
                  + (0 if mesh_x > 1 and i < n - 1 else padded[i][1] * ce) for i in range(n)]
    g_fwd = all_u if gathered_all else root_u + sum(kept_u)
    # FSDP2 keeps the last all-gather's output buffer (``comm_ctx.all_gather_state``) until the next all-gather: at the
    # end of forward that is the last block's (its experts' when it is an MoE block: a unit of its own), and when
    # that unit is the experts, the first backward all-gather comes only after their backward (their prefetch is a
    # no-op: they were never resharded).
    # The buffer holds every rank's padded shard: ceil(dim0 / n) rows each (one expert over two ranks: twice its size).
    ag_buf, ag_into_bwd = 0, False
    if not gathered_all and blocks:
        d_last, x_last = last_shapes
        if x_last and n_expert > 1:
            ag_buf, ag_into_bwd = sharded_numel(x_last, n_expert) * n_expert * ce, True
        elif n_dense > 1:
            ag_buf = sharded_numel(d_last, n_dense) * n_dense * ce

    phases: dict[str, tuple[int, dict[str, int]]] = {}

    def moment(name: str, total: int, parts: dict[str, int]) -> None:
        if name not in phases or total > phases[name][0]:
            phases[name] = (total, parts)

    # Tensors a pipeline schedule sent to another rank: the runtime schedules (interleaved_1f1b, zbv) and GPipe keep
    # every send's work, and with it the tensor (a non-last stage's output, a non-first one's input gradient), until
    # the end of the step; 1F1B waits each send at its next action, so an input gradient sent after a backward lives
    # through the next backward only (its cool-down). zbv's input backward also leaves each input gradient as its
    # receive buffer's .grad, which the schedule clears when the next step starts.
    zbv = pp > 1 and s.schedule == "zbv"
    keeps_sends = pp > 1 and s.schedule in ("gpipe", "interleaved_1f1b", "zbv")
    local_prev, local_next = local_neighbours(s.schedule, pp, vpp, r)
    send_in = [pp > 1 and not st[0] and not local_prev[v] for v, st in enumerate(stages)]
    send_out = [pp > 1 and not st[1] and not local_next[v] for v, st in enumerate(stages)]
    sent = pending = 0
    # optimizer step: sharded gradients and one scratch copy of the shard (foreach sqrt of exp_avg_sq)
    tx = bufs + (mb * act * sum(send_in) if zbv else 0)
    moment("optimizer step", state + grads + shard * pb + tx, {"grads": grads, "transient": shard * pb + tx})

    # Walk the schedule (megashard.advisor.schedule): which microbatches' activations are alive, and which gradients
    # exist. Without a pipeline, microbatches accumulate under FSDP's no-sync (every unsharded gradient kept) until
    # the last, whose backward reduce-scatters block by block; a pipeline stage keeps every unsharded gradient from
    # its first backward until the end of the step, when they are reduce-scattered.
    grad_state = [0] * n  # 0: none, 1: unsharded (accumulated), 2: sharded (reduced this step)
    any_backward = False
    alive: dict[tuple[int, int], int] = {}
    by_stage = [[j for j in range(n) if stage_of[j] == v] for v in range(len(stages))]

    # Under mixed precision FSDP keeps an fp32 sum of the bf16 gradients autograd makes, folded in by each block's
    # post-backward hook; zbv's weight backward makes them after that hook ran (in the input backward), so they wait in
    # bf16 for the stage's next input backward (each block's until its own hook, the head's until its end) or the
    # step's end. unfolded[j]: block j's (index n: the head's) bytes waiting.
    unfolded = [0] * (n + 1)
    head_u = numel(root_params(s, tp, False, True)) * ce if last else 0

    def grads_now(head_started: bool) -> int:
        g = sum(block_g[j] if st == 1 else block_s[j] if st == 2 else 0 for j, st in enumerate(grad_state))
        return g + (root_g if any_backward else head_g if head_started else 0) + sum(unfolded)

    def zbv_input_backward(v: int, other: int, tx: int) -> int:
        """zbv's input backward of a non-first stage (``stage_backward_input``): it retains the graph for the weight
        step, so none of the microbatch's activations goes, and it holds the gradient at every weighted op's output
        (:func:`weight_grad_inputs`) until then. Returns what the microbatch keeps afterwards."""
        st_last = stages[v][1]
        gr = grads_now(False)
        base = other + stage_act[v]
        held = 0
        if st_last:  # the loss's backward starts as in a full backward
            moment("backward start", state + g_fwd + ag_buf + base + head_extra + gr + tx,
                   {"gathered": g_fwd, "activations": base, "logits": head_extra, "grads": gr,
                    "transient": tx + ag_buf})
            held = head_weight_grad_inputs(s, t, tp)
        top = by_stage[v][-1] if by_stage[v] else -1
        # a block's deepest moments (measured): its attention's backward, every held gradient but the first norm's and
        # q, k, v's gradients beside their stacked copy (the QKV output's); or its first norm's backward, with all of
        # them: LayerNorm's fused kernel makes the input's gradient and the residual sum, RMSNorm five [t, h] terms
        # (x², its scaled gradient, the two paths and their sum; fp32 under bf16 but the first)
        norm_bwd = 2 * t * h * e if s.arch == "gpt" else t * h * (e + 4 * F32)
        for j in reversed(by_stage[v]):
            # a non-last stage's top block gets its output's gradient in the receive buffer (counted with them)
            wg = wgi[j] - (act if j == top and not st_last else 0)
            g = all_u if gathered_all else (root_u + block_u[j] + (block_u[j - 1] if j > 0 else 0)
                                            + sum(kept_u[:max(0, j - 1)]))
            work = held + wg + max(3 * t * h // tp * e - act, norm_bwd)
            moment(f"input backward block {j}", state + g + base + work + gr + tx,
                   {"gathered": g, "activations": base, "grads": gr, "transient": tx + work})
            held += wg
            if unfolded[j]:  # its post-backward hook folds the bf16 gradients into the fp32 sum (made by the first)
                unfolded[j], grad_state[j] = 0, 1
            gr = grads_now(False)
        unfolded[n] = 0 if st_last else unfolded[n]
        # then the loss's part of the graph goes (the last stage's log-softmax and logits)
        loss_part = t * (s.vocab // tp) * (F32 + e) if st_last else 0
        return stage_act[v] - loss_part + held

    for kind, v, m in rank_actions(s.schedule, pp, vpp, mb, r):
        st_first, st_last = stages[v][0], stages[v][1]
        if kind == "F":
            pending = 0  # 1F1B waits the last backward's send together with this forward's receive
        tx = bufs + sent + pending
        if kind == "F":
            alive[(v, m)] = stage_act[v]
            a_all = sum(alive.values())
            gr = grads_now(False)
            if not st_last or pp > 1:
                moment("forward end" if pp == 1 else f"forward, microbatch {m}",
                       state + g_fwd + a_all + gr + tx, {"gathered": g_fwd, "activations": a_all, "grads": gr,
                                                         "transient": tx})
            continue
        other = sum(a for key, a in alive.items() if key != (v, m))
        if zbv and kind == "B" and st_first:
            continue  # the first stage's input backward is empty (no input needs a gradient): its W is a full one
        if zbv and not st_first:
            if kind == "B":
                alive[(v, m)] = zbv_input_backward(v, other, tx)
                sent += act if send_in[v] else 0
            else:  # the weight backward: weight by weight (forward order), each one's gradient from its held output
                # gradient, then that part of the graph goes: at its start the whole graph and the first new gradient
                # (summed in place into the one kept; mixed precision: the bf16 one FSDP folds in later), at its end
                # none of the graph and every new gradient
                head = root_params(s, tp, False, True) if st_last else []
                new = max(a * b for a, b in head + [(w_big[j], 1) for j in by_stage[v]]) * (ce if gb != ce else gb)
                g = all_u if gathered_all else root_u + sum(block_u[j] for j in by_stage[v])
                gr = grads_now(True)
                a_all = other + alive.pop((v, m))
                moment("weight backward", state + g + a_all + gr + new + tx,
                       {"gathered": g, "activations": a_all, "grads": gr + new, "transient": tx})
                for j in by_stage[v]:
                    grad_state[j] = 1 if gb == ce else grad_state[j]
                    unfolded[j] = block_u[j] if gb != ce else 0
                unfolded[n] = head_u if st_last and gb != ce else unfolded[n]
                any_backward = True
                sent += act if send_out[v] else 0
                gr = grads_now(True)
                moment("weight backward (end)", state + g + other + gr + bufs + sent,
                       {"gathered": g, "activations": other, "grads": gr, "transient": bufs + sent})
            continue
        sync = pp == 1 and m == mb - 1  # the microbatch whose backward reduce-scatters
        if st_last:  # the loss's backward starts: every activation alive, the logits' gradients
            a_all = other + stage_act[v]
            gr = grads_now(False)
            total = state + g_fwd + ag_buf + a_all + head_extra + gr + tx
            moment("forward end" if pp == 1 else "backward start", total,
                   {"gathered": g_fwd, "activations": a_all, "logits": head_extra, "grads": gr,
                    "transient": tx + ag_buf})
        mine = stage_act[v] - (head_saved if st_last else 0)
        rs_held = 0  # FSDP2 keeps the last reduce-scatter's input until the next block's post-backward
        for j in reversed(by_stage[v]):
            i = j  # the block's index among the rank's blocks, forward order
            if gathered_all:
                g = all_u
            else:  # this block, the prefetched next, and the earlier blocks never resharded (blocks resharded after backward)
                g = root_u + block_u[i] + (block_u[i - 1] if i > 0 else 0) + sum(kept_u[:max(0, i - 1)])
            before = other + mine + rerun[i]  # activations of this microbatch's blocks <= i, and the others'
            after = other + mine - kept[i]
            mine -= kept[i]
            gr = grads_now(True)
            held = ag_buf if ag_into_bwd and i == n - 1 and pp == 1 else 0
            # the block's backward begins by prefetching the next block, which releases the held all-gather buffer; an
            # MoE block's MLP gradients come in the experts' moment below (its start has only the output's gradient)
            prefetch = block_u[i - 1] if i > 0 and not gathered_all else 0
            held = max(0, held - prefetch)
            start = start_bwd if not pairs_of[i] else t * h * e
            moment(f"backward block {i}", state + g + before + start + gr + tx + held + rs_held,
                   {"gathered": g, "activations": before + start, "grads": gr, "transient": tx + held + rs_held})
            # its end: its new unsharded gradients (experts: each stacked weight's gradient arrives as a full-size
            # tensor, select_backward, summed into the weight's: one more of the largest alive meanwhile); reduced
            # now (no pipeline, mb = 1 or the last microbatch: autograd's gradients and the reduce-scatter's copy),
            # or accumulated into the unsharded ones kept
            # (bytes: autograd's gradients come in the gathered parameters' dtype, bf16 under mixed precision; where a
            # shard group has more than one rank, gloo's reduce-scatter holds a copy of its fp32 input instead, while
            # FSDP2 copies a group of one's input to its output itself; the select_backward of an expert weight is
            # autograd's too)
            new = (blocks[i][0] * (ce if n_dense == 1 else gb) + blocks[i][1] * (ce if n_expert == 1 else gb)
                   + expert_big[i] * ce)
            reduced = pp == 1 and (sync or mb == 1)
            # reduced: autograd's gradients (or, on gloo, its reduce-scatter's copy of the input) and the input, and
            # the sharded output
            end_g = gr + new + ((block_g[i] if grad_state[i] != 1 else 0) + block_s[i] if reduced else 0)
            # FSDP2 frees the block's unsharded parameters (reshard after backward) before it reduce-scatters
            g_rs = g - (0 if gathered_all else block_u[i])
            moment(f"backward block {i} (reduce-scatter)", state + g_rs + after + end_g + tx,
                   {"gathered": g_rs, "activations": after, "grads": end_g, "transient": tx})
            if pairs_of[i]:
                # the experts' backward, one expert after another (the first one's activations freed): each stacked
                # weight's gradient builds up as a full-size tensor (select_backward of w[e]) that the next expert's is
                # summed into out of place, so every weight's running sum plus a new one and their sum are alive;
                # beside them the output's gradient, the pairs' gradients received and scattered back, one expert's
                # hidden one (autograd's, in the gathered weights' dtype). The held all-gather buffer is gone: the
                # block's backward began by prefetching.
                per_expert = pairs_of[i] // max(1, s.num_experts // ep)
                work = (expert_n[i] + 2) * expert_big[i] * ce
                grads_moe = (t * h + 2 * pairs_of[i] * h + per_expert * (s.ffn // etp)) * e
                c_act = before - per_expert * moe_pair_bytes(s, etp) + grads_moe
                moment(f"backward block {i} (experts)", state + g + c_act + gr + work + tx + rs_held,
                       {"gathered": g, "activations": c_act, "grads": gr + work, "transient": tx + rs_held})
            grad_state[i] = 2 if reduced else 1
            rs_held = block_g[i] if reduced and n_dense > 1 else 0
        if stages[v][0]:
            # the embedding's backward: its new gradient, beside the one accumulated from earlier microbatches
            emb = (s.vocab // tp) * h * gb
            g = all_u if gathered_all else root_u
            a_rest = other + stage_act[v] - sum(kept[j] for j in by_stage[v]) - (head_saved if st_last else 0)
            gr = grads_now(True)
            moment("embedding backward", state + g + a_rest + gr + emb + tx + rs_held,
                   {"gathered": g, "activations": a_rest, "grads": gr + emb, "transient": tx + rs_held})
        alive.pop((v, m), None)
        any_backward = True
        if keeps_sends:
            sent += act * (send_in[v] + send_out[v])
        else:
            pending = act if send_in[v] else 0
    if pp > 1:  # the end of the step: every stage's unsharded gradients reduce-scattered, one block's copy at a time
        g = all_u if gathered_all else root_u
        gr = grads_now(True)
        gr += max(block_g, default=0)
        moment("reduce-scatter (end of step)", state + g + gr + bufs + sent,
               {"gathered": g, "grads": gr, "transient": bufs + sent})
    phase, (peak, parts) = max(phases.items(), key=lambda kv: kv[1][0])
    at = {k.replace(" (reduce-scatter)", "").replace(" (experts)", ""): v for k, (v, _) in phases.items()}
    full = {"params": params, "grads": 0, "optimizer": optim, "gathered": 0, "activations": 0, "logits": 0,
            "transient": 0, "data": data}
    full.update(parts)
    inflight = max(alive_peak(rank_actions(s.schedule, pp, vpp, mb, r), len(stages)), default=1)
    return MemoryEstimate(peak=int(peak), rank=r, phase=phase, parts=full,
                          activation_per_block=(acts[0] if acts else 0),
                          activation_kept_per_block=(kept[0] if kept else 0), inflight=inflight,
                          largest_moe_shard=moe_shard, phases=at)


def live_copies_bytes(s: JobShape, sz: Any, copies: int) -> int:
    """Host memory per rank that live recovery's copies take (``launch.recovery: live``,
    :mod:`megashard.train.memory_copies`): two generations (this step, the one before) of the largest rank's own
    parameter and optimizer shards and of ``copies`` (``checkpoint.memory_copies``) peers' shards."""
    est = estimate_memory(s, sz)
    return 2 * (1 + copies) * (est.parts.get("params", 0) + est.parts.get("optimizer", 0))
