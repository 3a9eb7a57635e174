"""Local shape / global offset for any rank.

* No process group: every mesh coordinate of a grid of shapes x placements (uneven, empty shards,
  _StridedShard, 1-, 2- and 3-axis meshes) equals PyTorch's own arithmetic, and the shards tile the
  global tensor exactly once per replica.
* fake backend: a DeviceMesh of 8 ranks, rank=None (calling rank) vs PyTorch's public function.
* gloo, 4 ranks: real DTensors whose values are their global flat index, so a local tensor reveals
  exactly which global elements a rank holds; the owner of every element is checked.
"""
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from megashard._compat import _StridedShard, torch_compute_local_shape_and_global_offset, torch_local_shape_and_offset_at
from megashard.errors import ShardingError, StateError
from megashard.tensors.shape import (
    _explicit_order_placements,
    compute_global_index_runs,
    compute_local_shape_and_global_offset,
    get_local_shape_and_global_offset,
    global_index_runs_at,
    local_shape_and_offset_at,
)
from tests._dist import spawn_checks

SHAPES = [(0,), (1,), (7,), (3, 5), (13, 15), (2, 9, 4)]
MESHES = [(4,), (2, 2), (3, 2), (1, 3), (2, 2, 2)]


def _options(ndim):
    return (
        [Replicate(), Partial()]
        + [Shard(d) for d in range(ndim)]
        + [_StridedShard(d, split_factor=s) for d in range(ndim) for s in (2, 3)]
    )


def _cases():
    for mesh_shape in MESHES:
        for gs in SHAPES:
            opts = _options(len(gs))
            if len(mesh_shape) == 3:  # keep the 3-axis corner cheap
                last = len(gs) - 1
                opts = [Replicate(), Shard(0), _StridedShard(0, split_factor=2)] + (
                    [Shard(last), _StridedShard(last, split_factor=3)] if last else [_StridedShard(0, split_factor=3)])
            elif len(gs) == 3:
                opts = [Replicate(), Partial(), Shard(0), Shard(2), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
            for pl in itertools.product(opts, repeat=len(mesh_shape)):
                yield mesh_shape, gs, list(pl)


def _coords(mesh_shape):
    return itertools.product(*(range(n) for n in mesh_shape))


def _indices(runs):
    return torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.int64)


def _ix(*indices):
    """numpy's ix_: index tensors shaped to select the outer product of per-dim indices."""
    n = len(indices)
    return tuple(t.view([-1 if j == k else 1 for j in range(n)]) for k, t in enumerate(indices))


@pytest.mark.skipif(torch_local_shape_and_offset_at((1,), (1,), [0], [Replicate()]) is None, reason="torch lacks the plain-data helper")
def test_every_coordinate_matches_pytorch_and_tiles_exactly():
    n_cases = n_uneven = n_empty = n_strided = 0
    for mesh_shape, gs, pl in _cases():
        counts = torch.zeros(gs, dtype=torch.int64)
        for c in _coords(mesh_shape):
            ours = local_shape_and_offset_at(gs, mesh_shape, pl, c)
            want = torch_local_shape_and_offset_at(gs, mesh_shape, c, pl)
            assert ours == want, (mesh_shape, gs, pl, c, ours, want)
            runs = global_index_runs_at(gs, mesh_shape, pl, c)
            assert tuple(sum(b - a for a, b in r) for r in runs) == ours[0]
            counts[_ix(*[_indices(r) for r in runs])] += 1
            n_empty += 0 in ours[0] and 0 not in gs
            n_strided += any(len(r) > 1 for r in runs)
        replicas = math.prod(n for n, p in zip(mesh_shape, pl) if not isinstance(p, (Shard, _StridedShard)))
        assert (counts == replicas).all(), (mesh_shape, gs, pl, counts)
        n_cases += 1
        n_uneven += any(isinstance(p, Shard) and gs[p.dim] % n for n, p in zip(mesh_shape, pl))
    assert n_cases > 1000 and n_uneven > 300 and n_empty > 300 and n_strided > 300, (n_cases, n_uneven, n_empty, n_strided)


