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
counters per group: the fast path), ``intercept`` (torch.distributed's collectives wrapped while enabled),
``watch`` (the background thread, the store, the report), ``diagnose`` (records -> the line and the table).
See docs/doctor.md.
"""
from __future__ import annotations

import atexit
from typing import IO, Any, Optional

from megashard.doctor.diagnose import NO_HEARTBEAT, attempt_dirs, format_table, read_run_dir, summarize
from megashard.doctor.watch import Doctor, default_interval

__all__ = ["Doctor", "NO_HEARTBEAT", "attempt_dirs", "current", "default_interval", "disable", "enable", "format_table",
           "read_run_dir", "set_step", "summarize"]

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
    if state is None and ms.is_initialized():
        state = ms.get_parallel_state()
    if timeout is None:
        if state is None:
            raise ConfigError("megashard.doctor.enable() needs timeout= (seconds) when no ParallelState is given")
        timeout = state.config.timeout
    if not timeout or timeout <= 0:
        raise ConfigError(f"megashard.doctor.enable(timeout={timeout!r}): the timeout must be a positive number of "
                          "seconds (parallel.timeout)")
    doctor = Doctor(timeout, out_dir, interval=interval, store=store, stream=stream)
    if state is not None:
        doctor.register_state(state)
    else:
        import torch.distributed as dist

        doctor.ledger.register(dist.group.WORLD, "world", range(dist.get_world_size()), default=True)
    _CURRENT[0] = doctor.start()
    if not _AT_EXIT[0]:
        atexit.register(disable)  # files written and torch's functions back even if the script never disables
        _AT_EXIT[0] = True
    return doctor


def disable(reason: str = "exit") -> None:
    """Stop the doctor (writes its file, with ``reason`` ``exit`` or ``failure``); a no-op when it is off."""
    doctor, _CURRENT[0] = _CURRENT[0], None
    if doctor is not None:
        doctor.stop(reason)


def current() -> Optional[Doctor]:
    """The enabled doctor of this process, or None."""
    return _CURRENT[0]


def set_step(step: int) -> None:
    """Tell the doctor the training step (shown next to every rank's last collective); free when it is off."""
    doctor = _CURRENT[0]
    if doctor is not None:
        doctor.ledger.step = step
