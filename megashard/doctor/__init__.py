"""The hang doctor: when a collective on a megashard group does not finish within ``parallel.timeout``, every waiting
rank prints one line naming the group, the operation and its number there, and the ranks that never reached it with
what they do instead; ``megashard doctor RUN_DIR`` prints the same after the fact.

    import megashard.doctor
    state = megashard.initialize(config)
    megashard.doctor.enable(state, out_dir="runs/mine")      # timeout: state.config.timeout
    for step in range(steps):
        megashard.doctor.set_step(step)
        ...
    megashard.doctor.disable()                                # also at exit

``megashard run`` turns it on for the training job (``train.doctor``, default true). Modules: ``ledger`` (in-memory
counters per group: the fast path), ``intercept`` (torch.distributed's collectives, and the functional ones DTensor
uses, wrapped while enabled), ``board`` (each rank's entry slot in shared memory: the call it is in, or returned
from), ``watch`` (the background thread, the store, the report), ``identity`` (a world's run id and directory),
``process`` (peers' processes on this host; SIGTERM), ``diagnose`` (records -> the line), ``waitfor`` (deadlock
cycles), ``records`` (the files, checked and sorted by run -> the table), ``endings`` (deaths, and world changes
that are not hangs), ``stragglers`` (which ranks arrive last at the collectives, and by how much). See
docs/doctor.md.
"""
from __future__ import annotations

import atexit
import os
from typing import IO, Any, Optional

from megashard.doctor.diagnose import NO_HEARTBEAT
from megashard.doctor.records import attempt_dirs, format_table, read_attempts, read_run_dir, summarize
from megashard.doctor.watch import Doctor, default_interval

__all__ = ["Doctor", "NO_HEARTBEAT", "attempt_dirs", "current", "default_interval", "disable", "enable", "format_table",
           "read_attempts", "read_run_dir", "register", "set_step", "summarize"]

_CURRENT: list[Optional[Doctor]] = [None]
_AT_EXIT: list[bool] = [False]


def enable(state: Any = None, *, timeout: Optional[float] = None, out_dir: Optional[str] = None,
           interval: Optional[float] = None, store: Any = None, stream: Optional[IO[str]] = None) -> Doctor:
    """Start the hang doctor of this process (every rank calls it; no collective) and return it.

    ``state``: a :class:`~megashard.state.ParallelState` whose groups to watch (default: the current one, if any;
    the default group is always watched, as ``world``); more groups with ``doctor.register(pg, name)``.
    ``timeout``: seconds after which an open call is reported (default ``state.config.timeout``).
    ``out_dir``: the run directory for ``doctor/rank_<r>.json`` (None: no files).
    """
    import megashard.state as ms
    from megashard.errors import ConfigError, StateError

    if _CURRENT[0] is not None:
        raise StateError("the hang doctor is already enabled in this process: call megashard.doctor.disable() first")
    _check_arguments(state, timeout, out_dir, interval, store, stream)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise StateError("megashard.doctor.enable() needs torch.distributed initialised: call "
                         "megashard.initialize(...) (or torch.distributed.init_process_group(...)) first")
    if state is None and ms.is_initialized():
        state = ms.get_parallel_state()
    if timeout is None:
        if state is None:
            raise ConfigError("megashard.doctor.enable() needs timeout= (seconds) when no ParallelState is given")
        timeout = state.config.timeout
    out_dir = os.fspath(out_dir) if out_dir is not None else None
    doctor = Doctor(timeout, out_dir, interval=interval, store=store, stream=stream)
    if state is not None:
        doctor.register_state(state)
    else:
        doctor.ledger.register(dist.group.WORLD, "world", range(dist.get_world_size()), default=True)
    _CURRENT[0] = doctor.start()
    if not _AT_EXIT[0]:
        atexit.register(disable)  # files written and torch's functions back even if the script never disables
        _AT_EXIT[0] = True
    return doctor


def _check_arguments(state: Any, timeout: Any, out_dir: Any, interval: Any, store: Any, stream: Any) -> None:
    """The arguments of :func:`enable`, checked as the config checks ``parallel.timeout`` (one line each)."""
    import os

    from megashard.config.parallel import MAX_TIMEOUT
    from megashard.errors import ConfigError

    def seconds(name: str, value: Any, upper: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:  # nan, inf too
            raise ConfigError(f"megashard.doctor.enable({name}={value!r}): {name} must be a positive number of "
                              f"seconds, at most {upper:.0e}" + (" (as parallel.timeout)" if name == "timeout" else ""))

    if timeout is not None:
        seconds("timeout", timeout, MAX_TIMEOUT)
    if interval is not None:
        seconds("interval", interval, float(timeout) if timeout is not None else MAX_TIMEOUT)
    if state is not None and not (hasattr(state, "named_groups") and hasattr(state, "config")):
        raise ConfigError(f"megashard.doctor.enable(state={state!r:.60}): a megashard ParallelState is expected (what "
                          "megashard.initialize returns), or None")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise ConfigError(f"megashard.doctor.enable(out_dir={out_dir!r:.60}): a directory path (str) is expected, or "
                          "None for no files")
    if out_dir is not None and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"megashard.doctor.enable(out_dir={os.fspath(out_dir)!r}): exists and is not a directory")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise ConfigError(f"megashard.doctor.enable(stream={stream!r:.60}): a text stream (with write) is expected")
    if store is not None and not all(callable(getattr(store, m, None)) for m in ("set", "get", "check")):
        raise ConfigError(f"megashard.doctor.enable(store={store!r:.60}): a torch.distributed.Store is expected")


def register(pg: Any, name: str, ranks: Any = None) -> None:
    """Watch the collectives on process group ``pg`` as ``name`` (every rank may call it; a no-op on ranks outside
    the group and when the doctor is off)."""
    if not isinstance(name, str) or not name:
        from megashard.errors import ConfigError

        raise ConfigError(f"megashard.doctor.register(name={name!r:.60}): name must be a non-empty string (how the "
                          "group is named in reports)")
    doctor = _CURRENT[0]
    if doctor is not None:
        doctor.register(pg, name, ranks)


def disable(reason: str = "exit") -> None:
    """Stop the doctor (writes its file, with ``reason`` ``exit``, ``failure``, or ``world_change``: this rank's world
    ends on purpose — an elastic re-formation in-process — so what its ranks found about the ranks it lost is a
    planned change, not a hang, in ``megashard doctor``); a no-op when it is off."""
    if reason not in ("exit", "failure", "world_change"):
        from megashard.errors import ConfigError

        raise ConfigError(f"megashard.doctor.disable(reason={reason!r:.60}): reason must be 'exit', 'failure' or "
                          "'world_change'")
    doctor, _CURRENT[0] = _CURRENT[0], None
    if doctor is not None:
        doctor.stop(reason)


def current() -> Optional[Doctor]:
    """The enabled doctor of this process, or None."""
    return _CURRENT[0]


def set_step(step: int) -> None:
    """Tell the doctor the training step (shown next to every rank's last collective); free when it is off."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        from megashard.errors import ConfigError

        raise ConfigError(f"megashard.doctor.set_step(step={step!r:.60}): step must be an integer >= 0")
    doctor = _CURRENT[0]
    if doctor is not None:
        doctor.ledger.set_step(step)