def test_public_api_with_rank_grid_for_every_rank():
    # a plain rank grid whose ranks are not in row-major order: coordinates come from the grid
    grid = torch.tensor([[5, 1, 3], [0, 4, 2]])
    pl = [Shard(0), _StridedShard(1, split_factor=2)]
    for r in range(6):
        coord = tuple(int(x) for x in (grid == r).nonzero()[0])
        assert compute_local_shape_and_global_offset((3, 11), grid, pl, rank=r) == torch_local_shape_and_offset_at((3, 11), (2, 3), coord, pl)
    # rank 5 sits at (0, 0): rows 0..1, columns {0, 1} and {6, 7} of the two halves
    assert compute_global_index_runs((3, 11), grid, pl, rank=5) == (((0, 2),), ((0, 2), (6, 8)))
    assert compute_local_shape_and_global_offset((3, 11), grid.tolist(), pl, rank=5) == ((2, 4), (0, 0))
    # not in the mesh: PyTorch's answer
    assert compute_local_shape_and_global_offset((3, 11), grid, pl, rank=9) == ((0,), ())
    assert compute_global_index_runs((3, 11), grid, pl, rank=9) is None


def test_olmo_core_docstring_examples():
    grid = torch.arange(8).reshape(2, 4)
    for r in range(8):
        assert compute_local_shape_and_global_offset((8, 4), grid, [Shard(0), Shard(0)], rank=r) == ((1, 4), (r, 0))
    grid1 = torch.arange(8)
    got = [compute_local_shape_and_global_offset((2,), grid1, [Shard(0)], rank=r) for r in range(8)]
    assert got == [((1,), (0,)), ((1,), (1,))] + [((0,), (2,))] * 6
    # PyTorch's docstring: (2, 5) on (DP=2, TP=2) with (Shard(1), Shard(1))
    got = [compute_local_shape_and_global_offset((2, 5), torch.arange(4).reshape(2, 2), [Shard(1), Shard(1)], rank=r) for r in range(4)]
    assert got == [((2, 2), (0, 0)), ((2, 1), (0, 2)), ((2, 1), (0, 3)), ((2, 1), (0, 4))]


def test_explicit_order_placements():
    ss = _StridedShard(0, split_factor=2)
    assert list(_explicit_order_placements((2, 2, 2), [Shard(0), ss, Shard(0)])) == [(0, Shard(0)), (2, Shard(0)), (1, Shard(0))]
    assert list(_explicit_order_placements((3, 2), [_StridedShard(0, split_factor=2), Shard(0)])) == [(1, Shard(0)), (0, Shard(0))]
    # two strided axes closed by one Shard: split factors multiply right to left
    pl = [_StridedShard(1, split_factor=6), _StridedShard(1, split_factor=2), Shard(1)]
    assert list(_explicit_order_placements((4, 3, 2), pl)) == [(2, Shard(1)), (1, Shard(1)), (0, Shard(1))]
    assert list(_explicit_order_placements((2, 2), [Replicate(), Partial()])) == [(0, Replicate()), (1, Partial())]
    with pytest.raises(ShardingError, match="split_factor == 2"):
        _explicit_order_placements((2, 2), [_StridedShard(0, split_factor=3), Shard(0)])
    with pytest.raises(ShardingError, match="after its strided part ended"):
        _explicit_order_placements((2, 2, 2), [ss, Shard(0), Shard(0)])
    with pytest.raises(ShardingError, match="not closed"):
        _explicit_order_placements((2, 2), [ss, Replicate()])
    with pytest.raises(ShardingError, match="one placement per mesh axis"):
        _explicit_order_placements((2, 2), [Shard(0)])


def test_explicit_order_equals_dtensor_semantics_when_even():
    # [SS(0, sf=tp), S(0)] on (dp, tp) means "TP splits first": rank (d, t) holds chunk t*dp + d
    for dp, tp, per in [(2, 2, 3), (3, 2, 4), (2, 4, 1)]:
        n = dp * tp * per
        for d, t in itertools.product(range(dp), range(tp)):
            shape, off = local_shape_and_offset_at((n,), (dp, tp), [_StridedShard(0, split_factor=tp), Shard(0)], (d, t))
            assert (shape, off) == ((per,), ((t * dp + d) * per,))


