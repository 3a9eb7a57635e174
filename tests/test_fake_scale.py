"""One rank of a 4,096-rank world at a time, on the ``fake`` backend: megashard's groups and meshes
equal the pure-arithmetic `RankLayout`, and a rank creates exactly the communicators it belongs to.

Ranks 0, 1, 777 and 4095 are simulated one after another in this process (``destroy_process_group``
between them: the fake backend re-initialises cleanly, and megashard's communicator pool is dropped with
the old default group). Every ``new_group`` call and every fake-backend construction is counted by wrapping.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import megashard.state as ms
from megashard._compat import fake_store, wrap_backend_creator
from megashard.config import ParallelConfig
from megashard.layout import DENSE_MESH_AXES, EXPERT_MESH_AXES, GROUP_NAMES, RankLayout

WORLD = 4096
RANKS = (0, 1, 777, 4095)
LAYOUTS = {
    "tp8-cp2-pp4-ep8": dict(tp=8, cp=2, pp=4, ep=8),  # dp 128, expt_dp 64
    "hsdp": dict(tp=4, cp=2, pp=2, dp_outer=4, ep=4, expt_tp=2),  # dp_shard 64, expt_dp 256
}
#: mesh dim name -> the group name whose groups are the rows of that dim
_DIM_GROUP = {"dp_shard_cp": "dp_shard_cp", "pp": "pp"}


@pytest.fixture
def fake_rank(request):
    """Initialise the fake default group for (layout, rank) with counters; tear everything down after."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    counts = {"new_group": 0, "backend": 0}
    orig_new_group = c10d.new_group

    def new_group(*args, **kwargs):
        counts["new_group"] += 1
        return orig_new_group(*args, **kwargs)

    def counting(creator):
        def create(*args, **kwargs):
            counts["backend"] += 1
            return creator(*args, **kwargs)

        return create

    store = fake_store()  # imports (and so registers) the fake backend before wrapping its creator
    restore = wrap_backend_creator("fake", counting)
    dist.new_group = c10d.new_group = new_group

    def start(rank: int) -> dict:
        dist.init_process_group("fake", store=store, rank=rank, world_size=WORLD)
        counts.update(new_group=0, backend=0)  # count only what megashard does
        return counts

    try:
        yield start
    finally:
        dist.new_group = c10d.new_group = orig_new_group
        restore()
        ms.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rows(mesh_tensor: torch.Tensor, dim: int) -> list[list[int]]:
    """Every 1-D line of ``mesh_tensor`` along ``dim`` (the rank sets of that mesh dim), sorted."""
    t = mesh_tensor.movedim(dim, -1)
    return sorted(t.reshape(-1, t.shape[-1]).tolist())


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_and_meshes_equal_layout(fake_rank, layout, rank):
    cfg = LAYOUTS[layout]
    counts = fake_rank(rank)
    st = ms.initialize(ParallelConfig(**cfg, backend="fake", device="cpu"))
    lay = RankLayout(ParallelConfig(**cfg), WORLD)
    world = tuple(range(WORLD))

    # Every named group: exact members (in group-rank order), this rank's index, size.
    by_set: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name in lay.names():
        want = lay.group_of(name, rank)
        if name in ("embd", "pos_embd") and rank not in want:  # off the embedding stages: no group
            assert not st.in_group(name) and st.ranks(name) == want, name
            continue
        pg = st.group(name)
        assert dist.get_process_group_ranks(pg) == want, name
        assert dist.get_rank(pg) == lay.rank_in(name, rank) == want.index(rank), name
        assert dist.get_world_size(pg) == len(want) == st.size(name), name
        assert st.ranks(name) == want and st.rank_in(name) == want.index(rank), name
        # identical rank sets share one communicator (e.g. hsdp and dp_cp)
        assert by_set.setdefault(tuple(want), pg) is pg, name
    assert by_set[world] is dist.group.WORLD

    # Exactly one communicator per distinct non-world rank set of this rank, nothing more.
    expected = len(set(by_set) - {world})
    # tp8…: 10 axis sets + the embedding group (first and last stage); hsdp: 15 + intra_dist_opt (all but the
    # replica axis) + [rank] (pos_embd, gtp_remat); the other new names share sets (expt_dp_shard = dp_shard,
    # expt_dp_outer = inter_dist_opt = dp_outer, embd = pp with pp=2).
    assert expected == {"tp8-cp2-pp4-ep8": 11, "hsdp": 17}[layout]
    assert st.groups_created == expected
    assert counts["new_group"] == expected
    assert counts["backend"] == expected
    assert st.groups_used == expected + 1

    # Root meshes: the exact rank grid, every dim's rows are that group's rank sets, own coordinate right.
    s = lay.sizes
    views = {
        "dense": (st.dense_mesh, DENSE_MESH_AXES, lay.mesh_ranks()),
        "expert": (st.expert_mesh, EXPERT_MESH_AXES, lay.mesh_ranks(expert=True)),
        "fsdp": (st.fsdp_mesh, ("pp", "dp_outer", "dp_shard_cp", "tp"), None),
    }
    assert tuple(st.fsdp_mesh.mesh.shape) == (s.pp, s.dp_outer, s.dp_shard * s.cp, s.tp)
    for view, (mesh, names, grid) in views.items():
        assert mesh.mesh_dim_names == names, view
        if grid is not None:
            assert mesh.mesh.tolist() == grid, view
        for d, name in enumerate(names):
            assert _rows(mesh.mesh, d) == sorted(lay.groups(name)), (view, name)
            assert mesh.get_local_rank(d) == lay.rank_in(name, rank), (view, name)
            assert mesh[name].mesh.tolist() == lay.group_of(name, rank), (view, name)
            assert mesh.get_group(d).group_name == st.group(name).group_name, (view, name)

    # 1-D mesh of every name.
    for name in GROUP_NAMES:
        m = st.mesh(name)
        assert m.mesh.tolist() == lay.group_of(name, rank), name
        assert m.get_group().group_name == st.group(name).group_name, name

    # Building every mesh created no further communicator.
    assert counts["new_group"] == counts["backend"] == expected
