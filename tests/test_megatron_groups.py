"""Every group of Megatron-LM 0.19's ``initialize_model_parallel`` equals megashard's, on random configs (pure
arithmetic against the plain re-statement of Megatron's code in tests/_megatron_ref.py) and on thousands of
simulated ranks of the ``fake`` backend through the Megatron facade (one rank at a time, one process).
"""
from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from megashard.config import ParallelConfig
from megashard.errors import ConfigError
from megashard.layout import RankLayout
from tests._megatron_ref import communicators_of_rank, hierarchical, megatron_groups

#: megashard name -> Megatron family (tests/_megatron_ref.py)
NAMES = {
    "gtp_remat": "gtp_remat", "dp_cp": "dp_cp", "dp": "dp", "cp": "cp", "mp": "mp", "tp": "tp", "pp": "pp",
    "embd": "embd", "pos_embd": "pos_embd", "tp_dp_cp": "tp_dp_cp", "tp_dp": "tp_dp", "tp_cp": "tp_cp",
    "expt_gtp_remat": "expt_gtp_remat", "ep": "ep", "expt_tp": "expt_tp", "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp",
    "expt_dp": "expt_dp",
}
#: Megatron creates these by slicing each dp·cp / expert dp group in turn: the same groups (members in the same
#: order), listed in another order than a RankGenerator token would list them — compared as sorted lists of groups.
SLICED = {"intra_dp_cp": "intra_dp_cp", "intra_expt_dp": "intra_expt_dp"}
EDGE_CHOICES = {
    "first": lambda r: [r[0]],
    "last": lambda r: [r[-1]],
    "all": lambda r: list(r),
    "first-and-second": lambda r: r[:2],
}


def _factor(n: int, rng: random.Random) -> list[int]:
    """A random ordered factorisation of ``n`` (hierarchical cp level sizes)."""
    out = []
    while n > 1:
        d = rng.choice([d for d in range(2, n + 1) if n % d == 0])
        out.append(d)
        n //= d
    return out or [1]


