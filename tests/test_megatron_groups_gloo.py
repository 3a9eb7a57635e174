"""Megatron-LM 0.19's groups on real gloo process groups (4 and 8 processes, one spawn each): embedding groups with
pp = 1, 2, 4 and virtual stages, amax with and without cp and tp-only, hierarchical cp [2, 2], two distributed
optimizer instances (dense and expert), the expert replica axis with HSDP, and ``ProcessGroupCollection`` —
every group's members equal the re-statement of Megatron's code (tests/_megatron_ref.py), and a collective on
each group adds up exactly its members. With megatron-core installed, a Megatron module built with
``pg_collection=`` from megashard computes on megashard's groups.
"""
from __future__ import annotations

import pytest

from tests._dist import spawn_checks


def _ref(world, **kw):
    from tests._megatron_ref import megatron_groups

    return megatron_groups(world, **kw)


def _mine(ref, fam, rank):
    (g,) = [g for g in ref[fam] if rank in g]
    return g


def _sum_check(pg, members, rank, what):
    """A collective on ``pg`` sums (rank + 1) over exactly ``members``."""
    import torch
    import torch.distributed as dist

    assert dist.get_process_group_ranks(pg) == sorted(members), (what, dist.get_process_group_ranks(pg), members)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=pg)
    assert t.item() == sum(r + 1 for r in members), what


def _init(**kw):
    import megashard.parallel_state as ps

    ps.initialize_model_parallel(distributed_timeout_minutes=1, **kw)
    return ps


def check_embedding_groups(rank, world_size):
    """pp = 1, 2, 4 (and pp=2 with virtual stages, and a custom get_embedding_ranks)."""
    for pp in (1, 2, 4):
        for vpp in ((None, 2) if pp == 2 else (None,)):
            kw = dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
            ps = _init(**kw)
            try:
                ref = _ref(world_size, pp=pp)
                stage = ps.get_pipeline_model_parallel_rank()
                edge = stage in (0, pp - 1)
                assert ps.is_rank_in_embedding_group() == edge and ps.is_rank_in_position_embedding_group() == (stage == 0)
                if edge:
                    _sum_check(ps.get_embedding_group(), _mine(ref, "embd", rank), rank, ("embd", pp))
                else:
                    assert ps.get_embedding_group(check_initialized=False) is None
                    with pytest.raises(Exception, match=r"is not in the 'embd' group"):
                        ps.get_embedding_group()
                if stage == 0:
                    _sum_check(ps.get_position_embedding_group(), _mine(ref, "pos_embd", rank), rank, ("pos", pp))
                st = ps._st()
                assert st.ranks("embd") == _ref_embd_of_pipeline(ref, ps.get_pipeline_model_parallel_first_rank())
                assert st.size("embd") == (1 if pp == 1 else 2)
                if vpp:
                    for vp in range(vpp):
                        want = (stage == 0 and vp == 0) or (stage == pp - 1 and vp == vpp - 1)
                        assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=vp) == want, (vp, stage)
            finally:
                ps.destroy_model_parallel()
    # A custom choice: every stage holds the embedding (Megatron's get_embedding_ranks callable).
    ps = _init(pipeline_model_parallel_size=2, get_embedding_ranks=lambda r: list(r))
    try:
        _sum_check(ps.get_embedding_group(), ps._st().ranks("pp"), rank, "embd=all")
        assert ps.get_embedding_group() is ps.get_pipeline_model_parallel_group()  # one rank set, one communicator
    finally:
        ps.destroy_model_parallel()


def _ref_embd_of_pipeline(ref, first):
    (g,) = [g for g in ref["embd"] if g[0] == first]
    return g


def check_amax_and_hierarchical_cp(rank, world_size):
    cases = [dict(tensor_model_parallel_size=2), dict(tensor_model_parallel_size=2, context_parallel_size=2)]
    if world_size == 8:
        cases.append(dict(tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]))
    else:
        cases.append(dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]))
    for kw in cases:
        ps = _init(**kw)
        try:
            ref = _ref(world_size, tp=kw.get("tensor_model_parallel_size", 1), cp=kw.get("context_parallel_size", 1),
                       hcp=kw.get("hierarchical_context_parallel_sizes"))
            for (with_cp, tp_only), fam in {(False, False): "tp_dp", (True, False): "tp_dp_cp",
                                            (False, True): "tp", (True, True): "tp_cp"}.items():
                pg = ps.get_amax_reduction_group(with_context_parallel=with_cp, tp_only_amax_red=tp_only)
                _sum_check(pg, _mine(ref, fam, rank), rank, ("amax", with_cp, tp_only, kw))
            hcp = kw.get("hierarchical_context_parallel_sizes")
            if hcp:
                groups = ps.get_hierarchical_context_parallel_groups()
                assert len(groups) == 2
                for k, pg in enumerate(groups):
                    _sum_check(pg, _mine(ref, f"hcp{k}", rank), rank, ("hcp", k))
                assert ps._st().pg_collection(megatron=False).hcp == groups
            else:
                assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
        finally:
            ps.destroy_model_parallel()


