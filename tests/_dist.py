"""Run checks on real gloo process groups: one spawn per test module, many checks per spawn.

Usage in a test module::

    def check_tp_groups(rank, world_size):   # module-level, so it pickles by reference
        ...                                    # plain asserts; raise to fail

    @pytest.fixture(scope="module")
    def dist4():
        return spawn_checks([check_tp_groups, ...], world_size=4)

    def test_tp_groups(dist4):
        dist4.assert_ok("check_tp_groups")     # fails naming every failing rank and its traceback

Every process group gets a short timeout so a bug fails fast instead of hanging; the whole spawn has
a deadline after which all ranks are killed and the report names the check each rank was running.

Start-up cost (why the ranks are forked from a preloaded server): importing torch with torch.distributed, DTensor,
DCP and FSDP costs ~3.5 CPU-s per process, which for a 4-rank spawn on a 2-core machine is ~7 s before the first
check runs, and the suite starts ~190 ranks (measured: 2.2-3.2 CPU-s less per rank than with ``spawn``, and fewer
group timeouts on a loaded machine, the ranks starting together). So the ranks come from a ``forkserver`` (one per pytest process, started
once, in a process without CUDA) that has imported those torch modules already (``PRELOAD``); each rank is a fork of
it and starts in ~0.1 s. Nothing else is shared: each rank is a fresh process that imports the test module and
megashard itself, joins its own process group (one per ``spawn_checks`` call, i.e. per module's fixture) and takes
the caller's environment *as it is at the call* (``os.environ`` is copied to every rank, so a fixture's
``monkeypatch.setenv`` or ``os.environ[...] = dir`` reaches the ranks as with ``spawn``). megashard is not preloaded:
its import-time state stays per rank. ``cuda=True``, ``backend="nccl"`` or ``MEGASHARD_TEST_START=spawn`` in the
environment use plain ``spawn`` (every rank imports torch itself), as before. New tests need nothing new: call
``spawn_checks`` as above.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

Check = Callable[[int, int], None]
_UNSET = object()

# What the forkserver imports once so that each forked rank need not (torch's import is most of a rank's start-up).
# torch modules only: megashard (import-time state, e.g. its CUDA probe) is imported by each rank itself.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "torch.nn.functional", "numpy",
           "yaml", "pytest"]
START_ENV = "MEGASHARD_TEST_START"  # "spawn": every rank a fresh interpreter (no forkserver)
_forkserver_ready: list[bool] = []


def _stop_forkserver() -> None:
    """At exit: end the forkserver and wait for it, so nothing is left behind and the ranks' CPU time (reaped by the
    server) counts toward this process's children (``/usr/bin/time``, rusage)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own (its tests use it); absent: leave it
    if stop is not None:
        try:
            stop()
        except OSError:
            pass


def _context(cuda: bool):
    """The multiprocessing context the ranks start from: the preloaded forkserver, or ``spawn`` for CUDA/NCCL (no
    fork of anything that might have touched a device) or when the environment asks for it."""
    if cuda or os.environ.get(START_ENV, "forkserver") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _forkserver_ready:
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the server itself never sees a GPU (read when it starts)
        try:
            forkserver.ensure_running()
        finally:
            if saved is _UNSET:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        _forkserver_ready.append(True)
        atexit.register(_stop_forkserver)
    return ctx


def _worker(rank: int, world_size: int, init_file: str, checks: Sequence[Check], q, pg_timeout: float, backend: str,
            device_id: str | None = None, env: dict[str, str] | None = None):
    if env is not None:  # the caller's environment at the call (a forked rank has the forkserver's)
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout), **({"device_id": torch.device(device_id)} if device_id else {}),
        )
    except BaseException:  # noqa: BLE001 - report, do not hang
        q.put(("error", rank, "<init_process_group>", traceback.format_exc()))
        q.put(("done", rank, None, None))
        return
    for check in checks:
        name = check.__name__
        q.put(("start", rank, name, None))
        try:
            check(rank, world_size)
        except BaseException:  # noqa: BLE001
            q.put(("error", rank, name, traceback.format_exc()))
        else:
            q.put(("ok", rank, name, None))
    try:
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        pass
    q.put(("done", rank, None, None))


