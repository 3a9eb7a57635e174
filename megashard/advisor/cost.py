"""A roofline estimate of one training step: compute at a device's sustained flop rate plus the bytes each parallel
axis moves at the bandwidth of the links it crosses (docs/advisor.md).

    hw = Hardware()                                      # H100-like defaults; every number can be changed
    cost = estimate_step(shape, sizes, hw, ranks_per_node=8, recompute=False)
    cost.seconds, cost.bytes_by_axis, cost.compute_s, cost.bubble

Assumptions (each a field of :class:`Hardware` or a line of docs/advisor.md):

- compute: 6 flops per parameter and token for the matrix multiplies (forward 2, backward 4; 8 with recompute), the
  causal attention's ``6 · seq · hidden`` per token and layer (times 8/6 with recompute), each rank doing
  ``1 / (tp · cp · dp)`` of its stage's work, at ``tflops · mfu``;
- the pipeline bubble adds ``(pp - 1) / (vpp · microbatches)`` of the compute (1F1B, interleaved, GPipe);
- collectives move ring-algorithm bytes per rank: all-reduce ``2 (n-1)/n · S``, all-gather and reduce-scatter
  ``(n-1)/n · S``, all-to-all ``(n-1)/n · S``; an axis whose groups fit in a node uses ``intra_gbps``, else
  ``inter_gbps``; each collective also costs ``latency_us``;
- tp, cp, ep, expt_tp and pp traffic is on the critical path; FSDP's all-gathers and reduce-scatters (dp_shard·cp)
  and the HSDP all-reduce (dp_outer) overlap with compute, so only what exceeds compute time counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megashard.advisor.shape import JobShape, block_params, numel, root_params

#: The axes whose traffic is reported, in this order.
AXES = ("tp", "cp", "dp", "dp_outer", "ep", "expt_tp", "pp")


@dataclass(frozen=True)
class Hardware:
    """The device and links the estimate assumes (defaults: an H100 SXM node with NVLink and 400 Gb/s InfiniBand)."""

    tflops: float = 989.0
    """Peak dense bf16 tera-flops per device (float32 jobs: times ``fp32_factor``, see :meth:`flops`)."""
    mfu: float = 0.45
    """Share of the peak a well-tuned step sustains on its matrix multiplies."""
    intra_gbps: float = 360.0
    """Bus bandwidth of a collective inside a node, GB/s per rank (NVLink 4: ~450 GB/s; ~80% reached)."""
    inter_gbps: float = 40.0
    """Bus bandwidth of a collective across nodes, GB/s per rank (one 400 Gb/s NIC per GPU; ~80% reached)."""
    latency_us: float = 10.0
    """Fixed cost of one collective, microseconds."""
    fp32_factor: float = 0.5
    """Flop rate of float32 / float64 jobs relative to bf16 (TF32 tensor cores: about half)."""
    op_overhead_us: float = 0.0
    """Fixed cost of one block's forward and backward per microbatch beyond its flops (kernel launches, Python,
    FSDP's hooks), microseconds; a third more with recompute. Small on a GPU (hidden behind the kernels), the
    larger part of a small model's step on a CPU (:mod:`megashard.advisor.machine`)."""
    device: str = "cuda"
    """``cuda`` or ``cpu``: what the numbers describe (the report says which). On ``cpu`` the processes share the
    node's ``cores``: nothing overlaps (communication and compute take turns on the same cores) and a collective
    of n ranks costs ``latency_us`` for each of its n - 1 ring steps, times ``(n / cores)³`` when its ranks are
    more than the cores (each step waits for the scheduler to run every member; the power is fitted to step times
    measured on 2 cores, docs/advisor.md), FSDP's all-gathers add to the step and its gradient reductions overlap
    with the backward (gloo runs them on its own thread)."""
    cores: int = 0
    """CPU cores of a node (``device: cpu``; 0 otherwise)."""
    name: str = "H100 SXM"
    """The device the numbers are of, for the report."""

    def __post_init__(self) -> None:
        import math

        from megashard.errors import ConfigError

        for name in ("tflops", "mfu", "intra_gbps", "inter_gbps", "latency_us", "fp32_factor", "op_overhead_us"):
            v = getattr(self, name)
            if name == "op_overhead_us" and v == 0:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 or (
                    name in ("mfu", "fp32_factor") and v > 1):
                rule = "in (0, 1]" if name in ("mfu", "fp32_factor") else "a positive number"
                raise ConfigError(f"Hardware.{name}={v!r}: must be {rule}")

    def flops(self, dtype: str) -> float:
        """Sustained flops per second for ``train.dtype``."""
        rate = self.tflops * 1e12 * self.mfu
        return rate if dtype == "bfloat16" else rate * self.fp32_factor

    def describe(self, dtype: str) -> str:
        """The numbers the step time assumes for a job in ``dtype``, in words (the report's ``assumed:`` line)."""
        if self.device == "cpu":
            compute = f"{self.name}: {self.tflops * 1e3:.1f} GFLOP/s {dtype} per rank × {self.mfu:g}"
        elif dtype == "bfloat16":
            compute = f"{self.name}: {self.tflops:g} TFLOP/s bf16 × {self.mfu:g} MFU"
        else:
            compute = (f"{self.name}: {self.tflops * self.fp32_factor:g} TFLOP/s {dtype} ({self.tflops:g} bf16 × "
                       f"{self.fp32_factor:g}) × {self.mfu:g} MFU")
        over = f", {self.op_overhead_us:g} µs per block and microbatch" if self.op_overhead_us else ""
        return (f"{compute}{over}, {self.intra_gbps:g} GB/s in a node, {self.inter_gbps:g} GB/s across nodes, "
                f"{self.latency_us:g} µs per collective")


