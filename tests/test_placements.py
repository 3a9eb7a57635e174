"""TP attributes + FSDP layout -> DTensor placements, checked against what fully_shard really produces."""
import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megashard._compat import _StridedShard
from megashard.errors import ShardingError
from megashard.tensors.placements import FSDP_MESH_AXES, param_mesh_axes, resolve_placements, tp_placement
from megashard.tensors.shape import global_index_runs_at
from megashard.tensors.tp_attrs import set_tensor_model_parallel_attributes, set_tensor_parallel_mode
from tests._dist import spawn_checks

MESH = {"pp": 2, "dp_outer": 2, "dp_shard_cp": 3, "tp": 2}
R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _param(shape, mode=None, attrs=None):
    p = torch.nn.Parameter(torch.zeros(shape))
    if mode:
        set_tensor_parallel_mode(p, mode)
    if attrs:
        set_tensor_model_parallel_attributes(p, *attrs)
    return p


def test_tp_placement():
    assert tp_placement(_param((8, 4), "column")) == S0
    assert tp_placement(_param((8, 4), "row")) == S1
    assert tp_placement(_param((8,), "replicated")) == R
    assert tp_placement(_param((8, 4))) == R
    assert tp_placement(_param((8, 4), attrs=(True, 1, 3))) == _StridedShard(1, split_factor=3)


def test_resolve_on_fsdp_mesh():
    col, row, rep = _param((8, 4), "column"), _param((8, 4), "row"), _param((8,), "replicated")
    assert resolve_placements(col, MESH) == (R, R, _StridedShard(0, split_factor=2), S0)
    assert resolve_placements(row, MESH) == (R, R, S0, S1)
    assert resolve_placements(rep, MESH) == (R, R, S0, R)
    assert resolve_placements(_param((8, 4)), MESH) == (R, R, S0, R)
    # Megatron attributes: same answers; stride 2 on TP becomes a strided TP placement
    assert resolve_placements(_param((8, 4), attrs=(True, 0, 1)), MESH) == (R, R, _StridedShard(0, split_factor=2), S0)
    assert resolve_placements(_param((8, 4), attrs=(True, 1, 2)), MESH) == (R, R, S0, _StridedShard(1, split_factor=2))
    # FSDP on dim 1 of a row-parallel weight: strided there instead
    assert resolve_placements(row, MESH, fsdp_dim=1) == (R, R, _StridedShard(1, split_factor=2), S1)
    # no FSDP (DDP), no TP axis, a different axis order
    assert resolve_placements(col, MESH, fsdp=False) == (R, R, R, S0)
    assert resolve_placements(col, {"dp_shard_cp": 4}) == (S0,)
    assert resolve_placements(col, {"tp": 4, "dp_shard_cp": 2}) == (S0, S0)  # tp outermost: plain nesting
    assert param_mesh_axes(MESH) == ("dp_outer", "dp_shard_cp", "tp")
    assert FSDP_MESH_AXES == tuple(MESH)


def test_uneven_fsdp_is_exact():
    """Column weight of 2*m rows, tp=2, FSDP over d: the strided placements give each (d, t) exactly the
    rows FSDP chunks out of TP shard t — also when m does not divide by d (and when some are empty)."""
    for m, d in [(3, 2), (5, 3), (1, 2), (7, 4), (2, 3)]:
        rows = 2 * m
        pl = resolve_placements(_param((rows, 3), "column"), {"dp_shard_cp": d, "tp": 2}, global_shape=(rows, 3))
        chunk = -(-m // d)
        for dd, t in itertools.product(range(d), range(2)):
            lo, hi = t * m + min(dd * chunk, m), t * m + min((dd + 1) * chunk, m)
            want = ((lo, hi),) if hi > lo else ()
            assert global_index_runs_at((rows, 3), (d, 2), pl, (dd, t))[0] == want, (m, d, dd, t)


def test_tp_split_that_does_not_divide_is_refused_only_when_misread():
    col = _param((7, 3), "column")
    # 7 rows over tp=2 then FSDP 2: DTensor reads it right
    assert resolve_placements(col, {"dp_shard_cp": 2, "tp": 2}, global_shape=(7, 3))[0] == _StridedShard(0, split_factor=2)
    # 7 rows over tp=2 then FSDP 3: FSDP puts row 6 on (2, 1), DTensor would read it on (2, 0)
    with pytest.raises(ShardingError, match=r"coordinate \(2, 0\).*must divide"):
        resolve_placements(col, {"dp_shard_cp": 3, "tp": 2}, global_shape=(7, 3))


def test_bad_input():
    col = _param((8, 4), "column")
    with pytest.raises(ShardingError, match="no FSDP axis 'dp_shard_cp'"):
        resolve_placements(col, {"dp": 2, "tp": 2})
    with pytest.raises(ShardingError, match="partition_stride > 1"):
        resolve_placements(_param((8, 4), attrs=(True, 0, 2)), MESH)
    with pytest.raises(ShardingError, match="fsdp_dim 2"):
        resolve_placements(col, MESH, fsdp_dim=2)
    with pytest.raises(ShardingError, match="repeat a name"):
        resolve_placements(col, _Repeated())


class _Repeated(dict):
    """A mapping with a repeated axis name (a dict cannot hold one, so keys() is faked)."""

    def keys(self):
        return ["dp_shard_cp", "tp", "tp"]

    def values(self):
        return [2, 2, 2]


# ------------------------------------------------------------------------------------------------
# gloo, 4 ranks: fully_shard over a parallelize_module-ed model on (dp_shard_cp=2, tp=2)
# ------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.col = torch.nn.Linear(5, 6)    # weight (6, 5): 3 rows per TP rank -> FSDP 2 / 1
        self.row = torch.nn.Linear(6, 7)    # weight (7, 6): TP on dim 1, FSDP 4 / 3 rows; bias replicated on TP
        self.tiny = torch.nn.Linear(7, 2)   # weight (2, 7): 1 row per TP rank -> FSDP 1 / 0 (empty shard)
        self.big = torch.nn.Linear(3, 10)   # weight (10, 3): 5 rows per TP rank -> FSDP 3 / 2
        self.odd = torch.nn.Linear(3, 7)    # weight (7, 3): TP 4 / 3 rows (uneven TP too) -> FSDP 2 / 2 and 2 / 1
        with torch.no_grad():
            for p in self.parameters():  # values = flat index: a local shard shows where it came from
                p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape))


