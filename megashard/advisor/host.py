"""Host memory per rank (issue 42): what a rank's process holds in RAM, next to its device memory.

    est = estimate_host(shape, device="cpu", device_peak=4 << 20)
    est.peak, est.parts      # bytes; {"runtime": ..., "data": ..., "data set-up": ..., "tensors": ...}

**The measure** it predicts: a rank's *peak RSS growth* — ``VmHWM`` at the end of the job minus ``VmRSS`` when the
worker starts training (after its imports; the job's end summary reports the same figure as "peak RSS per rank").

The parts:

- **runtime**: what the process gains by running at all — the process groups (gloo's buffers and threads), the
  modules imported on first use (FSDP, DTensor, the optimizer's foreach kernels), the allocator's arenas and the
  caches that fill in the first ~100 steps. It does not grow with the model: a constant measured on this machine's
  build (:data:`RUNTIME`; docs/advisor.md, "Host memory");
- **data**: the synthetic rows every rank holds, ``num_sequences · (seq + 1) · b`` bytes, ``b`` the bytes of
  :func:`token_bytes` (2 up to a vocabulary of 32,768; memory-mapped corpora:
  only the pages a rank reads, not counted);
- **data set-up** (synthetic, while the rows are made; freed after): the successor table and its probabilities,
  ``vocab · branching · 16`` bytes, and one column's sampling scratch, ``num_sequences · branching · 16`` — linear in
  vocab × branching, as the set-up is since issue 42 (before, it held ``vocab² · 8`` bytes at once: 2 GiB at a vocabulary
  of 16,384);
- **tensors** (CPU jobs only): the device peak itself — on a CPU the model, optimizer and activations live in host
  memory (the advisor's device-memory figure, modelled or traced).

The peak is ``runtime + data + max(data set-up, tensors)``: the set-up's scratch is returned before training starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20

#: A rank's runtime growth (module docstring), bytes: measured on CPU with gloo (configs/default.yaml, 4 ranks on 2
#: cores, torch 2.13, 200 steps: the largest rank's peak RSS growth was 192-203 MiB over four runs, less the data and
#: tensors counted apart); on CUDA not measured here (no GPU): assumed (the CUDA context, NCCL's and cuBLAS's host
#: buffers), to be replaced by a measurement (tests/gpu).
RUNTIME = {"cpu": 184 * MIB, "cuda": 1536 * MIB}


def token_bytes(vocab: int) -> int:
    """Bytes of one synthetic token as the job holds its rows (megashard.train.data.synthetic_token_dtype: int16 up
    to 32,768 ids, int32 up to 2**31, else int64)."""
    return 2 if vocab <= 1 << 15 else 4 if vocab <= 1 << 31 else 8


@dataclass
class HostEstimate:
    """Peak RSS growth of one rank, bytes, and what it is made of."""

    peak: int
    parts: dict[str, int] = field(default_factory=dict)
    measured_runtime: bool = True
    """Whether the runtime part was measured on this kind of device (False: assumed; the report says so)."""


def estimate_host(s: Any, device: str, device_peak: int) -> HostEstimate:
    """Host memory per rank of the job ``s`` (:class:`~megashard.advisor.shape.JobShape`) on ``device`` (``cpu`` /
    ``cuda``), given the rank's device peak in bytes (counted in host memory on a CPU)."""
    runtime = RUNTIME.get(device, RUNTIME["cuda"])
    n = s.synthetic_sequences
    data = n * (s.seq + 1) * token_bytes(s.vocab)
    setup = (s.vocab * s.branching * 16 + n * s.branching * 16) if n else 0
    tensors = device_peak if device == "cpu" else 0
    peak = runtime + data + max(setup, tensors)
    parts = {"runtime": runtime, "data": data, "data set-up": setup, "tensors": tensors}
    return HostEstimate(peak=peak, parts=parts, measured_runtime=device == "cpu")
