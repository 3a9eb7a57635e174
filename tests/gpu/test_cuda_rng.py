"""The RNG tracker on CUDA generators: streams bitwise equal to plain generators with the same seeds, forks that
leave the CPU generator alone, graph-safe states captured in a CUDA graph and replayed, recompute with dropout.

Reference sequence: a stream seeded ``s`` must draw exactly what ``torch.Generator("cuda").manual_seed(s)`` draws
(same Philox seed, offset 0, same kernels), in the order the stream's draws were made.
"""
from __future__ import annotations

import pytest
import torch

from megashard.state.current import current_locals
from megashard.state.rng import get_cuda_rng_tracker, model_parallel_manual_seed
from megashard.state.rng_tracker import _get_cuda_rng_state

pytestmark = pytest.mark.gpu

SEED = 1234
N = 4096  # draws per call: several Philox blocks, so an offset error shows
MP, EP, DP = "model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"


@pytest.fixture(autouse=True)
def _fresh_tracker():
    current_locals().reset()
    torch.cuda.set_device(0)
    yield
    current_locals().reset()


def _seed(cudagraphable: bool = False) -> dict[str, int]:
    return model_parallel_manual_seed(SEED, use_cudagraphable_rng=cudagraphable, force_reset_rng=True,
                                      tp_rank=0, ep_rank=0, expt_tp_rank=0)


def _refs(seeds: dict[str, int]) -> dict[str, torch.Generator]:
    """One plain CUDA generator per stream (and "default" = the device generator after seeding)."""
    gens = {name: torch.Generator(device="cuda").manual_seed(s) for name, s in seeds.items()}
    gens["default"] = torch.Generator(device="cuda").manual_seed(SEED)
    return gens


def _draw() -> torch.Tensor:
    return torch.rand(N, device="cuda")


def _expect(gens: dict[str, torch.Generator], name: str) -> torch.Tensor:
    return torch.rand(N, device="cuda", generator=gens[name])


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.device.type == "cuda", f"{what}: drawn on {got.device}, not on CUDA"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} of {N} values differ from the reference generator "
                             f"(first at {bad[0].tolist()}: {got[bad[0]].item()} != {want[bad[0]].item()})")


@pytest.mark.parametrize("cudagraphable", [False, True], ids=["state-tensors", "graph-safe"])
def test_fork_nested_fork_equal_reference_sequence(cudagraphable):
    seeds = _seed(cudagraphable)
    tracker = get_cuda_rng_tracker()
    assert tracker.use_cudagraphable_rng is cudagraphable
    ref = _refs(seeds)
    cpu_before = torch.get_rng_state()
    _equal(_draw(), _expect(ref, "default"), "default stream before any fork")
    with tracker.fork():
        _equal(_draw(), _expect(ref, MP), "model-parallel stream, first fork")
        with tracker.fork(EP):
            _equal(_draw(), _expect(ref, EP), "expert stream nested in the model-parallel fork")
        _equal(_draw(), _expect(ref, MP), "model-parallel stream after the nested expert fork")
        with tracker.fork():  # the same stream nested: continues it
            _equal(_draw(), _expect(ref, MP), "model-parallel stream nested in itself")
        _equal(_draw(), _expect(ref, MP), "model-parallel stream after nesting itself")
    _equal(_draw(), _expect(ref, "default"), "default stream after the forks (as if none happened)")
    with tracker.fork(DP):
        _equal(_draw(), _expect(ref, DP), "data-parallel stream")
    with tracker.fork():
        _equal(_draw(), _expect(ref, MP), "model-parallel stream, second fork")
    assert torch.equal(torch.get_rng_state(), cpu_before), "a CUDA fork moved the CPU generator"


@pytest.mark.parametrize("cudagraphable", [False, True], ids=["state-tensors", "graph-safe"])
def test_get_states_set_states_replay(cudagraphable):
    _seed(cudagraphable)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        _draw()
        inside = tracker.get_states()  # the live state of the forked stream
        first = _draw()
    snapshot = tracker.get_states()
    with tracker.fork():
        second = _draw()
    assert not torch.equal(first, second), "the model-parallel stream did not advance"
    tracker.set_states(snapshot)
    with tracker.fork():
        _equal(_draw(), second, "set_states(get_states()) then fork")
    tracker.set_states(inside)
    with tracker.fork():
        _equal(_draw(), first, "set_states of a snapshot taken inside a fork")
    if not cudagraphable:
        state = _get_cuda_rng_state()
        # The CUDA generator's state (seed and Philox offset, 16 bytes), not the CPU generator's (5056 bytes).
        assert state.dtype == torch.uint8 and state.numel() < torch.get_rng_state().numel(), state.numel()


def test_graph_safe_states_in_a_captured_cuda_graph():
    """use_cudagraphable_rng=True: forks inside a CUDA-graph capture; every replay draws what eager generators
    with the same seeds draw next, and after the replays the streams continue where the graph left them."""
    seeds = _seed(cudagraphable=True)
    tracker = get_cuda_rng_tracker()
    ref = _refs(seeds)
    graph = torch.cuda.CUDAGraph()
    for state in tracker.states_.values():  # the stream states the capture may swap in
        graph.register_generator_state(state)
    outs = {k: torch.empty(N, device="cuda") for k in ("default", "mp1", "ep", "mp2")}
    with torch.cuda.graph(graph):
        outs["default"].copy_(_draw())
        with tracker.fork():
            outs["mp1"].copy_(_draw())
            with tracker.fork(EP):
                outs["ep"].copy_(_draw())
            outs["mp2"].copy_(_draw())
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        _equal(outs["default"], _expect(ref, "default"), f"replay {replay}: default stream")
        _equal(outs["mp1"], _expect(ref, MP), f"replay {replay}: model-parallel stream")
        _equal(outs["ep"], _expect(ref, EP), f"replay {replay}: expert stream nested in the fork")
        _equal(outs["mp2"], _expect(ref, MP), f"replay {replay}: model-parallel stream after the nested fork")
    snapshot = tracker.get_states()  # graph-safe clones
    with tracker.fork():
        _equal(_draw(), _expect(ref, MP), "eager fork after three replays")
    tracker.set_states(snapshot)
    with tracker.fork():
        again = _draw()
    ref[MP] = torch.Generator(device="cuda").manual_seed(seeds[MP])
    for _ in range(3 * 2):
        _expect(ref, MP)
    _equal(again, _expect(ref, MP), "fork after set_states of the snapshot taken after the replays")


def test_recompute_with_dropout_bitwise_on_cuda():
    from tests._helpers import assert_bitwise_equal
    from tests.test_recompute import make_blocks, run

    blocks = [b.cuda() for b in make_blocks()]
    x0 = torch.randn(4, 3, 5, device="cuda")
    plain, recomputed = run(blocks, x0, ckpt=False), run(blocks, x0, ckpt=True)
    assert plain[0].device.type == "cuda"
    assert_bitwise_equal(plain, recomputed)
    # The masks are really random on CUDA: another seed gives other gradients.
    model_parallel_manual_seed(SEED + 1, tp_rank=0, ep_rank=0, expt_tp_rank=0)
    h = x0.clone().requires_grad_(True)
    out = h
    for b in blocks:
        out = b(out)
    assert not torch.equal(out.detach(), plain[0]), "dropout drew the same masks with another seed"
