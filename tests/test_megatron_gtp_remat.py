"""Megatron-LM 0.19's generalized tensor-parallel weight rematerialisation (``gtp_remat_size`` /
``expert_gtp_remat_size``) as a real axis of megashard's rank grids: every group equals Megatron's construction
(the re-statement of its code in tests/_megatron_ref.py, on random configs), the issue's example holds through the
Megatron facade on a ``fake`` world of 64 ranks, and — with megatron-core installed — every getter answers as
Megatron's own ``parallel_state`` does (tests/_megatron_parity.py).
"""
from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError
from megashard.layout import RankLayout
from tests._megatron_ref import megatron_groups

#: megashard group name -> Megatron family (tests/_megatron_ref.py)
NAMES = {
    "gtp_remat": "gtp_remat", "dp_cp": "dp_cp", "dp": "dp", "cp": "cp", "mp": "mp", "tp": "tp", "pp": "pp",
    "tp_dp_cp": "tp_dp_cp", "tp_dp": "tp_dp", "tp_cp": "tp_cp", "dp_gtp_remat": "dp_gtp_remat",
    "dp_cp_gtp_remat": "dp_cp_gtp_remat", "expt_gtp_remat": "expt_gtp_remat", "ep": "ep", "expt_tp": "expt_tp",
    "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp", "tp_ep_pp_with_egtp_remat": "tp_ep_pp_with_egtp_remat",
    "expt_dp": "expt_dp", "expt_dp_gtp_remat": "expt_dp_gtp_remat",
    "embd": "embd", "pos_embd": "pos_embd",
}
ORDERS = ["tp-cp-ep-dp-pp", "tp-dp-pp", "cp-tp-dp-pp", "tp-ep-dp-pp", "dp-pp", "ep-dp-cp-pp", "cp-dp-pp"]


