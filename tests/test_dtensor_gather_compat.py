"""DTensor gathers where torch crashes: on gloo with CUDA tensors torch 2.11's own gather (``redistribute`` Shard ->
Replicate, ``full_tensor()``) kills every rank (SIGSEGV), so megashard's ``full_tensor`` takes broadcasts there.

No GPU is needed for what is checked here: the decision (which meshes, backends and torch releases avoid DTensor's
gather), the probe that backs the table (two real child processes on gloo; on the CPU it must find no crash), its
verdict from exit codes, and the way round itself, forced on CPU tensors and compared bit for bit with
``DTensor.full_tensor()`` over sharded, strided (FSDP2 + TP), replicated and partial placements on a 2x2 mesh.
The CUDA half (the probe on a GPU agrees with the table; the way round on CUDA tensors) is tests/gpu/test_cuda_gloo.py.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import spawn_checks


def test_which_meshes_avoid_dtensor_gather():
    from megashard._compat import GLOO_CUDA_DTENSOR_GATHER_CRASHES, dtensor_gather_crashes

    table = {(2, 11): True, (2, 13): False}
    assert dtensor_gather_crashes("cuda", "gloo", (2, 11), table)
    assert dtensor_gather_crashes("cuda", "cuda:gloo", (2, 11), table)
    assert not dtensor_gather_crashes("cuda", "gloo", (2, 13), table)  # probed unaffected: DTensor's own gather
    assert dtensor_gather_crashes("cuda", "gloo", (2, 15), table)  # not probed yet: the safe way
    assert not dtensor_gather_crashes("cuda", "nccl", (2, 11), table)
    assert not dtensor_gather_crashes("cuda", "cpu:gloo,cuda:nccl", (2, 11), table)
    assert not dtensor_gather_crashes("cpu", "gloo", (2, 11), table)
    assert GLOO_CUDA_DTENSOR_GATHER_CRASHES[(2, 11)] is True  # seen on torch 2.11.0+cu130, H100 (issue 20)


def test_probe_verdict_from_exit_codes():
    from megashard._compat import probe_verdict

    assert probe_verdict([-11, -11]) is True and probe_verdict([0, -11]) is True and probe_verdict([-6, 0]) is True
    assert probe_verdict([0, 0]) is False
    assert probe_verdict([3, 0]) is None  # a wrong result, not a crash
    assert probe_verdict([-9, -9]) is None  # killed by the probe's timeout
    assert probe_verdict([]) is None


def test_probe_runs_the_gather_in_child_processes_on_cpu():
    from megashard._compat import probe_gloo_cuda_dtensor_gather

    assert probe_gloo_cuda_dtensor_gather("cpu", timeout=120) is False


def check_way_round_equals_full_tensor(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from megashard._compat import _StridedShard
    from megashard.tensors.uneven.gather import full_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6) * 0.25 - 1
    cases = {
        "Shard(0),Shard(1)": [Shard(0), Shard(1)],
        "Shard(1),Shard(0)": [Shard(1), Shard(0)],
        "Shard(0),Shard(0)": [Shard(0), Shard(0)],
        "Replicate,Shard(1)": [Replicate(), Shard(1)],
        "Replicate,Replicate": [Replicate(), Replicate()],
    }
    for what, placements in cases.items():
        d = distribute_tensor(full, mesh, placements)
        got = full_tensor(d, avoid_dtensor_gather=True)
        assert got.dtype == full.dtype and torch.equal(got, full), what
        assert torch.equal(got, full_tensor(d, avoid_dtensor_gather=False)), what
        assert torch.equal(full_tensor(d), d.full_tensor()), what  # on CPU: DTensor's own gather
    # FSDP2 over TP on the same dim: _StridedShard(0, split_factor=2) on dp, Shard(0) on tp
    tp_rank, dp_rank = mesh.get_coordinate()[1], mesh.get_coordinate()[0]
    tp_slice = full.chunk(2, 0)[tp_rank]
    local = tp_slice.chunk(2, 0)[dp_rank].contiguous()
    d = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(0)], run_check=False,
                           shape=full.shape, stride=full.stride())
    assert torch.equal(d.full_tensor(), full)  # torch's reading of the placements
    assert torch.equal(full_tensor(d, avoid_dtensor_gather=True), full), "strided"
    # Partial on dp: each dp rank holds a part of the sum
    part = distribute_tensor(full, mesh, [Replicate(), Shard(1)]).to_local() * (0.75 if dp_rank == 0 else 0.25)
    d = DTensor.from_local(part, mesh, [Partial(), Shard(1)], run_check=False, shape=full.shape, stride=full.stride())
    assert torch.equal(full_tensor(d, avoid_dtensor_gather=True), d.full_tensor()), "partial"


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks([check_way_round_equals_full_tensor], world_size=4)


def test_way_round_equals_full_tensor_on_cpu(dist4):
    dist4.assert_ok("check_way_round_equals_full_tensor")
