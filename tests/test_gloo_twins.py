"""Gloo twins of every group: created during initialisation (members only, pooled) when the config asks for them,
looked up afterwards — a rank that asks on a code path others skip does not wait for anyone.

CPU machines have no nccl, so the default group here is gloo named ``cpu:gloo``: a backend other than plain gloo,
for which megashard creates real gloo twins exactly as it does on nccl.
"""
from __future__ import annotations


import pytest

from tests._dist import spawn_checks

WORLD = 4


def _members(pg) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(pg)


def check_twins_created_at_initialisation(rank, world_size):
    import torch
    import torch.distributed as dist

    import megashard
    import megashard.parallel_state as ps
    from megashard.errors import StateError
    from megashard.state import pooled_group_count
    from megashard.state.core import GLOO_TWIN_GROUPS

    assert dist.get_backend() == "cpu:gloo"
    before = pooled_group_count()
    # dp_outer=2: two optimizer instances, so the intra-instance (partial) groups differ from the whole ones.
    st = megashard.initialize(megashard.ParallelConfig(tp=2, dp_outer=2, timeout=30))
    try:
        assert st.config.create_gloo_process_groups  # the default
        after_init = pooled_group_count()
        # Communicators: one per distinct rank set (the world is the default group): tp [r, r^1] (= mp, tp_cp,
        # intra_dist_opt, expt_dp_shard), dp [r%2, r%2+2] (= dp_outer, dp_cp, hsdp, expt_dp_outer), [r] (size-1 axes,
        # embd and pos_embd with pp=1). Gloo twins: Megatron's data-parallel set only — dp, dp_cp, hsdp ([r%2, r%2+2]),
        # dp_shard_cp = intra_dp_cp ([r]), expt_dp (the world), expt_dp_shard = intra_expt_dp ([2(r//2), 2(r//2)+1]).
        assert after_init - before == st.groups_created == 3 + 4
        for name in GLOO_TWIN_GROUPS:
            twin = st.gloo_group(name)
            assert dist.get_backend(twin) == "gloo" and twin is not st.group(name), name
            assert _members(twin) == st.ranks(name), name
            # A twin is a working gloo group with exactly the members of its group: a collective on each.
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=twin)
            assert t.item() == sum(r + 1 for r in st.ranks(name)), name
        assert st.ranks("intra_dp_cp") == [rank] and st.ranks("intra_expt_dp") == [rank - rank % 2, rank - rank % 2 + 1]
        assert _members(ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)) == [rank]
        assert _members(ps.get_expert_data_parallel_group_gloo()) == [0, 1, 2, 3]
        assert _members(ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)) == st.ranks("expt_dp_shard")
        assert pooled_group_count() == after_init  # looking twins up created nothing
        with pytest.raises(StateError, match=r"no gloo twin of group 'tp'.*data-parallel groups"):
            st.gloo_group("tp")  # as Megatron: twins of the data-parallel groups only
        # Only rank 0 asks for a twin here: a lookup, so nobody else has to join (a group created here would wait
        # for the other ranks and fail after the group timeout) and no group is created.
        if rank == 0:
            g = ps.get_data_parallel_group_gloo()
            assert _members(g) == st.ranks("dp") and pooled_group_count() == after_init
        dist.barrier()
    finally:
        megashard.destroy()


def check_twins_not_requested(rank, world_size):
    import torch.distributed as dist

    import megashard
    import megashard.parallel_state as ps
    from megashard.errors import StateError
    from megashard.state import pooled_group_count

    before = pooled_group_count()
    st = megashard.initialize(megashard.ParallelConfig(tp=2, timeout=30, create_gloo_process_groups=False))
    try:
        assert st.groups_created == 0 and pooled_group_count() == before  # tp and dp re-used from the pool, no twins
        with pytest.raises(StateError, match=r"no gloo twin of group 'dp'.*create_gloo_process_groups is false"):
            ps.get_data_parallel_group_gloo()
        with pytest.raises(StateError, match=r"no gloo twin of group 'expt_dp'.*create_gloo_process_groups is false"):
            st.gloo_group("expt_dp")
        dist.barrier()
    finally:
        megashard.destroy()


