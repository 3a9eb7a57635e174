"""What the advisor assumes of the machine a job runs on, read from the job's config and from this machine.

    dev = job_device(job.parallel)                       # "cpu" or "cuda" (``auto``: cuda when this machine has one)
    m = describe_machine(dev, ranks_per_node=4)          # memory per rank, the device's name, the hardware numbers

``megashard plan --suggest`` takes every number it is not given from here (docs/advisor.md, "What it assumes"):

- **device**: ``parallel.device`` (``auto``: cuda when this machine has a GPU, else cpu; ``backend: nccl``: cuda);
- **memory per rank**: on CPU this machine's RAM (``MemTotal``, or the cgroup's limit when smaller) shared by the
  node's ranks; on CUDA the GPU's total memory (``torch.cuda.get_device_properties``) when this machine has one;
- **hardware**: on CPU a matrix multiply timed here in the job's dtype, one rank's share of the cores, and gloo's
  numbers on one host (:data:`CPU_GLOO`); on CUDA the peak of the GPU this machine has (:data:`GPU_TFLOPS`), else an
  H100's (:class:`~megashard.advisor.cost.Hardware`'s defaults).

Only the CPU timing and the CUDA properties import torch; the layout search itself never does.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megashard.advisor.cost import Hardware

#: Peak dense bf16 TFLOP/s of GPUs by a part of their name (the first match wins; H100 SXM when none matches).
GPU_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("B200", 2250.0), ("B100", 1750.0),
              ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
              ("A10", 125.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0))

#: gloo between the processes of one host: bus bandwidth (GB/s per rank) and the cost of one ring step of a
#: collective (µs; :func:`megashard.advisor.cost.collective_latency` scales it with the group and the cores), and the
#: fixed cost of one block's forward and backward per microbatch (µs: launches of ~50 small kernels, autograd, FSDP's
#: hooks), both with each rank on a core of its own; more ranks than cores multiply them by ranks / cores. Fitted
#: to step times of the default job's layouts measured on a 2-core machine (docs/advisor.md, "On CPU").
CPU_GLOO = {"gbps": 2.0, "latency_us": 1500.0, "block_us": 2500.0}

#: Share of the timed matrix multiply a CPU step sustains on the model's matmuls (small shapes).
CPU_EFFICIENCY = 0.5


@dataclass
class MachineInfo:
    """The device a job runs on and the numbers the advisor assumes for it."""

    device: str
    """``cpu`` or ``cuda``."""
    name: str
    """The CPU (``12 cores``) or the GPU's name, or ``H100 (assumed: no GPU here)``."""
    memory_per_rank: Optional[int]
    """Bytes a rank may use (None: unknown here, e.g. a CUDA job planned on a machine without a GPU)."""
    memory_note: str
    """Where that figure comes from, for the report."""
    hardware: Hardware
    hardware_note: str
    """Where the hardware numbers come from, for the report."""


def job_device(parallel: Any) -> str:
    """``cpu`` or ``cuda``: ``parallel.device``, ``auto`` resolved as ``megashard run`` resolves it here (an nccl
    backend means CUDA)."""
    device = getattr(parallel, "device", "auto")
    if device in ("cpu", "cuda"):
        return device
    if getattr(parallel, "backend", "auto") == "nccl":
        return "cuda"
    return "cuda" if _cuda_count() > 0 else "cpu"


def _cuda_count() -> int:
    if not os.path.exists("/proc/driver/nvidia") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0  # no NVIDIA driver: do not import torch to learn it
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA set-up is "no GPU" for the planner
        return 0


def host_ram() -> int:
    """Bytes of RAM this machine (or its cgroup, when that is smaller) gives its processes."""
    total = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
            if text.isdigit() and 0 < int(text) < (total or 1 << 62):
                total = int(text)
        except OSError:
            continue
    return total


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def measure_cpu_flops(dtype: str = "float32", seconds: float = 0.15) -> float:
    """Flops per second of one core on a ``[256, 512] @ [512, 512]`` matrix multiply in ``dtype``, timed here (the
    best of a few repeats; imports torch)."""
    import time

    import torch

    dt = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[dtype]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 512, dtype=dt), torch.randn(512, 512, dtype=dt)
        flop = 2 * 256 * 512 * 512
        torch.mm(a, b)
        best, end = float("inf"), time.perf_counter() + seconds
        while True:
            t = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = min(best, (time.perf_counter() - t) / 4)
            if time.perf_counter() > end:
                break
    finally:
        torch.set_num_threads(before)
    return flop / best