@dataclass
class StepCost:
    """The estimate of one optimizer step on the slowest rank."""

    seconds: float
    compute_s: float
    bubble: float
    """Pipeline bubble as a share of compute."""
    comm_s: dict[str, float] = field(default_factory=dict)
    """Seconds per axis (before overlap)."""
    bytes_by_axis: dict[str, int] = field(default_factory=dict)
    """Bytes one rank sends per step over each axis (ring algorithms)."""
    in_node: dict[str, bool] = field(default_factory=dict)
    """Whether the axis's groups stay inside a node."""
    tokens_per_s: float = 0.0


def _span(order: tuple[str, ...], sizes: dict[str, int], axis: str) -> int:
    """Ranks spanned by one group of ``axis`` in rank order ``order`` (leftmost fastest): stride · size."""
    stride = 1
    for a in order:
        if a == axis:
            return stride * sizes[a]
        stride *= sizes[a]
    return stride * sizes.get(axis, 1)


def axis_in_node(sz: Any, axis: str, ranks_per_node: int) -> bool:
    """True when every group of ``axis`` fits inside one node (its span divides the node size)."""
    order = tuple(sz.order)
    dense = {"tp": sz.tp, "cp": sz.cp, "ep": 1, "dp": sz.dp, "pp": sz.pp}
    expert = {"tp": sz.expt_tp, "cp": 1, "ep": sz.ep, "dp": sz.expt_dp, "pp": sz.pp}
    if axis == "dp":  # FSDP: dp_shard (the fast part of dp) times cp
        span = _span(order, {**dense, "dp": sz.dp_shard}, "dp")
    elif axis == "dp_outer":
        span = _span(order, dense, "dp")
    elif axis == "ep":
        span = _span(order, expert, "ep")
    elif axis == "expt_tp":
        span = _span(order, expert, "tp")
    else:
        span = _span(order, dense, axis)
    return span <= ranks_per_node and ranks_per_node % span == 0


def collective_latency(hw: Hardware, n: int) -> float:
    """Seconds of fixed cost of one collective over ``n`` ranks (:attr:`Hardware.device`)."""
    if hw.device != "cpu" or not hw.cores:
        return hw.latency_us * 1e-6
    return hw.latency_us * 1e-6 * max(1, n - 1) * max(1.0, n / hw.cores) ** 3


