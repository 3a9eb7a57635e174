"""DTensor gathers on gloo with CUDA tensors: which torch releases crash there, and the probe that tells
(:func:`megashard.tensors.uneven.gather.full_tensor` gathers with broadcasts where they do).
"""
from __future__ import annotations

import os

from megashard._compat.version import TORCH_VERSION


#: torch releases (major, minor) -> whether a DTensor gather (``redistribute`` Shard -> Replicate, ``full_tensor()``)
#: kills the process (SIGSEGV in every rank) on gloo with CUDA tensors; raw collectives (all_gather_into_tensor,
#: broadcast) work there. Filled from :func:`probe_gloo_cuda_dtensor_gather` on a GPU (tests/gpu/test_cuda_gloo.py
#: compares the two): 2.11 from torch 2.11.0+cu130 on an H100. A release not listed is treated as affected.
GLOO_CUDA_DTENSOR_GATHER_CRASHES: dict[tuple[int, int], bool] = {(2, 11): True}


def dtensor_gather_crashes(device_type: str, backend: str, version: tuple[int, int] = TORCH_VERSION,
                           table: dict | None = None) -> bool:
    """True where a DTensor gather must not be used: a CUDA mesh over gloo on a torch release that crashes there
    (per :data:`GLOO_CUDA_DTENSOR_GATHER_CRASHES`; an unlisted release counts as affected: the way round costs a
    little speed, a crash costs the job). NCCL, CPU meshes and listed unaffected releases: False."""
    if device_type != "cuda" or "gloo" not in str(backend) or "nccl" in str(backend):
        return False
    known = (GLOO_CUDA_DTENSOR_GATHER_CRASHES if table is None else table).get(tuple(version[:2]))
    return True if known is None else bool(known)


_GATHER_PROBE = r"""
import os, sys, datetime, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
rank, world, device, init = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
if device == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh(device, (world,))
full = torch.arange(48, dtype=torch.float32, device=device).reshape(8, 6)
d = distribute_tensor(full, mesh, [Shard(0)])
ok = torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full) and torch.equal(d.full_tensor(), full)
print("gathered", int(ok), flush=True)  # the verdict: what happens at teardown is not the gather's
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 3)
"""


def probe_gloo_cuda_dtensor_gather(device: str = "cuda", timeout: float = 180.0) -> bool | None:
    """Run a DTensor gather (Shard(0) -> Replicate and ``full_tensor()``) on gloo in two child processes on
    ``device`` (both on ``cuda:0`` for CUDA). True: a child died of a signal (torch's crash); False: both gathered
    the right tensor; None: undecided (the children failed otherwise or timed out). Seconds: a few (CUDA set-up)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megashard-gather-probe-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-c", _GATHER_PROBE, str(r), device, init], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2)]
        codes = []
        for p in procs:
            try:
                out = p.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0]
            # A child that reported its gather is judged by it: a crash at teardown (gloo's, seen once on torch
            # 2.11 on CPU) is not the crash this probes for.
            codes.append(0 if "gathered 1" in out else 3 if "gathered 0" in out else p.returncode)
    return probe_verdict(codes)


def probe_verdict(codes: list) -> bool | None:
    """The probe's verdict from its children's exit codes (``subprocess`` style: -N = killed by signal N)."""
    if any(c is not None and c < 0 and c != -9 for c in codes):  # SIGSEGV/SIGABRT/SIGBUS: torch crashed
        return True
    if codes and all(c == 0 for c in codes):
        return False
    return None
