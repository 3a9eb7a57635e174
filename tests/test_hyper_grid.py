"""`HyperCommGrid` (megashard.state.hyper_grid): Megatron-LM's rank order and errors, rank_offset, views, and
member-only group creation through megashard's pool — pure enumeration, a fake-backend count on 4,096 ranks, and a
4-rank gloo run."""
from __future__ import annotations

import itertools
import random
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, RankGridError, RankGridKeyError
from megashard.layout import RankLayout
from megashard.state import HyperCommGrid
from tests._dist import spawn_checks


def megatron_rank_enum(shape, dim_names, dims, rank_offset=0):
    """Megatron-LM 0.19's ``_gen_rank_enum_for`` re-stated: reversed dims, moveaxis, reshape."""
    rev = dim_names[::-1]
    sizes = dict(zip(dim_names, shape))
    t = np.arange(rank_offset, rank_offset + int(np.prod(shape))).reshape([sizes[d] for d in rev])
    dims = [dims] if isinstance(dims, str) else [rev[i] for i in sorted(rev.index(d) for d in dims)]
    t = np.moveaxis(t, [rev.index(d) for d in dims], list(range(len(rev) - len(dims), len(rev))))
    return t.reshape(-1, int(np.prod([sizes[d] for d in dims]))).tolist()


@pytest.fixture
def world(monkeypatch):
    def set_world(n):
        monkeypatch.setenv("WORLD_SIZE", str(n))
    return set_world


def test_rank_enum_equals_megatron_on_random_grids(world):
    rng = random.Random(3)
    names = ["tp", "cp", "ep", "dp", "pp", "x"]
    n = 0
    for _ in range(150):
        k = rng.randint(1, 5)
        dim_names = rng.sample(names, k)
        shape = [rng.choice([1, 2, 3, 4]) for _ in range(k)]
        off = rng.choice([0, 0, 3, 16])
        world(int(np.prod(shape)) + off + rng.choice([0, 5]))
        grid = HyperCommGrid(shape, dim_names, rank_offset=off)
        for r in range(1, k + 1):
            for dims in itertools.combinations(dim_names, r):
                dims = list(dims)
                rng.shuffle(dims)  # the order dims are given in does not matter
                want = megatron_rank_enum(shape, dim_names, dims, off)
                assert grid.get_rank_enum(dims) == want, (shape, dim_names, dims, off)
                n += 1
        assert grid.get_rank_enum(dim_names[0]) == megatron_rank_enum(shape, dim_names, dim_names[0], off)
    assert n > 1000


@pytest.mark.parametrize("order,sizes", [
    ("tp-cp-dp-pp", dict(tp=2, cp=3, dp=4, pp=5)),
    ("tp-pp-dp", dict(tp=2, cp=1, dp=2, pp=2)),
    ("tp-cp-ep-dp-pp", dict(tp=2, cp=2, dp=2, pp=2)),
])
def test_groups_equal_the_order_string_layout(world, order, sizes):
    config = ParallelConfig(tp=sizes["tp"], cp=sizes["cp"], pp=sizes["pp"], order=order)
    toks = [t for t in config.full_order() if t != "ep"]  # missing size-1 axes appended, as Megatron does
    world(int(np.prod([sizes[t] for t in toks])))
    grid = HyperCommGrid([sizes[t] for t in toks], toks)
    lay = RankLayout(config.resolve(grid.size))
    for name, dims in [("tp", ["tp"]), ("cp", ["cp"]), ("dp", ["dp"]), ("pp", ["pp"]), ("dp_cp", ["cp", "dp"]),
                       ("tp_cp", ["tp", "cp"]), ("tp_dp_cp", ["dp", "cp", "tp"]), ("mp", ["pp", "tp"]),
                       ("world", toks)]:
        assert grid.get_rank_enum(dims) == lay.groups(name), name
    gen = lay.rank_generator()
    assert grid.get_rank_enum(["dp", "pp"]) == gen.get_ranks("dp-pp")