_PLAN = {"col": "colwise", "row": "rowwise", "tiny": "colwise", "big": "colwise", "odd": "colwise"}
_MODES = {"colwise": "column", "rowwise": "row"}


def _build_and_shard(tp_mesh, fsdp_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _Model()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in _PLAN.items()})
    # what we know before FSDP: the TP DTensor, and the Megatron view of the same parameter
    before = {}
    for name, p in model.named_parameters():
        module, kind = name.split(".")
        megatron = torch.nn.Parameter(torch.zeros(p.shape))
        if kind == "weight" or _PLAN[module] == "colwise":
            set_tensor_parallel_mode(megatron, _MODES[_PLAN[module]])
        else:
            set_tensor_parallel_mode(megatron, "replicated")
        before[name] = (p, megatron, tuple(p.shape))
    fully_shard(model, mesh=fsdp_mesh)
    return model, before


def _check_model(model, before, mesh_sizes, world_size):
    import torch.distributed as dist

    from megashard.tensors.shape import compute_global_index_runs, compute_local_shape_and_global_offset
    from megashard._compat import torch_compute_local_shape_and_global_offset

    seen_strided = seen_empty = 0
    for name, p in model.named_parameters():
        tp_dt, megatron, shape = before[name]
        got = tuple(p.placements)
        assert resolve_placements(tp_dt, mesh_sizes) == got, (name, got)
        assert resolve_placements(megatron, mesh_sizes, global_shape=shape) == got, (name, got)
        seen_strided += any(isinstance(x, _StridedShard) for x in got)
        full = torch.arange(p.numel(), dtype=p.dtype).reshape(shape)
        # the local shard is exactly the block our arithmetic names, and equals PyTorch's shape/offset
        runs = compute_global_index_runs(shape, p.device_mesh, got)
        assert all(len(r) <= 1 for r in runs), (name, runs)
        block = full[tuple(slice(r[0][0], r[0][1]) if r else slice(0, 0) for r in runs)]
        assert torch.equal(p.to_local(), block), (name, p.to_local(), runs)
        mine = compute_local_shape_and_global_offset(shape, p.device_mesh, got)
        assert mine == torch_compute_local_shape_and_global_offset(shape, p.device_mesh, got), name
        seen_empty += 0 in mine[0]
        # DTensor reassembles the same tensor, and every rank's answer for every rank tiles it once
        assert torch.equal(p.full_tensor(), full), name
        counts = torch.zeros(shape, dtype=torch.int64)
        for r in range(world_size):
            s, o = compute_local_shape_and_global_offset(shape, p.device_mesh, got, rank=r)
            counts[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
        replicas = 1
        for n, x in zip(p.device_mesh.shape, got):
            replicas *= 1 if isinstance(x, (Shard, _StridedShard)) else n
        assert (counts == replicas).all(), name
    assert seen_strided >= 4  # col/tiny/big weight and bias
    dist.barrier()
    return seen_empty


def check_fully_shard_init_device_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_cp", "tp"))
    model, before = _build_and_shard(mesh["tp"], mesh["dp_shard_cp"])
    empty = _check_model(model, before, {"dp_shard_cp": 2, "tp": 2}, world_size)
    # tiny.weight (2, 7): one row per TP rank, so dp_shard_cp rank 1 holds nothing
    assert empty == (1 if mesh.get_coordinate()[0] == 1 else 0) * 2  # tiny weight + tiny bias


def check_fully_shard_megashard_state(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig

    st = ms.initialize(ParallelConfig(tp=2))
    try:
        model, before = _build_and_shard(st.fsdp_mesh["tp"], st.fully_shard_mesh)
        mesh4 = st.fsdp_mesh
        for name, p in model.named_parameters():
            # on the 4-axis FSDP mesh: pp and dp_outer (size 1 here) replicate, the rest is what fully_shard made
            want = (Replicate(), Replicate(), *p.placements)
            assert resolve_placements(before[name][0], mesh4) == want, name
        _check_model(model, before, {"dp_shard_cp": 2, "tp": 2}, world_size)
    finally:
        ms.destroy()


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks([check_fully_shard_init_device_mesh, check_fully_shard_megashard_state], world_size=4)


def test_gloo_fully_shard_matches_resolved_placements(dist4):
    dist4.assert_ok("check_fully_shard_init_device_mesh")


def test_gloo_fully_shard_on_megashard_fsdp_mesh(dist4):
    dist4.assert_ok("check_fully_shard_megashard_state")
