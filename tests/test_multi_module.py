"""Multi-module layouts: config, the pairing rule (pure), per-module ParallelStates built by their own ranks only, and
an encoder -> language-model forward and backward across the seam on 8 gloo ranks whose gradients equal a
single-process reference (fan-in 4 -> 1 with tp=2, pp=2 behind the seam; fan-out 2 -> 4)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml

from megashard.config import ModulesConfig
from megashard.errors import ConfigError
from megashard.layout import Link, MultiModuleLayout, pair_modules
from tests._dist import spawn_checks

ISSUE_EXAMPLE = """
modules:
  - name: encoder
    ranks: 0-3
    parallel: {tp: 1}
  - name: llm
    ranks: 4-11
    parallel: {tp: 2, pp: 2}
"""


def _multi(text, world):
    return MultiModuleLayout.from_config(ModulesConfig.from_dict(yaml.safe_load(text)), world)


# ----------------------------------------------------------------------------------------------
# pure
# ----------------------------------------------------------------------------------------------
def test_issue_example_groups_and_pairing():
    multi = _multi(ISSUE_EXAMPLE, 12)
    enc, llm = multi.module("encoder"), multi.module("llm")
    assert list(enc.ranks) == [0, 1, 2, 3] and list(llm.ranks) == list(range(4, 12))
    assert llm.groups("tp") == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert llm.groups("pp") == [[4, 8], [5, 9], [6, 10], [7, 11]]
    assert llm.groups("dp") == [[4, 6], [5, 7], [8, 10], [9, 11]]
    assert enc.groups("dp") == [[0, 1, 2, 3]]
    assert llm.group_of("tp_cp", 7) == [6, 7]
    assert multi.module_of(3) is enc and multi.module_of(9) is llm and multi.module_of(12) is None
    # encoder dp=4 -> llm dp=2: fan-in of 2 whole outputs per llm replica, in order
    assert multi.links("encoder", "llm") == [
        Link(0, 4, 0, 1, 0, 2), Link(1, 4, 0, 1, 1, 2), Link(2, 6, 0, 1, 0, 2), Link(3, 6, 0, 1, 1, 2)]


def test_pairing_fan_out_and_last_stage():
    # sender with pp=2, tp=2 on ranks 0-7 (dp 2, last stage = ranks 4-7, leaders 4, 6) -> receiver dp=4 on 8-11
    multi = _multi("""
modules:
  - {name: a, ranks: 0-7, parallel: {tp: 2, pp: 2}}
  - {name: b, ranks: 8-11, parallel: {}}
""", 16)
    assert multi.idle_ranks == 4
    assert multi.links("a", "b") == [
        Link(4, 8, 0, 2, 0, 1), Link(4, 9, 1, 2, 0, 1), Link(6, 10, 0, 2, 0, 1), Link(6, 11, 1, 2, 0, 1)]
    # a pure function of the two layouts: the reverse direction pairs b's last stage with a's first
    assert pair_modules(multi.module("b"), multi.module("a")) == [
        Link(8, 0, 0, 1, 0, 2), Link(9, 0, 0, 1, 1, 2), Link(10, 2, 0, 1, 0, 2), Link(11, 2, 0, 1, 1, 2)]


def test_pairing_keeps_every_sample_in_place():
    """Replica i of a module holds the i-th contiguous block of the global batch: every link moves sample rows
    from the sender block they sit in to the receiver block they belong to."""
    for ds, dd in [(1, 4), (4, 1), (2, 6), (6, 3), (8, 8), (3, 3)]:
        multi = _multi(f"""
modules:
  - {{name: s, ranks: 0-{ds - 1}, parallel: {{}}}}
  - {{name: r, ranks: {ds}-{ds + dd - 1}, parallel: {{}}}}
