"""RankLayout against Megatron-LM's facts (DESIGN.md §2), Megatron's rank-generation algorithm, and a
brute-force mesh construction, for hundreds of configs."""
import itertools
import random

import pytest
import torch

from megashard.config import ParallelConfig
from megashard.errors import ConfigError
from megashard.layout import GROUP_NAMES, RankLayout


# ------------------------------------------------------------------ facts from DESIGN.md §2
def test_fact_tp2_pp4_16():
    lay = RankLayout(ParallelConfig(tp=2, pp=4), 16)
    assert lay.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert lay.groups("dp")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups("mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert lay.groups("tp-pp") == lay.groups("mp")


def test_fact_tp2_cp2_dp2_8():
    lay = RankLayout(ParallelConfig(tp=2, cp=2), 8)
    assert lay.sizes.dp == 2
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("tp_dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_fact_expert_16():
    lay = RankLayout(ParallelConfig(expt_tp=2, ep=2, pp=2), 16)
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("expt_dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lay.groups("tp_ep_pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert lay.groups("expt_pp") == lay.groups("pp")


def test_fact_order_tp_pp_dp():
    lay = RankLayout(ParallelConfig(tp=2, pp=2, order="tp-pp-dp"), 8)
    assert lay.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hsdp_split_dp_shard_fastest():
    lay = RankLayout(ParallelConfig(tp=2, dp_outer=2), 8)
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp_outer") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # HSDP shard groups are contiguous slices of the dp groups.
    for g in lay.groups("dp"):
        assert [g[:2], g[2:]] == [s for s in lay.groups("dp_shard") if s[0] in g]


# ------------------------------------------------------------------ Megatron's algorithm, re-stated from its docs
def _megatron_groups(world, sizes_by_token, order, token):
    """generate_masked_orthogonal_rank_groups as documented in Megatron-LM's parallel_state."""
    toks = order.split("-")
    for name, s in sizes_by_token.items():
        if name not in toks:
            toks.append(name)
    parallel_size = [sizes_by_token[t] for t in toks]
    mask = [t in token.split("-") for t in toks]

    def prefix_product(a):
        r, acc = [1], 1
        for v in a:
            acc *= v
            r.append(acc)
        return r

    def decompose(index, shape):
        stride = prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride)]

    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    gstride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(gstride, mask) if m]
    unmasked_stride = [d for d, m in zip(gstride, mask) if not m]
    group_size = prefix_product(masked_shape)[-1]
    out = []
    for gi in range(world // group_size):
        gidx = decompose(gi, unmasked_shape)
        out.append([
            sum(a * b for a, b in zip(decompose(ri, masked_shape), masked_stride))
            + sum(a * b for a, b in zip(gidx, unmasked_stride))
            for ri in range(group_size)
        ])
    return out


DENSE_TOKENS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "dp_cp": "dp-cp", "tp_cp": "tp-cp",
                "tp_dp": "tp-dp", "tp_dp_cp": "tp-cp-dp", "mp": "tp-pp", "hsdp": "dp-cp"}
