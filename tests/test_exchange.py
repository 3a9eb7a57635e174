"""Shard metadata from DTensors, the save/load distribution and every exchange algorithm on 4 gloo ranks.

Layout: mesh (dp=2, tp=2) over ranks [[0, 1], [2, 3]]; rank r has dp = r // 2, tp = r % 2.
State dict (every rank builds the same global tensors):
    w    (8, 4) fp32   (Replicate, Shard(0))    2 shards x 64 B, replicas on dp
    u    (7, 3) fp32   (Replicate, Shard(0))    uneven: rows 0-3 (48 B) and 4-6 (36 B)
    b    (5,)   fp32   (Replicate, Replicate)   20 B on all ranks, replica_id = rank
    e    (6, 2) bf16   (Shard(0), Shard(1))     4 single-holder shards x 6 B
    step ()     int64  plain tensor             8 B on all ranks, replica_id = rank
"""
import pytest
import torch
import torch.distributed as dist

from megashard.checkpoint.exchange import (
    _get_empty_tensor_for_exchange,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from megashard.checkpoint.mapping import (
    ShardedTensor,
    nested_values,
    sharded_state_dict_from_dtensors,
    sharded_tensor_from_dtensor,
    sharded_tensor_shard_id,
)
from megashard.errors import CheckpointError
from tests._dist import spawn_checks

W0, W1 = ("w", (0, 0), None), ("w", (4, 0), None)
U0, U1 = ("u", (0, 0), None), ("u", (4, 0), None)
B, STEP = ("b", (0,), None), ("step", (), None)


def E(d, t):
    return ("e", (3 * d, t), None)


_CACHE = {}


def _globals():
    return {
        "w": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "u": torch.arange(21, dtype=torch.float32).reshape(7, 3) / 7,
        "b": torch.arange(5, dtype=torch.float32) + 100.5,
        "e": (torch.arange(12).reshape(6, 2) * 3 + 1).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def _setup():
    """Mesh, dp group and sharded state dict, built once per process (groups are collective)."""
    if not _CACHE:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        g = _globals()
        sd = {
            "w": distribute_tensor(g["w"], mesh, [Replicate(), Shard(0)]),
            "u": distribute_tensor(g["u"], mesh, [Replicate(), Shard(0)]),
            "b": distribute_tensor(g["b"], mesh, [Replicate(), Replicate()]),
            "e": distribute_tensor(g["e"], mesh, [Shard(0), Shard(1)]),
            "step": g["step"].clone(),
        }
        _CACHE.update(mesh=mesh, dp=mesh.get_group("dp"), ssd=sharded_state_dict_from_dtensors(sd), g=g)
    return _CACHE


def _expected(sh: ShardedTensor) -> torch.Tensor:
    return _globals()[sh.key][sh.global_slice()].contiguous()


# ---------------------------------------------------------------- checks (run on every rank)
def check_dtensor_description(rank, world_size):
    c = _setup()
    ssd = c["ssd"]
    dp, tp = divmod(rank, 2)
    u = ssd["u"]
    want = ((4, 3), (7, 3), (0, 0)) if tp == 0 else ((3, 3), (7, 3), (4, 0))  # torch.chunk: 4 + 3 rows
    assert (u.local_shape, u.global_shape, u.global_offset) == want
    assert u.axis_fragmentations is None  # 7 rows over 2: not a regular grid
    assert u.replica_id == dp and torch.equal(u.data, _expected(u))
    w = ssd["w"]
    assert (w.local_shape, w.global_offset, w.axis_fragmentations, w.replica_id) == ((4, 4), (4 * tp, 0), (2, 1), dp)
    e = ssd["e"]
    assert (e.local_shape, e.global_offset, e.axis_fragmentations, e.replica_id) == ((3, 1), (3 * dp, tp), (2, 2), 0)
    assert ssd["b"].replica_id == rank and ssd["b"].global_offset == (0,)
    assert ssd["step"].replica_id == rank and ssd["step"].local_shape == () and ssd["step"].dtype == torch.int64
    # A mesh without this rank: nothing to describe.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sub = DeviceMesh("cpu", torch.tensor([0, 1]))
    dt = distribute_tensor(torch.ones(4, 2), sub, [Shard(0)])
    sh = sharded_tensor_from_dtensor("sub", dt)
    if rank < 2:
        assert (sh.local_shape, sh.global_offset, sh.replica_id) == ((2, 2), (2 * rank, 0), 0)
    else:
        assert sh is None


def check_distribution_world(rank, world_size):
    d = determine_main_replica_uniform_distribution(_setup()["ssd"], None)
    expected = {E(0, 0): 0, E(0, 1): 1, E(1, 0): 2, E(1, 1): 3,
                W0: 0, W1: 1, U0: 2, U1: 3, B: 3, STEP: 2}
    assert d.main_rank_for_shard == expected, d.main_rank_for_shard
    assert d.shards_in_this_group == set(expected)
    assert d.all_ranks_for_shard[W1] == [1, 3] and d.all_ranks_for_shard[B] == [0, 1, 2, 3]
    assert d.shard_to_metadata[U1].local_shape == (3, 3) and d.shard_to_metadata[U1].data is None


def check_distribution_dp_groups(rank, world_size):
    c = _setup()
    tp = rank % 2
    plain = determine_main_replica_uniform_distribution(c["ssd"], c["dp"])
    loading = determine_main_replica_uniform_distribution(c["ssd"], c["dp"], ignore_groups=True)
    if tp == 0:  # group {0, 2}: every shard has its main replica (rank 0) here
        expected = {E(0, 0): 0, E(1, 0): 1, W0: 0, U0: 1, B: 1, STEP: 0}
        assert plain.main_rank_for_shard == expected and loading.main_rank_for_shard == expected
    else:  # group {1, 3}: b and step have their main replica on rank 0 (other group)
        assert plain.main_rank_for_shard == {E(0, 1): 0, E(1, 1): 1, W1: 0, U1: 1}
        assert plain.shards_in_this_group == {E(0, 1), E(1, 1), W1, U1}
        # loading: the cross-group shards come last; group rank 1 (global 3) takes both
        assert loading.main_rank_for_shard == {E(0, 1): 0, E(1, 1): 1, W1: 0, U1: 1, B: 1, STEP: 1}


def _load_and_exchange(rank, group, ignore_groups, algo):
    c = _setup()
    d = determine_main_replica_uniform_distribution(c["ssd"], group, ignore_groups=ignore_groups)
    me = dist.get_rank(group)
    local = [sh for sh in nested_values(c["ssd"]) if isinstance(sh, ShardedTensor)]
    loaded, unloaded, prealloc = {}, {}, {}
    for sh in local:
        sid = sharded_tensor_shard_id(sh)
        if d.main_rank_for_shard[sid] == me:
            loaded[sid] = _expected(sh)  # what this rank read from "disk"
        else:
            target = sh.without_data()
            if sh.key == "u":  # receive into a caller-owned buffer
                target.data = torch.full(sh.local_shape, -1.0)
                prealloc[sid] = target.data
            unloaded[sid] = target
    out = exchange_by_distribution(loaded, unloaded, d, group, exchange_algo=algo)
    want = {sharded_tensor_shard_id(sh): _expected(sh) for sh in local}
    if algo == "gather_object":
        assert set(want) <= set(out) and set(out) == set(d.main_rank_for_shard), (set(out), set(want))
    else:
        assert set(out) == set(want), (algo, set(out) ^ set(want))
    for sid, value in want.items():
        got = out[sid]
        assert got.dtype == value.dtype and got.shape == value.shape, (algo, sid, got.dtype, got.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), (algo, sid)
    for sid, buf in prealloc.items():
        assert out[sid] is buf, (algo, sid)


def check_exchange_broadcast(rank, world_size):
    _load_and_exchange(rank, None, False, "broadcast")
    _load_and_exchange(rank, _setup()["dp"], True, "broadcast")


def check_exchange_gather_rounds(rank, world_size):
    _load_and_exchange(rank, None, False, "gather_rounds")
    _load_and_exchange(rank, _setup()["dp"], True, "gather_rounds")


def check_exchange_gather_object(rank, world_size):
    _load_and_exchange(rank, None, False, "gather_object")
    _load_and_exchange(rank, _setup()["dp"], True, "gather_object")


def check_exchange_objects(rank, world_size):
    out = exchange_loaded_objects_gather_object({("obj", (rank,), None): {"rank": rank}})
    assert out == {("obj", (r,), None): {"rank": r} for r in range(world_size)}
    try:
        exchange_loaded_objects_gather_object({("dup", (), None): rank})
    except CheckpointError as e:
        assert "loaded by rank 0 and rank 1" in str(e)
    else:
        raise AssertionError("duplicate shard ids were accepted")


def check_single_rank_group_returns_none(rank, world_size):
    solo = dist.new_group([rank], use_local_synchronization=True)
    assert determine_main_replica_uniform_distribution(_setup()["ssd"], solo) is None


CHECKS = [
    check_dtensor_description,
    check_distribution_world,
    check_distribution_dp_groups,
    check_exchange_broadcast,
    check_exchange_gather_rounds,
    check_exchange_gather_object,
    check_exchange_objects,
    check_single_rank_group_returns_none,
]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=4)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_on_4_gloo_ranks(dist4, name):
    dist4.assert_ok(name)


# ---------------------------------------------------------------- receive buffers (no communication)
def test_receive_buffer_for_needed_and_unneeded_shards():
    sid = ("w", (0, 0), None)
    needed = ShardedTensor("w", None, torch.bfloat16, (2, 3), (4, 3), (0, 0))
    loaded = {}
    buf, orig = _get_empty_tensor_for_exchange(sid, {sid: needed}, {}, loaded)
    assert buf is needed.data and loaded[sid] is buf and orig == torch.device("cpu")
    assert buf.shape == (2, 3) and buf.dtype == torch.bfloat16
    # a caller buffer that is not contiguous: receive elsewhere, remember where it belongs
    base = torch.zeros(3, 2)
    strided = ShardedTensor("w", base.t(), torch.float32, (2, 3), (4, 3), (0, 0))
    buf, orig = _get_empty_tensor_for_exchange(sid, {sid: strided}, {}, loaded)
    assert buf is not strided.data and buf.is_contiguous() and loaded[sid] is buf and orig == torch.device("cpu")
    # not needed here: a fresh buffer from metadata, never the metadata's own data
    meta = ShardedTensor("f", torch.ones(4), torch.float32, (3, 5), (6, 5), (3, 0), flattened_range=slice(2, 6))
    fsid = ("f", (3, 0), (2, 6))
    buf, orig = _get_empty_tensor_for_exchange(fsid, {}, {fsid: meta}, {})
    assert orig is None and buf.shape == (4,) and buf is not meta.data and fsid not in loaded


# ---------------------------------------------------------------- object collectives without numpy
def test_object_collectives_work_without_numpy(monkeypatch):
    # torch unpickles received objects through numpy; megashard._compat swaps in a bytearray copy when
    # numpy is unusable. Simulated here (numpy present), on a one-rank gloo group in this process.
    import megashard._compat.c10d as compat
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    monkeypatch.setattr(c10d, "_tensor_to_object", c10d._tensor_to_object)  # restored after the test
    monkeypatch.setattr(compat, "_numpy_usable", lambda: False)
    assert compat.install_numpy_free_object_collectives() is True
    assert c10d._tensor_to_object._megashard_numpy_free
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a, **k: pytest.fail("numpy used"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        obj = {("w", (0, 4), None): [0, 1], "bytes": bytes(range(256)) * 3, "t": torch.arange(5)}
        out = [None]
        dist.all_gather_object(out, obj)
        assert out[0].keys() == obj.keys() and out[0]["bytes"] == obj["bytes"]
        assert torch.equal(out[0]["t"], obj["t"]) and out[0][("w", (0, 4), None)] == [0, 1]
        box = ["x" * 1000]
        dist.broadcast_object_list(box, src=0)
        assert box == ["x" * 1000]
    finally:
        dist.destroy_process_group()
