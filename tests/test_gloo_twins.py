"""Gloo twins of every group: created during initialisation (members only, pooled) when the config asks for them,
looked up afterwards — a rank that asks on a code path others skip does not wait for anyone.

CPU machines have no nccl, so the default group here is gloo named ``cpu:gloo``: a backend other than plain gloo,
for which megashard creates real gloo twins exactly as it does on nccl.
"""
from __future__ import annotations

import time

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
    from megashard.layout import GROUP_NAMES
    from megashard.state import pooled_group_count

    assert dist.get_backend() == "cpu:gloo"
    before = pooled_group_count()
    st = megashard.initialize(megashard.ParallelConfig(tp=2, timeout=30))
    try:
        assert st.config.create_gloo_process_groups  # the default
        after_init = pooled_group_count()
        # One communicator per distinct rank set (the world is the default group), one gloo twin per rank set
        # (the world's too): here tp [r, r^1], dp [r%2, r%2+2], [r] (size-1 axes) and their twins plus the world's.
        sets = {tuple(st.ranks(n)) for n in GROUP_NAMES}
        assert len(sets) == 4 and after_init - before == st.groups_created == 3 + 4
        for name in GROUP_NAMES:
            twin = st.gloo_group(name)
            assert dist.get_backend(twin) == "gloo" and twin is not st.group(name), name
            assert _members(twin) == st.ranks(name), name
        assert pooled_group_count() == after_init  # looking twins up created nothing
        # A twin is a working gloo group with exactly the members of its group.
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=st.gloo_group("tp"))
        assert t.item() == sum(r + 1 for r in st.ranks("tp"))
        # Only rank 0 asks for a twin here: a lookup, so it returns at once and nobody else has to join.
        if rank == 0:
            t0 = time.monotonic()
            g = ps.get_data_parallel_group_gloo()
            assert time.monotonic() - t0 < 1.0 and _members(g) == st.ranks("dp")
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
        with pytest.raises(StateError, match="no gloo twin of group 'tp'"):
            st.gloo_group("tp")
        dist.barrier()
    finally:
        megashard.destroy()


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks([check_twins_created_at_initialisation, check_twins_not_requested], world_size=WORLD,
                        backend="cpu:gloo")


def test_twins_created_at_initialisation(dist4):
    dist4.assert_ok("check_twins_created_at_initialisation")


def test_twins_not_requested_is_a_clear_error(dist4):
    dist4.assert_ok("check_twins_not_requested")
