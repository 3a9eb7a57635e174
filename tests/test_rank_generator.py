"""`RankGenerator` (megashard.layout.rank_generator) against a plain re-statement of Megatron-LM 0.19's construction
(``generate_masked_orthogonal_rank_groups`` + ``RankGenerator.get_ranks``) on hundreds of random configs: every token
string, dense and expert, with rank offsets; plus Megatron's errors and the agreement with ``RankLayout``."""
from __future__ import annotations

import itertools
import random

import pytest

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, RankGridAssertionError, RankGridError, RankGridKeyError
from megashard.layout import RankGenerator, RankLayout

TOKENS = ("tp", "pp", "dp", "ep", "cp", "gtp_remat")


# ----------------------------------------------------------------------------------------------
# Megatron-LM 0.19's construction, re-stated plainly (prefix products, decompose, inner products)
# ----------------------------------------------------------------------------------------------
def _prefix_product(a, init=1):
    r = [init]
    for v in a:
        init *= v
        r.append(init)
    return r


def _decompose(index, shape):
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride)]


def megatron_masked_groups(world_size, parallel_size, mask):
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = _prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    ranks = []
    for group_index in range(world_size // group_size):
        g = _decompose(group_index, unmasked_shape)
        ranks.append([
            sum(x * y for x, y in zip(_decompose(r, masked_shape), masked_stride))
            + sum(x * y for x, y in zip(g, unmasked_stride))
            for r in range(group_size)
        ])
    return ranks


def megatron_get_ranks(sizes, order, token, rank_offset=0):
    order = order.lower()
    for name in TOKENS:  # (token-wise: the configs below never put a token inside another)
        if name not in order.split("-"):
            assert sizes[name] == 1
            order += "-" + name
    ordered = order.split("-")
    mask = [False] * len(ordered)
    for t in token.split("-"):
        mask[ordered.index(t)] = True
    world = 1
    for v in sizes.values():
        world *= v
    ranks = megatron_masked_groups(world, [sizes[t] for t in ordered], mask)
    if rank_offset > 0:
        ranks = [[r + rank_offset for r in g] for g in ranks]
    return ranks


# ----------------------------------------------------------------------------------------------
def _random_config(rng, expert):
    sizes = {t: 1 for t in TOKENS}
    axes = ["tp", "dp", "pp", "ep" if expert else "cp", "gtp_remat"]
    for a in axes:
        sizes[a] = rng.choice([1, 1, 2, 3, 4])
    world = 1
    for v in sizes.values():
        world *= v
    if world > 512:
        sizes["dp"] = sizes["pp"] = 1
    present = [t for t in TOKENS if sizes[t] > 1 or rng.random() < 0.5]
    rng.shuffle(present)
    return sizes, "-".join(present), rng.choice([0, 0, 1, 4, 12, 1000])


def _tokens_of(order):
    toks = order.split("-")
    for r in range(1, len(toks) + 1):
        for combo in itertools.combinations(toks, r):
            yield "-".join(combo)


@pytest.mark.parametrize("expert", [False, True], ids=["dense", "expert"])
def test_get_ranks_equals_megatron_on_random_configs(expert):
    rng = random.Random(14 + expert)
    checked = 0
    for _ in range(200):
        sizes, order, off = _random_config(rng, expert)
        gen = RankGenerator(tp=sizes["tp"], ep=sizes["ep"], dp=sizes["dp"], pp=sizes["pp"], cp=sizes["cp"],
                            order=order, rank_offset=off, gtp_remat=sizes["gtp_remat"])
        full = gen.order
        assert gen.world_size == sizes["tp"] * sizes["ep"] * sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["gtp_remat"]
        assert gen.ordered_size == [sizes[t] for t in full.split("-")]
        toks = list(_tokens_of(full))
        for token in rng.sample(toks, min(12, len(toks))):
            want = megatron_get_ranks(sizes, order, token, off)
            assert gen.get_ranks(token) == want, (sizes, order, token, off)
            shuffled = token.split("-")
            rng.shuffle(shuffled)  # token order does not matter (a mask)
            assert gen.get_ranks("-".join(shuffled)) == want
            assert gen.get_mask(full, token) == [t in token.split("-") for t in full.split("-")]
            r = rng.choice(rng.choice(want))
            assert list(gen.group_of(token, r)) == next(g for g in want if r in g)
            checked += 1
    assert checked > 1500


@pytest.mark.parametrize("expert", [False, True], ids=["dense", "expert"])
def test_every_token_on_small_configs(expert):
    """Every token string (every subset of the order's axes) of 60 random small configs."""
    rng = random.Random(140 + expert)
    for _ in range(60):
        sizes, order, off = _random_config(rng, expert)
        while sizes["tp"] * sizes["dp"] * sizes["pp"] * sizes["ep"] * sizes["cp"] * sizes["gtp_remat"] > 64:
            sizes, order, off = _random_config(rng, expert)
        gen = RankGenerator(sizes["tp"], sizes["ep"], sizes["dp"], sizes["pp"], sizes["cp"], order, off,
                            sizes["gtp_remat"])
        for token in _tokens_of(gen.order):
            assert gen.get_ranks(token) == megatron_get_ranks(sizes, order, token, off), (sizes, order, token)


def test_known_layouts_and_expert_tp_dp():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert gen.get_ranks("tp-pp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert gen.order == "tp-cp-ep-dp-pp-gtp_remat"
    ex = RankGenerator(tp=2, ep=2, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert ex.get_ranks("tp-ep-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert ex.get_ranks("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert RankGenerator(2, 1, 2, 2, 1, "tp-pp-dp").get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    off = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp", rank_offset=4)
    assert off.get_ranks("pp") == [[4, 8], [5, 9], [6, 10], [7, 11]]
    g = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-gtp_remat-dp", gtp_remat=2)
    assert g.get_gtp_ranks(2) == [[0, 2], [1, 3], [4, 6], [5, 7]] == g.get_ranks("gtp_remat")


@pytest.mark.parametrize("world,kw", [
    (16, dict(tp=2, pp=4)), (8, dict(tp=2, cp=2)), (16, dict(expt_tp=2, ep=2, pp=2)),
    (24, dict(tp=2, cp=3, order="tp-cp-pp-dp", pp=2)), (32, dict(tp=2, ep=4, pp=2, expt_tp=2)),
])
def test_layout_rank_generator_equals_layout_groups(world, kw):
    lay = RankLayout(ParallelConfig(**kw).resolve(world))
    dense, expert = lay.rank_generator(), lay.rank_generator(expert=True)
    for tok in ("tp", "cp", "dp", "pp", "tp-cp", "dp-cp", "tp-dp", "tp-dp-cp", "tp-pp", "tp-cp-dp-pp"):
        assert dense.get_ranks(tok) == lay.groups(tok), tok
    # the expert grid splits expt_dp into its replica axes (expt_dp_shard inner, expt_dp_outer outer)
    axis = {"tp": ["expt_tp"], "ep": ["ep"], "dp": ["expt_dp_shard", "expt_dp_outer"], "pp": ["pp"]}
    for tok in ("tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp", "tp-dp", "ep-dp", "tp-ep-dp-pp"):
        want = lay.grid(expert=True).groups([a for t in tok.split("-") for a in axis[t]])
        assert expert.get_ranks(tok) == want, tok
    for name in ("ep", "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp"):
        tok = {"expt_tp": "tp", "expt_dp": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp"}.get(name, name)
        assert expert.get_ranks(tok) == lay.groups(name), name
    assert lay.rank_generator(rank_offset=8).get_ranks("tp")[0] == [r + 8 for r in lay.groups("tp")[0]]


def test_errors_as_megatron():
    with pytest.raises(AssertionError, match="ep=2 and cp=2"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(RankGridAssertionError):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(RuntimeError, match=r"The size of \(pp\) is \(2\), but you haven't specified the order"):
        RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-dp")
    with pytest.raises(RankGridError):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-dp", gtp_remat=2)
    with pytest.raises(KeyError, match="unknown token 'xp'"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xp")
    with pytest.raises(RankGridKeyError) as e:
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-gtp_rmat")
    assert "did you mean 'gtp_remat'" in str(e.value) and not str(e.value).startswith("'")
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="'zz' is not an axis"):
        gen.get_ranks("tp-zz")
    with pytest.raises(AssertionError, match="gtp_remat axis size"):
        gen.get_gtp_ranks(2)
    for bad in (dict(tp=0), dict(dp=-1), dict(rank_offset=-1), dict(order="tp-tp")):
        args = dict(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-dp")
        args.update(bad)
        with pytest.raises(ConfigError):
            RankGenerator(**args)
    with pytest.raises(ConfigError, match="outside"):
        gen.group_of("tp", 4)
