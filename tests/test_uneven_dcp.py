"""DCP save/load of uneven DTensors prepared by preprocess_state_dict_for_uneven_dtensor (4 gloo ranks).

A full training state (model AND AdamW state after one step, fully_shard-ed with odd shapes, plus
DTensors with arbitrary per-rank lengths) goes through preprocess + ``dcp.save`` to a real
directory + ``dcp.load`` into fresh DTensors, and must come back bitwise equal; the arbitrary
tensors are loaded into a *different* uneven layout, so DCP must use our chunk metadata both ways.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal

W = 4


def _shared_tmpdir():
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="megashard-uneven-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _cleanup(path):
    import shutil

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _rows_dtensor(global_t, mesh, parts, fill=None):
    """Shard(0) DTensor whose rank r holds ``parts[r]`` consecutive rows (``fill``: value instead of data)."""
    from torch.distributed.tensor import DTensor, Shard

    r = mesh.get_local_rank()
    lo = sum(parts[:r])
    local = global_t[lo:lo + parts[r]].clone()
    if fill is not None:
        local.fill_(fill)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=global_t.shape, stride=global_t.stride())


def _train_one_step(model, opt, in_features):
    torch.manual_seed(123)  # same batch on every rank
    x = torch.randn(6, in_features)
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return x


def check_dcp_fsdp_adamw_and_arbitrary_uneven(rank, world_size):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from megashard._compat import torch_compute_local_shape_and_global_offset
    from megashard.tensors.uneven import (
        gather_uneven_dtensor_to_full_tensor,
        get_chunk_layout,
        preprocess_state_dict_for_uneven_dtensor,
    )

    mesh = init_device_mesh("cpu", (W,))

    def build(seed):
        torch.manual_seed(seed)
        # (7, 5): rows 2, 2, 2, 1   (3, 7): rows 1, 1, 1, 0 (rank 3 holds nothing)   (7,), (3,): likewise
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    model, opt = build(0)
    x = _train_one_step(model, opt, 5)
    msd, osd = get_state_dict(model, opt)
    rows = torch.arange(11 * 3, dtype=torch.float32).view(11, 3)  # value = global flat index
    nested = torch.arange(9 * 4, dtype=torch.int64).view(9, 4)
    sd = {
        "model": msd,
        "optim": osd,
        "extra": {"rows": _rows_dtensor(rows, mesh, [5, 0, 2, 4]), "nested": [_rows_dtensor(nested, mesh, [0, 0, 9, 0])]},
    }
    preprocess_state_dict_for_uneven_dtensor(sd)
    # our chunk equals PyTorch's where PyTorch knows it (FSDP's torch.chunk shards) ...
    for k, v in list(msd.items()) + [(f"exp_avg.{k}", s["exp_avg"]) for k, s in osd["state"].items()]:
        shape, off = torch_compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        lay = get_chunk_layout(v)
        assert (lay.local_shape, lay.offsets) == (tuple(shape), tuple(off)), k
    # ... and differs from it for the arbitrary layout, which is why the hook is needed
    rows_dt = sd["extra"]["rows"]
    ours = rows_dt.__create_chunk_list__()
    assert [tuple(c.offsets) for c in ours] == [[(0, 0)], [], [(5, 0)], [(7, 0)]][rank]
    # DTensor's own hook delegates to the local tensor's, where Megatron-FSDP puts (and looks for) it
    assert DTensor.__create_chunk_list__(rows_dt) == ours == rows_dt._local_tensor.__create_chunk_list__()
    _, theirs = torch_compute_local_shape_and_global_offset(rows_dt.shape, rows_dt.device_mesh, rows_dt.placements)
    if rank == 2:
        assert tuple(theirs) != (5, 0)

    path = _shared_tmpdir()
    try:
        dcp.save(sd, checkpoint_id=path)

        model2, opt2 = build(1)  # different init, no step taken
        msd2, osd2 = get_state_dict(model2, opt2)
        sd2 = {
            "model": msd2,
            "optim": osd2,
            # loaded into a different uneven layout than the one saved
            "extra": {"rows": _rows_dtensor(rows, mesh, [1, 6, 4, 0], fill=-1.0),
                      "nested": [_rows_dtensor(nested, mesh, [3, 1, 0, 5], fill=-1)]},
        }
        preprocess_state_dict_for_uneven_dtensor(sd2)
        dcp.load(sd2, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])

        m_a, o_a = get_state_dict(model, opt)
        m_b, o_b = get_state_dict(model2, opt2)
        assert_bitwise_equal(m_a, m_b, "model")
        assert_bitwise_equal(o_a, o_b, "optim")
        assert torch.equal(model(x), model2(x))
        for name, g, parts in (("rows", rows, [1, 6, 4, 0]), ("nested", nested, [3, 1, 0, 5])):
            t = sd2["extra"][name] if name == "rows" else sd2["extra"][name][0]
            lo = sum(parts[:rank])
            assert torch.equal(t.to_local(), g[lo:lo + parts[rank]]), name
            assert torch.equal(gather_uneven_dtensor_to_full_tensor(t).to_local(), g), name
        # one more step from the restored state matches one more step from the original
        _train_one_step(model, opt, 5)
        _train_one_step(model2, opt2, 5)
        assert_bitwise_equal(get_state_dict(model, opt)[0], get_state_dict(model2, opt2)[0], "after-step")
    finally:
        _cleanup(path)


def check_dcp_fsdp_tp_strided(rank, world_size):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from megashard._compat import _StridedShard
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor, preprocess_state_dict_for_uneven_dtensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(seed):
        torch.manual_seed(seed)
        # TP dims divide by tp (as Megatron requires); FSDP dims do not: 6 -> tp 3 -> dp 2, 1; 5 -> dp 3, 2
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    model, opt = build(0)
    assert isinstance(model[0].weight.placements[0], _StridedShard)
    x = _train_one_step(model, opt, 4)
    msd, osd = get_state_dict(model, opt)
    for k, v in msd.items():  # our gather agrees with DTensor's own full_tensor()
        assert torch.equal(gather_uneven_dtensor_to_full_tensor(v).to_local(), v.full_tensor()), k
    sd = {"model": msd, "optim": osd}
    preprocess_state_dict_for_uneven_dtensor(sd)
    path = _shared_tmpdir()
    try:
        dcp.save(sd, checkpoint_id=path)
        model2, opt2 = build(1)
        msd2, osd2 = get_state_dict(model2, opt2)
        sd2 = {"model": msd2, "optim": osd2}
        preprocess_state_dict_for_uneven_dtensor(sd2)
        dcp.load(sd2, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
        assert_bitwise_equal(get_state_dict(model, opt)[0], get_state_dict(model2, opt2)[0], "model")
        assert_bitwise_equal(get_state_dict(model, opt)[1], get_state_dict(model2, opt2)[1], "optim")
        assert torch.equal(model(x).full_tensor(), model2(x).full_tensor()) if hasattr(model(x), "full_tensor") \
            else torch.equal(model(x), model2(x))
    finally:
        _cleanup(path)


CHECKS = [check_dcp_fsdp_adamw_and_arbitrary_uneven, check_dcp_fsdp_tp_strided]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=W, timeout=300.0, pg_timeout=30.0)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_uneven_dcp(dist4, name):
    dist4.assert_ok(name)
