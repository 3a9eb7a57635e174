"""Collective steps of save and load: every rank leaves a step with the same result or the same error.

A checkpoint step can fail on one rank only (a bad argument, a full disk, a damaged file). If that rank
raised alone, its peers would wait in the next collective until the process-group timeout. So every
step of :func:`~megashard.checkpoint.saving.save` and :func:`~megashard.checkpoint.loading.load` ends
in :func:`agree`: each rank hands in its value and its error (if any), and either every rank gets the
values or every rank raises the error of the lowest failing rank — its own exception on that rank,
a copy prefixed ``(raised on rank r)`` on the others (so a launcher prints it once, see
:mod:`megashard.launch.worker`).

Errors cross ranks pickled and callers catch megashard's error classes, so anything that is not a
:class:`~megashard.errors.MegashardError` is raised as a :class:`~megashard.errors.CheckpointError`
describing it (:func:`portable`; on its own rank chained to the original exception).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megashard.errors import CheckpointError, MegashardError

__all__ = ["agree", "capture", "dist_on", "portable", "rank_world", "unwrap_dcp_error"]


def dist_on() -> bool:
    """True if the default process group exists (else save / load run as one process)."""
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` in the default group; ``(0, 1)`` without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist_on() else (0, 1)


def portable(e: Optional[BaseException]) -> Optional[BaseException]:
    """``e`` itself if it is a megashard error (picklable, keeps its type), else a CheckpointError describing it."""
    if e is None or isinstance(e, MegashardError):
        return e
    return CheckpointError(f"{type(e).__name__}: {e}")


def unwrap_dcp_error(e: BaseException) -> BaseException:
    """The megashard error inside DCP's CheckpointException (lowest rank first), else a CheckpointError.

    DCP gathers every rank's exception of a save / load into one ``CheckpointException`` raised on
    every rank; megashard's own errors (e.g. a damaged file found by the reader) come out unchanged.
    """
    if isinstance(e, CheckpointException):
        for rank in sorted(e.failures):
            exc = e.failures[rank][0]
            if isinstance(exc, MegashardError):
                return exc
        first = sorted(e.failures)[0] if e.failures else None
        inner = e.failures[first][0] if first is not None else e
        return CheckpointError(f"DCP failed on ranks {sorted(e.failures)}; rank {first}: {type(inner).__name__}: {inner}")
    return e


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Optional[BaseException]]:
    """``(fn(*args, **kwargs), None)``, or ``(None, exception)`` if it raised: a rank's input to :func:`agree`."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - handed to agree(), which raises it on every rank
        return None, e


def agree(value: Any = None, error: Optional[BaseException] = None, *,
          rank0: Optional[Callable[[list], Any]] = None, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Collective over the default group (or ``group``, which holds every rank in the same order: e.g. the
    group of a background save): end a step with the same outcome on every rank.

    Without ``rank0``: all-gather every rank's ``(value, error)``; if any rank failed, every rank raises
    the lowest failing rank's error, else every rank returns the values in rank order.

    With ``rank0``: gather to rank 0 only; rank 0 raises the lowest failing rank's error or runs
    ``rank0(values)``; its result (or error) is broadcast and every rank returns (or raises) it. Use it
    for what one rank does for all (touch the directory, write the marker).

    Without a process group: ``[value]`` / ``rank0([value])`` in one process, errors raised by the same rule.
    """
    rank, world = rank_world()
    if not dist_on() or world == 1:
        if error is None and rank0 is not None:
            result, error = capture(rank0, [value])
            if error is None:
                return result
        if error is not None:
            _raise_from(rank, portable(error), rank, error)
        return [value]
    mine = (value, portable(error))
    if rank0 is None:
        pairs: list = [None] * world
        dist.all_gather_object(pairs, mine, group=group)
        _raise_first(pairs, rank, error)
        return [v for v, _ in pairs]
    pairs = [None] * world if rank == 0 else []
    dist.gather_object(mine, pairs if rank == 0 else None, dst=0, group=group)
    outcome: list = [None]
    if rank == 0:
        failed = _first_failure(pairs)
        if failed is not None:
            outcome[0] = (None, failed[1], failed[0])
        else:
            result, err = capture(rank0, [v for v, _ in pairs])
            outcome[0] = (result, portable(err), 0 if err is not None else None)
            error = err if err is not None else error
    dist.broadcast_object_list(outcome, src=0, group=group)
    result, err, origin = outcome[0]
    if err is not None:
        _raise_from(origin, err, rank, error)
    return result


def _first_failure(pairs: Sequence[tuple]) -> Optional[tuple[int, BaseException]]:
    for r, (_, err) in enumerate(pairs):
        if err is not None:
            return r, err
    return None


def _raise_first(pairs: Sequence[tuple], rank: int, own: Optional[BaseException]) -> None:
    failed = _first_failure(pairs)
    if failed is not None:
        _raise_from(failed[0], failed[1], rank, own)


def _raise_from(origin: int, err: BaseException, rank: int, own: Optional[BaseException]) -> None:
    """Raise ``err`` (portable) that rank ``origin`` raised: on that rank its own exception (a megashard error
    as is, anything else as ``err`` chained to it), elsewhere a copy that names the origin (same type and
    attributes, e.g. ``problems`` of a CheckpointCorruptedError)."""
    if origin == rank and own is not None:
        if own is err or isinstance(own, MegashardError):
            raise own
        raise err from own
    copy = type(err)(f"(raised on rank {origin}) {err}")
    copy.__dict__.update(err.__dict__)
    raise copy