def _nccl_options_class():
    import torch.distributed as dist

    return getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)  # CUDA builds only


def check_every_group_has_parallel_timeout(rank, world_size):
    """parallel.timeout reaches every communicator megashard creates (read back from each group's backend), and
    the NCCL options megashard hands to new_group carry it (torch warned at every NCCL group where they did not)."""
    import warnings
    from datetime import timedelta

    import torch.distributed as dist

    import megashard
    from megashard._compat import group_timeout
    from megashard.config.nccl import nccl_options
    from megashard.layout import GROUP_NAMES
    from megashard.state.core import GLOO_TWIN_GROUPS
    from megashard.state.pool import pooled_group

    want = timedelta(seconds=37)
    assert group_timeout(dist.group.WORLD) == timedelta(seconds=30)  # the spawn's default group: not megashard's
    st = megashard.initialize(megashard.ParallelConfig(tp=2, dp_outer=2, ep=2, timeout=37))
    try:
        seen = 0
        for name in GROUP_NAMES:
            pg = st.group(name)
            if pg is not dist.group.WORLD:  # a group spanning the world is the default group itself
                assert group_timeout(pg) == want, f"group {name}: {group_timeout(pg)}"
                seen += 1
        assert seen >= 10, seen
        for name in GLOO_TWIN_GROUPS:
            if st.gloo_group(name) is not dist.group.WORLD:
                assert group_timeout(st.gloo_group(name)) == want, f"gloo twin of {name}"
        for axis in st.fsdp_mesh.mesh_dim_names:
            assert group_timeout(st.fsdp_mesh.get_group(axis)) == want, f"fsdp_mesh axis {axis}"
        if _nccl_options_class() is not None:  # the options object of an NCCL group, through the real pool
            opts = nccl_options({"is_high_priority_stream": True, "max_ctas": 8})
            assert opts._timeout != want  # torch's default (10 min): what made torch warn
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "backend_options._timeout was specified, ..." would fail here
                pg, _ = pooled_group((rank,), timedelta(seconds=41), "gloo", "test:options", pg_options=opts)
            assert opts._timeout == timedelta(seconds=41) and group_timeout(pg) == timedelta(seconds=41)
        dist.barrier()
    finally:
        megashard.destroy()


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks([check_twins_created_at_initialisation, check_twins_not_requested,
                         check_every_group_has_parallel_timeout], world_size=WORLD, backend="cpu:gloo")


def test_twins_created_at_initialisation(dist4):
    dist4.assert_ok("check_twins_created_at_initialisation")


def test_twins_not_requested_is_a_clear_error(dist4):
    dist4.assert_ok("check_twins_not_requested")


def test_parallel_timeout_reaches_every_group(dist4):
    dist4.assert_ok("check_every_group_has_parallel_timeout")


@pytest.mark.skipif(_nccl_options_class() is None, reason="ProcessGroupNCCL.Options exist in CUDA builds of torch only "
                    "(CI's second torch, 2.11.0 from PyPI, is one)")
def test_nccl_options_carry_the_group_timeout():
    """The NCCL branch of new_group compares options._timeout with its timeout (and warns when they differ), then
    sets it: the options megashard builds and passes hold the group's timeout already."""
    from datetime import timedelta

    from megashard._compat import options_with_timeout
    from megashard.config.nccl import nccl_options

    opts = nccl_options({"cga_cluster_size": 2, "max_ctas": 16})
    assert options_with_timeout(opts, timedelta(seconds=90)) is opts and opts._timeout == timedelta(seconds=90)
    assert opts.config.max_ctas == 16 and options_with_timeout(None, timedelta(seconds=1)) is None