def check_two_optimizer_instances(rank, world_size):
    """num_distributed_optimizer_instances=2, dense and expert; and the intra-instance group with one instance."""
    import torch.distributed as dist

    # One instance (the example on 8 ranks: tp=2, pp=2 -> the whole world, not the dp·cp group).
    ps = _init(tensor_model_parallel_size=2, pipeline_model_parallel_size=2 if world_size == 8 else 1)
    try:
        _sum_check(ps.get_intra_distributed_optimizer_instance_group(), list(range(world_size)), rank, "intra 1")
        assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    finally:
        ps.destroy_model_parallel()
    kw = dict(tensor_model_parallel_size=2 if world_size == 8 else 1, num_distributed_optimizer_instances=2,
              expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    ps = _init(**kw)
    try:
        ref = _ref(world_size, tp=kw["tensor_model_parallel_size"], ep=2, etp=1, n_inst=2)
        part = dict(with_context_parallel=True, partial_data_parallel=True)
        _sum_check(ps.get_data_parallel_group(**part), _mine(ref, "intra_dp_cp", rank), rank, "intra_dp_cp")
        assert ps.get_data_parallel_world_size(**part) == ps.get_data_parallel_world_size() // 2
        _sum_check(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
                   _mine(ref, "intra_expt_dp", rank), rank, "intra_expt_dp")
        _sum_check(ps.get_inter_distributed_optimizer_instance_group(), _mine(ref, "inter_dist_opt", rank), rank, "inter")
        _sum_check(ps.get_intra_distributed_optimizer_instance_group(), sorted(_mine(ref, "intra_dist_opt", rank)),
                   rank, "intra_dist_opt")
        # The inter-instance group is the dense replica group too (Megatron: "attention and MLP share it").
        assert dist.get_process_group_ranks(ps.get_inter_distributed_optimizer_instance_group()) == ps._st().ranks("dp_outer")
        # ProcessGroupCollection: Megatron's field names, the getters' groups.
        pgs = ps._st().pg_collection(megatron=False)
        assert pgs.intra_dp_cp is ps.get_data_parallel_group(**part)
        assert pgs.intra_expt_dp is ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
        assert pgs.inter_dist_opt is ps.get_inter_distributed_optimizer_instance_group()
        assert pgs.intra_dist_opt is ps.get_intra_distributed_optimizer_instance_group()
        for field, getter in {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
                              "mp": ps.get_model_parallel_group, "cp": ps.get_context_parallel_group,
                              "tp_cp": ps.get_tensor_and_context_parallel_group, "ep": ps.get_expert_model_parallel_group,
                              "expt_tp": ps.get_expert_tensor_parallel_group,
                              "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
                              "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
                              "dp": ps.get_data_parallel_group, "expt_dp": ps.get_expert_data_parallel_group,
                              "embd": ps.get_embedding_group, "pos_embd": ps.get_position_embedding_group}.items():
            assert getattr(pgs, field) is getter(), field
        assert pgs.dp_cp is ps.get_data_parallel_group(with_context_parallel=True)
        assert pgs.tp_dp_cp is ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        assert pgs.dp_cp_ag is None and pgs.expt_dp_ag is None
    finally:
        ps.destroy_model_parallel()


def check_expert_replica_axis(rank, world_size):
    """HSDP with experts: dp_outer=2, dp_shard=4, ep=2 on 8 ranks — experts shard inside a replica."""
    import torch
    import torch.distributed as dist

    import megashard

    outer, shard = 2, world_size // 2
    st = megashard.initialize(megashard.ParallelConfig(dp_outer=outer, dp_shard=shard, ep=2, timeout=60))
    try:
        R = dist.get_process_group_ranks
        replica = st.ranks("dp_shard")  # this rank's replica: dense FSDP group
        assert st.ranks("expt_dp_shard") == [r for r in replica if r % 2 == rank % 2]  # inside the replica
        if world_size == 8 and rank == 0:
            assert st.ranks("expt_dp_shard") == [0, 2] and st.ranks("expt_dp_outer") == [0, 4]
        _sum_check(st.group("expt_dp_shard"), st.ranks("expt_dp_shard"), rank, "expt_dp_shard")
        _sum_check(st.group("expt_dp_outer"), st.ranks("expt_dp_outer"), rank, "expt_dp_outer")
        idx = st.fsdp_index(hsdp_outer_dp_shard=True)
        assert R(idx.get_fsdp_group(is_expert_parallel=True)) == st.ranks("expt_dp_shard")
        assert R(idx.get_outer_fsdp_group(is_expert_parallel=True)) == st.ranks("expt_dp_outer")
        assert R(idx.get_dp_group(is_expert_parallel=True)) == st.ranks("expt_dp")
        assert idx.hybrid_fsdp_expt_group is st.group("expt_dp")
        # Megatron-FSDP's rule: reorder the flat expert dp ranks (outer, inner) -> (inner, outer), find our dp rank.
        dp = idx.get_dp_group(True)
        o, i = idx.get_outer_fsdp_group(True).size(), idx.get_fsdp_group(True).size()
        order = torch.arange(dp.size()).reshape(o, i).t().reshape(-1).tolist()
        assert idx.get_logical_hybrid_fsdp_rank(True) == order.index(dp.rank())
        assert idx.get_logical_hybrid_fsdp_rank(False) == torch.arange(st.size("hsdp")).reshape(
            outer, shard).t().reshape(-1).tolist().index(st.rank_in("hsdp"))
        assert idx.get_fsdp_group(independent_all_gather=True) is None  # no all-gather twin given
        # The expert mesh with its replica axis, and the one fully_shard takes.
        m = st.expert_hsdp_mesh
        assert m.mesh_dim_names == ("pp", "expt_dp_outer", "expt_dp_shard", "ep", "expt_tp")
        assert tuple(m.mesh.shape) == (1, outer, shard // 2, 2, 1)
        fm = st.expert_fully_shard_mesh
        assert fm.mesh_dim_names == ("expt_dp_outer", "expt_dp_shard")
        assert fm["expt_dp_shard"].mesh.tolist() == st.ranks("expt_dp_shard")
        assert fm.get_group(1).group_name == st.group("expt_dp_shard").group_name
    finally:
        megashard.destroy()


def check_megatron_module_on_megashard_groups(rank, world_size):
    """megatron-core's GPTModel built with ``pg_collection=`` from megashard; its tensor-parallel MLP computes the
    full MLP through megashard's tp group."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import megashard

    if _megatron_core_importable():
        return  # the test reports the skip with the reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig
    st = megashard.initialize(megashard.ParallelConfig(tp=2, timeout=60))
    try:
        pgs = st.pg_collection()
        assert isinstance(pgs, ProcessGroupCollection) and pgs.tp is st.group("tp") and pgs.dp is st.group("dp")
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                                tensor_model_parallel_size=2, params_dtype=torch.float32, add_bias_linear=False)
        torch.manual_seed(rank)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                         max_sequence_length=8, pg_collection=pgs)
        mlp = model.decoder.layers[0].mlp
        assert mlp.linear_fc1.tp_group is st.group("tp")
        w1, w2 = mlp.linear_fc1.weight.detach(), mlp.linear_fc2.weight.detach()
        assert tuple(w1.shape) == (32, 16) and tuple(w2.shape) == (16, 32)  # ffn 64 split over tp=2
        x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(7))
        out, _ = mlp(x)
        g1 = [torch.empty_like(w1) for _ in range(2)]
        g2 = [torch.empty_like(w2) for _ in range(2)]
        dist.all_gather(g1, w1.contiguous(), group=st.group("tp"))
        dist.all_gather(g2, w2.contiguous(), group=st.group("tp"))
        want = F.gelu(x @ torch.cat(g1, 0).t()) @ torch.cat(g2, 1).t()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finally:
        megashard.destroy()


def _megatron_core_importable() -> str | None:
    """None when megatron-core's modules this test uses import; else the reason to skip (one line)."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in ("megatron.core.models.gpt.gpt_model", "megatron.core.process_groups_config"):
                importlib.import_module(mod)
    except ModuleNotFoundError as e:
        return f"megatron-core is not installed (pip install -e '.[megatron-test]'): {e}"
    except Exception as e:  # noqa: BLE001 - an installed but broken megatron-core: say why, do not pass silently
        return f"megatron-core does not import here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


@pytest.fixture(scope="module")
def world4():
    return spawn_checks([check_embedding_groups, check_amax_and_hierarchical_cp, check_two_optimizer_instances,
                         check_expert_replica_axis, check_megatron_module_on_megashard_groups], world_size=4,
                        timeout=300)


@pytest.fixture(scope="module")
def world8():
    return spawn_checks([check_embedding_groups, check_amax_and_hierarchical_cp, check_two_optimizer_instances,
                         check_expert_replica_axis], world_size=8, timeout=400)


@pytest.mark.parametrize("check", ["check_embedding_groups", "check_amax_and_hierarchical_cp",
                                   "check_two_optimizer_instances", "check_expert_replica_axis"])
def test_world4(world4, check):
    world4.assert_ok(check)


@pytest.mark.parametrize("check", ["check_embedding_groups", "check_amax_and_hierarchical_cp",
                                   "check_two_optimizer_instances", "check_expert_replica_axis"])
def test_world8(world8, check):
    world8.assert_ok(check)


def test_megatron_module_with_megashard_pg_collection(world4):
    reason = _megatron_core_importable()
    if reason:
        pytest.skip(reason)
    world4.assert_ok("check_megatron_module_on_megashard_groups")