def _configs(n: int, seed: int = 14):
    rng = random.Random(seed)
    orders = ["tp-cp-ep-dp-pp", "tp-dp-pp", "tp-pp-dp", "cp-tp-dp-pp", "tp-ep-dp-pp", "pp-dp-cp-tp", "tp-cp-pp-ep-dp"]
    out = []
    while len(out) < n:
        tp, cp, pp, dp = (rng.choice([1, 1, 2, 3, 4]) for _ in range(4))
        world = tp * cp * pp * dp
        if world > 192:
            continue
        stage = tp * cp * dp
        etp = rng.choice([d for d in (1, 2, 3, 4) if stage % d == 0])
        ep = rng.choice([d for d in range(1, stage // etp + 1) if (stage // etp) % d == 0])
        edp = stage // (etp * ep)
        n_inst = rng.choice([d for d in range(1, dp + 1) if dp % d == 0 and edp % d == 0])
        hcp = _factor(cp, rng) if cp > 1 and rng.random() < 0.5 else None
        emb = rng.choice([None, None, *EDGE_CHOICES])
        pos = rng.choice([None, None, *EDGE_CHOICES])
        order = rng.choice(orders)
        cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, expt_tp=etp, dp_outer=n_inst, order=order,
                             hierarchical_context_parallel_sizes=hcp)
        try:
            RankLayout(cfg, world)
        except ConfigError:
            continue  # e.g. pp not last with expt_dp != dp: refused as Megatron does (tested elsewhere)
        out.append((cfg, world, emb, pos))
    return out


CONFIGS = _configs(300)


def _dp_before_cp(cfg: ParallelConfig) -> bool:
    """An order with dp faster than cp (e.g. pp-dp-cp-tp) and several optimizer instances and cp > 1: Megatron's
    intra partial dp·cp groups, consecutive slices of a dp-major dp·cp group, then span every instance and part of
    cp; megashard keeps them inside an instance (dp_shard·cp), consistent with the inter-instance groups (see
    docs/parallel_state.md)."""
    toks = cfg.full_order()
    return cfg.cp > 1 and cfg.dp_outer > 1 and toks.index("dp") < toks.index("cp")


def _ref(cfg: ParallelConfig, world: int, emb, pos) -> dict[str, list[list[int]]]:
    # (resolved expt_tp: without experts and pp not last megashard folds the unused expert layout onto the dense
    # one, as Megatron's default expt_tp = tp does)
    etp = cfg.resolve(world).expt_tp
    return megatron_groups(world, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=etp, n_inst=cfg.dp_outer,
                           hcp=cfg.hierarchical_context_parallel_sizes, order=cfg.order,
                           embedding_ranks=EDGE_CHOICES.get(emb), position_embedding_ranks=EDGE_CHOICES.get(pos))


@pytest.mark.parametrize("chunk", range(3))
def test_every_group_equals_megatron_on_random_configs(chunk):
    for cfg, world, emb, pos in CONFIGS[chunk * 100:(chunk + 1) * 100]:
        lay = RankLayout(cfg.resolve(world), embedding_ranks=EDGE_CHOICES.get(emb),
                         position_embedding_ranks=EDGE_CHOICES.get(pos))
        ref = _ref(cfg, world, emb, pos)
        where = (cfg, world, emb, pos)
        for name, fam in NAMES.items():
            assert lay.groups(name) == ref[fam], (where, name)  # members, their order and the order of groups
        for name, fam in SLICED.items():
            if name == "intra_dp_cp" and _dp_before_cp(cfg):
                continue  # Megatron's slices then cut across instances (see _dp_before_cp)
            assert sorted(lay.groups(name)) == sorted(ref[fam]), (where, name)
        for k in range(len(cfg.hierarchical_context_parallel_sizes or ())):
            assert sorted(lay.groups(f"hcp{k}")) == sorted(ref[f"hcp{k}"]), (where, k)
        if cfg.dp_outer > 1:  # Megatron creates the inter-instance group only with several instances
            assert sorted(lay.groups("inter_dist_opt")) == sorted(ref["inter_dist_opt"]), where
        # Megatron concatenates consecutive tp-ep-pp groups; torch orders a group's ranks, so compare as sets.
        assert sorted(map(sorted, lay.groups("intra_dist_opt"))) == sorted(map(sorted, ref["intra_dist_opt"])), where
        # Every rank finds its own group of each name, and is a member exactly where Megatron makes it one.
        for r in range(world):
            for name in ("embd", "pos_embd"):
                mine = [g for g in ref[name] if r in g]
                assert lay.is_member(name, r) == bool(mine), (where, name, r)
                if mine:
                    assert lay.group_of(name, r) == mine[0] and lay.rank_in(name, r) == mine[0].index(r)


def test_partial_dp_groups_are_the_replica_split():
    """With num_distributed_optimizer_instances = dp_outer, Megatron's intra/inter partial expert dp groups are the
    expert shard/replica axes, and its intra partial dp·cp groups are dp_shard·cp (DESIGN §6)."""
    for cfg, world, _, _ in CONFIGS:
        lay = RankLayout(cfg, world)
        ref = megatron_groups(world, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=lay.sizes.expt_tp,
                              n_inst=cfg.dp_outer, order=cfg.order)
        assert sorted(lay.groups("expt_dp_shard")) == sorted(ref["intra_expt_dp"]), cfg
        if not _dp_before_cp(cfg):
            assert sorted(lay.groups("dp_shard_cp")) == sorted(ref["intra_dp_cp"]), cfg
        if cfg.dp_outer > 1:
            assert sorted(lay.groups("expt_dp_outer")) == sorted(ref["inter_dist_opt"]), cfg


def test_issue_examples():
    # 8 ranks, tp=2, pp=2, one optimizer instance: Megatron's intra-instance group is the whole world.
    lay = RankLayout(ParallelConfig(tp=2, pp=2), 8)
    assert lay.group_of("intra_dist_opt", 0) == list(range(8))
    assert lay.groups("embd") == [[0, 4], [1, 5], [2, 6], [3, 7]] and lay.groups("pos_embd") == [[0], [1], [2], [3]]
    # Expert replica axis: dp_outer=2, dp_shard=4, ep=2 on 8 ranks: rank 0's expert FSDP group stays in replica 0.
    lay = RankLayout(ParallelConfig(dp_outer=2, dp_shard=4, ep=2), 8)
    assert lay.group_of("dp_shard", 0) == [0, 1, 2, 3]
    assert lay.group_of("expt_dp_shard", 0) == [0, 2] and lay.group_of("expt_dp_outer", 0) == [0, 4]
    assert lay.group_of("expt_dp", 0) == [0, 2, 4, 6] and lay.mesh_shape("hsdp") == (1, 2, 2, 2, 1)
    assert hierarchical([0, 2, 4, 6], [2, 2]) == [[[0, 2], [4, 6]], [[0, 4], [2, 6]]]
    lay = RankLayout(ParallelConfig(tp=2, cp=4, hierarchical_context_parallel_sizes=[2, 2]), 8)
    assert lay.groups("hcp0") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lay.groups("hcp1") == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"expt_dp=1 must be divisible by dp_outer=2"):
        ParallelConfig(dp_outer=2, ep=8).resolve(8)
    with pytest.raises(ConfigError, match=r"hierarchical_context_parallel_sizes=\[2, 3\] multiply to 6, but cp=4"):
        ParallelConfig(cp=4, hierarchical_context_parallel_sizes=[2, 3])
    with pytest.raises(ConfigError, match=r"hierarchical_context_parallel_sizes=\[0\] must be a non-empty list"):
        ParallelConfig(cp=1, hierarchical_context_parallel_sizes=[0])
    # NCCL communicator config (Megatron's YAML format): checked on any machine, one line naming the problem.
    f = tmp_path / "nccl.yaml"
    f.write_text("dp_cp: {cga_cluster_size: 4, max_ctas: 32, min_ctas: 1}\ntp: {net_name: IB}\n")
    ok = ParallelConfig(nccl_communicator_config_path=str(f), high_priority_stream_groups=["ep_dp"])
    from megashard.config.nccl import nccl_spec

    spec = nccl_spec(ok.nccl_communicator_config_path, ok.high_priority_stream_groups)
    assert spec["dp_cp"] == spec["hsdp"] == {"cga_cluster_size": 4, "max_ctas": 32, "min_ctas": 1}
    assert spec["tp"] == {"net_name": "IB"} and spec["expt_dp"] == {"is_high_priority_stream": True}
    for text, msg in [("dpcp: {max_ctas: 2}\n", r"unknown group 'dpcp' \(did you mean 'dp_cp'\?\); valid"),
                      ("tp: {max_cta: 2}\n", r"group 'tp' has unknown option 'max_cta' \(did you mean 'max_ctas'\?\)"),
                      ("tp: {net_name: eth}\n", r"tp.net_name='eth' is not supported; valid: IB, socket"),
                      ("tp: {max_ctas: -1}\n", r"tp.max_ctas=-1 must be a non-negative integer"),
                      ("tp: {min_ctas: 8, max_ctas: 2}\n", r"tp.min_ctas=8 exceeds max_ctas=2"),
                      ("[1, 2]\n", r"must hold a mapping of group names")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            ParallelConfig(nccl_communicator_config_path=str(f))
    with pytest.raises(ConfigError, match=r"nccl_communicator_config_path='/nonexistent.yaml': no such file"):
        ParallelConfig(nccl_communicator_config_path="/nonexistent.yaml")
    with pytest.raises(ConfigError, match=r"high_priority_stream_groups: unknown group 'dpp' \(did you mean 'pp'\?\); valid: dp, dp_cp"):
        ParallelConfig(high_priority_stream_groups=["dpp"])
    bad = RankLayout(ParallelConfig(pp=2), 4, embedding_ranks=lambda r: [99])
    with pytest.raises(ConfigError, match=r"get_embedding_ranks\(\[0, 2\]\) returned \[99\]: it must return distinct "
                                          r"ranks of the pipeline group"):
        bad.group_of("embd", 0)


def test_megatron_communicator_count_of_the_reference():
    """The reference counts what Megatron creates on a rank: every create_group call holding it (no de-duplication)."""
    # 8 ranks, tp=2, pp=2, gloo twins: gtp, dp_cp (+gloo), dp (+gloo), cp, mp, tp, pp, embd, pos_embd, tp_dp_cp,
    # tp_dp, tp_cp, expt_gtp, ep, expt_tp, tp_ep, tp_ep_pp, tp_ep_pp (egtp), expt_dp (+gloo), intra_dist_opt = 23.
    n = communicators_of_rank(8, 0, tp=2, pp=2)
    assert (n["calls"], n["default"], n["gloo"]) == (23, 20, 3)
    # Distinct (rank set, backend) among them: [0] (gtp, cp, pos_embd, expt_gtp), [0, 2] (dp, dp_cp, tp_dp?),
    # the dp groups' gloo twins, [0, 1] (tp, tp_cp), [0, 1, 4, 5] (mp, tp_ep_pp x2), [0, 4] (pp, embd) ...
    lay = RankLayout(ParallelConfig(tp=2, pp=2, expt_tp=2), 8)
    sets = {tuple(lay.group_of(n, 0)) for n in lay.names() if lay.is_member(n, 0)} - {tuple(range(8))}
    twins = {(tuple(lay.group_of(n, 0)), "gloo") for n in ("dp", "dp_cp", "expt_dp")}
    assert n["sets"] == len(sets) + len(twins) + 1  # + Megatron's whole-world intra_dist_opt group


# ---------------------------------------------------------------------- thousands of ranks, fake backend
FAKE_WORLD = 4096
FAKE_CASES = {
    # name: (facade kwargs, ranks to simulate)
    "pp4-vpp-tp8-cp2-ep8": (dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                                 virtual_pipeline_model_parallel_size=2, context_parallel_size=2,
                                 expert_model_parallel_size=8, expert_tensor_parallel_size=1,
                                 hierarchical_context_parallel_sizes=[2, 1]), (0, 1500, 4095)),
    "inst2-tp4-pp2-ep4": (dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                               expert_model_parallel_size=4, expert_tensor_parallel_size=2,
                               num_distributed_optimizer_instances=2, context_parallel_size=2,
                               hierarchical_context_parallel_sizes=[2]), (0, 777, 4095)),
    "pp1-tp4-cp2": (dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1, context_parallel_size=2,
                         expert_model_parallel_size=2, expert_tensor_parallel_size=1), (0, 4095)),
}


@pytest.fixture
def fake_world():
    from megashard._compat import fake_store

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = fake_store()

    def start(rank: int) -> None:
        dist.init_process_group("fake", store=store, rank=rank, world_size=FAKE_WORLD)

    yield start
    import megashard.parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(FAKE_CASES))
def test_facade_getters_on_fake_ranks(fake_world, case):
    import megashard.parallel_state as ps

    kw, ranks = FAKE_CASES[case]
    ref = megatron_groups(FAKE_WORLD, tp=kw["tensor_model_parallel_size"], pp=kw["pipeline_model_parallel_size"],
                          cp=kw.get("context_parallel_size", 1), ep=kw["expert_model_parallel_size"],
                          etp=kw["expert_tensor_parallel_size"], n_inst=kw.get("num_distributed_optimizer_instances", 1),
                          hcp=kw.get("hierarchical_context_parallel_sizes"))
    R = dist.get_process_group_ranks

    def mine(fam: str, rank: int) -> list[int]:
        (g,) = [g for g in ref[fam] if rank in g]
        return g

    for rank in ranks:
        fake_world(rank)
        ps.initialize_model_parallel(**kw)
        try:
            st = ps._st()
            pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
            edge = pp_rank in (0, pp - 1)
            assert ps.is_rank_in_embedding_group() == edge
            if edge:
                assert R(ps.get_embedding_group()) == mine("embd", rank)
            else:
                assert ps.get_embedding_group(check_initialized=False) is None
            assert ps.is_rank_in_position_embedding_group() == (pp_rank == 0)
            if pp_rank == 0:
                assert R(ps.get_position_embedding_group()) == mine("pos_embd", rank)
            if ps.get_virtual_pipeline_model_parallel_world_size():
                vpp = ps.get_virtual_pipeline_model_parallel_world_size()
                for vp in range(vpp):  # the embedding lives on the first stage's first and the last stage's last vp
                    want = edge and ((pp_rank == 0 and vp == 0) or (pp_rank == pp - 1 and vp == vpp - 1))
                    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=vp) == want, (rank, vp)
            assert R(ps.get_amax_reduction_group()) == mine("tp_dp", rank)
            assert R(ps.get_amax_reduction_group(with_context_parallel=True)) == mine("tp_dp_cp", rank)
            assert R(ps.get_amax_reduction_group(tp_only_amax_red=True)) == mine("tp", rank)
            assert R(ps.get_amax_reduction_group(True, True)) == mine("tp_cp", rank)
            hcp = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
            if kw.get("hierarchical_context_parallel_sizes"):
                assert [R(g) for g in hcp] == [mine(f"hcp{k}", rank) for k in range(len(hcp))]
            else:
                assert hcp is None
            assert R(ps.get_intra_distributed_optimizer_instance_group()) == sorted(mine("intra_dist_opt", rank))
            part = dict(with_context_parallel=True, partial_data_parallel=True)
            assert R(ps.get_data_parallel_group(**part)) == mine("intra_dp_cp", rank)
            assert ps.get_data_parallel_rank(**part) == mine("intra_dp_cp", rank).index(rank)
            assert R(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == mine("intra_expt_dp", rank)
            if kw.get("num_distributed_optimizer_instances", 1) > 1:
                assert R(ps.get_inter_distributed_optimizer_instance_group()) == mine("inter_dist_opt", rank)
            else:
                assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
            assert R(ps.get_gtp_weight_remat_group()) == [rank] and ps.get_gtp_weight_remat_world_size() == 1
            assert R(ps.get_expert_gtp_weight_remat_group()) == [rank] and ps.get_expert_gtp_weight_remat_rank() == 0
            # ProcessGroupCollection: Megatron's field names, the getters' groups.
            pgs = st.pg_collection(megatron=False)
            assert pgs.tp is ps.get_tensor_model_parallel_group() and pgs.intra_dist_opt is \
                ps.get_intra_distributed_optimizer_instance_group()
            assert pgs.embd is ps.get_embedding_group(check_initialized=False)
            assert pgs.hcp == hcp and pgs.dp_cp_ag is None
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def test_nccl_options_objects():
    """Each checked entry becomes a ProcessGroupNCCL.Options (as Megatron's get_nccl_options); a torch without NCCL
    (this CPU build) gets a clear error instead, and the parsed spec is what test_bad_options_are_one_line_errors
    checks."""
    from megashard.config.nccl import nccl_options

    opts = {"cga_cluster_size": 2, "max_ctas": 16, "min_ctas": 1, "net_name": "IB", "is_high_priority_stream": True}
    if getattr(dist, "ProcessGroupNCCL", None) is None:
        with pytest.raises(ConfigError, match=r"need a torch build with NCCL"):
            nccl_options(opts)
        pytest.skip("this torch build has no NCCL: ProcessGroupNCCL.Options cannot be built here")
    o = nccl_options(opts)
    assert o.is_high_priority_stream
    assert (o.config.cga_cluster_size, o.config.max_ctas, o.config.min_ctas) == (2, 16, 1)
    assert o.config.net_name == "IB"
    assert not nccl_options({}).is_high_priority_stream