@dataclass
class DistResults:
    world_size: int
    errors: dict[str, dict[int, str]] = field(default_factory=dict)
    passed: dict[str, set[int]] = field(default_factory=dict)
    hung: dict[int, str] = field(default_factory=dict)  # rank -> check it was running at the deadline

    def assert_ok(self, name: str) -> None:
        """Fail with one message per failing rank if check ``name`` failed (or never finished) anywhere."""
        problems = []
        for rank, tb in sorted(self.errors.get(name, {}).items()):
            problems.append(f"--- rank {rank} of {self.world_size} failed {name}:\n{tb}")
        init = self.errors.get("<init_process_group>", {})
        for rank, tb in sorted(init.items()):
            problems.append(f"--- rank {rank}: init_process_group failed:\n{tb}")
        for rank, running in sorted(self.hung.items()):
            problems.append(f"--- rank {rank} timed out while running {running}")
        missing = set(range(self.world_size)) - self.passed.get(name, set()) - set(self.errors.get(name, {}))
        if missing and not problems:
            problems.append(f"--- ranks {sorted(missing)} never ran {name} (an earlier check hung)")
        if problems:
            raise AssertionError("\n".join(problems))


def spawn_checks(
    checks: Sequence[Check],
    world_size: int,
    *,
    timeout: float = 240.0,
    pg_timeout: float = 30.0,
    backend: str = "gloo",
    cuda: bool = False,
    device_id: str | None = None,
) -> DistResults:
    """Start ``world_size`` processes (forked from the preloaded forkserver; see the module's docstring), join one
    process group, run every check on every rank.

    ``timeout`` (s) bounds the whole spawn; ``pg_timeout`` (s) is every collective's timeout. The processes see no
    GPU (``CUDA_VISIBLE_DEVICES=""``) unless ``cuda=True`` (tests/gpu): on a GPU machine the CPU tests stay CPU
    tests (megashard's ``auto`` device would otherwise pick the GPU). ``device_id`` (e.g. ``"cpu:0"``): the device
    the default group is bound to (``init_process_group(device_id=...)``).
    """
    ctx = _context(cuda or backend == "nccl")
    q = ctx.Queue()
    results = DistResults(world_size)
    with tempfile.TemporaryDirectory(prefix="megashard-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        env = dict(os.environ)
        if not (cuda or backend == "nccl"):
            env["CUDA_VISIBLE_DEVICES"] = ""  # set by each rank before anything touches CUDA
        procs = [
            ctx.Process(target=_worker,
                        args=(r, world_size, init_file, list(checks), q, pg_timeout, backend, device_id, env),
                        daemon=True)
            for r in range(world_size)
        ]
        hidden = None if cuda or backend == "nccl" else os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET)
        if hidden is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by each spawned child at start (spawn copies it)
        try:
            for p in procs:
                p.start()
        finally:
            if hidden is not None:
                if hidden is _UNSET:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        running: dict[int, str] = {r: "<startup>" for r in range(world_size)}
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                kind, rank, name, payload = q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                for r, p in enumerate(procs):  # a rank that died without saying so
                    if r not in done and not p.is_alive() and p.exitcode not in (0, None):
                        results.errors.setdefault(running[r], {})[r] = f"process exited with code {p.exitcode}"
                        done.add(r)
                continue
            if kind == "start":
                running[rank] = name
            elif kind == "ok":
                results.passed.setdefault(name, set()).add(rank)
            elif kind == "error":
                results.errors.setdefault(name, {})[rank] = payload
            elif kind == "done":
                done.add(rank)
        for r in range(world_size):
            if r not in done:
                results.hung[r] = running[r]
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return results
