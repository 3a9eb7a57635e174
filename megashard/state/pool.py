"""The communicator pool: one process group per (rank set, timeout, backend), created by its members only.

Every :class:`~megashard.state.ParallelState` of a process asks this pool for its groups, so two states (or a
state and a Megatron ``HyperCommGrid``-style request) that need the same rank set share one communicator.

Why module-level and not owned by a ``ParallelState``: communicators belong to the *default* process group, not to
a layout. PyTorch names a locally-synchronised group by a hash of its ranks and of the number of live groups, so
destroying a state's groups and re-creating the same rank set for the next state would reuse the old group's
store keys and connect to dead sockets. The pool therefore outlives states (re-initialising megashard re-uses the
pooled communicators — also the fast path: creating NCCL communicators is the slow part of start-up) and dies with
the default group: a new default group empties it, and :func:`release_process_groups` destroys it at shutdown.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["pooled_group", "pooled_group_count", "release_process_groups"]

_POOL: dict[tuple, dist.ProcessGroup] = {}
_POOL_WORLD: list = [None]  # the default group the pool belongs to


def pooled_group(ranks: tuple[int, ...], timeout: timedelta, backend: str | None, desc: str) -> tuple[dist.ProcessGroup, bool]:
    """The pooled group for ``ranks`` (created by its members only on first use, ``backend`` None = the default
    group's); returns ``(group, created_now)``. Only members may call it: no rank waits on groups it is not in."""
    world = dist.group.WORLD
    if _POOL_WORLD[0] is not world:  # a new default group: the old communicators died with the old one
        _POOL.clear()
        _POOL_WORLD[0] = world
    key = (ranks, timeout.total_seconds(), backend)
    pg = _POOL.get(key)
    if pg is not None:
        return pg, False
    pg = dist.new_group(list(ranks), timeout=timeout, backend=backend, use_local_synchronization=True, group_desc=desc)
    _POOL[key] = pg
    return pg, True


def pooled_group_count() -> int:
    """How many communicators megashard holds in this process (for tests and benchmarks)."""
    return len(_POOL)


def release_process_groups() -> None:
    """Destroy every pooled communicator (at shutdown, before ``destroy_process_group()``).

    Do not initialise megashard again in the same default group afterwards: re-created groups would get
    the released groups' names (see the module note). Destroying the default group releases them too.
    """
    for pg in _POOL.values():
        try:
            dist.destroy_process_group(pg)
        except (ValueError, RuntimeError):
            pass
    _POOL.clear()