def test_bad_input():
    with pytest.raises(ShardingError, match="one placement per mesh axis"):
        local_shape_and_offset_at((4,), (2, 2), [Shard(0)], (0, 0))
    with pytest.raises(ShardingError, match="shards dim 2.*legal dims are -2..1"):
        local_shape_and_offset_at((4, 4), (2,), [Shard(2)], (0,))
    with pytest.raises(ShardingError, match="outside the mesh"):
        local_shape_and_offset_at((4,), (2,), [Shard(0)], (2,))
    with pytest.raises(ShardingError, match="lists a rank twice"):
        compute_local_shape_and_global_offset((4,), [0, 0], [Shard(0)], rank=0)
    with pytest.raises(ShardingError, match="integer rank grid"):
        compute_local_shape_and_global_offset((4,), torch.zeros(2), [Shard(0)], rank=0)
    if not dist.is_initialized():
        with pytest.raises(StateError, match="pass rank="):
            compute_local_shape_and_global_offset((4,), torch.arange(2), [Shard(0)])
    # negative dims are normalised like DTensor's user-facing APIs do
    assert local_shape_and_offset_at((4, 6), (2,), [Shard(-1)], (1,)) == ((4, 3), (0, 3))


def test_fake_backend_device_mesh_every_rank():
    """A 2x2x2 DeviceMesh on the fake backend, one rank at a time: rank=None equals PyTorch's public function."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cases = [
        ((9, 5), [Shard(0), Shard(0), Shard(0)]),
        ((13, 15, 3), [Shard(0), Shard(1), Shard(0)]),
        ((14, 3), [_StridedShard(0, split_factor=2), Shard(0), Replicate()]),
        ((3, 7), [Replicate(), Shard(1), Partial()]),
    ]
    for r in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=8)
        try:
            mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2), mesh_dim_names=("a", "b", "c"))
            for gs, pl in cases:
                want = torch_compute_local_shape_and_global_offset(gs, mesh, pl)
                assert compute_local_shape_and_global_offset(gs, mesh, pl) == want, (r, gs, pl)
                assert compute_local_shape_and_global_offset(gs, torch.arange(8).reshape(2, 2, 2), pl) == want
                assert compute_local_shape_and_global_offset(gs, mesh, pl, rank=r) == want
        finally:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# gloo, 4 ranks: real DTensors
# ------------------------------------------------------------------------------------------------
def _global(shape):
    """Values = global flat index, so any element shows where it came from."""
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)


def _gather_owner_map(dt, world_size):
    """Place every rank's local tensor at its offsets; returns (reconstruction, owner rank per element, counts)."""
    local = dt.to_local()
    shape, off = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    assert tuple(local.shape) == shape
    infos = [None] * world_size
    dist.all_gather_object(infos, (shape, off, local.tolist()))
    full = torch.full(tuple(dt.shape), -1.0, dtype=torch.float64)
    owner = torch.full(tuple(dt.shape), -1, dtype=torch.int64)
    counts = torch.zeros(tuple(dt.shape), dtype=torch.int64)
    for r, (s, o, data) in enumerate(infos):
        if 0 in s:
            continue
        box = tuple(slice(a, a + n) for a, n in zip(o, s))
        full[box] = torch.tensor(data, dtype=torch.float64).reshape(s)
        owner[box] = r
        counts[box] += 1
    # every rank answers for every other rank exactly what that rank reports about itself
    for r, (s, o, _) in enumerate(infos):
        assert get_local_shape_and_global_offset(dt, rank=r) == (tuple(s), tuple(o)), r
    return full, owner, counts


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def check_uneven_rows(rank, world_size):
    from torch.distributed.tensor import distribute_tensor

    rows = 3 * world_size + 2  # 14 over 4: 4, 4, 4, 2
    g = _global((rows, 5))
    dt = distribute_tensor(g, _mesh((world_size,), ("x",)), [Shard(0)])
    full, owner, counts = _gather_owner_map(dt, world_size)
    assert torch.equal(full, g) and (counts == 1).all()
    assert owner[:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 2
    assert compute_local_shape_and_global_offset(g.shape, dt.device_mesh, dt.placements) == \
        torch_compute_local_shape_and_global_offset(g.shape, dt.device_mesh, dt.placements)


def check_uneven_cols_with_empty_shard(rank, world_size):
    from torch.distributed.tensor import distribute_tensor

    g = _global((3, 5))  # 5 columns over 4 ranks: 2, 2, 1, 0 -> rank 3 empty, offset = 5
    dt = distribute_tensor(g, _mesh((world_size,), ("x",)), [Shard(1)])
    full, owner, counts = _gather_owner_map(dt, world_size)
    assert torch.equal(full, g) and (counts == 1).all()
    assert owner[0].tolist() == [0, 0, 1, 1, 2]
    assert get_local_shape_and_global_offset(dt, rank=3) == ((3, 0), (0, 5))
    assert compute_local_shape_and_global_offset(g.shape, dt.device_mesh, dt.placements) == \
        torch_compute_local_shape_and_global_offset(g.shape, dt.device_mesh, dt.placements)


def check_2x2_shard0_shard1_13x15(rank, world_size):
    from torch.distributed.tensor import distribute_tensor

    g = _global((13, 15))
    dt = distribute_tensor(g, _mesh((2, 2), ("a", "b")), [Shard(0), Shard(1)])
    full, owner, counts = _gather_owner_map(dt, world_size)
    assert torch.equal(full, g) and (counts == 1).all()
    want = torch.zeros(13, 15, dtype=torch.int64)
    want[:7, 8:], want[7:, :8], want[7:, 8:] = 1, 2, 3  # rows 7/6, columns 8/7
    assert torch.equal(owner, want)
    assert get_local_shape_and_global_offset(dt, rank=3) == ((6, 7), (7, 8))


def check_local_data_equals_index_runs(rank, world_size):
    """For many placements on a (2, 2) mesh, incl. strided ones, the local data is exactly global[runs]."""
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh((2, 2), ("a", "b"))
    opts = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
    for gs in [(7, 5), (2, 9), (11, 1)]:
        g = _global(gs)
        for pl in itertools.product(opts, repeat=2):
            dt = distribute_tensor(g, mesh, list(pl), src_data_rank=None)  # local split: torch 2.13 cannot scatter uneven strided shards
            runs = compute_global_index_runs(gs, mesh, list(pl))
            idx = [_indices(r) for r in runs]
            want = g[idx[0]][:, idx[1]]
            assert torch.equal(dt.to_local(), want), (gs, pl, runs)
            assert compute_local_shape_and_global_offset(gs, mesh, list(pl)) == \
                torch_compute_local_shape_and_global_offset(gs, mesh, list(pl))


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(
        [check_uneven_rows, check_uneven_cols_with_empty_shard, check_2x2_shard0_shard1_13x15, check_local_data_equals_index_runs],
        world_size=4,
    )


def test_gloo_uneven_rows(dist4):
    dist4.assert_ok("check_uneven_rows")


def test_gloo_uneven_cols_with_empty_shard(dist4):
    dist4.assert_ok("check_uneven_cols_with_empty_shard")


def test_gloo_2x2_shard0_shard1_13x15(dist4):
    dist4.assert_ok("check_2x2_shard0_shard1_13x15")


def test_gloo_local_data_equals_index_runs(dist4):
    dist4.assert_ok("check_local_data_equals_index_runs")


def test_chunk_arithmetic_and_contiguous_strides_match_torch():
    """megashard.chunks, which every torch.chunk-style split and every strided view in the package uses."""
    from megashard.chunks import chunk_bounds, chunk_size, chunk_sizes, contiguous_strides

    for n in range(0, 23):
        for k in (1, 2, 3, 4, 5, 8):
            pieces = torch.arange(n).chunk(k)
            sizes = [p.numel() for p in pieces] + [0] * (k - len(pieces))
            assert list(chunk_sizes(n, k)) == sizes and chunk_size(n, k) == (sizes[0] if n else 0)
            starts = [sum(sizes[:i]) for i in range(k)]
            assert [chunk_bounds(n, k, i) for i in range(k)] == [(a, a + s) for a, s in zip(starts, sizes)]
    for shape in [(), (5,), (2, 3), (4, 0, 3), (0, 2), (3, 1, 7, 2)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape
