import os
import sys

import pytest

_REAL_CUDA: list = []  # [torch.cuda.is_available()] of this machine, asked once

# Spawned gloo ranks share two cores: one thread each keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The check before launch (megashard.launch.preflight.check_collectives) rehearses every rank of a job before
# `megashard run` starts it: ~5-10 s of these two cores per launch. Tests of other things launch without it; the
# tests of the check itself and of the README's command turn it back on (MEGASHARD_CHECK=auto in their env).
os.environ.setdefault("MEGASHARD_CHECK", "off")


LONG_ENV = "MEGASHARD_LONG_TESTS"
"""``1``: run the long end-to-end tests too (as ``--long``); CI does, after the README's command."""


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the long end-to-end tests (marked `long`: several launchers, held-out sweeps); "
                          f"CI runs them after the README's command (or set {LONG_ENV}=1)")


def _long(config) -> bool:
    return bool(config.getoption("--long")) or os.environ.get(LONG_ENV, "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a usable CUDA device (tests/gpu); skipped with a one-line reason where there is none",
    )
    config.addinivalue_line(
        "markers",
        "long: a long end-to-end test (several launchers, a sweep of held-out jobs, a whole job per case): run with "
        "--long (CI does); the README's command runs every other test",
    )


_DESELECTED_LONG: list = []


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` are left out unless ``--long`` (named at the end of the run, with how to run them);
    tests marked ``gpu`` are skipped, each with the one-line reason, on a machine without a usable CUDA device."""
    if not _long(config):
        long_ones = [item for item in items if item.get_closest_marker("long") is not None]
        if long_ones:
            items[:] = [item for item in items if item.get_closest_marker("long") is None]
            config.hook.pytest_deselected(items=long_ones)
            _DESELECTED_LONG.extend(long_ones)
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    from megashard.state.devices import cuda_unavailable_reason  # imports torch: only when GPU tests are collected

    reason = cuda_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"needs CUDA: {reason}")
        for item in marked:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if _DESELECTED_LONG:
        files = len({item.nodeid.split("::")[0] for item in _DESELECTED_LONG})
        terminalreporter.write_line(
            f"megashard: {len(_DESELECTED_LONG)} long end-to-end tests (in {files} files) were not run: "
            f"`pytest tests --long` runs them too (CI does)")


@pytest.fixture(autouse=True)
def _cpu_tests_see_a_cpu_machine(request, monkeypatch):
    """On a machine with a GPU, every test not marked ``gpu`` runs as on a CPU machine: ``torch.cuda.is_available()``
    is False in this process and no subprocess sees a GPU, so megashard's ``auto`` device, the RNG tracker's
    generator and the memory buffer stay on the CPU these tests were written for. Nothing changes without a GPU."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    if not _REAL_CUDA:
        import torch

        _REAL_CUDA.append(torch.cuda.is_available())
    if not _REAL_CUDA[0]:
        yield
        return
    import torch

    import megashard.state.rng_tracker as tracker_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(tracker_module, "_HAS_CUDA", None)  # re-asked (False) inside, forgotten afterwards
    yield


@pytest.fixture(autouse=True)
def _no_process_state_left_behind(request):
    """Every test leaves this process as it found it: no default process group and no megashard state initialised.
    A test that left one would change what the next test sees (several skip when a group is up), so its teardown
    fails naming it, after cleaning up so the tests after it run as they would alone."""
    yield
    dist = sys.modules.get("torch.distributed")
    left = []
    if dist is not None and dist.is_available() and dist.is_initialized():
        left.append("a default process group")
    current = sys.modules.get("megashard.state.current")
    if current is not None and current.is_initialized():
        left.append("megashard's parallel state")
    if not left:
        return
    if current is not None and current.is_initialized():
        current.destroy()
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    pytest.fail(f"{request.node.nodeid} left {' and '.join(left)} initialised in the pytest process: destroy it in a "
                "finally (or a fixture's teardown), or the tests after it see it", pytrace=False)



#: Seconds one test may take before the suite stops with every thread's traceback (MEGASHARD_TEST_LIMIT; 0: none).
#: Not a speed check: a hang in one test would otherwise hold CI until its hard limit and say nothing.
_TEST_LIMIT = float(os.environ.get("MEGASHARD_TEST_LIMIT", "900"))


@pytest.fixture(autouse=True)
def _a_hang_ends_the_run_with_tracebacks(request):
    if _TEST_LIMIT <= 0:
        yield
        return
    import contextlib
    import threading

    capture = request.config.pluginmanager.getplugin("capturemanager")

    def stop() -> None:
        import faulthandler

        # past pytest's capture (it would be lost with the process), to the terminal or CI's log
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            sys.stderr.write(f"\n{request.node.nodeid}: still running after {_TEST_LIMIT:.0f} s "
                             f"(MEGASHARD_TEST_LIMIT); the suite stops here. Every thread:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(_TEST_LIMIT, stop)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
