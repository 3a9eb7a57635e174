"""The CUDA code paths that can be checked without a GPU: one clear error (and nothing lost) when CUDA, NCCL or
TransformerEngine is missing, and the misuse of ``mem_alloc_context``. The GPU itself is tests/gpu's job; on a GPU
machine these run as on a CPU machine too (tests/conftest.py hides the GPU from every test not marked ``gpu``)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, TransformerEngineMissingError
from megashard.state.current import current_locals
from megashard.state.devices import check_devices, cuda_unavailable_reason
from megashard.state.memory import GlobalMemoryBuffer
from megashard.state.rng import get_cuda_rng_tracker, initialize_rng_tracker, model_parallel_manual_seed
from megashard.state.rng_tracker import RNGStatesTracker, _get_cuda_rng_state, _set_cuda_rng_state


@pytest.fixture(autouse=True)
def _fresh_tracker():
    current_locals().reset()
    yield
    current_locals().reset()


def test_reason_names_the_build(monkeypatch):
    reason = cuda_unavailable_reason()
    if torch.version.cuda is None:
        assert reason == f"this machine has no usable CUDA device (torch {torch.__version__}, a CPU-only build)"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_unavailable_reason() == (
        f"this machine has no usable CUDA device (torch {torch.__version__} built for CUDA 12.8 finds none: no "
        "NVIDIA driver or GPU, CUDA_VISIBLE_DEVICES='')")


@pytest.mark.parametrize("config, message", [
    (dict(device="cuda"), "parallel.device=cuda, but this machine has no usable CUDA device"),
    (dict(backend="nccl"), "parallel.backend=nccl needs CUDA devices, but this machine has no usable CUDA device"),
    (dict(backend="nccl", device="cuda"), "parallel.device=cuda, but this machine has no usable CUDA device"),
])
def test_device_checks_name_field_and_fix(config, message):
    with pytest.raises(ConfigError) as info:
        check_devices(ParallelConfig(**config), prefix="parallel.")
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text
    assert text.endswith("use parallel.device=cpu (or auto) and parallel.backend=gloo (or auto) on this machine")
    if torch.version.cuda is None:  # a CPU-only build: the error says how to get a CUDA one
        assert "for GPUs install a CUDA build of torch (in a megashard checkout: TORCH_CUDA=auto bash tools/setup.sh; " \
               "see docs/gpu.md), or use parallel.device=cpu" in text, text


def test_a_cpu_only_torch_is_told_how_to_get_a_cuda_build(monkeypatch):
    """Also where this torch is a CUDA build: as a CPU-only one it names the way to a CUDA build; a CUDA build that
    sees no GPU does not (its reason names the driver and CUDA_VISIBLE_DEVICES instead)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"^parallel.device=cuda, but this machine has no usable CUDA device \(torch "
                       r".*, a CPU-only build\); for GPUs install a CUDA build of torch \(in a megashard checkout: "
                       r"TORCH_CUDA=auto bash tools/setup.sh; see docs/gpu.md\), or use parallel.device=cpu"):
        check_devices(ParallelConfig(device="cuda"), prefix="parallel.")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ConfigError) as info:
        check_devices(ParallelConfig(device="cuda"), prefix="parallel.")
    assert "CUDA build of torch" not in str(info.value) and "built for CUDA 13.0 finds none" in str(info.value)


def test_nccl_on_cpu_refused_when_the_config_is_built():
    with pytest.raises(ConfigError, match=r"^backend='nccl' runs on CUDA devices only, but device='cpu'"):
        ParallelConfig(backend="nccl", device="cpu")


