"""Uneven DTensors (megashard.tensors.uneven) on real gloo process groups: 4 ranks, one spawn.

Global tensors are ``arange``, so every element's value is its global flat index: a gathered tensor
is bitwise equal to the truth only if every rank's shard landed exactly where it belongs. The truth
layouts are built top-down here (random or torch.chunk pieces per level), independently of the
library, which only sees the local shards.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests._dist import spawn_checks

W = 4
_MESHES: dict = {}


# ----------------------------------------------------------------------------------------------
# helpers (run inside the spawned ranks)
# ----------------------------------------------------------------------------------------------
def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape)
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _arange(*shape):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64).view(*shape)


def _rand_parts(total, n, rng):
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(n)]


def _chunk_parts(total, n):
    q = -(-total // n) if total else 0
    return [max(0, min(q, total - q * i)) for i in range(n)]


def _truth_box(gshape, mesh_shape, coord, orders, parts_fn):
    """(start, size) per dim of the shard at ``coord``: dim d is cut by ``orders[d]`` (outer first)."""
    start, size = [], []
    for d, g in enumerate(gshape):
        lo, ext, path = 0, g, ()
        for axis in orders.get(d, ()):
            parts = parts_fn(d, path, ext, mesh_shape[axis])
            c = coord[axis]
            lo += sum(parts[:c])
            ext = parts[c]
            path += (c,)
        start.append(lo)
        size.append(ext)
    return start, size


def _make(global_t, mesh, placements, orders, parts_fn):
    """DTensor.from_local of the truth shard; returns (dtensor, start, size)."""
    from torch.distributed.tensor import DTensor

    coord = mesh.get_coordinate()
    start, size = _truth_box(global_t.shape, tuple(mesh.shape), coord, orders, parts_fn)
    local = global_t
    for d, (a, n) in enumerate(zip(start, size)):
        local = local.narrow(d, a, n)
    dt = DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                            shape=global_t.shape, stride=global_t.stride())
    return dt, start, size


def _random_parts(seed, zero_bias=False):
    def fn(d, path, ext, n):
        rng = random.Random(f"{seed}-{d}-{path}")
        parts = _rand_parts(ext, n, rng)
        if zero_bias and ext and n > 1 and rng.random() < 0.5:  # force an empty shard
            k = rng.randrange(n)
            parts[(k + 1) % n] += parts[k]
            parts[k] = 0
        return parts
    return fn


def _chunk_fn(d, path, ext, n):
    return _chunk_parts(ext, n)


def _torch_offset(start, size, gshape, orders):
    return tuple(gshape[d] if (d in orders and size[d] == 0) else start[d] for d in range(len(gshape)))


def _gather(dt):
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor

    out = gather_uneven_dtensor_to_full_tensor(dt)
    from torch.distributed.tensor import DTensor, Replicate

    assert isinstance(out, DTensor) and all(isinstance(p, Replicate) for p in out.placements)
    return out.to_local()


class _Count:
    """Count calls of torch.distributed collectives while active."""

    NAMES = ("all_gather", "all_gather_object", "broadcast", "all_reduce", "all_gather_into_tensor", "all_to_all")

    def __enter__(self):
        import torch.distributed as dist

        self.n = {k: 0 for k in self.NAMES}
        self._orig = {k: getattr(dist, k) for k in self.NAMES}
        for k in self.NAMES:
            def wrap(*a, _k=k, **kw):
                self.n[_k] += 1
                return self._orig[_k](*a, **kw)
            setattr(dist, k, wrap)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for k, f in self._orig.items():
            setattr(dist, k, f)


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
def check_rows_and_columns_1d(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    from megashard.tensors.uneven import gather_and_compute_chunk_metadata

    mesh = _mesh((W,))
    rows = 3 * W + 2  # 14 -> torch.chunk pieces 4, 4, 4, 2
    g = _arange(rows, 5)
    dt = distribute_tensor(g, mesh, [Shard(0)])
    assert torch.equal(_gather(dt), g) and torch.equal(dt.full_tensor(), g)
    md = gather_and_compute_chunk_metadata(dt)
    assert tuple(md.offsets) == (4 * rank, 0) and tuple(md.sizes) == ([4, 4, 4, 2][rank], 5)

    g = _arange(5, rows)  # columns
    dt = distribute_tensor(g, mesh, [Shard(1)])
    assert torch.equal(_gather(dt), g) and torch.equal(dt.full_tensor(), g)
    md = gather_and_compute_chunk_metadata(dt)
    assert tuple(md.offsets) == (0, 4 * rank) and tuple(md.sizes) == (5, [4, 4, 4, 2][rank])

    # the first gather attached the layout: the second one moves data only
    with _Count() as c:
        assert torch.equal(_gather(dt), g)
    assert c.n["all_gather"] == 0 and c.n["broadcast"] == 4  # one per piece (own included)

    # arbitrary sizes, an empty shard in the middle: rows [5, 0, 6, 3], columns [2, 7, 0, 5]
    for dim, parts, gshape in ((0, [5, 0, 6, 3], (rows, 5)), (1, [2, 7, 0, 5], (5, rows))):
        g = _arange(*gshape)
        dt, start, size = _make(g, mesh, [Shard(dim)], {dim: [0]}, lambda d, p, e, n, parts=parts: parts)
        assert torch.equal(_gather(dt), g)
        md = gather_and_compute_chunk_metadata(dt)
        exp_off = [0, 0]
        exp_off[dim] = gshape[dim] if parts[rank] == 0 else sum(parts[:rank])
        assert tuple(md.offsets) == tuple(exp_off), (md.offsets, exp_off)
        assert tuple(md.sizes) == tuple(size)


def check_gather_rounds_1d(rank, world_size):
    """A 1-D gather without a layout is one round (metadata + data); big pieces add a second one."""
    from torch.distributed.tensor import Shard

    mesh = _mesh((W,))
    g = _arange(40, 3)
    dt, start, size = _make(g, mesh, [Shard(0)], {0: [0]}, lambda d, p, e, n: [9, 12, 10, 9])
    with _Count() as c:
        assert torch.equal(_gather(dt), g)
    assert c.n == {**c.n, "all_gather": 0, "broadcast": W}, c.n
    # one rank holds everything: far beyond torch.chunk's 10 rows -> its piece follows in round two
    dt, start, size = _make(g, mesh, [Shard(0)], {0: [0]}, lambda d, p, e, n: [0, 0, 40, 0])
    with _Count() as c:
        assert torch.equal(_gather(dt), g)
    assert c.n == {**c.n, "all_gather": 0, "broadcast": W + 1}, c.n
    # a tensor too big to send eagerly takes the general path: metadata all-gather, then data
    import megashard.tensors.uneven.gather as U

    cap, U._EAGER_CAP = U._EAGER_CAP, 1 << 16  # 64 KiB instead of 4 MiB keeps the test small
    try:
        g = _arange(512, 96)  # torch.chunk piece: 128 rows * 768 B = 96 KiB
        dt, start, size = _make(g, mesh, [Shard(0)], {0: [0]}, _random_parts("big"))
        with _Count() as c:
            assert torch.equal(_gather(dt), g)
    finally:
        U._EAGER_CAP = cap
    assert c.n["all_gather"] == 1 and c.n["broadcast"] == sum(1 for x in _random_parts("big")(0, (), 512, W) if x)


def check_2d_mesh_13x15(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    from megashard._compat import torch_compute_local_shape_and_global_offset
    from megashard.tensors.uneven import gather_and_compute_chunk_metadata

    mesh = _mesh((2, 2))
    i, j = rank // 2, rank % 2
    g = _arange(13, 15)
    dt = distribute_tensor(g, mesh, [Shard(0), Shard(1)])
    assert torch.equal(_gather(dt), g) and torch.equal(dt.full_tensor(), g)
    md = gather_and_compute_chunk_metadata(dt)
    assert tuple(md.offsets) == (7 * i, 8 * j) and tuple(md.sizes) == ((7, 6)[i], (8, 7)[j])

    # nested on one dim, PyTorch order (mesh axis 0 outermost): 13 -> [7, 6] -> [4, 3], [3, 3]
    dt = distribute_tensor(g, mesh, [Shard(0), Shard(0)])
    md = gather_and_compute_chunk_metadata(dt)
    assert tuple(md.offsets) == ((0, 4, 7, 10)[rank], 0) and md.sizes[0] == (4, 3, 3, 3)[rank]
    shape, off = torch_compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    assert (tuple(md.sizes), tuple(md.offsets)) == (tuple(shape), tuple(off))
    assert torch.equal(_gather(dt), g) and torch.equal(dt.full_tensor(), g)

    # nested with arbitrary sizes and a mesh axis that does not shard (Replicate)
    for placements, orders in (([Shard(0), Shard(0)], {0: [0, 1]}), ([Shard(1), Shard(0)], {1: [0], 0: [1]})):
        dt, start, size = _make(g, mesh, placements, orders, _random_parts(7, zero_bias=True))
        assert torch.equal(_gather(dt), g)
        md = gather_and_compute_chunk_metadata(dt)
        assert tuple(md.offsets) == _torch_offset(start, size, g.shape, orders)


def check_random_lengths(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard

    from megashard._compat import _StridedShard
    from megashard.tensors.uneven import get_chunk_layout, update_uneven_dtensor_chunk_metadata

    cases = [
        ((W,), [Shard(0)], {0: [0]}),
        ((W,), [Shard(1)], {1: [0]}),
        ((2, 2), [Shard(0), Shard(1)], {0: [0], 1: [1]}),
        ((2, 2), [Shard(0), Shard(0)], {0: [0, 1]}),
        ((2, 2), [Replicate(), Shard(0)], {0: [1]}),
        ((2, 2), [Shard(1), Replicate()], {1: [0]}),
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], {0: [1, 0]}),  # FSDP + TP: TP axis outer
    ]
    for trial in range(3):
        for ci, (mshape, placements, orders) in enumerate(cases):
            mesh = _mesh(mshape)
            rng = random.Random(f"shape-{trial}-{ci}")
            g = _arange(rng.randint(0, 9), rng.randint(1, 7))
            dt, start, size = _make(g, mesh, placements, orders, _random_parts(f"{trial}-{ci}", zero_bias=trial > 0))
            assert torch.equal(_gather(dt), g), (trial, ci)
            md = update_uneven_dtensor_chunk_metadata(dt)
            assert tuple(md.offsets) == _torch_offset(start, size, g.shape, orders), (trial, ci, md, start)
            assert tuple(get_chunk_layout(dt).start) == tuple(start)
            chunks = dt.__create_chunk_list__()
            if 0 in size and g.numel():
                assert chunks == []  # an empty shard writes nothing (its offset could collide in DCP)
            else:
                assert [tuple(c.offsets) for c in chunks] == [tuple(md.offsets)]
            with _Count() as c:  # attached layout: the gather needs no metadata exchange
                assert torch.equal(_gather(dt), g)
            assert c.n["all_gather"] == 0 and c.n["all_gather_object"] == 0


def check_strided_fsdp_tp_odd_shapes(rank, world_size):
    from torch.distributed.tensor import Shard

    from megashard._compat import _StridedShard, torch_compute_local_shape_and_global_offset
    from megashard.tensors.shape import get_local_shape_and_global_offset
    from megashard.tensors.uneven import gather_and_compute_chunk_metadata

    mesh = _mesh((2, 2))  # axis 0 = dp (FSDP), axis 1 = tp
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    for shape in ((11, 3), (5,), (7, 2, 3), (3, 5)):
        g = _arange(*shape)
        # FSDP2 on TP: torch.chunk by tp first, then each TP piece by dp
        dt, start, size = _make(g, mesh, placements, {0: [1, 0]}, _chunk_fn)
        assert torch.equal(_gather(dt), g), shape
        assert torch.equal(dt.full_tensor(), g), shape  # PyTorch agrees on these shapes
        md = gather_and_compute_chunk_metadata(dt)
        ref = torch_compute_local_shape_and_global_offset(dt.shape, mesh, placements)
        assert (tuple(md.sizes), tuple(md.offsets)) == (tuple(ref[0]), tuple(ref[1])), (shape, md, ref)
        assert (tuple(md.sizes), tuple(md.offsets)) == tuple(map(tuple, get_local_shape_and_global_offset(dt)))
    # and uneven beyond torch.chunk (TP pieces 6/5, FSDP pieces arbitrary, one empty)
    g = _arange(11, 3)
    parts = {(): [6, 5], (0,): [6, 0], (1,): [2, 3]}
    dt, start, size = _make(g, mesh, placements, {0: [1, 0]}, lambda d, p, e, n: parts[p])
    assert torch.equal(_gather(dt), g)
    md = gather_and_compute_chunk_metadata(dt)
    assert tuple(md.offsets) == ((0, 6, 11, 8)[rank], 0)


def check_partial_and_target(rank, world_size):
    from torch.distributed.tensor import DTensor, Partial, Shard

    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor

    mesh = _mesh((2, 2))
    g = _arange(9, 4)
    dt, start, size = _make(g, mesh, [Shard(0), Partial()], {0: [0]}, _random_parts("p"))
    local = dt.to_local() * (rank % 2 + 1)  # partial values: the sum over axis 1 is 3 * shard
    dt = DTensor.from_local(local, mesh, [Shard(0), Partial()], run_check=False, shape=g.shape, stride=g.stride())
    out = gather_uneven_dtensor_to_full_tensor(dt, return_dtensor=False)
    assert isinstance(out, torch.Tensor) and not isinstance(out, DTensor)
    assert torch.equal(out, 3 * g)
    out = gather_uneven_dtensor_to_full_tensor(dt, target_device=torch.device("cpu"))
    assert isinstance(out, DTensor) and torch.equal(out.to_local(), 3 * g)
    # avg on an even layout equals DTensor's own answer
    g = _arange(8, 4)
    even = DTensor.from_local(g.chunk(2)[rank // 2].double() * (rank % 2 + 1), mesh, [Shard(0), Partial("avg")],
                              run_check=False)
    assert torch.equal(gather_uneven_dtensor_to_full_tensor(even).to_local(), even.full_tensor())


def check_assemble_helper(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from megashard.tensors.uneven import _assemble_full_tensor_from_uneven_chunks, gather_and_compute_chunk_metadata

    mesh = _mesh((W,))
    g = _arange(10, 3)
    dt, start, size = _make(g, mesh, [Shard(0)], {0: [0]}, lambda d, p, e, n: [0, 7, 1, 2])
    md = gather_and_compute_chunk_metadata(dt)
    infos = [None] * W
    dist.all_gather_object(infos, {"offsets": tuple(md.offsets), "sizes": tuple(md.sizes)})
    out = _assemble_full_tensor_from_uneven_chunks(dt, infos, mesh.get_group(), None)
    assert torch.equal(out.to_local(), g) and all(isinstance(p, Replicate) for p in out.placements)


def check_batched_metadata_one_exchange_per_axis(rank, world_size):
    from torch.distributed.tensor import Shard

    from megashard._compat import _StridedShard
    from megashard.tensors.uneven import get_chunk_layout, preprocess_state_dict_for_uneven_dtensor

    m1, m2 = _mesh((W,)), _mesh((2, 2))
    sd, truth = {"a": {}, "b": []}, {}
    for k in range(30):
        g = _arange(3 + k % 7, 2 + k % 3)
        dt, start, size = _make(g, m1, [Shard(k % 2)], {k % 2: [0]}, _random_parts(f"b{k}", zero_bias=True))
        sd["a"][f"t{k}"] = dt
        truth[f"a.t{k}"] = start
    for k in range(20):
        g = _arange(5 + k, 3)
        pl, orders = [([Shard(0), Shard(0)], {0: [0, 1]}), ([_StridedShard(0, split_factor=2), Shard(0)], {0: [1, 0]}),
                      ([Shard(1), Shard(0)], {1: [0], 0: [1]})][k % 3]
        dt, start, size = _make(g, m2, pl, orders, _random_parts(f"c{k}"))
        sd["b"].append({"w": dt})
        truth[f"b.{k}.w"] = start
    with _Count() as c:
        out = preprocess_state_dict_for_uneven_dtensor(sd)
    assert out is sd
    # 1-D mesh: 1 axis, 2-D mesh: 2 axes; each exchange = header + payload all-gather
    assert c.n["all_gather"] == 2 * (1 + 2), c.n
    assert c.n["all_gather_object"] == 0 and c.n["broadcast"] == 0
    for k in range(30):
        assert list(get_chunk_layout(sd["a"][f"t{k}"]).start) == truth[f"a.t{k}"]
    for k in range(20):
        assert list(get_chunk_layout(sd["b"][k]["w"]).start) == truth[f"b.{k}.w"]


def _expect_raise(fn, cls, *needles):
    """``fn`` raises ``cls`` with every needle in its message: the error itself, not a timeout (a collective that
    waited for a peer would fail with gloo's timeout error, another class and message)."""
    try:
        fn()
    except cls as e:
        msg = str(e)
        for n in needles:
            assert n in msg, (n, msg)
    else:
        raise AssertionError(f"{cls.__name__} not raised")


def check_mismatched_state_dicts_raise_everywhere(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from megashard.errors import StateDictMismatchError
    from megashard.tensors.uneven import preprocess_state_dict_for_uneven_dtensor

    m1, m2 = _mesh((W,)), _mesh((2, 2))
    # (a) rank 2 lacks key "b"
    sd = {"a": distribute_tensor(_arange(7, 2), m1, [Shard(0)]), "b": distribute_tensor(_arange(5), m1, [Shard(0)])}
    if rank == 2:
        del sd["b"]
    _expect_raise(lambda: preprocess_state_dict_for_uneven_dtensor(sd), StateDictMismatchError,
                  "different DTensor keys", "['b']")
    # (b) 2-D mesh, only rank 3 differs (global shape): detected on its axes, raised on all 4 ranks
    g = _arange(6, 3) if rank != 3 else _arange(6, 4)
    sd = {"x": _make(g, m2, [Shard(0), Shard(1)], {0: [0], 1: [1]}, _chunk_fn)[0]}
    _expect_raise(lambda: preprocess_state_dict_for_uneven_dtensor(sd), StateDictMismatchError)
    # (c) rank 1 holds no DTensor at all; meshes= makes it join its peers
    sd = {"a": distribute_tensor(_arange(7, 2), m1, [Shard(0)])}
    if rank == 1:
        sd = {}
    _expect_raise(lambda: preprocess_state_dict_for_uneven_dtensor(sd, meshes=[m1]), StateDictMismatchError)
    dist.barrier()  # nobody is stuck in an exchange


def check_invalid_tilings_raise_everywhere(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from megashard.errors import UnevenDTensorError
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor, validate_uneven_dtensor

    m1, m2 = _mesh((W,)), _mesh((2, 2))
    # sizes add up to 16, global says 14
    bad = DTensor.from_local(torch.zeros(4, 3), m1, [Shard(0)], run_check=False, shape=(14, 3), stride=(3, 1))
    _expect_raise(lambda: validate_uneven_dtensor(bad), UnevenDTensorError, "add up to 16", "has 14")
    # one rank holds part of a dim no placement shards
    bad = DTensor.from_local(torch.zeros(2, 3 if rank else 2), m1, [Shard(0)], run_check=False, shape=(8, 3), stride=(3, 1))
    _expect_raise(lambda: gather_uneven_dtensor_to_full_tensor(bad), UnevenDTensorError)
    # 2-D mesh [Shard(0), Shard(1)]: rank 3's row count differs from rank 2's along axis 1 (which shards cols)
    rows = 3 if rank != 3 else 2
    bad = DTensor.from_local(torch.zeros(rows, 2), m2, [Shard(0), Shard(1)], run_check=False, shape=(6, 4), stride=(4, 1))
    _expect_raise(lambda: validate_uneven_dtensor(bad), UnevenDTensorError)
    good = DTensor.from_local(torch.zeros(rank + 1, 2), m1, [Shard(0)], run_check=False, shape=(10, 2), stride=(2, 1))
    validate_uneven_dtensor(good)
    dist.barrier()


def _local_is_view(piece, dt):
    p, o = piece.to_local(), dt.to_local()
    return p.numel() == 0 or p.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()


def check_split_dtensor(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megashard.tensors.uneven import get_chunk_layout, split_dtensor, update_uneven_dtensor_chunk_metadata

    m1 = _mesh((W,))
    # even by 4 on (16, 4) sharded rows: piece k lives on rank k only
    g = _arange(16, 4)
    dt = distribute_tensor(g, m1, [Shard(0)])
    with _Count() as c:
        pieces = list(split_dtensor(dt, 4, dim=0, update_uneven_dtensor_chunk_meta=True))
    assert c.n["all_gather"] + c.n["all_gather_object"] + c.n["all_gather_into_tensor"] >= 1  # no metadata yet
    with _Count() as c:  # the layout is attached now: the next split communicates nothing
        again = list(split_dtensor(dt, 8, dim=0))
    assert sum(c.n.values()) == 0 and [p.shape[0] for p in again] == [8, 8]
    assert [p.shape[0] for p in pieces] == [4, 4, 4, 4]
    for k, p in enumerate(pieces):
        assert p.to_local().shape[0] == (4 if k == rank else 0) and _local_is_view(p, dt)
        assert torch.equal(_gather(p), g[4 * k:4 * k + 4])
    # sections [3, 5, 5] on dim 1 of (8, 13) sharded by columns (torch.chunk: 4, 4, 4, 1)
    g = _arange(8, 13)
    dt = distribute_tensor(g, m1, [Shard(1)])
    pieces = list(split_dtensor(dt, [3, 5, 5], dim=1))
    for p, (a, b) in zip(pieces, [(0, 3), (3, 8), (8, 13)]):
        assert tuple(p.shape) == (8, b - a) and _local_is_view(p, dt)
        assert torch.equal(_gather(p), g[:, a:b])
    # Replicate: pure local views, no redistribution
    g = _arange(6, 5)
    dt = distribute_tensor(g, m1, [Replicate()])
    with _Count() as c:
        pieces = list(split_dtensor(dt, 4, dim=-2, update_uneven_dtensor_chunk_meta=True))
    assert sum(c.n.values()) == 0
    assert [tuple(p.to_local().shape) for p in pieces] == [(4, 5), (2, 5)]
    assert all(_local_is_view(p, dt) and p.placements == (Replicate(),) for p in pieces)
    assert torch.equal(pieces[1].to_local(), g[4:])
    # rows 3W+1 = 13 (torch.chunk 4, 4, 4, 1) split by 2: pieces straddle shard borders
    g = _arange(3 * W + 1, 3)
    dt = distribute_tensor(g, m1, [Shard(0)])
    pieces = list(split_dtensor(dt, 2, dim=0, update_uneven_dtensor_chunk_meta=True))
    assert [p.shape[0] for p in pieces] == [2, 2, 2, 2, 2, 2, 1]
    for k, p in enumerate(pieces):
        lo, hi = 2 * k, min(2 * k + 2, 13)
        mine = max(0, min(hi, 4 * rank + [4, 4, 4, 1][rank]) - max(lo, 4 * rank))
        assert p.to_local().shape[0] == mine
        lay = get_chunk_layout(p)
        if mine:
            assert lay.start[0] == max(lo, 4 * rank) - lo
            assert torch.equal(p.to_local(), g[lo:hi][lay.start[0]:lay.start[0] + mine])
        with _Count() as c:
            assert torch.equal(_gather(p), g[lo:hi])
        assert c.n["all_gather"] == 0
    # an empty local shard: (3, 5) over 4 ranks -> rank 3 holds nothing
    g = _arange(3, 5)
    dt = distribute_tensor(g, m1, [Shard(0)])
    pieces = list(split_dtensor(dt, [1, 2], update_uneven_dtensor_chunk_meta=True))
    assert [p.to_local().shape[0] for p in pieces] == [[1, 0], [0, 1], [0, 1], [0, 0]][rank]
    for p, (a, b) in zip(pieces, [(0, 1), (1, 3)]):
        assert torch.equal(_gather(p), g[a:b])
        assert (p.__create_chunk_list__() == []) == (p.to_local().numel() == 0)
    # an arbitrary uneven DTensor with its layout attached first: the split is communication-free
    g = _arange(10, 2)
    dt, start, size = _make(g, m1, [Shard(0)], {0: [0]}, lambda d, p, e, n: [1, 5, 0, 4])
    update_uneven_dtensor_chunk_metadata(dt)
    with _Count() as c:
        pieces = list(split_dtensor(dt, [5, 5], dim=0))  # no layout attached to the pieces
    assert sum(c.n.values()) == 0
    assert torch.equal(_gather(pieces[0]), g[:5]) and torch.equal(_gather(pieces[1]), g[5:])
    # the DCP hooks sit where Megatron-FSDP looks for them, on the local tensor too
    assert dt._local_tensor.__create_chunk_list__() == dt.__create_chunk_list__()
    assert (dt.__create_chunk_list__() == []) == (size[0] == 0)
    if size[0]:
        assert tuple(dt._local_tensor.__create_chunk_list__()[0].offsets) == (start[0], 0)


def _check_pieces(pieces, g, dim, sections, start, size):
    """Every piece's local tensor is the slice of ``g`` this rank's shard ``(start, size)`` holds of it, and the
    piece gathers to the slice of the full tensor."""
    a = 0
    for piece, n in zip(pieces, sections):
        lo, hi = max(a, start[dim]), min(a + n, start[dim] + size[dim])
        box = g
        for d in range(g.ndim):
            box = box.narrow(d, lo, max(0, hi - lo)) if d == dim else box.narrow(d, start[d], size[d])
        assert tuple(piece.shape) == tuple(g.narrow(dim, a, n).shape)
        assert torch.equal(piece.to_local(), box), (a, n, start, size, piece.to_local().shape, box.shape)
        assert torch.equal(_gather(piece), g.narrow(dim, a, n))
        a += n


def check_split_without_metadata_random(rank, world_size):
    """split_dtensor on shards of random sizes (zeros included) that no layout was computed for: every rank gets
    its right pieces (the layout is computed in the call, which every rank makes)."""
    from torch.distributed.tensor import Shard

    from megashard.tensors.uneven import get_chunk_layout, split_dtensor
    from megashard.tensors.uneven.layout import attached_layout

    m1, m2 = _mesh((W,)), _mesh((2, 2))
    cases = []
    for seed in range(12):
        rng = random.Random(seed)
        rows, cols = rng.randint(0, 13), rng.randint(1, 6)
        if seed % 3 == 2:  # 2-D mesh: rows by axis 0, columns by axis 1
            cases.append((seed, (rows, cols), m2, [Shard(0), Shard(1)], {0: [0], 1: [1]}))
        elif seed % 3 == 1:  # both axes on the rows (Shard(0), Shard(0))
            cases.append((seed, (rows, cols), m2, [Shard(0), Shard(0)], {0: [0, 1]}))
        else:
            cases.append((seed, (rows, cols), m1, [Shard(0)], {0: [0]}))
    for seed, shape, mesh, placements, orders in cases:
        rng = random.Random(1000 + seed)
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        dt, start, size = _make(g, mesh, placements, orders, _random_parts(seed, zero_bias=True))
        assert attached_layout(dt) is None
        for dim in (0, 1):
            ext = shape[dim]
            if seed % 2:
                sections = _rand_parts(ext, rng.randint(1, 4), rng)
            else:
                step = rng.randint(1, max(1, ext))
                sections = [min(step, ext - s) for s in range(0, ext, step)] or [0]
            fresh = dt if dim == 0 else _make(g, mesh, placements, orders, _random_parts(seed, zero_bias=True))[0]
            pieces = list(split_dtensor(fresh, sections if seed % 2 else sections[0] or 1, dim=dim,
                                        update_uneven_dtensor_chunk_meta=bool(seed % 2)))
            assert len(pieces) == len(sections), (sections, [p.shape for p in pieces])
            _check_pieces(pieces, g, dim, sections, start, size)
            assert get_chunk_layout(fresh) is not None  # computed in the call and kept


CHECKS = [
    check_rows_and_columns_1d,
    check_gather_rounds_1d,
    check_2d_mesh_13x15,
    check_random_lengths,
    check_strided_fsdp_tp_odd_shapes,
    check_partial_and_target,
    check_assemble_helper,
    check_batched_metadata_one_exchange_per_axis,
    check_mismatched_state_dicts_raise_everywhere,
    check_invalid_tilings_raise_everywhere,
    check_split_dtensor,
    check_split_without_metadata_random,
]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=W, timeout=300.0, pg_timeout=20.0)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_uneven_dist(dist4, name):
    dist4.assert_ok(name)


# ----------------------------------------------------------------------------------------------
# single-process tests
# ----------------------------------------------------------------------------------------------
def test_filter_and_get_nested_state_dict():
    from megashard.errors import StateDictKeyError
    from megashard.tensors.uneven import filter_unflattened_state_dict, get_unflattened_state_dict

    t1, t2, t3 = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    sd = {"model": {"w": t1, "b": 3}, "optim": {"state": {0: {"exp_avg": t2}}, "param_groups": [{"lr": 0.1, "x": t3}]}}
    is_t = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    chains = filter_unflattened_state_dict(sd, visit_condition=is_t)
    assert chains == [["model", "w"], ["optim", "state", 0, "exp_avg"], ["optim", "param_groups", 0, "x"]]
    assert [get_unflattened_state_dict(sd, c) is t for c, t in zip(chains, (t1, t2, t3))] == [True] * 3
    assert filter_unflattened_state_dict(sd["model"], ["model"], is_t) == [["model", "w"]]
    assert filter_unflattened_state_dict(sd) == []  # default condition: DTensors only
    assert get_unflattened_state_dict(sd) is sd and get_unflattened_state_dict(sd, []) is sd
    with pytest.raises(StateDictKeyError, match="position 1"):
        get_unflattened_state_dict(sd, ["optim", "nope"])


def test_slice_helpers_and_chunk_sizes():
    from megashard.chunks import chunk_sizes
    from megashard.tensors.uneven import _intersection, _offset_slice

    assert _intersection(slice(0, 5), slice(3, 8)) == slice(3, 5)
    assert _intersection(slice(0, 2), slice(4, 8)) == slice(4, 4)
    assert _offset_slice(slice(3, 5), -3) == slice(0, 2)
    for n in range(0, 20):
        for k in (1, 2, 3, 4, 7):
            ref = [c.shape[0] for c in torch.arange(n).chunk(k)]
            assert list(chunk_sizes(n, k)) == ref + [0] * (k - len(ref))


class _StubDTensor:
    """What the metadata engine reads from a DTensor: global shape, placements, local shard, dtype."""

    def __init__(self, gshape, placements, local_shape):
        self.shape = torch.Size(gshape)
        self.placements = tuple(placements)
        self.dtype = torch.float32
        self._local_tensor = torch.empty(local_shape)


def _simulate_exchange(gshape, mesh_shape, placements, orders, parts_fn):
    """Run the per-axis exchange of every rank of a virtual mesh in one process (no communication)."""
    import itertools

    from megashard.tensors.uneven.metadata import ExtentTables

    truth, works = {}, {}
    for c in itertools.product(*[range(n) for n in mesh_shape]):
        start, size = _truth_box(gshape, mesh_shape, c, orders, parts_fn)
        truth[c] = (start, size)
        works[c] = ExtentTables("k", _StubDTensor(gshape, placements, size), mesh_shape)
    for axis, n in enumerate(mesh_shape):
        payloads = {c: w.payload() for c, w in works.items()}  # all sent before anyone absorbs
        for c, w in works.items():
            rows = [payloads[c[:axis] + (i,) + c[axis + 1:]] for i in range(n)]
            assert w.absorb(axis, rows, c) is None
    out = {}
    for c, w in works.items():
        layout, problem = w.finish()
        assert problem is None, problem
        out[c] = layout
    return truth, out


@pytest.mark.parametrize("mesh_shape,placements,orders", [
    ((2, 2, 2), "S0 S0 S0", {0: [0, 1, 2]}),
    ((2, 2, 2), "S0 SS0/2 S0", {0: [0, 2, 1]}),
    ((2, 2, 2), "SS0/4 SS0/2 S0", {0: [2, 1, 0]}),
    ((3, 2, 4), "S1 SS0/4 S0", {1: [0], 0: [2, 1]}),
    ((2, 3, 2), "S0 R S1", {0: [0], 1: [2]}),
    ((4, 1, 3), "S0 S0 S1", {0: [0, 1], 1: [2]}),
])
def test_exchange_engine_on_virtual_meshes(mesh_shape, placements, orders):
    """Every rank of up to 24-rank meshes (3 nesting levels, both orders) finds the true layout."""
    from torch.distributed.tensor import Replicate, Shard

    from megashard._compat import _StridedShard
    from megashard.tensors.shape import local_shape_and_offset_at

    def parse(tok):
        if tok == "R":
            return Replicate()
        if tok.startswith("SS"):
            d, sf = tok[2:].split("/")
            return _StridedShard(int(d), split_factor=int(sf))
        return Shard(int(tok[1:]))

    pl = [parse(t) for t in placements.split()]
    for trial in range(4):
        gshape = (random.Random(trial).randint(0, 29), 3 + trial)
        fn = _chunk_fn if trial == 0 else _random_parts(f"sim{trial}{placements}", zero_bias=trial > 1)
        truth, layouts = _simulate_exchange(gshape, mesh_shape, pl, orders, fn)
        for c, lay in layouts.items():
            start, size = truth[c]
            assert list(lay.start) == start and list(lay.local_shape) == size, (c, lay, truth[c])
            assert tuple(lay.offsets) == _torch_offset(start, size, gshape, orders)
            for d, axes in orders.items():  # the gather plan: sibling extents at every level
                assert [lv.axis for lv in lay.levels[d]] == axes
                ext, path = gshape[d], ()
                for lv in lay.levels[d]:
                    assert list(lv.extents) == fn(d, path, ext, mesh_shape[lv.axis])
                    ext, path = lv.extents[c[lv.axis]], path + (c[lv.axis],)
            if trial == 0:  # torch.chunk layout: PyTorch (shape.py) agrees
                ref = local_shape_and_offset_at(gshape, mesh_shape, pl, c)
                assert (lay.local_shape, lay.offsets) == (tuple(ref[0]), tuple(ref[1])), (c, lay, ref)
