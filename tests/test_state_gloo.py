"""Every group, rank and mesh of ParallelState and the Megatron facade on real gloo process groups.

Each check runs several layouts in sequence on the same spawned world, destroying and re-initialising
megashard between them, and compares every rank's groups with RankLayout (itself checked against
Megatron-LM's facts in test_layout.py) and with the members a real all_reduce sees.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn_checks

CONFIGS_4 = [
    dict(tp=2), dict(cp=2), dict(pp=2), dict(tp=2, pp=2), dict(dp_outer=2), dict(ep=2), dict(ep=2, expt_tp=2),
    dict(tp=2, order="tp-pp-dp"), dict(cp=2, dp_outer=2), dict(ep=4), dict(pp=2, vpp=2, ep=2),
]
CONFIGS_8 = [
    dict(tp=2, cp=2), dict(tp=2, pp=2), dict(tp=2, dp_outer=2), dict(cp=2, pp=2, ep=2), dict(tp=2, ep=2, expt_tp=1),
    dict(pp=2, ep=2, expt_tp=2), dict(tp=2, cp=2, pp=2), dict(ep=8), dict(tp=4, expt_tp=2, ep=2),
]


def _check_state_against_layout(cfg_kwargs):
    import megashard.state as ms
    from megashard.config import ParallelConfig
    from megashard.layout import GROUP_NAMES, RankLayout

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ParallelConfig(**cfg_kwargs)
    layout = RankLayout(cfg, world)
    st = ms.initialize(cfg)
    try:
        for name in GROUP_NAMES:
            expected = layout.group_of(name, rank)
            pg = st.group(name)
            assert dist.get_process_group_ranks(pg) == expected, (cfg_kwargs, name)
            assert st.ranks(name) == expected
            assert pg.rank() == expected.index(rank) == st.rank_in(name), (cfg_kwargs, name)
            assert pg.size() == len(expected) == st.size(name)
            # The communicator really connects exactly these ranks.
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=pg)
            assert t.item() == float(sum(expected)), (cfg_kwargs, name, t.item(), expected)
            m = st.mesh(name)
            assert m.mesh.flatten().tolist() == expected, (cfg_kwargs, name, m.mesh.tolist())
            assert m.get_local_rank() == expected.index(rank)
        # Root meshes: every axis present, the slices agree with the layout.
        dense = st.dense_mesh
        assert dense.mesh_dim_names == ("pp", "dp_outer", "dp_shard", "cp", "tp")
        assert dense.mesh.tolist() == layout.mesh_ranks()
        assert st.expert_mesh.mesh.tolist() == layout.mesh_ranks(expert=True)
        for axis in dense.mesh_dim_names:
            assert dense[axis].mesh.tolist() == layout.group_of(axis, rank), (cfg_kwargs, axis)
        fsdp = st.fsdp_mesh
        for axis in fsdp.mesh_dim_names:
            assert fsdp[axis].mesh.tolist() == layout.group_of(axis, rank), (cfg_kwargs, axis)
        fs = st.fully_shard_mesh
        if layout.sizes.dp_outer > 1:
            assert fs.mesh_dim_names == ("dp_outer", "dp_shard_cp")
            assert sorted(fs.mesh.flatten().tolist()) == sorted(layout.group_of("hsdp", rank))
        else:
            assert fs.mesh.tolist() == layout.group_of("dp_shard_cp", rank)
    finally:
        ms.destroy()
    assert not ms.is_initialized()


def _run(configs):
    for c in configs:
        _check_state_against_layout(c)


def check_state_world4(rank, world_size):
    _run(CONFIGS_4)


def check_state_world8(rank, world_size):
    _run(CONFIGS_8)


def _check_facade(tp, pp, cp, ep, etp, order="tp-cp-ep-dp-pp", instances=1):
    from megashard import parallel_state as ps
    from megashard.config import ParallelConfig
    from megashard.layout import RankLayout

    rank, world = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order,
        num_distributed_optimizer_instances=instances,
    )
    try:
        assert ps.model_parallel_is_initialized()
        # Megatron defaults expert TP to TP when None.
        lay = RankLayout(ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, expt_tp=tp if etp is None else etp,
                                        order=order, dp_outer=instances), world)
        R = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
        cases = {
            "tp": (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            "pp": (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
            "dp": (ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
            "dp_cp": (ps.get_data_parallel_group(with_context_parallel=True), ps.get_data_parallel_rank(with_context_parallel=True),
                      ps.get_data_parallel_world_size(with_context_parallel=True)),
            "dp_shard_cp": (ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
                            ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True),
                            ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)),
            "cp": (ps.get_context_parallel_group(), ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
            "mp": (ps.get_model_parallel_group(), ps.get_model_parallel_rank(), ps.get_model_parallel_world_size()),
            "tp_dp": (ps.get_tensor_and_data_parallel_group(), ps.get_tensor_and_data_parallel_rank(),
                      ps.get_tensor_and_data_parallel_world_size()),
            "tp_dp_cp": (ps.get_tensor_and_data_parallel_group(with_context_parallel=True), ps.get_tensor_and_data_parallel_rank(True),
                         ps.get_tensor_and_data_parallel_world_size(True)),
            "tp_cp": (ps.get_tensor_and_context_parallel_group(), ps.get_tensor_and_context_parallel_rank(),
                      ps.get_tensor_and_context_parallel_world_size()),
            "ep": (ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
            "expt_tp": (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(),
                        ps.get_expert_tensor_parallel_world_size()),
            "expt_dp": (ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_rank(),
                        ps.get_expert_data_parallel_world_size()),
            "tp_ep": (ps.get_expert_tensor_and_model_parallel_group(), ps.get_expert_tensor_and_model_parallel_rank(),
                      ps.get_expert_tensor_and_model_parallel_world_size()),
            "tp_ep_pp": (ps.get_expert_tensor_model_pipeline_parallel_group(),
                         ps.get_expert_tensor_model_pipeline_parallel_rank(),
                         ps.get_expert_tensor_model_pipeline_parallel_world_size()),
        }
        for name, (g, r, ws) in cases.items():
            exp = lay.group_of(name, rank)
            assert R(g) == exp, (name, R(g), exp)
            assert r == exp.index(rank), (name, r)
            assert ws == len(exp), (name, ws)
        pp_ranks = lay.group_of("pp", rank)
        i = pp_ranks.index(rank)
        assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[-1]
        assert ps.get_pipeline_model_parallel_next_rank() == pp_ranks[(i + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == pp_ranks[(i - 1) % pp]
        assert ps.is_pipeline_first_stage() == (i == 0)
        assert ps.is_pipeline_last_stage() == (i == pp - 1)
        assert ps.get_tensor_model_parallel_src_rank() == lay.group_of("tp", rank)[0]
        assert ps.get_data_parallel_src_rank() == lay.group_of("dp", rank)[0]
        assert ps.get_data_parallel_src_rank(with_context_parallel=True) == lay.group_of("dp_cp", rank)[0]
        assert ps.get_context_parallel_global_ranks() == lay.group_of("cp", rank)
        g = ps.get_data_parallel_group_gloo()
        assert R(g) == lay.group_of("dp", rank)
        assert g is ps.get_data_parallel_group()  # on a gloo job the twin is the group itself
    finally:
        ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


def check_facade_world4(rank, world_size):
    for args in [(2, 1, 1, 1, None), (1, 2, 1, 2, 1), (1, 1, 2, 1, None), (2, 2, 1, 1, None, "tp-pp-dp"),
                 (1, 1, 1, 4, 1), (1, 1, 1, 1, None, "tp-cp-ep-dp-pp", 2)]:
        _check_facade(*args)


def check_facade_world8(rank, world_size):
    for args in [(2, 2, 1, 2, None), (2, 1, 2, 2, 1), (1, 2, 2, 1, None), (2, 2, 2, 1, None), (1, 1, 1, 8, 1),
                 (2, 1, 1, 2, 2, "tp-cp-ep-dp-pp", 2)]:
        _check_facade(*args)


def check_uninitialised_errors(rank, world_size):
    import megashard.state as ms
    from megashard import StateError
    from megashard import parallel_state as ps

    for fn in (ps.get_tensor_model_parallel_group, ps.get_data_parallel_rank, ms.get_parallel_state):
        try:
            fn()
        except StateError as e:
            assert "not initialised" in str(e)
        else:
            raise AssertionError(f"{fn.__name__} did not raise before initialisation")
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    st = ms.initialize(tp=2)
    try:
        ms.initialize(tp=2)
    except StateError as e:
        assert "already initialised" in str(e)
    else:
        raise AssertionError("second initialize did not raise")
    finally:
        ms.destroy()
    try:
        st.group("tp")
    except StateError as e:
        assert "destroyed" in str(e)
    else:
        raise AssertionError("destroyed state still hands out groups")
    ms.destroy()  # idempotent


def check_fsdp_index(rank, world_size):
    import megashard.state as ms
    from megashard.layout import RankLayout

    for kw in (dict(tp=2), dict(tp=2, dp_outer=2)):
        st = ms.initialize(**kw)
        lay = st.layout
        try:
            idx = st.fsdp_index(hsdp_outer_dp_shard=True)
            R = dist.get_process_group_ranks
            assert R(idx.get_fsdp_group()) == lay.group_of("dp_shard_cp", rank)
            if st.sizes.dp_outer > 1:
                assert idx.use_hybrid_fsdp
                assert R(idx.get_dp_group()) == lay.group_of("hsdp", rank)
                assert R(idx.get_outer_fsdp_group()) == lay.group_of("dp_outer", rank)
                inner, outer = st.rank_in("dp_shard_cp"), st.rank_in("dp_outer")
                assert idx.get_logical_hybrid_fsdp_rank() == inner * st.size("dp_outer") + outer
                assert idx.get_submesh(("dp_outer", "dp_shard_cp")).mesh_dim_names == ("dp_outer", "dp_shard_cp")
            else:
                assert not idx.use_hybrid_fsdp
                assert R(idx.get_dp_group()) == lay.group_of("dp_shard_cp", rank)
                assert idx.get_outer_fsdp_group() is None
            assert idx.get_submesh("tp").mesh.tolist() == lay.group_of("tp", rank)
            # Experts shard inside a replica (expt_dp_shard) and replicate across replicas (expt_dp_outer).
            assert R(idx.get_fsdp_group(is_expert_parallel=True)) == lay.group_of("expt_dp_shard", rank)
            assert R(idx.get_dp_group(is_expert_parallel=True)) == lay.group_of(
                "expt_dp" if st.sizes.dp_outer > 1 else "expt_dp_shard", rank)
            if st.sizes.dp_outer > 1:
                assert R(idx.get_outer_fsdp_group(is_expert_parallel=True)) == lay.group_of("expt_dp_outer", rank)
                assert idx.get_logical_hybrid_fsdp_rank(True) == (st.rank_in("expt_dp_shard") * st.size("expt_dp_outer")
                                                                  + st.rank_in("expt_dp_outer"))
            assert idx.get_submesh("tp", is_expert_parallel=True).mesh.tolist() == lay.group_of("expt_tp", rank)
            assert idx.get_root_mesh() is st.fsdp_mesh
        finally:
            ms.destroy()


def check_two_states_own_their_per_layout_state(rank, world_size):
    """Each ParallelState owns its RNG tracker, memory buffer and virtual-pipeline rank; the module functions use
    the current state's, and a tracker set up before initialize() moves into the state initialize() makes."""
    import megashard.parallel_state as ps
    import megashard.state as ms
    from megashard.config import ParallelConfig
    from megashard.errors import ConfigError
    from megashard.layout import RankLayout
    from megashard.state.memory import get_global_memory_buffer
    from megashard.state.rng import get_cuda_rng_tracker, model_parallel_manual_seed

    def draw(seed_stream: str) -> torch.Tensor:
        with get_cuda_rng_tracker().fork(seed_stream):
            return torch.rand(4)

    def fresh(seed: int) -> torch.Tensor:
        return torch.rand(4, generator=torch.Generator().manual_seed(seed))

    early = get_cuda_rng_tracker()  # before initialize(): the process's detached tracker
    a = ms.initialize(ParallelConfig(tp=2))
    try:
        assert get_cuda_rng_tracker() is early is a.locals.rng_tracker
        model_parallel_manual_seed(100)
        buf_a = get_global_memory_buffer()
        assert buf_a is a.locals.memory_buffer
        ps.set_virtual_pipeline_model_parallel_rank(1)
        cfg_b = ParallelConfig(pp=2)
        with pytest.raises(ConfigError, match="the layout was resolved for 8 ranks, but the default process group has 4"):
            ms.ParallelState(cfg_b, RankLayout(cfg_b.resolve(8)))
        b = ms.ParallelState(cfg_b, RankLayout(cfg_b.resolve(world_size)))  # a second state next to the current one
        assert b.layout.group_of("pp", rank) == [rank % 2, rank % 2 + 2]
        prev = ms.set_parallel_state(b)
        assert prev is a
        assert get_cuda_rng_tracker() is not early and not get_cuda_rng_tracker().is_initialized()
        assert get_global_memory_buffer() is not buf_a and ps.get_virtual_pipeline_model_parallel_rank() is None
        model_parallel_manual_seed(200)  # b's tracker, b's tp rank (tp=1: 0)
        assert torch.equal(draw("model-parallel-rng"), fresh(200 + 2718))
        ms.set_parallel_state(a)
        # a's streams were untouched by b's seeding: its model-parallel stream starts at seed + 2718 + tp_rank.
        assert torch.equal(draw("model-parallel-rng"), fresh(100 + 2718 + rank % 2))
        assert get_global_memory_buffer() is buf_a and ps.get_virtual_pipeline_model_parallel_rank() == 1
        b.destroy()
        assert b.locals.rng_tracker is None and a.locals.rng_tracker is early  # one state's teardown only
    finally:
        ms.destroy()
    assert a.locals.rng_tracker is None and ps.get_virtual_pipeline_model_parallel_rank() is None
    assert get_cuda_rng_tracker() is not early and not get_cuda_rng_tracker().is_initialized()


@pytest.fixture(scope="module")
def world4():
    return spawn_checks([check_uninitialised_errors, check_state_world4, check_facade_world4, check_fsdp_index,
                         check_two_states_own_their_per_layout_state], world_size=4)


@pytest.fixture(scope="module")
def world8():
    return spawn_checks([check_state_world8, check_facade_world8], world_size=8, timeout=400)


def test_uninitialised_and_double_init_errors(world4):
    world4.assert_ok("check_uninitialised_errors")


def test_state_groups_meshes_world4(world4):
    world4.assert_ok("check_state_world4")


def test_megatron_facade_world4(world4):
    world4.assert_ok("check_facade_world4")


def test_two_states_own_their_per_layout_state(world4):
    world4.assert_ok("check_two_states_own_their_per_layout_state")


def test_fsdp_index_world4(world4):
    world4.assert_ok("check_fsdp_index")


def test_state_groups_meshes_world8(world8):
    world8.assert_ok("check_state_world8")


def test_megatron_facade_world8(world8):
    world8.assert_ok("check_facade_world8")
