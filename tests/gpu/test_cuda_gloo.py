"""Several processes sharing the one GPU over gloo, with CUDA tensors — what NCCL cannot do with one device: the
uneven gather, megashard's DCP save/load of CUDA DTensors into other placements (resharding), and DTensor
redistribution. Where gloo itself refuses an operation on CUDA tensors, the test is skipped with gloo's message
(so the table shows exactly which operation), and every other failure fails.
"""
from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch

from tests._dist import spawn_checks

pytestmark = pytest.mark.gpu

WORLD = 2
DIR_ENV = "MEGASHARD_GPU_TEST_GLOO_DIR"
# What gloo says when it has no implementation of an operation for CUDA tensors.
_REFUSAL = re.compile(r"(?i)no support|not supported|unsupported|does not support|only supports|not implemented|"
                      r"expected .*cpu tensor")


def _gloo_refuses(message: str) -> bool:
    return "gloo" in message.lower() and _REFUSAL.search(message) is not None


def _skip_file(check: str) -> str:
    return os.path.join(os.environ[DIR_ENV], f"{check}.skip")


def _gloo_may_refuse(check: str, fn) -> None:
    """Run ``fn``; if gloo refuses a CUDA tensor, record gloo's message for the test to skip with."""
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not _gloo_refuses(str(e)):
            raise
        if torch.distributed.get_rank() == 0:
            with open(_skip_file(check), "w") as f:
                f.write(first)


def _state():
    import megashard

    if not megashard.is_initialized():
        torch.cuda.set_device(0)  # every process on the one GPU
        megashard.initialize(megashard.ParallelConfig(backend="gloo", device="cuda", timeout=60))
    return megashard.get_parallel_state()


def _full(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32, device="cuda").reshape(rows, cols) * 0.5 - 3


def check_uneven_gather_cuda(rank, world_size):
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor
    from tests.test_uneven_dcp import _rows_dtensor

    st = _state()
    assert st.device_type == "cuda" and st.mesh("dp").device_type == "cuda"

    def run():
        full = _full(7, 3)
        for parts in ([5, 2], [7, 0], [0, 7], [4, 3]):
            dt = _rows_dtensor(full, st.mesh("dp"), parts)
            got = gather_uneven_dtensor_to_full_tensor(dt, return_dtensor=False)
            assert got.device.type == "cuda", got.device
            assert torch.equal(got, full), f"rows split {parts}: gathered {got.tolist()}"
        big = _full(3001, 700)  # above the one-round cap: the general (metadata, then broadcast) path
        dt = _rows_dtensor(big, st.mesh("dp"), [2000, 1001])
        assert torch.equal(gather_uneven_dtensor_to_full_tensor(dt, return_dtensor=False), big), "large uneven gather"

    _gloo_may_refuse("check_uneven_gather_cuda", run)


