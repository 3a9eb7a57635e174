"""Flat sharded tensors: spec validation, bitwise shard/gather round trips over 4 gloo ranks, uneven and
multi-range specs, in-place unshard/reshard, and autograd through a ShardedFlatParameter."""
import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megashard.errors import ShardingError, StateError
from megashard.tensors.flat import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec
from tests._dist import spawn_checks

# 13 elements: rank 0 holds two ranges (stored tail first), rank 2 holds nothing
ODD_SPEC = ShardingSpec((13,), (((10, 13), (0, 2)), ((2, 7),), (), ((7, 10),)))


def _special_floats(shape):
    """float32 values whose bit patterns a sloppy copy would change: NaN payloads, -0.0, inf, denormals."""
    n = torch.Size(shape).numel()
    bits = torch.arange(n, dtype=torch.int32) * 7919 + 0x3F800000
    bits[0::5] = 0x7FC00001 + torch.arange(len(bits[0::5]), dtype=torch.int32)  # NaNs with payloads
    bits[1::5] = torch.tensor(-0x80000000, dtype=torch.int32)  # -0.0
    bits[2::5] = 0x00000003  # denormal
    bits[3::7] = 0x7F800000  # +inf
    return bits.view(torch.float32).reshape(shape)


# ------------------------------------------------------------------------------------------------
# single process (no process group: a world of one rank)
# ------------------------------------------------------------------------------------------------
def test_spec_validation():
    assert ODD_SPEC.sharded_numels == (5, 5, 0, 3)
    assert ODD_SPEC.unsharded_flattened_shape == (13,)
    assert ShardingSpec.even((5, 3), 4).unsharded_flattened_offsets == (((0, 4),), ((4, 8),), ((8, 12),), ((12, 15),))
    assert ShardingSpec.even((2,), 4).sharded_numels == (1, 1, 0, 0)
    with pytest.raises(ShardingError, match=r"\[2, 3\) belong to no rank"):
        ShardingSpec((4,), (((0, 2),), ((3, 4),)))
    with pytest.raises(ShardingError, match=r"rank 1's range \(2, 4\) overlaps"):
        ShardingSpec((4,), (((0, 3),), ((2, 4),)))
    with pytest.raises(ShardingError, match=r"\[3, 4\) belong to no rank"):
        ShardingSpec((2, 2), (((0, 3),),))
    with pytest.raises(ShardingError, match=r"rank 0 has range \(0, 5\).*4 elements"):
        ShardingSpec((4,), (((0, 5),),))
    with pytest.raises(ShardingError, match="start <= end"):
        ShardingSpec((4,), (((2, 0), (0, 4)),))
    with pytest.raises(ShardingError, match="pairs"):
        ShardingSpec((4,), ((0, 4),))
    with pytest.raises(ShardingError, match="at least one rank"):
        ShardingSpec((0,), ())


def test_single_process_world_of_one():
    t = torch.arange(12.0).reshape(3, 4)
    p = ShardedFlatParameter.shard(t)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.sharded_shape == (12,)
    assert torch.equal(p.gather(), t)
    assert not ShardedFlatTensor.shard(t).requires_grad
    w = p.wrap(torch.ones(12))
    assert type(w) is ShardedFlatTensor and w.sharding_spec == p.sharding_spec
    assert [c.tolist() for c in p.chunk_unsharded(t)] == [list(range(12))]
    # metadata survives deepcopy and pickling; the copy is independent
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert type(q) is ShardedFlatParameter and q.sharding_spec == p.sharding_spec and q.requires_grad
        q.data.add_(1)
        assert torch.equal(p.data, torch.arange(12.0))
    # an optimizer steps it like any parameter
    opt = torch.optim.SGD([p], lr=0.5)
    (p * torch.arange(12.0)).sum().backward()
    opt.step()
    assert torch.equal(p.data, torch.arange(12.0) * 0.5)


def test_state_errors():
    p = ShardedFlatParameter.shard(torch.arange(6.0))
    with pytest.raises(StateError, match="without a preceding unshard_"):
        p.reshard_()
    p.unshard_()
    with pytest.raises(StateError, match="called twice"):
        p.unshard_()
    with pytest.raises(StateError, match="reshard_"):
        p.gather()
    p.reshard_()
    with pytest.raises(ShardingError, match="1-D"):
        ShardedFlatTensor(torch.zeros(2, 2))
    with pytest.raises(ShardingError, match="unsharded shape"):
        p.sharded_chunk(torch.zeros(7))
    with pytest.raises(ShardingError, match="local shard shape"):
        p.wrap(torch.zeros(5))
    with pytest.raises(ShardingError, match="lists 4 ranks but the process group has 1"):
        ShardedFlatTensor.shard(torch.zeros(13), ODD_SPEC)
    with pytest.raises(StateError, match="no ShardingSpec"):
        ShardedFlatTensor(torch.zeros(3)).sharding_spec