def test_known_example_and_rank_offset(world):
    world(16)
    grid = HyperCommGrid([2, 2, 2], ["a", "b", "c"])
    assert grid.get_rank_enum(["a", "b"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid._gen_rank_enum(["b"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    g2 = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=8)
    assert g2.get_rank_enum("dp") == [[8, 10, 12, 14], [9, 11, 13, 15]]
    assert g2.size == 8 and g2.rank_offset == 8


def test_views(world):
    world(16)
    grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
    # the expert factorisation of the same 16 ranks: tp shared, (cp, dp) refolded as (ep, edp)
    grid.register_view("expert", [2, 4, 2], ["tp", "ep", "edp"], shared_dims=["tp"])
    assert grid.get_rank_enum("tp", view="expert") == grid.get_rank_enum("tp")
    assert grid.get_rank_enum("ep", view="expert") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert grid.get_rank_enum(["tp", "ep"], view="expert") == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="already registered"):
        grid.register_view("expert", [16], ["all"])
    with pytest.raises(ValueError, match="different membership"):
        grid.register_view("bad", [4, 2, 2], ["tp", "cp", "dp"], shared_dims=["tp"])
    with pytest.raises(ValueError, match="has size 8, but the grid size is 16"):
        grid.register_view("small", [2, 4], ["tp", "x"])
    with pytest.raises(ValueError, match="not in the base view"):
        grid.register_view("v", [16], ["zz"], shared_dims=["zz"])
    with pytest.raises(ValueError, match="not in the view's dim_names"):
        grid.register_view("v", [16], ["zz"], shared_dims=["tp"])
    with pytest.raises(KeyError, match="View 'nope' is not registered"):
        grid.get_rank_enum("tp", view="nope")
    with pytest.raises(ValueError, match="'cp' is not in view 'expert'"):
        grid.get_rank_enum("cp", view="expert")


def test_errors(world, monkeypatch):
    world(8)
    with pytest.raises(ValueError, match=r"len\(shape\)"):
        HyperCommGrid([2, 2], ["tp"])
    with pytest.raises(ValueError, match="rank_offset must be non-negative"):
        HyperCommGrid([2], ["tp"], rank_offset=-1)
    with pytest.raises(RuntimeError, match="over sized with world size 8 and rank offset 2"):
        HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=2)
    with pytest.raises(RankGridError):
        HyperCommGrid([16], ["dp"])
    with pytest.raises(ConfigError, match="duplicate dim_names"):
        HyperCommGrid([2, 2], ["tp", "tp"])
    grid = HyperCommGrid([2, 4], ["tp", "dp"])
    with pytest.raises(ValueError, match="'cp' is not in view 'base'"):
        grid.get_rank_enum(["cp"])
    with pytest.raises(KeyError, match="hasn't been created. Call create_pg first"):
        grid.get_pg("tp")
    with pytest.raises(RankGridKeyError) as e:
        grid.get_pg(["dp", "tp"])
    assert str(e.value).startswith("Process group for dp-tp")  # Megatron's key order: reversed dim_names
    monkeypatch.delenv("WORLD_SIZE")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="Cannot determine world size"):
            HyperCommGrid([2], ["tp"])


