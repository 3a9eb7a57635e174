import os

import pytest

# Spawned gloo ranks share two cores: one thread each keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a usable CUDA device (tests/gpu); skipped with a one-line reason where there is none",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, each with the one-line reason, on a machine without a usable CUDA device."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    from megashard.state.devices import cuda_unavailable_reason  # imports torch: only when GPU tests are collected

    reason = cuda_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"needs CUDA: {reason}")
        for item in marked:
            item.add_marker(skip)