def test_parallel_state_refuses_cuda_on_a_running_cpu_world():
    """A script that started its own (gloo) default group and asks for CUDA meshes: one line before any group."""
    import torch.distributed as dist

    from megashard.state import ParallelState, pooled_group_count

    if dist.is_initialized():
        pytest.skip("a default group is up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = pooled_group_count()
        with pytest.raises(ConfigError, match=r"^device=cuda, but this machine has no usable CUDA device"):
            ParallelState(ParallelConfig(device="cuda"))
        with pytest.raises(ConfigError, match=r"^device=cuda, but this machine has no usable CUDA device"):
            ParallelState(ParallelConfig(), device_type="cuda")
        assert pooled_group_count() == before  # refused before creating anything
    finally:
        dist.destroy_process_group()


def test_cudagraphable_rng_needs_cuda_and_keeps_the_streams():
    with pytest.raises(ConfigError, match=r"^use_cudagraphable_rng=True needs CUDA .*use use_cudagraphable_rng=False"):
        RNGStatesTracker(use_cudagraphable_rng=True)
    seeds = model_parallel_manual_seed(11, tp_rank=0, ep_rank=0, expt_tp_rank=0)
    tracker = get_cuda_rng_tracker()
    before = {k: v.clone() for k, v in tracker.get_states().items()}
    with pytest.raises(ConfigError, match="use_cudagraphable_rng=True needs CUDA"):
        model_parallel_manual_seed(12, use_cudagraphable_rng=True, force_reset_rng=True, tp_rank=0, ep_rank=0,
                                   expt_tp_rank=0)
    assert get_cuda_rng_tracker() is tracker and sorted(tracker.get_states()) == sorted(seeds)
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in before.items()), "a refused reset lost the streams"


def test_te_tracker_missing_keeps_the_streams():
    from megashard.state.te import have_te

    if have_te():
        pytest.skip("transformer_engine is importable here")
    model_parallel_manual_seed(11, tp_rank=0, ep_rank=0, expt_tp_rank=0)
    tracker = get_cuda_rng_tracker()
    with pytest.raises(TransformerEngineMissingError, match=r"^use_te_rng_tracker=True needs NVIDIA TransformerEngine"):
        initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    assert get_cuda_rng_tracker() is tracker and tracker.is_initialized()


def test_graph_safe_state_helpers_address_the_cpu_generator():
    """Without CUDA, graph_safe is ignored: plain state tensors of the CPU default generator."""
    torch.manual_seed(5)
    state = _get_cuda_rng_state(clone=True, graph_safe=True)
    assert isinstance(state, torch.Tensor) and torch.equal(state, torch.get_rng_state())
    want = torch.rand(8)
    _set_cuda_rng_state(state, graph_safe=True)
    assert torch.equal(torch.rand(8), want)


def test_memory_buffer_on_cuda_without_cuda():
    with pytest.raises(ConfigError, match=r"^GlobalMemoryBuffer\(device='cuda'\): this machine has no usable CUDA "
                                          r"device .*; use device='cpu'"):
        GlobalMemoryBuffer(device="cuda")
    assert GlobalMemoryBuffer().device == torch.device("cpu")


def test_mem_alloc_context_misuse_is_named_and_loses_nothing():
    buf = GlobalMemoryBuffer(device="cpu")
    kept = buf.get_tensor((4,), torch.float32, "x")
    kept.fill_(7.0)
    with pytest.raises(ConfigError, match=r"^get_tensor\('x'\): mem_alloc_context must be a callable returning a "
                                          r"context manager, got nullcontext .*e\.g\. mem_alloc_context=lambda: "
                                          r"torch\.cuda\.use_mem_pool\(pool\)"):
        buf.get_tensor((8,), torch.float32, "x", mem_alloc_context=contextlib.nullcontext())
    with pytest.raises(ConfigError, match=r"^get_tensor\('x'\): mem_alloc_context\(\) returned int 5, not a context "
                                          r"manager"):
        buf.get_tensor((8,), torch.float32, "x", mem_alloc_context=lambda: 5)
    assert buf.buffer[("x", torch.float32)].numel() == 4 and torch.equal(kept, torch.full((4,), 7.0))
    # Requests that fit never call it: a misused context only matters when the buffer must grow.
    assert buf.get_tensor((2,), torch.float32, "x", mem_alloc_context=contextlib.nullcontext()).numel() == 2
