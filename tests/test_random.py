"""RNG tracker and Megatron seeding: exact streams in one process, and per-rank seeds on a gloo world."""
from __future__ import annotations

import warnings

import pytest
import torch

import megashard.state.rng as mr
from megashard.errors import ConfigError, MegashardError, RNGTrackerError, TransformerEngineMissingError
from megashard.state.current import current_locals
from megashard.state.rng import RNGStatesTracker, get_cuda_rng_tracker, initialize_rng_tracker
from megashard.state.rng import model_parallel_cuda_manual_seed, model_parallel_manual_seed
from tests._dist import spawn_checks

N = 5  # numbers drawn per step


def draw(n: int = N) -> torch.Tensor:
    return torch.rand(n)  # from the default generator: the "device" generator here (no CUDA)


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _clean_tracker():
    current_locals().reset()
    yield
    current_locals().reset()


@pytest.fixture
def tracker() -> RNGStatesTracker:
    torch.manual_seed(0)
    t = RNGStatesTracker()
    t.add("a", 11)
    t.add("b", 22)
    return t


# --------------------------------------------------------------------------- streams
def test_device_state_helpers_use_cpu_generator_without_cuda():
    assert not torch.cuda.is_available()
    torch.manual_seed(3)
    state = mr._get_cuda_rng_state()
    x = draw()
    mr._set_cuda_rng_state(state)
    assert torch.equal(draw(), x)
    assert torch.equal(mr._get_cuda_rng_state("cpu", clone=True), torch.get_rng_state())


def test_fork_equals_fresh_generator_and_leaves_default_untouched(tracker):
    torch.manual_seed(123)
    expected_default = torch.rand(2 * N)
    torch.manual_seed(123)
    first = draw()
    with tracker.fork("a"):
        a1 = draw()
    with tracker.fork("a"):
        a2 = draw()
    second = draw()
    ga = fresh(11)
    assert torch.equal(a1, torch.rand(N, generator=ga))
    assert torch.equal(a2, torch.rand(N, generator=ga))  # the stream continues across forks
    assert torch.equal(torch.cat([first, second]), expected_default)  # default stream as if no fork


def test_nested_forks_equal_sequential_forks(tracker):
    ga, gb = fresh(11), fresh(22)
    torch.manual_seed(7)
    expected_default = torch.rand(2 * N)
    torch.manual_seed(7)
    d1 = draw()
    with tracker.fork("a"):
        a1 = draw()
        with tracker.fork("b"):
            b1 = draw()
            with tracker.fork("a"):  # same stream as the outer fork: continues, does not replay
                a2 = draw()
            b2 = draw()
        a3 = draw()
        with tracker.fork("a"):
            with tracker.fork("a"):
                a4 = draw()
            a5 = draw()
        a6 = draw()
    d2 = draw()
    for got in (a1, a2, a3, a4, a5, a6):
        assert torch.equal(got, torch.rand(N, generator=ga))
    for got in (b1, b2):
        assert torch.equal(got, torch.rand(N, generator=gb))
    assert torch.equal(torch.cat([d1, d2]), expected_default)
    # after everything the streams continue where they stopped
    with tracker.fork("b"):
        assert torch.equal(draw(), torch.rand(N, generator=gb))


def test_active_forks_bookkeeping(tracker):
    assert tracker.active_forks() == ()
    with tracker.fork("a"):
        with tracker.fork("b"):
            assert tracker.active_forks() == ("a", "b")
        assert tracker.active_forks() == ("a",)
    assert tracker.active_forks() == ()


def test_fork_restores_on_exception(tracker):
    torch.manual_seed(5)
    expected = torch.rand(N)
    torch.manual_seed(5)
    with pytest.raises(ZeroDivisionError):
        with tracker.fork("a"):
            draw()
            1 / 0
    assert torch.equal(draw(), expected)
    with tracker.fork("a"):  # the stream kept the draw made before the exception
        ga = fresh(11)
        torch.rand(N, generator=ga)
        assert torch.equal(draw(), torch.rand(N, generator=ga))


def test_get_set_states_round_trip(tracker):
    with tracker.fork("a"):
        draw()
    snap = tracker.get_states()
    with tracker.fork("a"):
        a_next = draw()
    with tracker.fork("b"):
        b_next = draw()
    tracker.set_states(snap)
    with tracker.fork("a"):
        assert torch.equal(draw(), a_next)
    with tracker.fork("b"):
        assert torch.equal(draw(), b_next)


def test_get_states_inside_fork_reports_live_state(tracker):
    with tracker.fork("a"):
        draw()
        snap = tracker.get_states()
        a_next = draw()
    tracker.set_states(snap)
    with tracker.fork("a"):
        assert torch.equal(draw(), a_next)