""", ds + dd)
        B = 24
        got = {d: [None] * (B // dd) for d in range(ds, ds + dd)}
        for l in multi.links("s", "r"):
            src_rows = list(range(l.src * (B // ds), (l.src + 1) * (B // ds)))
            step = len(src_rows) // l.src_parts
            rows = src_rows[l.src_part * step:(l.src_part + 1) * step]
            dstep = (B // dd) // l.dst_parts
            got[l.dst][l.dst_part * dstep:(l.dst_part + 1) * dstep] = rows
        for d, rows in got.items():
            j = d - ds
            assert rows == list(range(j * (B // dd), (j + 1) * (B // dd))), (ds, dd, d, rows)


@pytest.mark.parametrize("text,world,needle", [
    ("modules: []", 4, "the list is empty"),
    ("modules: [{name: a, ranks: 0-3}, {name: a, ranks: 4-7}]", 8, "name(s) a used twice"),
    ("modules: [{name: a, ranks: 0-3}, {name: b, ranks: 3-7}]", 8, "overlap"),
    ("modules: [{name: a, ranks: 0-3}, {name: b, ranks: 4-7}]", 6, "uses ranks up to 7, but the world has 6"),
    ("modules: [{name: a, ranks: 3-1}]", 4, "first <= last"),
    ("modules: [{name: a, ranks: 'x'}]", 4, "must be a rank range"),
    ("modules: [{name: a, ranks: 0-3, paralel: {}}]", 4, "did you mean 'parallel'"),
    ("modules: [{name: a, ranks: 0-3, parallel: {tp: 3}}]", 4, "module 'a' (ranks 0-3, 4 ranks)"),
    ("modules: [{name: a, ranks: 0-3, parallel: {tq: 2}}]", 4, "module 'a'"),
    ("modules: [{name: a, ranks: 0-2}, {name: b, ranks: 3-4}]", 5, "one data-parallel size must divide the other"),
    ("modules: [{name: a, ranks: 0-1}, {name: b, ranks: 2-3}]\nconnect: [[a, c]]", 4, "unknown module 'c'"),
    ("modules: [{name: a, ranks: 0-1}]\nconnect: [[a, a]]", 4, "to itself"),
    ("modules: [{name: a, ranks: 0-1}]\nmodule: 1", 4, "unknown section(s) 'module'"),
])
def test_config_errors(text, world, needle):
    with pytest.raises(ConfigError) as e:
        MultiModuleLayout.from_config(ModulesConfig.from_dict(yaml.safe_load(text)), world)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# gloo, 8 ranks: encoder on 0-3 -> llm on 4-7
# ----------------------------------------------------------------------------------------------
B, F_IN, F_ENC, F_HID, F_OUT = 8, 4, 6, 8, 3
SCENARIOS = {
    # encoder dp=4 (tp=1) -> llm tp=2, pp=2, dp=1: fan-in 4 -> 1, tensor- and pipeline-parallel behind the seam
    "fan_in": """
modules:
  - {name: encoder, ranks: 0-3, parallel: {tp: 1, backend: gloo, device: cpu, timeout: 30}}
  - {name: llm, ranks: 4-7, parallel: {tp: 2, pp: 2, backend: gloo, device: cpu, timeout: 30}}
""",
    # encoder tp=2, dp=2 -> llm dp=4: fan-out 2 -> 4
    "fan_out": """
modules:
  - {name: encoder, ranks: 0-3, parallel: {tp: 2, backend: gloo, device: cpu, timeout: 30}}
  - {name: llm, ranks: 4-7, parallel: {backend: gloo, device: cpu, timeout: 30}}
