"""``train.compile`` on one GPU with the real inductor backend, and the host-overhead paths on CUDA (issue 20).

Runs the first 10 steps of configs/default.yaml as tests/test_train_parity.py does (dropout 0, clipping active),
``model.arch: llama``, tp=1, dp=1, NCCL world of one, eager and with ``train.compile: true`` (inductor, Triton
kernels): float32 losses within 1e-4 relative of the eager CUDA run (the float32 tolerance across kernels), bf16
within 5e-3 (the bf16 tolerance of tests/gpu/test_cuda_train.py). The eager runs use the job's host-overhead
paths (grouped foreach clipping without host sync, LocalShardAdamW on CUDA tensors): their float32 losses also
match the CPU run to 1e-4.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests._dist import spawn_checks
from tests.test_train_parity import ENV, SINGLE, STEPS, _assert_close, _losses, _run

pytestmark = pytest.mark.gpu

LLAMA = SINGLE + ["model.arch=llama"]
CUDA = LLAMA + ["parallel.device=cuda"]


def _cuda(tag: str, extra: list[str]) -> None:
    import torch

    torch.cuda.set_device(0)
    _run(tag, CUDA + extra)


def check_eager_f32(rank, world_size):
    _cuda("eager-f32", ["train.dtype=float32"])


def check_compiled_f32(rank, world_size):
    _cuda("compiled-f32", ["train.dtype=float32", "train.compile=true"])


def check_eager_bf16(rank, world_size):
    _cuda("eager-bf16", ["train.dtype=bfloat16"])


def check_compiled_bf16(rank, world_size):
    _cuda("compiled-bf16", ["train.dtype=bfloat16", "train.compile=true"])


def check_cpu_f32(rank, world_size):
    _run("cpu-f32", LLAMA + ["parallel.device=cpu", "train.dtype=float32"])


GPU_CHECKS = [check_eager_f32, check_compiled_f32, check_eager_bf16, check_compiled_bf16]


@pytest.fixture(scope="module")
def runs():
    tmp = tempfile.mkdtemp(prefix="megashard-gpu-compile-")
    old = os.environ.get(ENV)
    os.environ[ENV] = tmp
    try:
        gpu = spawn_checks(GPU_CHECKS, world_size=1, backend="nccl", timeout=900, pg_timeout=600)
        cpu = spawn_checks([check_cpu_f32], world_size=1, timeout=400)
        yield tmp, gpu, cpu
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
        shutil.rmtree(tmp, ignore_errors=True)


def test_compiled_float32_matches_eager_on_cuda(runs):
    tmp, gpu, _ = runs
    gpu.assert_ok("check_eager_f32")
    gpu.assert_ok("check_compiled_f32")
    _assert_close(_losses(tmp, "compiled-f32"), _losses(tmp, "eager-f32"), 1e-4, range(1, STEPS + 1))


def test_compiled_bfloat16_matches_eager_on_cuda(runs):
    tmp, gpu, _ = runs
    gpu.assert_ok("check_eager_bf16")
    gpu.assert_ok("check_compiled_bf16")
    _assert_close(_losses(tmp, "compiled-bf16"), _losses(tmp, "eager-bf16"), 5e-3, range(1, STEPS + 1))


def test_eager_float32_on_cuda_matches_cpu(runs):
    tmp, gpu, cpu = runs
    gpu.assert_ok("check_eager_f32")
    cpu.assert_ok("check_cpu_f32")
    _assert_close(_losses(tmp, "eager-f32"), _losses(tmp, "cpu-f32"), 1e-4, range(1, STEPS + 1))
