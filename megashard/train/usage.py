"""What a run uses: model FLOPs per token and MFU against a stated peak, peak device memory and peak host RSS per rank.

    flops = model_flops_per_token(model, job, state)    # 6 × active matmul parameters + attention (per token)
    peak = device_peak(job, device)                     # PeakFlops(tflops, "NVIDIA H100 80GB HBM3, bf16 dense (table)")
    host = HostMemory.start()   ...   host.peak_growth()  # bytes: VmHWM at the end − RSS at the start

**Model FLOPs** count the model's arithmetic, not the hardware's (activation recompute is not counted), as torchtitan
and Megatron-LM do: per token 6 × the parameters of every matrix multiply a token goes through (forward 2, backward
4; embedding lookups excluded, a tied LM head counted once as a matmul, experts at ``moe_top_k / num_experts`` of
their parameters) plus 12 × layers × seq_len × hidden for attention's scores and weighted values (forward and
backward; the causal mask is not discounted). Model TFLOP/s per device = FLOPs per token × tokens/s / devices; MFU =
that / the device's peak.

**Peak per device** (``train.peak_tflops`` when set): a GPU in :data:`GPU_PEAK_TFLOPS` (dense, no sparsity; bf16
for ``train.dtype: bfloat16``, plain fp32 without TF32 for float32), else unknown (MFU not reported); on CPU a
measured figure: a square matmul in ``train.dtype`` timed on rank 0 for about 0.2 s with the worker's threads (noisy
on a loaded machine: set ``train.peak_tflops`` for a fixed denominator).

**Host memory** of a rank: the growth of its peak resident set (``VmHWM``, reset to the current RSS through
``/proc/self/clear_refs`` when the run starts) over its resident set at that moment (torch and megashard imported,
before the process groups, model, optimizer and data): what the run itself adds to a process. Where the reset is not
available it is ``ru_maxrss`` − the start RSS (an overestimate when an earlier peak was higher). Device memory is
``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) on CUDA; on CPU the device is the host.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["GPU_PEAK_TFLOPS", "PeakFlops", "model_params", "model_flops_per_token", "parameter_count", "device_peak",
           "gpu_peak", "HostMemory", "device_memory_peak", "gather_usage"]

#: Dense peak TFLOP/s per GPU (vendor data sheets, no sparsity): ``{name substring: (bf16, fp32 without TF32)}``;
#: matched against ``torch.cuda.get_device_name()`` in this order (the first substring found wins).
GPU_PEAK_TFLOPS: list[tuple[str, tuple[float, float]]] = [
    ("GB200", (2500.0, 80.0)),
    ("B200", (2250.0, 80.0)),
    ("H200", (989.4, 66.9)),
    ("H100 PCIe", (756.0, 51.2)),
    ("H100 NVL", (835.0, 60.0)),
    ("H100", (989.4, 66.9)),  # SXM (HBM3)
    ("H800", (989.4, 66.9)),
    ("A100", (312.0, 19.5)),
    ("A800", (312.0, 19.5)),
    ("L40S", (362.1, 91.6)),
    ("MI300X", (1307.4, 163.4)),
    ("MI250X", (383.0, 47.9)),
]


@dataclass(frozen=True)
class PeakFlops:
    """The denominator of MFU: ``tflops`` per device (None: unknown) and where the figure comes from."""

    tflops: Optional[float]
    source: str


def _matmul_params(name: str, p: torch.Tensor) -> float:
    """The parameters of ``p`` that a token multiplies with (0 for vectors and embedding lookups; experts at the
    share of tokens routed to each)."""
    shape = tuple(getattr(p, "_global_shape", tuple(p.shape)))
    if len(shape) < 2 or name == "pos" or name.endswith("pos") or name.endswith("embed.weight"):
        return 0.0
    n = 1
    for d in shape:
        n *= int(d)
    return float(n)


def _stage_params(model: torch.nn.Module) -> dict[str, tuple[int, float, bool]]:
    """``{name: (numel, matmul numel, expert)}`` of this rank's parameters (global shapes)."""
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "_global_shape", tuple(p.shape)))
        numel = 1
        for d in shape:
            numel *= int(d)
        out[name] = (numel, _matmul_params(name, p), bool(getattr(p, "_expert_parallel", False)))
    return out


def model_params(model: torch.nn.Module, state: "ParallelState") -> dict[str, tuple[int, float, bool]]:
    """``{name: (numel, matmul numel, expert)}`` of the whole model, global shapes: every pipeline stage's (one
    all_gather_object over pp when pp > 1: a collective of the pp group), by name, so a tied embedding held by the
    first and the last stage counts once."""
    mine = _stage_params(model)
    if state.size("pp") == 1:
        return mine
    import torch.distributed as dist

    parts: list[Any] = [None] * state.size("pp")
    dist.all_gather_object(parts, mine, group=state.group("pp"))
    merged: dict[str, tuple[int, float, bool]] = {}
    for part in parts:
        merged.update(part)
    return merged


def parameter_count(params: dict[str, tuple[int, float, bool]]) -> int:
    """Parameters of the whole model (every expert counted)."""
    return sum(n for n, _, _ in params.values())