""",
}


def _weights():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(B, F_IN, generator=g, dtype=torch.float64)
    we = torch.randn(F_IN, F_ENC, generator=g, dtype=torch.float64)
    w1 = torch.randn(F_ENC, F_HID, generator=g, dtype=torch.float64)
    w2 = torch.randn(F_HID, F_OUT, generator=g, dtype=torch.float64)
    return x, we, w1, w2


def _reference():
    x, we, w1, w2 = (t.clone() for t in _weights())
    for w in (we, w1, w2):
        w.requires_grad_(True)
    out = torch.relu(torch.tanh(x @ we) @ w1) @ w2
    (out ** 2).sum().backward()
    return we.grad, w1.grad, w2.grad


def _run_scenario(text):
    import megashard.state as ms
    from megashard.state import pool

    rank = dist.get_rank()
    multi = _multi(text, dist.get_world_size())
    module, state = ms.init_module_state(multi)
    # members only: every communicator this process holds is inside its own module's ranks
    for ranks, *_ in pool._POOL:
        assert set(ranks) <= set(module.ranks), (module.name, ranks)
    for name in ("tp", "pp", "dp", "tp_cp", "world"):
        assert state.ranks(name) == module.group_of(name, rank)
        assert dist.get_process_group_ranks(state.group(name)) == sorted(module.group_of(name, rank))
    bridge = ms.ModuleBridge(multi, "encoder", "llm", state)
    x, we, w1, w2 = _weights()
    ref_we, ref_w1, ref_w2 = _reference()
    if module.name == "encoder":
        dp, i = state.size("dp"), state.rank_in("dp")
        rows = B // dp
        we = we.clone().requires_grad_(True)  # tp ranks compute the same (replicated) encoder
        y = torch.tanh(x[i * rows:(i + 1) * rows] @ we)
        bridge.send_forward(y)
        dy = bridge.recv_backward(y.shape, y.dtype)
        y.backward(dy)
        g = we.grad.clone()
        dist.all_reduce(g, group=state.group("dp"))
        torch.testing.assert_close(g, ref_we, rtol=1e-12, atol=1e-12)
    else:
        tp, t = state.size("tp"), state.rank_in("tp")
        pp, stage = state.size("pp"), state.rank_in("pp")
        dp, i = state.size("dp"), state.rank_in("dp")
        cols = F_HID // tp
        w1 = w1[:, t * cols:(t + 1) * cols].clone().requires_grad_(True)  # column-parallel
        w2 = w2[t * cols:(t + 1) * cols].clone().requires_grad_(True)  # row-parallel
        pp_ranks = state.ranks("pp")
        shape = (B // dp, F_ENC)
        if stage == 0:
            inp = bridge.recv_forward(shape, torch.float64)
            torch.testing.assert_close(inp, torch.tanh(x[i * shape[0]:(i + 1) * shape[0]] @ we), rtol=1e-12, atol=0)
            h = torch.relu(inp @ w1)
        if pp > 1:  # stage boundary inside the llm: tp rank t of stage 0 <-> tp rank t of stage 1
            if stage == 0:
                dist.send(h.detach().contiguous(), pp_ranks[1])
            else:
                h = torch.empty(B // dp, cols, dtype=torch.float64)
                dist.recv(h, pp_ranks[0])
                h.requires_grad_(True)
        if stage == pp - 1:
            partial = h @ w2
            out = partial.detach().clone()
            if tp > 1:
                dist.all_reduce(out, group=state.group("tp"))
            out.requires_grad_(True)
            (out ** 2).sum().backward()
            partial.backward(out.grad)  # d(sum of partials)/d(partial) = identity
        if pp > 1:
            if stage == 1:
                dist.send(h.grad.contiguous(), pp_ranks[0])
            else:
                dh = torch.empty_like(h)
                dist.recv(dh, pp_ranks[1])
                h.backward(dh)
        if stage == 0:
            dinp = inp.grad.clone()
            if tp > 1:  # a column-parallel input gradient is a sum over tp
                dist.all_reduce(dinp, group=state.group("tp"))
            bridge.send_backward(dinp)
        for w, ref in ((w1, ref_w1[:, t * cols:(t + 1) * cols]), (w2, ref_w2[t * cols:(t + 1) * cols])):
            if w.grad is None:
                continue  # the weight lives on the other stage
            g = w.grad.clone()
            dist.all_reduce(g, group=state.group("dp"))
            torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
        assert (w1.grad is not None) == (stage == 0) and (w2.grad is not None) == (stage == pp - 1)
    state.destroy()
    dist.barrier()


def check_fan_in_tp_pp(rank, world_size):
    _run_scenario(SCENARIOS["fan_in"])


def check_fan_out(rank, world_size):
    _run_scenario(SCENARIOS["fan_out"])


def check_non_members_create_nothing(rank, world_size):
    """A module on ranks 4-5 only: ranks 0-3 and 6-7 make no call and hold no new communicator."""
    import megashard.state as ms
    from megashard.state import pool

    multi = _multi("modules: [{name: m, ranks: 4-5, parallel: {tp: 2, backend: gloo, device: cpu, timeout: 30}}]", 8)
    before = set(pool._POOL)
    module, state = ms.init_module_state(multi)
    new = set(pool._POOL) - before
    if rank in (4, 5):
        assert module.name == "m" and state.rank_offset == 4 and state.layout_rank == rank - 4
        assert state.ranks("tp") == [4, 5] and state.rank_in("tp") == rank - 4
        assert all(set(k[0]) <= {4, 5} for k in new)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=state.group("tp"))
        assert t.item() == 9.0
        state.destroy()
    else:
        assert module is None and state is None and not new
    dist.barrier()


CHECKS = [check_fan_in_tp_pp, check_fan_out, check_non_members_create_nothing]


@pytest.fixture(scope="module")
def dist8():
    return spawn_checks(CHECKS, world_size=8, timeout=300.0, pg_timeout=30.0)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_multi_module_gloo(dist8, name):
    dist8.assert_ok(name)
