"""TransformerEngine on CUDA: real version values, and its RNG tracker through initialize_rng_tracker
(use_te_rng_tracker=True) drawing the reference sequences. Skipped with TE's own import error when it is not
importable (tools/gpu-check.sh attempts ``pip install transformer-engine[pytorch]`` and reports its failure)."""
from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from megashard.state.current import current_locals
from megashard.state.rng import get_cuda_rng_tracker, initialize_rng_tracker, model_parallel_manual_seed

pytestmark = pytest.mark.gpu

SEED = 99
N = 4096


def _te_or_skip():
    from megashard.errors import TransformerEngineMissingError
    from megashard.state.te import require_te

    try:
        return require_te("tests/gpu/test_cuda_te.py")
    except TransformerEngineMissingError as e:
        cause = e.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
        install = os.environ.get("MEGASHARD_TE_INSTALL_ERROR", "")
        reason = f"transformer_engine not importable ({why})" + (f"; its install failed: {install}" if install else "")
        pytest.skip(" ".join(reason.split()))


@pytest.fixture(autouse=True)
def _fresh_tracker():
    current_locals().reset()
    yield
    current_locals().reset()


def test_te_version_is_real():
    from megashard.state.te import get_te_version, is_te_min_version, parse_version

    te = _te_or_skip()
    import transformer_engine

    text = getattr(transformer_engine, "__version__", None) or importlib.metadata.version("transformer-engine")
    version = get_te_version()
    assert version == parse_version(text), (version, text)
    assert is_te_min_version(str(version)) and not is_te_min_version(str(version), check_equality=False)
    assert is_te_min_version("0.1") and not is_te_min_version("999.0")
    assert te.__name__ == "transformer_engine.pytorch"


def test_te_rng_tracker_draws_reference_sequences():
    te = _te_or_skip()
    from megashard.errors import RNGTrackerError

    torch.cuda.set_device(0)
    initialize_rng_tracker(use_te_rng_tracker=True)
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, te.distributed.CudaRNGStatesTracker), type(tracker).__mro__
    seeds = model_parallel_manual_seed(SEED, te_rng_tracker=True, tp_rank=0, ep_rank=0, expt_tp_rank=0)
    assert get_cuda_rng_tracker() is tracker and tracker.is_initialized()
    ref = {n: torch.Generator(device="cuda").manual_seed(s) for n, s in seeds.items()}
    default = torch.Generator(device="cuda").manual_seed(SEED)
    for name in ("model-parallel-rng", "expert-parallel-rng", "model-parallel-rng"):
        with tracker.fork(name):
            got = torch.rand(N, device="cuda")
        assert torch.equal(got, torch.rand(N, device="cuda", generator=ref[name])), f"TE tracker stream {name}"
        assert torch.equal(torch.rand(N, device="cuda"), torch.rand(N, device="cuda", generator=default)), (
            f"default stream after a TE fork of {name}")
    with pytest.raises(RNGTrackerError, match="already exists"):
        tracker.add("model-parallel-rng", 5)