def model_flops_per_token(params: dict[str, tuple[int, float, bool]], job: "JobConfig") -> float:
    """Model FLOPs of one token's forward and backward (see the module docstring)."""
    m = job.model
    active = 0.0
    for _name, (_, mm, expert) in params.items():
        active += mm * (m.moe_top_k / m.num_experts if expert and m.num_experts else 1.0)
    if m.tie_embeddings:  # the LM head multiplies with the embedding table
        active += float(m.vocab_size * m.hidden)
    return 6.0 * active + 12.0 * m.layers * m.seq_len * m.hidden


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def device_peak(job: "JobConfig", device: torch.device) -> PeakFlops:
    """The peak TFLOP/s of one device for ``train.dtype`` (see the module docstring); measures on CPU."""
    t = job.train
    if t.peak_tflops is not None:
        return PeakFlops(float(t.peak_tflops), f"train.peak_tflops={t.peak_tflops:g}")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), t.dtype)
    if device.type == "cpu":
        tflops = _cpu_matmul_tflops(t.dtype, torch.get_num_threads())
        return PeakFlops(tflops, f"CPU, {t.dtype} matmul measured at the start ({torch.get_num_threads()} "
                                 "thread(s) per process)")
    return PeakFlops(None, f"{device.type}: no peak known (set train.peak_tflops)")


def gpu_peak(name: str, dtype: str) -> PeakFlops:
    """The peak of the GPU ``name`` (``torch.cuda.get_device_name``) for ``train.dtype`` from :data:`GPU_PEAK_TFLOPS`."""
    for key, (bf16, fp32) in GPU_PEAK_TFLOPS:
        if key in name:
            if dtype == "bfloat16":
                return PeakFlops(bf16, f"{name}, bf16 dense peak (table)")
            if dtype == "float32":
                return PeakFlops(fp32, f"{name}, fp32 peak without TF32 (table)")
            return PeakFlops(None, f"{name}: no {dtype} peak in the table (set train.peak_tflops)")
    return PeakFlops(None, f"{name}: not in megashard's table (set train.peak_tflops)")


@functools.lru_cache(maxsize=None)
def _cpu_matmul_tflops(dtype: str, threads: int) -> float:
    """:func:`measure_matmul_tflops` once per process, dtype and thread count: a world re-formed in place (live
    recovery) does not spend its 0.2 s again."""
    return measure_matmul_tflops(_DTYPES[dtype])


def measure_matmul_tflops(dtype: torch.dtype, size: int = 512, seconds: float = 0.2) -> float:
    """TFLOP/s of ``size``² matmuls in ``dtype`` on this process's CPU threads, the best of ~``seconds``."""
    a = torch.randn(size, size, dtype=torch.float32).to(dtype)
    b = torch.randn(size, size, dtype=torch.float32).to(dtype)
    a @ b  # warm-up
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size ** 3 / best / 1e12


def device_memory_peak(device: torch.device) -> Optional[dict[str, int]]:
    """``{"allocated": bytes, "reserved": bytes}`` peaks of this rank's CUDA device, None off CUDA."""
    if device.type != "cuda":
        return None
    return {"allocated": int(torch.cuda.max_memory_allocated(device)),
            "reserved": int(torch.cuda.max_memory_reserved(device))}


def _status(key: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status in bytes (None where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostMemory:
    """The peak RSS growth of this process from :meth:`start` on (see the module docstring)."""

    def __init__(self, base: int, reset: bool) -> None:
        self.base, self.reset = base, reset

    @classmethod
    def start(cls) -> "HostMemory":
        base = _status("VmRSS")
        reset = False
        if base is not None:
            try:
                with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                    f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
                hwm = _status("VmHWM")
                reset = hwm is not None and hwm <= base + (16 << 20)
            except OSError:
                reset = False
        else:
            base = _maxrss()
        return cls(base or 0, reset)

    def peak(self) -> int:
        """The peak resident set of this process, bytes (since :meth:`start` when the reset worked)."""
        hwm = _status("VmHWM") if self.reset else None
        return hwm if hwm is not None else _maxrss()

    def peak_growth(self) -> int:
        """Bytes the peak resident set grew by since :meth:`start`."""
        return max(0, self.peak() - self.base)


def _maxrss() -> int:
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # macOS: bytes, Linux: kB


def gather_usage(result: Any, flops_per_token: float, world: int, peak: Optional[PeakFlops], host: HostMemory,
                 device: torch.device) -> dict[str, Any]:
    """The end summary's numbers (``TrainResult.usage``, ``summary.json``), on every rank: throughput per device, model
    TFLOP/s and MFU (``peak``: rank 0's, None elsewhere), and every rank's peak host RSS growth and device memory
    peaks in rank order (one all_gather_object on the default group: a collective)."""
    import torch.distributed as dist

    mine = {"growth": host.peak_growth(), "peak": host.peak(), "device": device_memory_peak(device)}
    every: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    per_device = result.tokens_per_s / world
    tflops = flops_per_token * per_device / 1e12
    return {
        "parameters": result.parameters, "model_flops_per_token": flops_per_token, "devices": world,
        "tokens_per_s": result.tokens_per_s, "tokens_per_s_per_device": per_device, "model_tflops_per_device": tflops,
        "peak_tflops_per_device": peak.tflops if peak is not None else None,
        "peak_source": peak.source if peak is not None else None,
        "mfu": tflops / peak.tflops if peak is not None and peak.tflops else None,
        "host_peak_rss_growth_bytes": [e["growth"] for e in every],
        "host_peak_rss_bytes": [e["peak"] for e in every],
        "device_peak_allocated_bytes": [e["device"]["allocated"] for e in every] if mine["device"] else None,
        "device_peak_reserved_bytes": [e["device"]["reserved"] for e in every] if mine["device"] else None,
    }