def cpu_hardware(ranks_per_node: int, dtype: str, flops_per_core: Optional[float] = None,
                 cores: Optional[int] = None) -> tuple[Hardware, str]:
    """The hardware numbers of a CPU job with ``ranks_per_node`` processes on this machine, and a note saying where
    they come from. ``flops_per_core``: a measured rate (default: :func:`measure_cpu_flops` now)."""
    cores = cores or cpu_count()
    rate = flops_per_core if flops_per_core is not None else measure_cpu_flops(dtype)
    threads = max(1, cores // ranks_per_node)  # megashard run gives each rank cores // nproc_per_node threads
    share = min(float(threads), cores / ranks_per_node)  # more ranks than cores: each gets its share of one
    oversubscribed = max(1.0, ranks_per_node / cores)
    hw = Hardware(tflops=rate * share / 1e12, mfu=CPU_EFFICIENCY, intra_gbps=CPU_GLOO["gbps"] / oversubscribed,
                  inter_gbps=min(CPU_GLOO["gbps"], 1.0), latency_us=CPU_GLOO["latency_us"], fp32_factor=1.0,
                  op_overhead_us=CPU_GLOO["block_us"] * oversubscribed, device="cpu", cores=cores,
                  name=f"CPU, {cores} core{'s' if cores != 1 else ''}")
    note = (f"cpu: {rate / 1e9:.1f} GFLOP/s {dtype} per core (a matmul timed here) × {share:g} core(s) per rank × "
            f"{CPU_EFFICIENCY:g}; {hw.op_overhead_us:g} µs per block and microbatch; gloo {hw.intra_gbps:g} GB/s, "
            f"{hw.latency_us:g} µs per ring step ({ranks_per_node} ranks on {cores} cores)")
    return hw, note


def gpu_hardware(name: Optional[str]) -> tuple[Hardware, str]:
    """The hardware numbers of a CUDA job: the peak of the GPU ``name`` (this machine's), else an H100's."""
    if name:
        for key, tflops in GPU_TFLOPS:
            if key.lower() in name.lower():
                return Hardware(tflops=tflops, name=name), f"cuda: {name} ({tflops:g} TFLOP/s bf16 peak)"
    return Hardware(), ("cuda: no GPU on this machine; assumed an H100 SXM (--tflops and the bandwidth flags change "
                        "it)" if not name else f"cuda: {name} is not in the table; assumed an H100 SXM's numbers")


def describe_machine(device: str, ranks_per_node: int, dtype: str = "float32", *,
                     measure: bool = True) -> MachineInfo:
    """What this machine gives a job on ``device`` with ``ranks_per_node`` processes per node (module docstring).
    ``measure=False`` skips the CPU timing (a nominal 10 GFLOP/s per core; tests)."""
    if device == "cpu":
        ram, cores = host_ram(), cpu_count()
        hw, note = cpu_hardware(ranks_per_node, dtype, None if measure else 10e9, cores)
        per_rank = ram // ranks_per_node if ram else None
        mem_note = (f"this machine's RAM {ram / 2**30:.1f} GiB / {ranks_per_node} rank(s) per node" if ram
                    else "this machine's RAM is unknown")
        return MachineInfo("cpu", hw.name, per_rank, mem_note, hw, note)
    name, total = None, None
    if _cuda_count() > 0:
        import torch

        props = torch.cuda.get_device_properties(0)
        name, total = props.name, int(props.total_memory)
    hw, note = gpu_hardware(name)
    mem_note = f"{name}: {total / 2**30:.1f} GiB (torch.cuda)" if total else "no GPU on this machine"
    return MachineInfo("cuda", name or "H100 (assumed)", total, mem_note, hw, note)
