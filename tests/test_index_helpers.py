"""Seed helpers of Megatron-FSDP utils: mesh names, submodules, signature extension, and
FSDPDistributedIndex misuse — on a fake-backend world in this process."""
import inspect

import pytest
import torch
import torch.distributed as dist

from megashard import MegashardError
from megashard.state.index import FSDPDistributedIndex, contains_submesh, get_mesh_names
from megashard.introspect import create_updated_function_signature, is_submodule


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        yield
    finally:
        import megashard

        megashard.destroy()
        dist.destroy_process_group()


def test_mesh_names_and_contains(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    assert get_mesh_names(mesh) == ["dp_outer", "dp_shard", "tp"]
    mesh["dp_outer", "dp_shard"]._flatten("dp")
    assert get_mesh_names(mesh, only_submesh_dims=True) == ["dp_outer", "dp_shard", "tp"]
    assert get_mesh_names(mesh) == ["dp_outer", "dp_shard", "tp", "dp"]
    assert contains_submesh(mesh, "tp") and contains_submesh(mesh, ("dp_outer", "tp")) and contains_submesh(mesh, "dp")
    assert not contains_submesh(mesh, "cp") and not contains_submesh(None, "tp") and not contains_submesh(mesh, None)
    assert get_mesh_names(None) == []


def test_index_from_state_and_errors(fake_world):
    import megashard

    st = megashard.initialize(tp=2, dp_outer=2, backend="fake", device="cpu")
    idx = st.fsdp_index()
    # rank 3 of 8 with tp=2, dp_outer=2, dp_shard=2: tp [2,3], dp_shard_cp [1,3], dp_outer [3,7], hsdp [1,3,5,7]
    R = dist.get_process_group_ranks
    assert R(idx.get_fsdp_group()) == [1, 3]
    assert R(idx.get_outer_fsdp_group()) == [3, 7]
    assert R(idx.get_dp_group()) == [1, 3, 5, 7]
    sub = idx.get_submesh(("dp_outer", "dp_shard_cp", "tp"))
    assert sub.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(MegashardError, match=r"get_logical_hybrid_fsdp_rank needs full-shard hybrid FSDP"):
        idx.get_logical_hybrid_fsdp_rank()
    assert st.fsdp_index(hsdp_outer_dp_shard=True).get_logical_hybrid_fsdp_rank() == 1 * 2 + 0
    with pytest.raises(MegashardError, match=r"no submesh \('cp',\)"):
        idx.get_submesh("cp")
    with pytest.raises(MegashardError, match=r"dp_shard_dim='dp_shard' is not an axis of the mesh"):
        FSDPDistributedIndex(st.fsdp_mesh, dp_shard_dim="dp_shard")
    with pytest.raises(MegashardError, match=r"needs hybrid_fsdp_group"):
        FSDPDistributedIndex(st.fsdp_mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer")
    with pytest.raises(MegashardError, match=r"dp_outer_dim='outer' is not an axis"):
        FSDPDistributedIndex(st.fsdp_mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="outer", hybrid_fsdp_group=st.group("hsdp"))


def test_is_submodule():
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(torch.nn.Sequential(inner), torch.nn.ReLU())
    assert is_submodule(inner, outer)
    assert not is_submodule(outer, inner)
    assert not is_submodule(outer, outer) and is_submodule(outer, outer, strict=False)


def test_create_updated_function_signature():
    def f(a, b=1, **kw):
        return a + b + len(kw)

    g = create_updated_function_signature(f, extra=5, flag=False)
    params = inspect.signature(g).parameters
    assert list(params) == ["a", "b", "extra", "flag", "kw"]
    assert params["extra"].kind is inspect.Parameter.KEYWORD_ONLY and params["extra"].default == 5
    assert g(1, 2, extra=3, flag=True) == 3  # extended kwargs are swallowed, not forwarded
    assert g(1, 2, other=0) == 4
    with pytest.raises(MegashardError, match=r"already has parameter\(s\) \['b'\]"):
        create_updated_function_signature(f, b=2)