def check_dcp_cuda_dtensors_reshard(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megashard import checkpoint
    from tests.test_uneven_dcp import _rows_dtensor

    st = _state()
    mesh = st.mesh("dp")

    def run():
        even, uneven = _full(8, 6), _full(7, 3)
        saved = {"even": distribute_tensor(even, mesh, [Shard(0)]), "uneven": _rows_dtensor(uneven, mesh, [5, 2])}
        path = checkpoint.save(os.path.join(os.environ[DIR_ENV], "ckpt"), 1, state_dict=saved)
        target = {"even": distribute_tensor(torch.zeros_like(even), mesh, [Shard(1)]),
                  "uneven": distribute_tensor(torch.zeros_like(uneven), mesh, [Replicate()])}
        checkpoint.load(path, state_dict=target)
        for key, want in (("even", even[:, 3 * rank: 3 * rank + 3]), ("uneven", uneven)):
            got = target[key].to_local()
            assert got.device.type == "cuda", (key, got.device)
            assert torch.equal(got, want), f"{key} loaded on rank {rank}: {got.tolist()} != {want.tolist()}"
        other = {"even": distribute_tensor(torch.zeros_like(even), mesh, [Replicate()]),
                 "uneven": _rows_dtensor(uneven, mesh, [2, 5], fill=0.0)}
        checkpoint.load(path, state_dict=other)
        assert torch.equal(other["even"].to_local(), even)
        assert torch.equal(other["uneven"].to_local(), uneven[[0, 2][rank]: [2, 7][rank]]), "uneven -> other split"

    _gloo_may_refuse("check_dcp_cuda_dtensors_reshard", run)


def check_megashard_full_tensor_cuda(rank, world_size):
    """megashard's full_tensor on CUDA over gloo: DTensor's own gather where this torch survives it, broadcasts where
    it crashes (torch 2.11) - the right tensor either way."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from megashard.tensors.uneven.gather import full_tensor

    st = _state()
    mesh = st.mesh("dp")
    full = _full(8, 6)
    for placements in ([Shard(0)], [Shard(1)]):
        got = full_tensor(distribute_tensor(full, mesh, placements))
        assert got.device.type == "cuda" and torch.equal(got, full), placements
    got = full_tensor(distribute_tensor(full, mesh, [Shard(0)]), avoid_dtensor_gather=True)
    assert torch.equal(got, full), "the way round, forced"


def check_redistribute_cuda(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    st = _state()
    mesh = st.mesh("dp")

    def run():
        full = _full(8, 6)
        d = distribute_tensor(full, mesh, [Shard(0)])
        assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full), "Shard(0) -> Replicate"
        assert torch.equal(d.redistribute(mesh, [Shard(1)]).to_local(), full[:, 3 * rank: 3 * rank + 3]), "Shard(0) -> Shard(1)"
        assert torch.equal(d.full_tensor(), full), "full_tensor"

    try:
        _gloo_may_refuse("check_redistribute_cuda", run)
    finally:
        import megashard

        megashard.destroy()


CHECKS = [check_uneven_gather_cuda, check_dcp_cuda_dtensors_reshard, check_megashard_full_tensor_cuda,
          check_redistribute_cuda]
_PROBE: list = []


def gather_crashes() -> bool | None:
    """The probe's verdict on this torch (child processes on the GPU; once per session): does DTensor's own gather
    (Shard(0) -> Replicate, full_tensor) crash on gloo with CUDA tensors?"""
    if not _PROBE:
        from megashard._compat import probe_gloo_cuda_dtensor_gather

        _PROBE.append(probe_gloo_cuda_dtensor_gather("cuda"))
    return _PROBE[0]


@pytest.fixture(scope="module")
def gloo_cuda():
    with tempfile.TemporaryDirectory(prefix="megashard-gloo-cuda-") as tmp:
        os.environ[DIR_ENV] = tmp
        try:
            # A check that would crash both ranks inside torch is not run (its test is skipped with the reason).
            checks = [c for c in CHECKS if not (c is check_redistribute_cuda and gather_crashes())]
            results = spawn_checks(checks, world_size=WORLD, timeout=240, pg_timeout=60, cuda=True)
            skips = {c.__name__: open(os.path.join(tmp, f"{c.__name__}.skip")).read()
                     for c in CHECKS if os.path.exists(os.path.join(tmp, f"{c.__name__}.skip"))}
            yield results, skips
        finally:
            os.environ.pop(DIR_ENV, None)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_gloo_with_cuda_tensors(gloo_cuda, check):
    results, skips = gloo_cuda
    if check == "check_redistribute_cuda" and gather_crashes():
        pytest.skip(f"torch {torch.__version__}: DTensor's gather (Shard(0) -> Replicate, full_tensor) on gloo with "
                    "CUDA tensors kills the process (SIGSEGV, a torch bug; probed in child processes); megashard "
                    "gathers with broadcasts there (check_megashard_full_tensor_cuda)")
    results.assert_ok(check)
    if check in skips:
        pytest.skip(f"gloo refuses CUDA tensors here: {skips[check]}")


def test_gather_probe_agrees_with_the_table():
    """megashard's table of torch releases whose DTensor gather crashes on gloo with CUDA tensors matches this GPU."""
    from megashard._compat import GLOO_CUDA_DTENSOR_GATHER_CRASHES, TORCH_VERSION

    verdict = gather_crashes()
    if verdict is None:
        pytest.skip("the probe was undecided (its child processes failed without a crash or timed out)")
    listed = GLOO_CUDA_DTENSOR_GATHER_CRASHES.get(TORCH_VERSION)
    if listed is None:
        pytest.skip(f"torch {torch.__version__} is not in GLOO_CUDA_DTENSOR_GATHER_CRASHES (treated as affected); the "
                    f"probe says {'it crashes' if verdict else 'it works'}: add {TORCH_VERSION}: {verdict} there")
    assert listed == verdict, (f"GLOO_CUDA_DTENSOR_GATHER_CRASHES says {listed} for torch {torch.__version__}, the "
                               f"probe on this GPU says {verdict}")
