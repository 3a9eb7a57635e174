"""The advisor's memory estimate against ``torch.cuda.max_memory_allocated`` of real jobs on one GPU (docs/advisor.md).

Two jobs train two steps on one GPU (NCCL, tp=1, dp=1, one microbatch): the default job in bfloat16 and the 0.95 B
Llama of configs/llama-1b.yaml (seq 2048, batch 8, bf16 compute with fp32 master weights). Each one's peak of
``torch.cuda.max_memory_allocated`` (reset before the job) is compared with
:func:`megashard.advisor.memory.estimate_memory` for the same job: within 15%, plus 64 MiB the estimate does not
model (cuBLAS / cuDNN workspaces, which the caching allocator counts; they dominate the tiny default job).
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests._dist import spawn_checks

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = "MEGASHARD_GPU_ADVISOR_DIR"
SLACK = 64 << 20
COMMON = ["train.steps=2", "train.progress=false", "train.plot=false", "train.resume=false",
          "checkpoint.interval=0", "checkpoint.save_final=false", "parallel.device=cuda", "parallel.tp=1",
          "parallel.dp_shard=1", "launch.nproc_per_node=1", "train.microbatches=1"]
JOBS = {
    "default bf16": ("configs/default.yaml", ["train.dtype=bfloat16"]),
    "llama 1b": ("configs/llama-1b.yaml", ["data.num_sequences=64"]),
}


def _job(name: str):
    from megashard.train.config import JobConfig

    path, overrides = JOBS[name]
    out = os.path.join(os.environ.get(ENV, tempfile.gettempdir()), name.replace(" ", "_"))
    return JobConfig.from_yaml(os.path.join(ROOT, path), COMMON + overrides + [f"train.out_dir={out}"])


def check_cuda_peaks(rank, world_size):
    import torch

    from megashard.train.loop import train

    torch.cuda.set_device(0)
    peaks = {}
    for name in JOBS:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train(_job(name))
        peaks[name] = torch.cuda.max_memory_allocated() - base
    with open(os.path.join(os.environ[ENV], "peaks.json"), "w") as f:
        json.dump(peaks, f)


@pytest.fixture(scope="module")
def measured():
    with tempfile.TemporaryDirectory(prefix="megashard-gpu-advisor-") as tmp:
        os.environ[ENV] = tmp
        try:
            spawn_checks([check_cuda_peaks], 1, backend="nccl", cuda=True, timeout=900,
                         pg_timeout=300).assert_ok("check_cuda_peaks")
            return json.load(open(os.path.join(tmp, "peaks.json")))
        finally:
            os.environ.pop(ENV, None)


@pytest.mark.parametrize("name", list(JOBS))
def test_estimate_matches_max_memory_allocated(measured, name):
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape

    job = _job(name)
    est = estimate_memory(JobShape.from_job(job), job.parallel.resolve(1), job.model.recompute)
    real = measured[name]
    print(f"{name}: predicted {est.peak / 2**30:.3f} GiB ({est.phase}), max_memory_allocated {real / 2**30:.3f} GiB, "
          f"{est.peak / real - 1:+.1%}")
    assert abs(est.peak - real) <= 0.15 * real + SLACK, (est.peak, real, est.parts)