def estimate_step(s: JobShape, sz: Any, hw: Hardware, ranks_per_node: int, recompute: bool = False) -> StepCost:
    """Seconds of one step of ``s`` in layout ``sz`` (the slowest pipeline stage), and the bytes per axis."""
    tp, cp, pp, vpp, dp = sz.tp, sz.cp, sz.pp, (sz.vpp or 1), sz.dp
    ep, etp = sz.ep, sz.expt_tp
    e = s.act_bytes
    mb = s.mb(pp, sz.dp)
    h = s.hidden
    tokens = s.global_batch * s.seq  # per step, all ranks
    t = tokens // (dp * cp * mb)  # tokens per microbatch on a rank (before tp)
    layers = -(-s.layers // pp)  # the largest stage's blocks
    moe_layers = sum(1 for i in range(s.layers) if s.is_moe(i))
    moe_stage = -(-moe_layers // pp)
    dense_stage = layers - moe_stage
    d_blk, _ = block_params(s, 1, False)
    m_blk, x_blk = block_params(s, 1, True) if s.num_experts else ([], [])
    x_one = numel(x_blk) // max(1, s.num_experts)  # one expert's parameters
    # matrix-multiply flops of the largest stage for every token, globally (6 per parameter and token)
    per_token = 6 * (dense_stage * numel(d_blk) + moe_stage * (numel(m_blk) + s.top_k * x_one))
    per_token += 6 * numel(root_params(s, 1, False, True)) // (pp if pp > 1 else 1)  # the head, on the last stage
    per_token += 6 * layers * s.seq * h // 2 * 2  # causal attention: QKᵀ and AV, half the square, fwd + bwd
    if recompute:
        per_token = per_token * 8 // 6
    ranks_per_stage = tp * cp * dp
    compute = per_token * tokens / ranks_per_stage / hw.flops(s.dtype)
    # the fixed cost of running a block once per microbatch (launches, Python, hooks), more with a recomputed forward
    compute += hw.op_overhead_us * 1e-6 * (layers + 1) * mb * (4 / 3 if recompute else 1)
    bubble = (pp - 1) / (vpp * mb) if pp > 1 else 0.0

    pb = s.param_bytes
    n_rec = 2 if recompute else 0
    b: dict[str, int] = {a: 0 for a in AXES}
    count: dict[str, int] = {a: 0 for a in AXES}
    act = t * h * e  # one [tokens, hidden] activation of a microbatch
    if tp > 1:  # 2 all-reduces forward, 2 backward per block (+2 recomputed); embedding and loss: 2 more
        n = (4 + n_rec) * layers + 2
        b["tp"] = int(n * mb * act * 2 * (tp - 1) / tp)
        count["tp"] = n * mb
    if cp > 1:  # keys and values all-gathered forward, reduce-scattered backward, per block
        n = (2 + 2 + n_rec) * layers
        b["cp"] = int(n * mb * act // tp * cp * (cp - 1) / cp)
        count["cp"] = n * mb
    stage_params = (dense_stage * numel(block_params(s, tp, False)[0])
                    + moe_stage * numel(block_params(s, tp, True, ep, etp)[0])
                    + numel(root_params(s, tp, True, True)) // pp)
    expert_params = moe_stage * numel(block_params(s, tp, True, ep, etp)[1]) if s.num_experts else 0
    n_fsdp = sz.dp_shard * cp
    gathers = 1 if (pp > 1 and not s.reshard_between_microbatches) else 2 * (mb if pp == 1 else mb)
    gather_s = 0.0  # the all-gathers' share of the dp seconds: a forward waits for them (on a CPU: nothing hides them)
    if n_fsdp > 1:  # all-gather (compute dtype) per forward / backward, reduce-scatter (fp32) once
        b["dp"] = int((gathers * stage_params * e + stage_params * max(pb, 4)) * (n_fsdp - 1) / n_fsdp)
        count["dp"] = (gathers + 1) * (layers + 1)
        gather_s = gathers * (layers + 1) * collective_latency(hw, n_fsdp) + (
            gathers * stage_params * e * (n_fsdp - 1) / n_fsdp) / (hw.intra_gbps * 1e9)
    n_exp = max(1, sz.expt_dp // sz.dp_outer)
    if n_exp > 1 and expert_params:
        b["dp"] += int((gathers * expert_params * e + expert_params * max(pb, 4)) * (n_exp - 1) / n_exp)
    if sz.dp_outer > 1:  # HSDP: the sharded gradients all-reduced over the replicas
        shard = stage_params // n_fsdp + expert_params // n_exp
        b["dp_outer"] = int(shard * max(pb, 4) * 2 * (sz.dp_outer - 1) / sz.dp_outer)
        count["dp_outer"] = layers + 1
    if moe_stage:
        pairs = t * s.top_k // tp  # (token, expert) pairs a rank dispatches per microbatch
        if ep > 1:  # dispatch + combine, forward and backward
            b["ep"] = int(4 * moe_stage * mb * pairs * h * e * (ep - 1) / ep)
            count["ep"] = 4 * moe_stage * mb
        if etp > 1:
            b["expt_tp"] = int(4 * moe_stage * mb * pairs * etp * h * e * (etp - 1) / etp)
            count["expt_tp"] = 4 * moe_stage * mb
    if pp > 1:  # one activation forward and one gradient backward per microbatch and virtual stage
        b["pp"] = int(2 * mb * vpp * act)
        count["pp"] = 2 * mb * vpp

    comm: dict[str, float] = {}
    in_node: dict[str, bool] = {}
    group = {"tp": tp, "cp": cp, "dp": n_fsdp, "dp_outer": sz.dp_outer, "ep": ep, "expt_tp": etp, "pp": 2}
    for a in AXES:
        inside = axis_in_node(sz, a, ranks_per_node)
        in_node[a] = inside
        bw = (hw.intra_gbps if inside else hw.inter_gbps) * 1e9
        comm[a] = b[a] / bw + count[a] * collective_latency(hw, group[a])
    exposed = sum(comm[a] for a in ("tp", "cp", "ep", "expt_tp", "pp"))
    overlapped = comm["dp"] + comm["dp_outer"]
    if hw.device == "cpu":
        # the cores that compute also communicate: FSDP's all-gathers (each forward waits for one) add up; the
        # gradient reductions run on gloo's thread while the next block's backward computes
        # (measured: HSDP over 4 replicas, whose only collectives are those reductions, was the fastest layout)
        seconds = compute * (1 + bubble) + exposed + min(gather_s, comm["dp"])
    else:
        seconds = compute * (1 + bubble) + exposed + max(0.0, overlapped - compute)
    return StepCost(seconds=seconds, compute_s=compute, bubble=bubble, comm_s=comm, bytes_by_axis=b,
                    in_node=in_node, tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
