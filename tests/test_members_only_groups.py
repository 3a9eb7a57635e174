"""Members-only group creation on the default group torch 2.15 builds: every rank names its next group alike.

megashard creates each group by its members only (``new_group(..., use_local_synchronization=True)``): no rank
waits on a group it is not in. torch names such a group by a hash of its ranks and a per-process count; the
members must agree on that count, so ``ParallelState`` pads the ranks that created fewer groups (the pipeline-edge
groups exist on the embedding stages only) with one-rank placeholders. torch 2.15 changed the count from the
number of live groups (``len(pg_names)``) to the number of group creations (``group_count``), which now also names
every later plain ``new_group`` that all ranks call: a rank that created one group fewer names that group
differently and its peers wait for it until the timeout. And 2.15 lets a CPU default group be bound to a device,
which makes torch offer the default group's backend as a split source for every later group (NCCL splits
communicators there, on GPUs; gloo builds its group afresh).

One spawn of 4 gloo ranks; where torch binds a CPU default group to ``cpu:0`` (2.15) it is bound. Every group has
a 30 s timeout, so a rank that names a group differently fails the test in seconds, not at the spawn's deadline.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

from tests._dist import spawn_checks

WORLD = 4
#: pp=4: only stages 0 and 3 hold the embedding (embd [0, 3], pos_embd [0]), so the ranks create different numbers
#: of groups and megashard pads; then layouts that re-use pooled groups and make new ones.
CONFIGS = [dict(pp=4), dict(tp=2, pp=2), dict(ep=2, dp_outer=2), dict(pp=2, cp=2)]


def _cpu_default_group_binds() -> bool:
    """Whether this torch lets a gloo default group be bound to ``cpu:0`` (2.15: yes; 2.13: ValueError, "device_id
    must be an accelerator"). Tried on a one-rank group in this process."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cpu", 0))
    except ValueError:
        return False
    dist.destroy_process_group()
    return True


def check_groups_made_by_members_only(rank, world_size):
    import torch
    import torch.distributed as dist

    import megashard.state as ms
    from megashard._compat import destroy_group_keep_name, live_process_groups, members_only_name_salt
    from megashard.config import ParallelConfig
    from megashard.layout import RankLayout

    for cfg in CONFIGS:
        st = ms.initialize(ParallelConfig(**cfg, timeout=30))
        layout = RankLayout(ParallelConfig(**cfg), world_size)
        try:
            for name in layout.names():
                if not layout.is_member(name, rank):
                    assert not st.in_group(name), (cfg, name)
                    continue
                expected = layout.group_of(name, rank)
                pg = st.group(name)
                assert dist.get_process_group_ranks(pg) == expected, (cfg, name)
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t, group=pg)  # the communicator connects exactly these ranks
                assert t.item() == sum(r + 1 for r in expected), (cfg, name, t.item(), expected)
            # Every group this process holds has it as a member: no rank made a group it is not in.
            for pg in live_process_groups():
                assert rank in dist.get_process_group_ranks(pg), (cfg, dist.get_process_group_ranks(pg))
            # The count torch salts the next members-only group's name with is the same on every rank ...
            salts = [None] * world_size
            dist.all_gather_object(salts, members_only_name_salt())
            assert len(set(salts)) == 1, (cfg, salts)
            # ... so a group every rank makes now (plain, and members-only over all ranks) meets on every rank.
            # (Destroyed as megashard destroys its members-only groups: torch 2.11 - 2.13 salt the next name with the
            # number of live names, so a plain destroy would hand the next config's group this one's dead name.)
            for local in (False, True):
                g = dist.new_group(list(range(world_size)), use_local_synchronization=local,
                                   timeout=timedelta(seconds=30))
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=g)
                assert t.item() == sum(range(world_size)), (cfg, local)
                destroy_group_keep_name(g)
        finally:
            ms.destroy()


def check_default_group_bound(rank, world_size):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    assert dist.group.WORLD.bound_device_id == torch.device("cpu", 0)
    # The premise of members_only_options: on a bound default group torch offers its backend as the split source of
    # every later group of that backend (gloo's creator ignores it; NCCL's splits the default communicator).
    assert c10d._get_split_source(dist.group.WORLD, "gloo") is not None


def check_nccl_options_kept_out_of_the_split(rank, world_size):
    """``members_only_options`` on this default group: NCCL options get ``lazy_init`` (torch then does not split
    them from the default group) exactly where the default group is bound and this torch has the option; other
    backends' options, and every option where the group is not bound, pass as they are."""
    import torch.distributed as dist

    from megashard._compat import members_only_options

    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    assert members_only_options(None, "gloo") is None
    sentinel = object()
    assert members_only_options(sentinel, "gloo") is sentinel
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # a CPU build: no NCCL options to guard
        assert members_only_options(None, "nccl") is None
        return
    has_lazy = hasattr(ProcessGroupNCCL.Options(), "lazy_init")
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    out = members_only_options(opts, "nccl")
    assert out is opts and out.is_high_priority_stream  # the caller's options, amended, not replaced
    assert getattr(out, "lazy_init", False) is (bound and has_lazy), (bound, has_lazy)
    fresh = members_only_options(None, "nccl")
    if bound and has_lazy:
        assert isinstance(fresh, ProcessGroupNCCL.Options) and fresh.lazy_init and not fresh.is_high_priority_stream
    else:
        assert fresh is None


@pytest.fixture(scope="module")
def world():
    bound = _cpu_default_group_binds()
    checks = [check_nccl_options_kept_out_of_the_split, check_groups_made_by_members_only]
    if bound:
        checks.insert(0, check_default_group_bound)
    res = spawn_checks(checks, world_size=WORLD, device_id="cpu:0" if bound else None, pg_timeout=30, timeout=240)
    return bound, res


def test_groups_made_by_members_only_and_a_group_of_every_rank_after_them(world):
    world[1].assert_ok("check_groups_made_by_members_only")


def test_nccl_options_of_members_only_groups_are_kept_out_of_the_default_groups_split(world):
    world[1].assert_ok("check_nccl_options_kept_out_of_the_split")


def test_the_default_group_is_bound_to_a_device_where_torch_allows_it(world):
    bound, res = world
    if not bound:
        pytest.skip("this torch binds no CPU default group (device_id must be an accelerator before torch 2.15)")
    res.assert_ok("check_default_group_bound")