EXPERT_TOKENS = {"ep": "ep", "expt_tp": "tp", "expt_dp": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_pp": "pp"}


def _random_configs(n, seed=0):
    rng = random.Random(seed)
    orders = ["tp-cp-ep-dp-pp", "tp-dp-pp", "tp-pp-dp", "tp-cp-dp-pp", "cp-tp-dp-pp", "tp-ep-dp-pp", "pp-dp-cp-tp",
              "tp-cp-pp-ep-dp"]
    out = []
    while len(out) < n:
        tp, cp, pp, dp = (rng.choice([1, 1, 2, 3, 4]) for _ in range(4))
        world = tp * cp * pp * dp
        if world > 256:
            continue
        stage = tp * cp * dp
        etp = rng.choice([d for d in (1, 2, 3, 4) if stage % d == 0])
        ep = rng.choice([d for d in range(1, stage // etp + 1) if (stage // etp) % d == 0])
        dpo = rng.choice([d for d in range(1, dp + 1) if dp % d == 0])
        order = rng.choice(orders)
        cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, expt_tp=etp, dp_outer=dpo, order=order)
        try:
            RankLayout(cfg, world)
        except ConfigError:
            continue  # e.g. pp not last with expt_dp != dp: refused on purpose (tested elsewhere)
        out.append((cfg, world))
    return out


CONFIGS = _random_configs(300)


@pytest.mark.parametrize("chunk", range(6))
def test_matches_megatron_algorithm(chunk):
    for cfg, world in CONFIGS[chunk * 50:(chunk + 1) * 50]:
        lay = RankLayout(cfg, world)
        s = lay.sizes
        dense = {"tp": s.tp, "cp": s.cp, "ep": 1, "dp": s.dp, "pp": s.pp}
        expert = {"tp": s.expt_tp, "cp": 1, "ep": s.ep, "dp": s.expt_dp, "pp": s.pp}
        for name, tok in DENSE_TOKENS.items():
            assert lay.groups(name) == _megatron_groups(world, dense, cfg.order, tok), (cfg, name)
        for name, tok in EXPERT_TOKENS.items():
            assert lay.groups(name) == _megatron_groups(world, expert, cfg.order, tok), (cfg, name)


def _brute_force(world, axes_fastest_first, wanted):
    """DESIGN.md's equivalent construction: arange(world) reshaped by the axes in reversed order,
    requested axes moved to the end, reshaped to (-1, group_size)."""
    names = [a for a, _ in axes_fastest_first][::-1]
    sizes = [s for _, s in axes_fastest_first][::-1]
    t = torch.arange(world).reshape(sizes)
    keep = [i for i, n in enumerate(names) if n not in wanted]
    moved = [i for i, n in enumerate(names) if n in wanted]
    gs = 1
    for i in moved:
        gs *= sizes[i]
    return t.permute(keep + moved).reshape(-1, gs).tolist()


def test_matches_brute_force_mesh_construction():
    from megashard.layout import DENSE_GROUPS, EXPERT_GROUPS

    for cfg, world in CONFIGS:
        lay = RankLayout(cfg, world)
        for name in GROUP_NAMES:
            grid = lay.grid(expert=name in EXPERT_GROUPS)
            axes = list(zip(grid.names, grid.sizes))
            wanted = set((EXPERT_GROUPS if name in EXPERT_GROUPS else DENSE_GROUPS)[name])
            assert lay.groups(name) == _brute_force(world, axes, wanted), (cfg, name)


def test_group_of_rank_in_coords_consistent():
    for cfg, world in CONFIGS[:60]:
        lay = RankLayout(cfg, world)
        for name in GROUP_NAMES:
            groups = lay.groups(name)
            # Every rank in exactly one group; group_of/rank_in/group_index agree with the full list.
            seen = sorted(r for g in groups for r in g)
            assert seen == list(range(world))
            for gi, g in enumerate(groups):
                for i, r in enumerate(g):
                    assert lay.group_of(name, r) == g
                    assert lay.rank_in(name, r) == i
                    assert lay.group_index(name, r) == gi
        for r in range(world):
            c = lay.coords(r)
            assert lay.grid().rank_at(c) == r and lay.grid(expert=True).rank_at(c) == r


def test_members_is_group_of_without_listing():
    from megashard.layout import GroupMembers

    for cfg, world in CONFIGS[:40]:
        lay = RankLayout(cfg, world)
        for name in GROUP_NAMES + ("tp-pp",):
            for r in range(world):
                g, m = lay.group_of(name, r), lay.members(name, r)
                assert m == g and list(m) == g and len(m) == len(g) and m[1:3] == g[1:3]
                assert [m[i] for i in range(-len(g), len(g))] == g + g
                assert [x for x in range(world) if x in m] == sorted(g)
                progression = len(g) == 1 or (g[1] > g[0] and g == list(range(g[0], g[-1] + 1, g[1] - g[0])))
                assert (m.stride is not None) == progression, (cfg, name, g)
    # Contiguous dims merge, so equal rank lists compare equal whatever their axes.
    assert GroupMembers(4, [(2, 1), (1, 8), (2, 2)]) == GroupMembers(4, [(4, 1)]) == [4, 5, 6, 7]
    with pytest.raises(IndexError):
        GroupMembers(0, [(4, 1)])[4]
    # 2^24 ranks: O(axes) whatever the group size.
    lay = RankLayout(ParallelConfig(tp=8, pp=4, dp_shard=-1), 1 << 24)
    dp = lay.members("dp", (1 << 24) - 1)
    assert len(dp) == 1 << 19 and dp.stride == 8 and dp[0] == 3 * (1 << 22) + 7 and dp[-1] == (1 << 24) - 1
    assert 3 * (1 << 22) + 15 in dp and 3 * (1 << 22) + 8 not in dp


def test_mesh_ranks_match_groups():
    lay = RankLayout(ParallelConfig(tp=2, cp=2, pp=2, dp_outer=2, order="tp-cp-ep-dp-pp"), 32)
    mesh = torch.tensor(lay.mesh_ranks())
    assert tuple(mesh.shape) == lay.mesh_shape() == (2, 2, 2, 2, 2)
    for r in range(32):
        c = lay.coords(r)
        assert mesh[c["pp"], c["dp_outer"], c["dp_shard"], c["cp"], c["tp"]].item() == r
    emesh = torch.tensor(lay.mesh_ranks(expert=True))
    assert tuple(emesh.shape) == lay.mesh_shape(expert=True)


def test_locality_report():
    lay = RankLayout(ParallelConfig(tp=16, ep=4), 64)
    rep = lay.locality(8)
    assert rep.crossing["tp"] == (4, 4)
    assert rep.crossing["ep"] == (0, 16)
    assert any(w.startswith("tp groups (size 16) cross node boundaries in 4 of 4") for w in rep.warnings)
    assert not any(w.startswith("ep ") for w in rep.warnings)
    lay = RankLayout(ParallelConfig(tp=8, ep=2), 64)
    rep = lay.locality(8)
    assert rep.warnings == ()
    assert rep.crossing["dp"] == (8, 8)
    lay = RankLayout(ParallelConfig(tp=4, ep=4, expt_tp=1, order="tp-cp-dp-ep-pp"), 64)
    rep = lay.locality(8)
    assert rep.crossing["ep"][0] > 0 and any(w.startswith("ep groups") for w in rep.warnings)


def test_one_rank_at_131072_is_cheap_and_right():
    lay = RankLayout(ParallelConfig(tp=8, cp=2, pp=4, ep=8), 131072)
    groups = lay.rank_groups(77777, [n for n in GROUP_NAMES if n != "world"])
    c = lay.coords(77777)
    assert groups["tp"] == [77776 + i for i in range(8)]
    assert len(groups["dp"]) == 131072 // 64
    assert groups["pp"] == [77777 % 32768 + i * 32768 for i in range(4)]
    assert c["pp"] == 77777 // 32768
    assert all(77777 in g for g in groups.values())


def test_unknown_group_and_rank_errors():
    lay = RankLayout(ParallelConfig(tp=2), 8)
    with pytest.raises(ConfigError, match=r"unknown group 'tpp' \(did you mean 'tp'\?\)"):
        lay.groups("tpp")
    with pytest.raises(ConfigError, match=r"rank 8 is outside the world of 8 ranks"):
        lay.group_of("tp", 8)
    with pytest.raises(ConfigError, match="cp and ep live in different layouts"):
        lay.groups("cp-ep")
