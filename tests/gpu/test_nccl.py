"""NCCL on one GPU (one rank): ``initialize`` with backend=nccl gives every group as an NCCL group and every mesh
on CUDA, a collective runs on each, the gloo twins exist and work; the NCCL options of issue 14
(``nccl_communicator_config_path``: a YAML of per-group ``ProcessGroupNCCL.Options``) reach the communicators.
With two or more GPUs, a tp=2 run also checks real two-rank groups.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import tempfile
from datetime import timedelta

import pytest
import torch

from tests._dist import spawn_checks

pytestmark = pytest.mark.gpu

OPTIONS_ENV = "MEGASHARD_GPU_TEST_NCCL_OPTIONS"
# Megatron-LM's communicator config YAML: group name -> options (ProcessGroupNCCL.Options / .config fields).
NCCL_OPTIONS = {
    "tp": {"is_high_priority_stream": True, "cga_cluster_size": 2, "max_ctas": 16, "min_ctas": 2},
    "dp": {"cga_cluster_size": 4, "max_ctas": 8, "min_ctas": 1},
}


def nccl_options_interface() -> str | None:
    """Where issue 14's ``nccl_communicator_config_path`` is accepted: ``"config"`` (a ParallelConfig field),
    ``"initialize"`` (a keyword of megashard.initialize), or None while it is not merged."""
    import megashard
    from megashard.config import ParallelConfig

    if "nccl_communicator_config_path" in {f.name for f in dataclasses.fields(ParallelConfig)}:
        return "config"
    if "nccl_communicator_config_path" in inspect.signature(megashard.initialize).parameters:
        return "initialize"
    return None


def _initialize(**kw):
    import megashard

    path = kw.pop("nccl_communicator_config_path", None)
    if path is not None and nccl_options_interface() == "initialize":
        return megashard.initialize(megashard.ParallelConfig(**kw), nccl_communicator_config_path=path)
    if path is not None:
        kw["nccl_communicator_config_path"] = path
    return megashard.initialize(megashard.ParallelConfig(**kw))


def _collective_on(pg, value: float, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    t = torch.full((8,), value, device="cuda")
    dist.all_reduce(t, group=pg)
    gathered = torch.empty(8 * size, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.full((8,), value, device="cuda"), group=pg)
    return t, gathered


def check_nccl_groups_meshes_twins(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import megashard
    import megashard.parallel_state as ps
    from megashard.errors import StateError
    from megashard.layout import GROUP_NAMES
    from megashard.state.core import GLOO_TWIN_GROUPS

    torch.cuda.set_device(0)
    assert dist.get_backend() == "nccl", dist.get_backend()
    st = _initialize(backend="nccl", device="cuda", timeout=60)
    try:
        assert st.device_type == "cuda", st.device_type
        for name in GROUP_NAMES:
            pg = st.group(name)
            assert dist.get_backend(pg) == "nccl", f"group {name}: backend {dist.get_backend(pg)}"
            assert dist.get_process_group_ranks(pg) == st.ranks(name) == [0], name
            total, gathered = _collective_on(pg, 3.0, 1)
            assert torch.equal(total, torch.full((8,), 3.0, device="cuda")), f"all_reduce on {name}"
            assert torch.equal(gathered, torch.full((8,), 3.0, device="cuda")), f"all_gather on {name}"
        x = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
        for view in ("dense_mesh", "expert_mesh", "fsdp_mesh", "fully_shard_mesh"):
            mesh = getattr(st, view)
            assert mesh.device_type == "cuda", f"{view} on {mesh.device_type}"
            for axis in mesh.mesh_dim_names:
                assert dist.get_backend(mesh.get_group(axis)) == "nccl", f"{view} axis {axis}"
            d = distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
            assert d.to_local().device.type == "cuda" and torch.equal(d.full_tensor(), x), view
            assert torch.equal(d.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(), x), view
        for name in GROUP_NAMES:
            mesh = st.mesh(name)
            assert mesh.device_type == "cuda" and dist.get_backend(mesh.get_group()) == "nccl", name
        # gloo twins (as in Megatron-LM): one per data-parallel group, created at initialisation, CPU collectives;
        # any other group has none and says so
        for name in GROUP_NAMES:
            if name not in GLOO_TWIN_GROUPS:
                with pytest.raises(StateError, match=rf"no gloo twin of group '{name}' on this nccl job: gloo twins "
                                   r"exist for the data-parallel groups"):
                    st.gloo_group(name)
                continue
            twin = st.gloo_group(name)
            assert dist.get_backend(twin) == "gloo" and dist.get_process_group_ranks(twin) == st.ranks(name), name
            t = torch.tensor([float(rank + 5)])
            dist.all_reduce(t, group=twin)
            assert t.item() == 5.0, name
        assert dist.get_backend(ps.get_data_parallel_group_gloo()) == "gloo"
        assert ps.get_data_parallel_group_gloo(with_context_parallel=True) is st.gloo_group("dp_cp")
        assert dist.get_backend(ps.get_expert_data_parallel_group_gloo()) == "gloo"
        assert st.locals.memory_buffer.device.type == "cuda"
        assert ps.get_tensor_model_parallel_group() is st.group("tp")
    finally:
        megashard.destroy()


def check_nccl_options_applied(rank, world_size):
    import warnings

    import megashard
    from megashard._compat import backend_options, group_timeout

    torch.cuda.set_device(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _initialize(backend="nccl", device="cuda", timeout=60,
                         nccl_communicator_config_path=os.environ[OPTIONS_ENV])
    try:
        # torch warned at every group with options that their timeout would be overridden: megashard sets it first
        assert not [w for w in caught if "_timeout was specified" in str(w.message)], [str(w.message) for w in caught]
        for name, wanted in NCCL_OPTIONS.items():
            pg = st.group(name)
            _collective_on(pg, 1.0, 1)  # the communicator exists now
            opts = backend_options(pg, "cuda")
            got = {k: (opts.is_high_priority_stream if k == "is_high_priority_stream" else getattr(opts.config, k))
                   for k in wanted}
            assert group_timeout(pg, "cuda") == timedelta(seconds=60), f"group {name!r}: {group_timeout(pg, 'cuda')}"
            assert got == wanted, (f"group {name!r}: the communicator's ProcessGroupNCCL.Options are {got}, the YAML "
                                   f"asks for {wanted} (with one rank every group spans the world: the options must "
                                   "still give it a communicator of its own, as Megatron-LM creates one per group)")
    finally:
        megashard.destroy()


def check_nccl_tp2(rank, world_size):
    import torch.distributed as dist

    import megashard
    from megashard._compat import group_timeout

    torch.cuda.set_device(rank)
    st = _initialize(tp=2, backend="nccl", device="cuda", timeout=60)
    try:
        assert st.ranks("tp") == [0, 1] and st.size("dp") == world_size // 2
        total, gathered = _collective_on(st.group("tp"), float(rank + 1), 2)
        assert torch.equal(total, torch.full((8,), 3.0, device="cuda")), total
        assert gathered.tolist() == [1.0] * 8 + [2.0] * 8, gathered
        # gloo twins of the data-parallel groups only: with tp=2 on two ranks, expt_dp spans both
        assert dist.get_process_group_ranks(st.gloo_group("expt_dp")) == st.ranks("expt_dp")
        assert dist.get_process_group_ranks(st.gloo_group("dp")) == st.ranks("dp") == [rank]
        assert group_timeout(st.group("tp"), "cuda") == timedelta(seconds=60)  # parallel.timeout reached NCCL
    finally:
        megashard.destroy()


@pytest.fixture(scope="module")
def one_rank():
    checks = [check_nccl_groups_meshes_twins]
    with tempfile.TemporaryDirectory(prefix="megashard-nccl-") as tmp:
        if nccl_options_interface() is not None:
            import yaml

            path = os.path.join(tmp, "nccl.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(NCCL_OPTIONS, f)
            os.environ[OPTIONS_ENV] = path
            checks.append(check_nccl_options_applied)
        try:
            yield spawn_checks(checks, world_size=1, backend="nccl", timeout=180, pg_timeout=60)
        finally:
            os.environ.pop(OPTIONS_ENV, None)


def test_nccl_groups_meshes_collectives_and_gloo_twins(one_rank):
    one_rank.assert_ok("check_nccl_groups_meshes_twins")


def test_nccl_options_applied_to_communicators(one_rank):
    if nccl_options_interface() is None:
        pytest.skip("needs issue 14's NCCL options (parallel.nccl_communicator_config_path is not in this megashard)")
    one_rank.assert_ok("check_nccl_options_applied")


def test_nccl_two_ranks_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    spawn_checks([check_nccl_tp2], world_size=2, backend="nccl", timeout=180, pg_timeout=60).assert_ok("check_nccl_tp2")