def _configs(n: int, seed: int = 22):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, cp, pp, dp, gtp = (rng.choice([1, 1, 2, 3, 4]) for _ in range(5))
        gtp = max(gtp, 2) if rng.random() < 0.8 else gtp
        world = tp * cp * pp * dp * gtp
        if world > 256:
            continue
        stage = world // pp
        egtp = rng.choice([d for d in (1, 1, 2, 3, 4) if stage % d == 0])
        etp = rng.choice([d for d in (1, 2, 3, 4) if (stage // egtp) % d == 0])
        ep = rng.choice([d for d in range(1, stage // (egtp * etp) + 1) if (stage // (egtp * etp)) % d == 0])
        order = rng.choice(ORDERS)
        if any(s > 1 and t not in order.split("-") for t, s in (("tp", tp), ("tp", etp), ("cp", cp), ("ep", ep))):
            continue
        cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, expt_tp=etp, gtp_remat=gtp, expt_gtp_remat=egtp, order=order)
        try:
            RankLayout(cfg, world)
        except ConfigError:
            continue  # e.g. pp not last with expt_dp != dp: refused as Megatron does
        out.append((cfg, world))
    return out


CONFIGS = _configs(120)


def test_every_group_equals_megatron_with_gtp_remat():
    assert sum(c.gtp_remat > 1 for c, _ in CONFIGS) > 80 and sum(c.expt_gtp_remat > 1 for c, _ in CONFIGS) > 20
    for cfg, world in CONFIGS:
        lay = RankLayout(cfg, world)
        ref = megatron_groups(world, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=lay.sizes.expt_tp,
                              order=cfg.order, gtp=cfg.gtp_remat, egtp=cfg.expt_gtp_remat)
        for name, fam in NAMES.items():
            assert lay.groups(name) == ref[fam], (cfg, world, name)
        # Megatron concatenates consecutive tp-ep-pp groups (sorted under gtp_remat); torch sorts a group's ranks
        assert sorted(map(sorted, lay.groups("intra_dist_opt"))) == sorted(map(sorted, ref["intra_dist_opt"])), cfg
        assert lay.sizes.dp == world // (cfg.tp * cfg.cp * cfg.pp * cfg.gtp_remat)  # replicate degree


def test_issue_example_layout():
    lay = RankLayout(ParallelConfig(tp=2, pp=2, gtp_remat=2), 64)
    assert lay.group_of("tp", 0) == [0, 1]
    assert lay.group_of("gtp_remat", 0) == [0, 2] and lay.rank_in("gtp_remat", 0) == 0
    assert lay.group_of("dp_gtp_remat", 0) == list(range(0, 32, 2))  # Megatron's default data-parallel group
    assert lay.group_of("dp", 0) == list(range(0, 32, 4))  # its replicate group (with_gtp_remat=False)
    assert lay.group_of("expt_gtp_remat", 0) == [0]
    assert lay.describe()["gtp_remat"] == 2 and "gtp_remat" not in RankLayout(ParallelConfig(tp=2), 8).describe()


@pytest.fixture
def fake64():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    yield lambda rank: dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    import megashard.parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_issue_example_through_the_facade(fake64):
    """World 64, tp=2, pp=2, gtp_remat=2, rank 0 — the numbers of Megatron's own construction."""
    import megashard.parallel_state as ps

    R = dist.get_process_group_ranks
    fake64(0)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, gtp_remat_size=2)
    assert R(ps.get_tensor_model_parallel_group()) == [0, 1]
    assert R(ps.get_gtp_weight_remat_group()) == [0, 2]
    assert ps.get_gtp_weight_remat_world_size() == 2 and ps.get_gtp_weight_remat_rank() == 0
    assert R(ps.get_data_parallel_group()) == list(range(0, 32, 2)) and ps.get_data_parallel_world_size() == 16
    assert R(ps.get_data_parallel_group(with_gtp_remat=False)) == list(range(0, 32, 4))
    assert ps.get_data_parallel_world_size(with_gtp_remat=False) == 8
    assert R(ps.get_expert_gtp_weight_remat_group()) == [0]
    assert R(ps.get_model_parallel_group()) == [0, 1, 2, 3, 32, 33, 34, 35]
    pgs = ps._st().pg_collection(megatron=False)
    assert R(pgs.gtp_remat) == [0, 2] and R(pgs.dp) == list(range(0, 32, 4))
    assert R(pgs.dp_cp_gtp_remat) == list(range(0, 32, 2)) and R(pgs.tp_dp_cp) == list(range(32))
    assert pgs.dp_gloo is None and pgs.intra_dp_cp_gloo is None  # gloo off under gtp_remat, as Megatron
    # Megatron switches gloo groups off under gtp_remat; meshes have no gtp_remat axis: both say so.
    with pytest.raises(StateError, match="no gloo groups with gtp_remat=2"):
        ps.get_data_parallel_group_gloo()
    with pytest.raises(StateError, match="no 'dense' DeviceMesh with gtp_remat=2"):
        ps._st().dense_mesh


def test_gtp_remat_bad_inputs_are_one_line_errors():
    with pytest.raises(ConfigError, match="gtp_remat=0 is not a valid size"):
        ParallelConfig(gtp_remat=0)
    with pytest.raises(ConfigError, match="one distributed-optimizer instance; set dp_outer: 1"):
        ParallelConfig(gtp_remat=2, dp_outer=2)
    with pytest.raises(ConfigError, match="world size 12 is not divisible by gtp_remat=8"):
        ParallelConfig(gtp_remat=8).resolve(12)
    with pytest.raises(ConfigError, match="expt_gtp_remat=3 must divide"):
        ParallelConfig(tp=2, expt_gtp_remat=3).resolve(8)


def _megatron_parallel_state():
    try:
        from tests._megatron_parity import load_megatron

        return load_megatron(), None
    except ImportError as e:
        return None, f"megatron-core is not installed (pip install -e '.[megatron-test]'): {e}"


def test_every_getter_equals_megatron_parallel_state():
    """Megatron's own parallel_state (installed megatron-core) against megashard's, getter by getter, on fake ranks;
    configs with options the installed version lacks (gtp_remat before 0.19) are left out of the count."""
    mod, reason = _megatron_parallel_state()
    if mod is None:
        pytest.skip(reason)
    from tests._megatron_parity import compare

    equal, total, diffs = compare(mod)
    assert total > 300 and not diffs, diffs[:5]


def test_multi_module_pg_collection(fake64):
    """Megatron's MultiModuleProcessGroupCollection over megashard states (the stand-in: same errors and access)."""
    import megashard
    from megashard.state.megatron_multi import MultiModuleProcessGroupCollection, multi_module_pg_collection

    fake64(5)
    st = megashard.initialize(ParallelConfig(tp=2, cp=4, backend="fake", device="cpu"))
    try:
        mm = multi_module_pg_collection({"llm": st}, "llm", megatron=False)
        assert isinstance(mm, MultiModuleProcessGroupCollection) and mm.has_language_model() and len(mm) == 1
        assert mm["llm"].tp is st.group("tp") and mm.get_language_model_cp_size() == 4
        assert list(mm.keys()) == ["llm"] and mm.get_module_collection("llm") is mm["llm"]
        with pytest.raises(ValueError, match="Module 'vit' not found"):
            mm.get_module_collection("vit")
        with pytest.raises(ValueError, match="language_model_module_name 'lm' not found"):
            multi_module_pg_collection({"llm": st}, "lm", megatron=False)
        with pytest.raises(ValueError, match="module_pgs dict cannot be empty"):
            MultiModuleProcessGroupCollection({})
        with pytest.raises(ValueError, match="No language model"):
            multi_module_pg_collection({"enc": st}, None, megatron=False).get_language_model_cp_size()
    finally:
        megashard.destroy()