def test_add_does_not_move_default_stream():
    torch.manual_seed(9)
    expected = torch.rand(N)
    torch.manual_seed(9)
    t = RNGStatesTracker()
    t.add("x", 1)
    assert torch.equal(draw(), expected)


def test_duplicate_name_seed_and_unknown_fork_raise(tracker):
    with pytest.raises(RNGTrackerError, match=r"'a' already exists"):
        tracker.add("a", 99)
    with pytest.raises(RNGTrackerError, match=r"seed 22 is already used by stream 'b'"):
        tracker.add("c", 22)
    with pytest.raises(RNGTrackerError, match=r"'zzz' was never added.*\['a', 'b'\]"):
        with tracker.fork("zzz"):
            pass
    assert isinstance(RNGTrackerError("x"), MegashardError)
    tracker.reset()
    assert not tracker.is_initialized()
    tracker.add("a", 22)  # reset forgets names and seeds
    assert tracker.is_initialized()


def test_inference_tracker_is_noop():
    torch.manual_seed(4)
    expected = torch.rand(2 * N)
    torch.manual_seed(4)
    t = get_cuda_rng_tracker(inference_rng_tracker=True)
    t.add("a", 1)
    t.set_states({"b": torch.get_rng_state()})
    assert t.get_states() == {}
    x1 = draw()
    with t.fork("a"):  # no stream switch: draws continue the default stream
        x2 = draw()
    assert torch.equal(torch.cat([x1, x2]), expected)


def test_second_initialisation_with_other_flags_warns():
    t1 = get_cuda_rng_tracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_cuda_rng_tracker() is t1  # plain lookups never warn
        initialize_rng_tracker()  # same flags: silent
    with pytest.warns(UserWarning, match=r"already initialised.*inference_rng_tracker=True.*force_reset=True"):
        initialize_rng_tracker(inference_rng_tracker=True)
    assert get_cuda_rng_tracker() is t1
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    assert get_cuda_rng_tracker() is not t1
    assert get_cuda_rng_tracker().is_inference_rng_tracker


def test_manual_seed_keeps_existing_tracker_unless_flags_differ():
    t = get_cuda_rng_tracker(inference_rng_tracker=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_parallel_manual_seed(1, tp_rank=0, ep_rank=0, expt_tp_rank=0)  # no flags: seeds the existing one
    assert get_cuda_rng_tracker() is t
    current_locals().reset()
    t = get_cuda_rng_tracker()
    with pytest.warns(UserWarning, match="inference_rng_tracker=True"):
        model_parallel_manual_seed(1, inference_rng_tracker=True, tp_rank=0, ep_rank=0, expt_tp_rank=0)
    assert get_cuda_rng_tracker() is t and not t.is_inference_rng_tracker
    model_parallel_manual_seed(1, inference_rng_tracker=True, tp_rank=0, ep_rank=0, expt_tp_rank=0, force_reset_rng=True)
    assert get_cuda_rng_tracker().is_inference_rng_tracker


def test_cudagraphable_rng_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="use_cudagraphable_rng=True needs CUDA"):
        initialize_rng_tracker(use_cudagraphable_rng=True)


def test_te_tracker_without_te_is_a_clear_error(monkeypatch):
    import megashard.state.te as te

    monkeypatch.setattr(te, "_import_te", lambda: (None, ImportError("No module named 'transformer_engine'")))
    with pytest.raises(TransformerEngineMissingError, match=r"use_te_rng_tracker=True.*pip install 'megashard\[te\]'"):
        initialize_rng_tracker(use_te_rng_tracker=True)
    assert current_locals().rng_tracker is None  # nothing half-initialised


# --------------------------------------------------------------------------- seeding (one process)
def test_manual_seed_formula_single_process():
    seeds = model_parallel_manual_seed(1234, tp_rank=1, ep_rank=3, expt_tp_rank=1)
    assert seeds == {"data-parallel-rng": 1234, "model-parallel-rng": 1234 + 2718 + 1, "expert-parallel-rng": 1234 + 1024 + 301}
    default = draw()
    assert torch.equal(default, torch.rand(N, generator=fresh(1234)))
    tracker = get_cuda_rng_tracker()
    for name, seed in seeds.items():
        with tracker.fork(name):
            assert torch.equal(draw(), torch.rand(N, generator=fresh(seed))), name
    with tracker.fork():  # default name
        assert torch.equal(draw(), torch.rand(2 * N, generator=fresh(seeds[mr._MODEL_PARALLEL_RNG_TRACKER_NAME]))[N:])
    # Megatron alias, reseeding resets the streams
    assert model_parallel_cuda_manual_seed(1234, tp_rank=1, ep_rank=3, etp_rank=1) == seeds
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(draw(), torch.rand(N, generator=fresh(1234 + 2719)))