# ------------------------------------------------------------------------------------------------
# gloo, 4 ranks
# ------------------------------------------------------------------------------------------------
def check_roundtrip_bitwise(rank, world_size):
    for shape, dtype in [((7, 5), torch.float32), ((3, 2, 2), torch.bfloat16), ((11,), torch.int64), ((2,), torch.float32)]:
        full = _special_floats(shape) if dtype == torch.float32 else torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype) * 3 - 7
        t = ShardedFlatTensor.shard(full)
        numel, chunk = full.numel(), -(-full.numel() // world_size)
        lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        assert t.sharded_shape == (hi - lo,)
        assert torch.equal(t.data.view(-1).view(torch.uint8), full.reshape(-1)[lo:hi].view(torch.uint8)), (shape, dtype)
        g = t.gather()
        assert g.shape == full.shape and g.dtype == dtype
        assert torch.equal(g.view(torch.uint8), full.view(torch.uint8)), (shape, dtype)
        g0 = t.gather(rank0_only=True)
        if rank == 0:
            assert torch.equal(g0.view(torch.uint8), full.view(torch.uint8))
        else:
            assert g0.numel() == 0
    t = ShardedFlatTensor.shard(torch.arange(9, dtype=torch.float32))
    assert t.gather(dtype=torch.float64).dtype == torch.float64


def check_uneven_and_multi_range_spec(rank, world_size):
    full = torch.arange(13.0) * 10  # value / 10 = global flat index
    t = ShardedFlatTensor.shard(full, ODD_SPEC)
    want = {0: [100, 110, 120, 0, 10], 1: [20, 30, 40, 50, 60], 2: [], 3: [70, 80, 90]}[rank]
    assert t.data.tolist() == want
    assert torch.equal(t.gather(), full)
    assert [c.tolist() for c in t.chunk_unsharded(full)] == [want_r for want_r in ([100, 110, 120, 0, 10], [20, 30, 40, 50, 60], [], [70, 80, 90])]
    assert [c.numel() for c in t.chunk_unsharded(full, pad=True)] == [5, 5, 5, 5]
    assert t.sharded_chunk(full * 2).tolist() == [2 * v for v in want]
    # 2 elements over 4 ranks: ranks 2, 3 hold nothing, gather still works on gloo
    s = ShardedFlatTensor.shard(torch.tensor([5.0, 6.0]))
    assert s.data.tolist() == [[5.0], [6.0], [], []][rank]
    assert s.gather().tolist() == [5.0, 6.0]


def check_synchronize_and_subgroups(rank, world_size):
    mine = torch.full((6,), float(rank))  # every rank passes different data
    t = ShardedFlatTensor.shard(mine, synchronize=True)
    assert torch.equal(t.gather(), torch.zeros(6))  # rank 0's tensor won
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[rank % 2]
    full = torch.arange(5.0) + 100 * rank  # group {1, 3}: its rank 0 is global rank 1
    t = ShardedFlatTensor.shard(full, process_group=g, synchronize=True)
    src = rank % 2
    assert t.data.tolist() == (torch.arange(5.0) + 100 * src)[[0, 1, 2] if rank < 2 else [3, 4]].tolist()
    assert torch.equal(t.gather(), torch.arange(5.0) + 100 * src)
    g0 = t.gather(rank0_only=True)
    assert g0.numel() == (5 if rank < 2 else 0)


def check_unshard_reshard(rank, world_size):
    full = torch.arange(15.0).reshape(5, 3)
    p = ShardedFlatParameter.shard(full)
    p.unshard_()
    assert not p.is_sharded and p.shape == (5, 3) and torch.equal(p.data, full)
    assert p.sharded_data.tolist() == full.reshape(-1)[4 * rank : 4 * rank + 4].tolist()
    p.data.mul_(-1)
    p.reshard_(writeback=True)
    assert p.is_sharded and p.shape == (p.sharded_shape[0],)
    assert p.data.tolist() == (-full).reshape(-1)[4 * rank : 4 * rank + 4].tolist()
    p.unshard_(rank0_only=True)
    assert p.numel() == (15 if rank == 0 else 0)
    with pytest.raises(StateError, match="writeback"):
        if rank != 0:
            p.reshard_(writeback=True)
        else:
            raise StateError("writeback (rank 0 has the data)")
    p.reshard_()
    p.unshard_(unsharded_data=torch.ones(5, 3), dtype=torch.float64)
    assert p.dtype == torch.float64 and p.shape == (5, 3)
    p.reshard_()
    assert p.dtype == torch.float32 and p.data.tolist() == (-full).reshape(-1)[4 * rank : 4 * rank + 4].tolist()


def check_autograd_through_gather(rank, world_size):
    w_full = torch.arange(35.0).reshape(7, 5) - 17  # exact small ints: sums are exact in float32
    xs = [torch.arange(10.0).reshape(2, 5) * (r + 1) - r for r in range(world_size)]
    # reference: one model, the loss summed over every rank's batch
    ref = w_full.clone().requires_grad_(True)
    sum(F.linear(x, ref).square().sum() for x in xs).backward()
    p = ShardedFlatParameter.shard(w_full)
    F.linear(xs[rank], p.gather()).square().sum().backward()  # no graph kept alive: see flat.py on unshard_
    assert p.grad is not None and p.grad.shape == p.shape
    assert torch.equal(p.grad, p.sharded_chunk(ref.grad)), (p.grad, p.sharded_chunk(ref.grad))
    # through a dtype cast too
    p.grad = None
    F.linear(xs[rank].double(), p.gather(dtype=torch.float64)).square().sum().backward()
    assert p.grad.dtype == torch.float32 and torch.equal(p.grad, p.sharded_chunk(ref.grad))
    # FSDP style: unshard in place, the gradient is full-shape and local to this rank's batch
    p.grad = None
    p.unshard_()
    F.linear(xs[rank], p).square().sum().backward()
    local_ref = w_full.clone().requires_grad_(True)
    F.linear(xs[rank], local_ref).square().sum().backward()
    assert torch.equal(p.grad, local_ref.grad)
    p.reshard_()
    assert p.shape == p.sharded_shape


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(
        [check_roundtrip_bitwise, check_uneven_and_multi_range_spec, check_synchronize_and_subgroups,
         check_unshard_reshard, check_autograd_through_gather],
        world_size=4,
    )


@pytest.mark.parametrize("name", [
    "check_roundtrip_bitwise", "check_uneven_and_multi_range_spec", "check_synchronize_and_subgroups",
    "check_unshard_reshard", "check_autograd_through_gather",
])
def test_gloo(dist4, name):
    dist4.assert_ok(name)
