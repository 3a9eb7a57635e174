"""Megatron-LM 0.19's last five ``initialize_model_parallel`` options, against the plain re-statement of its code
(tests/_megatron_ref.py): ``hybrid_context_parallel``, ``rank_offset`` (with ``local_world_size``), ``use_sharp`` /
``sharp_enabled_group`` and ``pipeline_model_parallel_comm_backend``.

Layout arithmetic at many world sizes without processes; the facade on ``fake`` worlds (every group of chosen ranks,
SHARP's environment sequence); real gloo groups on 4 and 8 spawned ranks (collectives add up exactly the members;
the pp groups on a registered backend and only they; SHARP on gloo refused naming the backend). Megatron's own
``parallel_state`` against megashard for these options: tests/_megatron_parity.py's configs.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch.distributed as dist

from megashard.config import ParallelConfig
from megashard.errors import ConfigError
from megashard.layout import RankLayout
from tests._dist import spawn_checks
from tests._megatron_ref import create_group_calls, megatron_groups

#: (world, tp, cp, pp, order) of the hybrid layouts checked: power-of-two and other dp·cp sizes (10, 12, 24 …), cp
#: that splits into non-blocks (3), orders with gaps between cp and dp
HYBRID_CASES = [
    (w, tp, cp, pp, order)
    for w in (4, 8, 12, 20, 24, 48)
    for tp, cp, pp in itertools.product((1, 2), (1, 2, 3, 4), (1, 2))
    for order in ("tp-cp-ep-dp-pp", "cp-tp-dp-pp", "tp-dp-cp-pp")
    if w % (tp * cp * pp) == 0 and (w // (tp * pp)) % 2 == 0
]


def _layout(world, **kw):
    return RankLayout(ParallelConfig(**kw).resolve(world))


# ---------------------------------------------------------------------- hybrid dp·cp groups: the layout
@pytest.mark.parametrize("world,tp,cp,pp,order", HYBRID_CASES)
def test_hybrid_groups_equal_megatron(world, tp, cp, pp, order):
    """Every hybrid dp·cp group (members, their order, group order) equals Megatron's, and every rank's lookups agree
    with the list."""
    lay = _layout(world, tp=tp, cp=cp, pp=pp, order=order, hybrid_context_parallel=True)
    ref = megatron_groups(world, tp=tp, cp=cp, pp=pp, order=order, hybrid=True)
    want = {f: g for f, g in ref.items() if f.startswith("hybrid_dp_cp_")}
    assert set(lay.hybrid_names) == set(want)
    for name in lay.hybrid_names:
        groups = lay.groups(name)
        assert groups == want[name], name
        for rank in range(world):
            i = lay.group_index(name, rank)
            assert list(lay.members(name, rank)) == lay.group_of(name, rank) == groups[i], (name, rank)
            assert groups[i][lay.rank_in(name, rank)] == rank


def test_hybrid_slices_stay_arithmetic():
    """A slice that is a block of the grid is a GroupMembers (O(dims), no list) even at 2^24 ranks; one that is not
    (cp=3 cut in twos) is listed, as Megatron's."""
    from megashard.layout import GroupMembers

    big = _layout(1 << 24, tp=8, cp=2, hybrid_context_parallel=True)
    m = big.members("hybrid_dp_cp_1048576", 123457)
    assert isinstance(m, GroupMembers) and len(m) == 1 << 20 and 123457 in m
    assert m == big.group_of("dp_cp", 123457)[(big.rank_in("dp_cp", 123457) // (1 << 20)) * (1 << 20):][:1 << 20]
    odd = _layout(12, tp=2, cp=3, order="cp-tp-dp-pp", hybrid_context_parallel=True)
    assert odd.group_of("dp_cp", 0) == [0, 1, 2, 6, 7, 8]
    assert odd.groups("hybrid_dp_cp_2")[:3] == [[0, 1], [2, 6], [7, 8]]
    assert odd.members("hybrid_dp_cp_2", 6) == [2, 6]


def test_hybrid_sizes_and_errors():
    from megashard.layout.hybrid import hybrid_group_sizes

    assert [hybrid_group_sizes(n) for n in (2, 4, 6, 8, 10, 16, 24)] == [[], [2], [2], [2, 4], [2, 4], [2, 4, 8],
                                                                         [2, 4, 8]]
    assert _layout(8, tp=4, hybrid_context_parallel=True).hybrid_names == {}  # dp·cp = 2: no slices, as Megatron
    assert "hybrid_dp_cp_2" in _layout(8, hybrid_context_parallel=True).names()
    assert "hybrid_dp_cp_2" not in _layout(8).names()
    with pytest.raises(ConfigError, match=r"Hybrid context parallel requires an even number of ranks.*dp·cp = 3·1 = 3"):
        ParallelConfig(hybrid_context_parallel=True).resolve(3)
    with pytest.raises(ConfigError, match=r"hybrid_context_parallel='yes' must be true or false"):
        ParallelConfig(hybrid_context_parallel="yes")
    with pytest.raises(ConfigError, match=r"group 'hybrid_dp_cp_2' is not an axis combination"):
        _layout(8, hybrid_context_parallel=True).group_dims("hybrid_dp_cp_2")
    # a record of the sizes says so only when on (older readers of saved sizes see what they knew)
    assert "hybrid_cp" not in ParallelConfig().resolve(8).as_dict()
    assert ParallelConfig(hybrid_context_parallel=True).resolve(8).as_dict()["hybrid_cp"] is True


def test_hybrid_groups_in_plan():
    """``megashard plan`` lists the hybrid groups of the rank when they are configured."""
    from megashard.layout.plan import build_plan, format_table

    lay = _layout(16, cp=2, hybrid_context_parallel=True)
    plan = build_plan(lay, rank=5, ranks_per_node=8)
    g = plan["rank_groups"]["hybrid_dp_cp_4"]
    assert list(g["ranks"]) == [4, 5, 6, 7] and g["rank_in_group"] == 1 and g["num_groups"] == 4
    assert list(plan["rank_groups"]["hybrid_dp_cp_8"]["ranks"]) == list(range(8))
    assert plan["sizes"]["hybrid_cp"] is True
    text = format_table(plan)
    assert "hybrid_dp_cp_2" in text and "hybrid_cp" in text
    assert "hybrid_dp_cp_2" not in format_table(build_plan(_layout(16, cp=2), rank=5))


def test_plan_cli_shows_hybrid_groups(tmp_path, capsys):
    from megashard.cli import main

    cfg = tmp_path / "h.yaml"
    cfg.write_text("parallel:\n  cp: 2\n  hybrid_context_parallel: true\n")
    assert main(["plan", str(cfg), "--world-size", "16", "--rank", "5"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("hybrid_dp_cp_4"))
    assert line.split()[1:4] == ["4", "1", "1/4"] and line.rstrip().endswith("[4, 5, 6, 7]")
    assert main(["plan", str(cfg), "--world-size", "16", "--format", "json", "--groups", "hybrid_dp_cp_8"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["groups"]["hybrid_dp_cp_8"] == [list(range(8)), list(range(8, 16))]


# ---------------------------------------------------------------------- rank_offset: the layout shifted
@pytest.mark.parametrize("world,offset,kw", [
    (16, 4, dict(tp=2, pp=2)), (32, 8, dict(tp=2, cp=2, ep=2, etp=1)), (24, 12, dict(pp=3, hybrid=True)),
    (12, 1, dict(tp=2, order="tp-pp-dp", pp=2)),
])
def test_rank_offset_groups_are_megatron_shifted(world, offset, kw):
    """Megatron's groups with rank_offset are its groups without it, every rank plus the offset (the re-statement
    checks the claim); megashard's RankGenerator over the layout's grid gives them too."""
    shifted = megatron_groups(world, rank_offset=offset, **kw)
    plain = megatron_groups(world, **kw)
    assert shifted == {f: [[r + offset for r in g] for g in gs] for f, gs in plain.items()}
    lay = _layout(world, tp=kw.get("tp", 1), cp=kw.get("cp", 1), pp=kw.get("pp", 1), ep=kw.get("ep", 1),
                  expt_tp=kw.get("etp", kw.get("tp", 1)), order=kw.get("order", "tp-cp-ep-dp-pp"))
    gen = lay.rank_generator(rank_offset=offset)
    assert gen.get_ranks("pp") == shifted["pp"] and gen.get_ranks("dp-cp") == shifted["dp_cp"]


@pytest.fixture
def fake():
    from megashard._compat import fake_store

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = fake_store()
    yield lambda rank, world: dist.init_process_group("fake", store=store, rank=rank, world_size=world)
    import megashard.parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


FACADE_FAMILIES = {  # family of the re-statement -> megashard group name
    "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp_cp": "dp_cp", "mp": "mp", "tp_dp": "tp_dp",
    "tp_dp_cp": "tp_dp_cp", "tp_cp": "tp_cp", "ep": "ep", "expt_tp": "expt_tp", "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp", "expt_dp": "expt_dp", "embd": "embd", "pos_embd": "pos_embd",
}


@pytest.mark.parametrize("world,n,offset,kw", [
    (32, 16, 8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    (24, 16, 4, dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2,
                     expert_tensor_parallel_size=1, hybrid_context_parallel=True)),
    (12, 8, 0, dict(pipeline_model_parallel_size=4, get_embedding_ranks=lambda r: [r[1], r[-1]])),
    (16, 12, 4, dict(pipeline_model_parallel_size=3, get_embedding_ranks=lambda r: [r[0]] + [x for x in r if x >= 12])),
])
def test_rank_offset_through_the_facade(fake, world, n, offset, kw):
    """Ranks in the layout: every group equals the re-statement's (global ranks; Megatron's get_embedding_ranks sees
    and returns global ranks); ranks outside: nothing, as in Megatron."""
    import megashard.parallel_state as ps

    ref_kw = dict(tp=kw.get("tensor_model_parallel_size", 1), pp=kw.get("pipeline_model_parallel_size", 1),
                  cp=kw.get("context_parallel_size", 1), ep=kw.get("expert_model_parallel_size", 1),
                  etp=kw.get("expert_tensor_parallel_size"), hybrid=kw.get("hybrid_context_parallel", False),
                  embedding_ranks=kw.get("get_embedding_ranks"))
    ref = megatron_groups(n, rank_offset=offset, **ref_kw)
    for rank in sorted({0, offset, offset + n // 2 + 1, offset + n - 1, world - 1}):
        fake(rank, world)
        try:
            ps.initialize_model_parallel(rank_offset=offset, local_world_size=n, **kw)
            if not offset <= rank < offset + n:
                assert not ps.model_parallel_is_initialized(), rank
                continue
            st = ps._st()
            for fam, name in {**FACADE_FAMILIES, **{f: f for f in ref if f.startswith("hybrid")}}.items():
                mine = [g for g in ref[fam] if rank in g]
                if fam in ("embd", "pos_embd") and not mine:
                    assert not st.in_group(name), (rank, name)
                    continue
                assert [st.ranks(name)] == mine, (rank, name)
                assert dist.get_process_group_ranks(st.group(name)) == sorted(mine[0]), (rank, name)
            assert ps.get_pipeline_model_parallel_first_rank() == st.ranks("pp")[0] >= offset
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def test_rank_offset_bad_inputs(fake):
    import megashard.parallel_state as ps

    fake(0, 8)
    with pytest.raises(ConfigError, match=r"rank_offset=2 with a layout of 8 ranks \(local_world_size, default: the "
                                          r"world size\) means ranks 2..9, past the 8 ranks.*local_world_size <= 6"):
        ps.initialize_model_parallel(rank_offset=2)
    with pytest.raises(ConfigError, match=r"rank_offset=-1 must be an integer >= 0"):
        ps.initialize_model_parallel(rank_offset=-1)
    with pytest.raises(ConfigError, match=r"local_world_size=0 must be an integer >= 1"):
        ps.initialize_model_parallel(local_world_size=0)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp=4·cp=1·pp=1·dp_outer=1 = 4"):
        ps.initialize_model_parallel(tensor_model_parallel_size=4, rank_offset=2, local_world_size=6)
    assert not ps.model_parallel_is_initialized()


# ---------------------------------------------------------------------- hybrid through the facade (fake world)
def test_hybrid_getter_semantics(fake):
    """Megatron's get_hybrid_data_context_parallel_groups: the whole dp·cp group at its size (with or without hybrid
    cp), a slice at a hybrid size, KeyError for any other size."""
    import megashard.parallel_state as ps

    fake(5, 16)
    ps.initialize_model_parallel(context_parallel_size=2, hybrid_context_parallel=True)
    R = dist.get_process_group_ranks
    assert [R(ps.get_hybrid_data_context_parallel_groups(group_size=k)) for k in (2, 4, 8)] == [
        [4, 5], [4, 5, 6, 7], list(range(8))]
    assert ps.get_hybrid_data_context_parallel_groups(group_size=16) is ps.get_data_parallel_group(
        with_context_parallel=True)
    # one communicator per rank set: the size-2 slice is the cp group here (tp=1, cp=2)
    assert ps.get_hybrid_data_context_parallel_groups(group_size=2) is ps.get_context_parallel_group()
    pgs = ps._st().pg_collection(megatron=False)
    assert sorted(pgs.hybrid_dp_cp) == [2, 4, 8] and pgs.hybrid_dp_cp[4] is ps.get_hybrid_data_context_parallel_groups(
        group_size=4)
    with pytest.raises(KeyError, match=r"group_size=3\): no such hybrid dp·cp group; the whole dp·cp group has 16 "
                                       r"ranks, the hybrid sizes are: 2, 4, 8"):
        ps.get_hybrid_data_context_parallel_groups(group_size=3)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    assert ps.get_hybrid_data_context_parallel_groups(group_size=16) is ps.get_data_parallel_group(
        with_context_parallel=True)
    with pytest.raises(KeyError, match=r"hybrid sizes are: none: initialise with hybrid_context_parallel=True"):
        ps.get_hybrid_data_context_parallel_groups(group_size=2)
    assert ps._st().pg_collection(megatron=False).hybrid_dp_cp == {}
    ps.destroy_model_parallel()
    assert ps.get_hybrid_data_context_parallel_groups(check_initialized=False, group_size=2) is None


# ---------------------------------------------------------------------- SHARP
def test_sharp_rules_are_megatrons(fake):
    import megashard.parallel_state as ps

    fake(0, 8)
    with pytest.raises(ConfigError, match=r"sharp_enabled_group='dp' is only valid when use_sharp is True"):
        ps.initialize_model_parallel(sharp_enabled_group="dp")
    with pytest.raises(ConfigError, match=r"sharp_enabled_group='tp' is invalid .*valid: dp, dp_replica"):
        ps.initialize_model_parallel(use_sharp=True, sharp_enabled_group="tp")
    with pytest.raises(ConfigError, match=r"'dp_replica' requires num_distributed_optimizer_instances > 1 \(it is 1\)"):
        ps.initialize_model_parallel(use_sharp=True, sharp_enabled_group="dp_replica")
    with pytest.raises(ConfigError, match=r"sharp_group='dp' needs the nccl backend .* backend='gloo'"):
        ParallelConfig(sharp_group="dp", backend="gloo")
    with pytest.raises(ConfigError, match=r"sharp_group='dp_replica' needs several distributed-optimizer instances"):
        ParallelConfig(sharp_group="dp_replica")
    with pytest.raises(ConfigError, match=r"dp_outer resolved to 1"):
        ParallelConfig(sharp_group="dp_replica", dp_outer=-1, dp=8, dp_shard=8).resolve(8)
    with pytest.raises(ConfigError, match=r"sharp_group='all' is not supported; valid: dp, dp_replica"):
        ParallelConfig(sharp_group="all")
    assert not ps.model_parallel_is_initialized()


@pytest.mark.parametrize("sharp,instances,name", [("dp", 1, "dp_cp"), ("dp_replica", 2, "expt_dp_outer")])
def test_sharp_environment_sequence(fake, monkeypatch, caplog, sharp, instances, name):
    """Megatron's sequence on a simulated world: NCCL_COLLNET_ENABLE removed at the start, "1" while the SHARP group
    (and only it) is made, removed afterwards; a communicator of its own (not the pooled one made without SHARP),
    which every name with its ranks then uses; Megatron's note on rank 0 for the dp groups."""
    import logging

    import megashard.parallel_state as ps

    fake(0, 16)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                 num_distributed_optimizer_instances=instances)
    before = ps._st().group(name)  # the pooled communicator without SHARP
    ps.destroy_model_parallel()
    seen = []
    real = dist.new_group

    def spy(*a, **k):
        seen.append((k.get("group_desc"), os.environ.get("NCCL_COLLNET_ENABLE")))
        return real(*a, **k)

    monkeypatch.setattr(dist, "new_group", spy)
    monkeypatch.setenv("NCCL_COLLNET_ENABLE", "1")  # a user's global setting: Megatron drops it
    with caplog.at_level(logging.INFO, logger="megashard.state.comm_env"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2, use_sharp=True,
                                     num_distributed_optimizer_instances=instances,
                                     sharp_enabled_group=None if sharp == "dp" else sharp)
    assert seen[0] == (f"megashard:{name}:sharp", "1") and all(env is None for _, env in seen[1:]), seen
    assert "NCCL_COLLNET_ENABLE" not in os.environ
    st = ps._st()
    assert st.group(name) is not before and st.config.sharp_group == sharp
    if sharp == "dp":
        assert st.group("hsdp") is st.group("dp_cp")  # the same ranks and options: the SHARP communicator
        assert "Nvidia QM1 switch supports SAHRP up to 8 process groups" in caplog.text
    else:
        assert st.group("inter_dist_opt") is st.group("expt_dp_outer") and "QM1" not in caplog.text


# ---------------------------------------------------------------------- pp backend and UCC (no processes)
def test_pp_backend_checks(monkeypatch):
    from megashard.state.comm_env import available_backends, check_pp_backend, ucc_environment

    have = available_backends()
    assert "gloo" in have and "undefined" not in have
    with pytest.raises(ConfigError, match=rf"pp_backend='foo' .* is not a backend this torch build has; available: "
                                          rf"{', '.join(have)}"):
        check_pp_backend("foo")
    check_pp_backend("gloo")
    check_pp_backend(None)
    with pytest.raises(ConfigError, match=r"pp_backend='gl oo' must be the name of a torch.distributed backend"):
        ParallelConfig(pp_backend="gl oo")
    for var in ("TORCH_UCC_BLOCKING_WAIT", "UCX_TLS", "UCX_NET_DEVICES", "UCC_CL_BASIC_TLS", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("UCX_TLS", "rc")  # a user's choice stays, as in Megatron
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")  # … this one Megatron overrides
    ucc_environment()
    assert (os.environ["TORCH_UCC_BLOCKING_WAIT"], os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"],
            os.environ["UCC_CL_BASIC_TLS"]) == ("none", "rc", "all", "^sharp,nccl")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match=r"pp_backend='ucc' needs CUDA_DEVICE_MAX_CONNECTIONS > 1"):
        ucc_environment()


def test_restatement_puts_only_pp_on_the_backend():
    calls = list(create_group_calls(8, tp=2, pp=2, pp_backend="ucc"))
    assert {fam for fam, _, b in calls if b == "ucc"} == {"pp"}
    assert [r for fam, r, b in calls if fam == "pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ---------------------------------------------------------------------- real gloo groups
def _sum_check(pg, members, rank, what):
    import torch

    assert dist.get_process_group_ranks(pg) == sorted(members), (what, dist.get_process_group_ranks(pg), members)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=pg)
    assert t.item() == sum(r + 1 for r in members), (what, rank)


def _mine(groups, rank):
    (g,) = [g for g in groups if rank in g]
    return g


def check_hybrid(rank, world_size):
    import megashard.parallel_state as ps

    for kw in (dict(context_parallel_size=2), dict(tensor_model_parallel_size=2, context_parallel_size=2),
               dict(context_parallel_size=world_size // 2, pipeline_model_parallel_size=2)):
        ps.initialize_model_parallel(hybrid_context_parallel=True, distributed_timeout_minutes=1, **kw)
        try:
            ref = megatron_groups(world_size, tp=kw.get("tensor_model_parallel_size", 1),
                                  cp=kw["context_parallel_size"], pp=kw.get("pipeline_model_parallel_size", 1),
                                  hybrid=True)
            sizes = sorted(int(f.rsplit("_", 1)[1]) for f in ref if f.startswith("hybrid_dp_cp_"))
            assert sorted(ps._st().hybrid_dp_cp_groups()) == sizes, (kw, sizes)
            for k in sizes:
                pg = ps.get_hybrid_data_context_parallel_groups(group_size=k)
                assert pg.size() == k
                _sum_check(pg, _mine(ref[f"hybrid_dp_cp_{k}"], rank), rank, ("hybrid", k, kw))
            whole = ps.get_data_parallel_world_size(with_context_parallel=True)
            _sum_check(ps.get_hybrid_data_context_parallel_groups(group_size=whole), _mine(ref["dp_cp"], rank), rank,
                       ("hybrid whole", kw))
        finally:
            ps.destroy_model_parallel()
    # megashard's own API: ParallelConfig(hybrid_context_parallel=True), the groups by name
    import megashard

    st = megashard.initialize(ParallelConfig(cp=2, hybrid_context_parallel=True, timeout=60))
    try:
        ref = megatron_groups(world_size, cp=2, hybrid=True)
        for name in st.layout.hybrid_names:
            _sum_check(st.group(name), _mine(ref[name], rank), rank, ("hybrid via ParallelConfig", name))
        assert st.pg_collection(megatron=False).hybrid_dp_cp == st.hybrid_dp_cp_groups()
    finally:
        megashard.destroy()


def check_rank_offset(rank, world_size):
    """Two layouts side by side (Megatron's multi-module use): the first half of the ranks at offset 0, the second at
    offset world/2, each rank calling with its own; then a layout on the middle ranks only (the others create nothing)
    — and afterwards a layout on the whole world still starts (every rank holds as many groups)."""
    import megashard.parallel_state as ps

    half = world_size // 2
    offset = 0 if rank < half else half
    kw = dict(tensor_model_parallel_size=2) if rank < half else dict(pipeline_model_parallel_size=2)
    ps.initialize_model_parallel(rank_offset=offset, local_world_size=half, distributed_timeout_minutes=1, **kw)
    try:
        ref = megatron_groups(half, rank_offset=offset, tp=kw.get("tensor_model_parallel_size", 1),
                              pp=kw.get("pipeline_model_parallel_size", 1))
        for fam, getter in (("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
                            ("dp", ps.get_data_parallel_group)):
            _sum_check(getter(), _mine(ref[fam], rank), rank, ("offset", fam))
        assert ps.get_data_parallel_src_rank() == _mine(ref["dp"], rank)[0]
    finally:
        ps.destroy_model_parallel()
    mid = world_size // 4
    ps.initialize_model_parallel(tensor_model_parallel_size=2, rank_offset=mid, local_world_size=half,
                                 distributed_timeout_minutes=1)
    try:
        inside = mid <= rank < mid + half
        assert ps.model_parallel_is_initialized() == inside
        if inside:
            ref = megatron_groups(half, rank_offset=mid, tp=2)
            _sum_check(ps.get_tensor_model_parallel_group(), _mine(ref["tp"], rank), rank, "mid tp")
            _sum_check(ps.get_data_parallel_group(), _mine(ref["dp"], rank), rank, "mid dp")
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=1)
    try:
        _sum_check(ps.get_data_parallel_group(), _mine(megatron_groups(world_size, tp=2)["dp"], rank), rank, "after")
    finally:
        ps.destroy_model_parallel()


_CREATED: list = []


def _make_test_backend(store, rank, size, timeout):
    """A registered third-party backend (gloo underneath) that records every group made on it."""
    _CREATED.append(size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def check_pp_backend(rank, world_size):
    """The pp groups, and only they, on the named backend: the mp groups (the same ranks when tp=1) stay on gloo."""
    import megashard.parallel_state as ps

    if "megashard_test_pp" not in dist.Backend.backend_list:
        dist.Backend.register_backend("megashard_test_pp", _make_test_backend, devices=["cpu"])
    pp = 2
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, pipeline_model_parallel_comm_backend="megashard_test_pp",
                                 distributed_timeout_minutes=1)
    try:
        ref = megatron_groups(world_size, pp=pp, pp_backend="megashard_test_pp")
        pg = ps.get_pipeline_model_parallel_group()
        assert dist.get_backend(pg) == "megashard_test_pp" and _CREATED == [pp], (dist.get_backend(pg), _CREATED)
        _sum_check(pg, _mine(ref["pp"], rank), rank, "pp on its backend")
        mp = ps.get_model_parallel_group()
        assert dist.get_process_group_ranks(mp) == dist.get_process_group_ranks(pg) and mp is not pg
        others = {n: g for n, g in ps._st().named_groups().items() if n not in ("pp", "expt_pp")}
        assert {dist.get_backend(g) for g in others.values()} == {"gloo"}, others
        assert ps._st().group("expt_pp") is pg
        _sum_check(mp, _mine(ref["mp"], rank), rank, "mp on gloo")
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(ConfigError, match=r"pp_backend='nosuch' .* available: gloo"):
        ps.initialize_model_parallel(pipeline_model_parallel_comm_backend="nosuch")
    assert not ps.model_parallel_is_initialized()
    # megashard's own API: the same through ParallelConfig (destroy_model_parallel released the first communicator)
    import megashard

    st = megashard.initialize(ParallelConfig(pp=pp, pp_backend="megashard_test_pp", timeout=60))
    try:
        assert dist.get_backend(st.group("pp")) == "megashard_test_pp" and _CREATED == [pp, pp]
        assert dist.get_backend(st.group("dp")) == "gloo"
        _sum_check(st.group("pp"), st.ranks("pp"), rank, "pp via ParallelConfig")
    finally:
        megashard.destroy()


def check_sharp_on_gloo(rank, world_size):
    import megashard
    import megashard.parallel_state as ps

    with pytest.raises(ConfigError, match=r"sharp_group='dp' needs the nccl backend .* backend='gloo'"):
        ps.initialize_model_parallel(use_sharp=True)
    with pytest.raises(ConfigError, match=r"sharp_group='dp' \(Megatron's use_sharp\) needs the nccl backend: SHARP is "
                                          r"NCCL's in-network reduction .* this job's backend is 'gloo'"):
        megashard.initialize(ParallelConfig(sharp_group="dp", timeout=60))
    assert not ps.model_parallel_is_initialized()


CHECKS = [check_hybrid, check_rank_offset, check_pp_backend, check_sharp_on_gloo]


@pytest.fixture(scope="module")
def world4():
    return spawn_checks(CHECKS, world_size=4, timeout=300)


@pytest.fixture(scope="module")
def world8():
    return spawn_checks(CHECKS, world_size=8, timeout=400)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_world4(world4, check):
    world4.assert_ok(check)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_world8(world8, check):
    world8.assert_ok(check)