# ----------------------------------------------------------------------------------------------
# fake backend: one rank of 4,096 creates only its own groups
# ----------------------------------------------------------------------------------------------
def test_member_only_creation_fake_4096(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from megashard._compat import fake_store
    from megashard.state import pooled_group_count, release_process_groups

    W, rank = 4096, 777
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    calls = []
    orig = c10d.new_group

    def new_group(ranks=None, *a, **kw):
        calls.append(tuple(ranks))
        return orig(ranks, *a, **kw)

    store = fake_store()
    monkeypatch.setattr(dist, "new_group", new_group)
    release_process_groups()  # communicators of an earlier test's world (they died with it)
    dist.init_process_group("fake", store=store, rank=rank, world_size=W)
    try:
        grid = HyperCommGrid([8, 2, 64, 4], ["tp", "cp", "dp", "pp"])
        asked = [["tp"], ["cp"], ["dp"], ["pp"], ["cp", "dp"], ["tp", "pp"], ["tp", "cp"], ["tp", "cp", "dp", "pp"]]
        before = pooled_group_count()
        for dims in asked:
            pg = grid.create_pg(dims)
            enum = grid.get_rank_enum(dims)
            mine = next(g for g in enum if rank in g)
            assert dist.get_process_group_ranks(pg) == sorted(mine)
            assert grid.get_pg(list(reversed(dims))) is pg
        # members only: one communicator per call (the world-spanning one is the default group: none)
        assert calls == [tuple(next(g for g in grid.get_rank_enum(d) if rank in g)) for d in asked[:-1]]
        assert pooled_group_count() - before == len(asked) - 1 == grid.groups_created
        megatron = sum(len(grid.get_rank_enum(d)) for d in asked)  # new_subgroups_by_enumeration: every subgroup
        assert megatron == 512 + 2048 + 64 + 1024 + 32 + 128 + 256 + 1
        # a grid on ranks 2048..4095 creates nothing on rank 777
        off = HyperCommGrid([8, 256], ["tp", "dp"], rank_offset=2048)
        n = len(calls)
        assert off.create_pg("tp") is None and off.get_pg("tp") is None and len(calls) == n
        assert not off.is_current_rank_in_grid() and grid.is_current_rank_in_grid()
        with pytest.raises(KeyError, match="has already been created"):
            grid.create_pg(["dp", "cp"])
        grid.destroy()
        with pytest.raises(KeyError):
            grid.get_pg("tp")
    finally:
        release_process_groups()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# gloo: 4 ranks, real collectives; the grid shares communicators with a ParallelState
# ----------------------------------------------------------------------------------------------
def check_grid_shares_state_groups(rank, world_size):
    import megashard.state as ms

    state = ms.initialize(ParallelConfig(tp=2, backend="gloo", device="cpu", timeout=30))
    grid = HyperCommGrid([2, 2], ["tp", "dp"])  # default timeout: the current state's
    before = ms.pooled_group_count()
    tp, dp = grid.create_pg("tp"), grid.create_pg("dp")
    assert tp is state.group("tp") and dp is state.group("dp")  # one communicator per rank set
    assert ms.pooled_group_count() == before and grid.groups_created == 0
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp)
    assert t.item() == sum(next(g for g in grid.get_rank_enum("tp") if rank in g))
    # another timeout is another communicator (the pool keys on it)
    grid2 = HyperCommGrid([2, 2], ["tp", "dp"])
    tp2 = grid2.create_pg("tp", timeout=timedelta(seconds=17), group_desc="TP17")
    assert tp2 is not tp and grid2.groups_created == 1
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=tp2)
    assert t.item() == 2.0
    # a view over the same ranks: its ep groups are the base dp groups, so the same communicator
    grid.register_view("expert", [2, 2], ["tp", "ep"], shared_dims=["tp"])
    assert grid.create_pg("ep", view="expert") is dp
    with pytest.raises(KeyError):
        grid.create_pg("tp", view="expert")  # shared with the base view: one key
    assert grid.get_pg("tp", view="expert") is tp
    ms.destroy()


def check_offset_grid_members_only(rank, world_size):
    import megashard.state as ms

    before = ms.pooled_group_count()
    grid = HyperCommGrid([2], ["tp"], rank_offset=2)  # ranks 2, 3 only
    pg = grid.create_pg("tp")
    if rank < 2:
        assert pg is None and ms.pooled_group_count() == before  # non-members create nothing
    else:
        assert dist.get_process_group_ranks(pg) == [2, 3]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        assert t.item() == 5.0
    dist.barrier()


CHECKS = [check_grid_shares_state_groups, check_offset_grid_members_only]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=4, timeout=180.0, pg_timeout=30.0)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_gloo(dist4, name):
    dist4.assert_ok(name)
