"""Optional TransformerEngine: absent → None/False/clear error; a (fake) installed TE → version checks and its tracker."""
from __future__ import annotations

import contextlib
import sys
import types

import pytest

import megashard.state.rng as mr
import megashard.state.te as te
from megashard.errors import ConfigError, RNGTrackerError, TransformerEngineMissingError
from megashard.state.current import current_locals


@pytest.fixture(autouse=True)
def _clean():
    te._reset_te_cache()
    current_locals().reset()
    yield
    te._reset_te_cache()
    current_locals().reset()


class FakeTETracker:
    """The interface of ``transformer_engine.pytorch.distributed.CudaRNGStatesTracker``."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_, self.seeds_ = {}, set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    def add(self, name, seed):
        self.seeds_.add(seed)
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forked = name
        yield


@pytest.fixture
def fake_te(monkeypatch):
    """Install a fake ``transformer_engine`` package; yields its top module (set ``__version__`` on it)."""
    top = types.ModuleType("transformer_engine")
    top.__version__ = "1.9.0"
    pt = types.ModuleType("transformer_engine.pytorch")
    dist = types.ModuleType("transformer_engine.pytorch.distributed")
    dist.CudaRNGStatesTracker = FakeTETracker
    pt.distributed = dist
    top.pytorch = pt
    for name, mod in (("transformer_engine", top), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.pytorch.distributed", dist)):
        monkeypatch.setitem(sys.modules, name, mod)
    te._reset_te_cache()
    return top


def test_absent_te_gives_none_false_and_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # makes the import fail, even where TE exists
    assert te.get_te_version() is None
    assert te.have_te() is False
    assert te.is_te_min_version("0.1") is False
    assert te.is_te_min_version("0.1", check_equality=False) is False
    with pytest.raises(TransformerEngineMissingError, match=r"FP8 layers needs NVIDIA TransformerEngine.*pip install 'megashard\[te\]'") as info:
        te.require_te("FP8 layers")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(TransformerEngineMissingError, match="use_te_rng_tracker=True"):
        mr.get_cuda_rng_tracker(use_te_rng_tracker=True)


def test_version_checks_compare_numerically(fake_te):
    assert str(te.get_te_version()) == "1.9.0"
    assert te.get_te_version() is te.get_te_version()  # cached
    assert te.is_te_min_version("1.9.0")
    assert not te.is_te_min_version("1.9.0", check_equality=False)
    assert te.is_te_min_version("1.8.5", check_equality=False)
    assert not te.is_te_min_version("1.10")  # 1.10 > 1.9: a string comparison would say otherwise
    assert te.require_te("x").distributed.CudaRNGStatesTracker is FakeTETracker


def test_version_from_pip_metadata_when_module_has_none(fake_te, monkeypatch):
    del fake_te.__version__
    monkeypatch.setattr(te.importlib.metadata, "version", lambda dist: "2.1.0+cu12")
    te._reset_te_cache()
    assert te.is_te_min_version("2.1.0") and not te.is_te_min_version("2.2")


def test_te_tracker_used_when_requested(fake_te):
    tracker = mr.get_cuda_rng_tracker(use_te_rng_tracker=True)
    assert isinstance(tracker, FakeTETracker)
    assert not tracker.is_initialized()
    mr.model_parallel_manual_seed(5, tp_rank=1, ep_rank=0, expt_tp_rank=0)  # seeds the TE tracker
    assert tracker.states_ == {"data-parallel-rng": 5, "model-parallel-rng": 5 + 2719, "expert-parallel-rng": 5 + 1024}
    assert tracker.is_initialized()
    with pytest.raises(RNGTrackerError, match="already exists"):
        tracker.add("model-parallel-rng", 1)
    with pytest.raises(RNGTrackerError, match="seed 5"):
        tracker.add("other", 5)
    with tracker.fork("expert-parallel-rng"):
        assert tracker.forked == "expert-parallel-rng"


def test_te_inference_tracker_is_noop(fake_te):
    tracker = mr.get_cuda_rng_tracker(use_te_rng_tracker=True, inference_rng_tracker=True)
    tracker.add("a", 1)
    tracker.set_states({"b": 2})
    assert tracker.get_states() == {}
    with tracker.fork("a"):
        assert not hasattr(tracker, "forked")


def test_te_too_old_for_tracker(fake_te):
    fake_te.__version__ = "1.4.0"
    te._reset_te_cache()
    with pytest.raises(ConfigError, match=r"transformer-engine >= 1.5.0.*found 1.4.0"):
        mr.initialize_rng_tracker(use_te_rng_tracker=True)