def test_manual_seed_without_distributed_is_rank_zero():
    assert model_parallel_manual_seed(10) == {"data-parallel-rng": 10, "model-parallel-rng": 2728, "expert-parallel-rng": 1034}


def test_seed_collision_is_reported_with_layout():
    # 1024 + 100*17 + 0 == 2718 + 6: expert and model streams would coincide on this rank
    with pytest.raises(ConfigError, match=r"'model-parallel-rng' and 'expert-parallel-rng'.*tp_rank=6, ep_rank=17, expt_tp_rank=0"):
        model_parallel_manual_seed(0, tp_rank=6, ep_rank=17, expt_tp_rank=0)
    assert current_locals().rng_tracker is None  # rejected before any state changed
    with pytest.raises(ConfigError, match="tp_rank must be >= 0"):
        model_parallel_manual_seed(0, tp_rank=-1, ep_rank=0, expt_tp_rank=0)


def test_reset_for_destroy_drops_tracker():
    t = get_cuda_rng_tracker()
    t.add("a", 1)
    current_locals().reset()
    assert get_cuda_rng_tracker() is not t
    assert not get_cuda_rng_tracker().is_initialized()


# --------------------------------------------------------------------------- seeding on gloo, 4 ranks
SEED = 1000


def _gather_streams() -> dict[str, list[torch.Tensor]]:
    """Seed from the ParallelState, draw from every stream, all-gather the draws."""
    import torch.distributed as dist

    seeds = model_parallel_manual_seed(SEED)
    draws = {"default": draw()}
    tracker = get_cuda_rng_tracker()
    for name in seeds:
        with tracker.fork(name):
            draws[name] = draw()
    out = {}
    for name, x in draws.items():
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        out[name] = parts
    return out


def _with_state(config_kwargs: dict, body) -> None:
    import megashard.state as ms
    from megashard.config import ParallelConfig

    st = ms.initialize(ParallelConfig(**config_kwargs))
    try:
        body(st)
    finally:
        ms.destroy()
    assert current_locals().rng_tracker is None, "megashard.state.destroy() must drop the RNG tracker"


def check_seeding_tp2(rank, world_size):
    def body(st):
        tp_rank = st.rank_in("tp")
        assert tp_rank == rank % 2  # tp groups [[0,1],[2,3]]
        out = _gather_streams()
        for r in range(world_size):
            assert torch.equal(out["default"][r], torch.rand(N, generator=fresh(SEED)))
            assert torch.equal(out["data-parallel-rng"][r], torch.rand(N, generator=fresh(SEED)))
            assert torch.equal(out["model-parallel-rng"][r], torch.rand(N, generator=fresh(SEED + 2718 + r % 2)))
            assert torch.equal(out["expert-parallel-rng"][r], torch.rand(N, generator=fresh(SEED + 1024)))
        mp = out["model-parallel-rng"]
        assert not torch.equal(mp[0], mp[1]) and torch.equal(mp[0], mp[2]) and torch.equal(mp[1], mp[3])

    _with_state({"tp": 2}, body)


def check_seeding_ep2(rank, world_size):
    def body(st):
        # expert layout, tp=1 ep=2 expt_tp=2 over 4 ranks: expt_tp fastest, then ep
        assert (st.rank_in("expt_tp"), st.rank_in("ep"), st.rank_in("tp")) == (rank % 2, rank // 2, 0)
        out = _gather_streams()
        for r in range(world_size):
            ep, etp = r // 2, r % 2
            assert torch.equal(out["expert-parallel-rng"][r], torch.rand(N, generator=fresh(SEED + 1024 + 100 * ep + etp)))
            assert torch.equal(out["model-parallel-rng"][r], torch.rand(N, generator=fresh(SEED + 2718)))
        assert len({tuple(x.tolist()) for x in out["expert-parallel-rng"]}) == 4

    _with_state({"ep": 2, "expt_tp": 2}, body)


@pytest.fixture(scope="module")
def dist4():
    pytest.importorskip("megashard.state", reason="megashard.state (the lead's ParallelState) not written yet")
    return spawn_checks([check_seeding_tp2, check_seeding_ep2], world_size=4)


def test_seeding_tp2_gloo(dist4):
    dist4.assert_ok("check_seeding_tp2")


def test_seeding_ep2_gloo(dist4):
    dist4.assert_ok("check_seeding_ep2")
