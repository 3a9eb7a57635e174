"""The communicator pool: one process group per (rank set, timeout, backend), created by its members only.

Every :class:`~megashard.state.ParallelState` of a process asks this pool for its groups, so two states (or a
state and a Megatron ``HyperCommGrid``-style request) that need the same rank set share one communicator.

Why module-level and not owned by a ``ParallelState``: communicators belong to the *default* process group, not to
a layout. PyTorch names a locally-synchronised group by a hash of its ranks and of the number of live groups, so
destroying a state's groups and re-creating the same rank set for the next state would reuse the old group's
store keys and connect to dead sockets. The pool therefore outlives states (re-initialising megashard re-uses the
pooled communicators — also the fast path: creating NCCL communicators is the slow part of start-up) and dies with
the default group: a new default group empties it, and :func:`release_process_groups` destroys it at shutdown.

Releasing matters: a communicator still referenced here when the interpreter shuts down keeps its backend threads
(gloo's ``pt_gloo_runloop`` and ``gloo_tcp_loop``) alive into finalization, where a thread that needs the GIL to
drop its last tensor reference is killed mid-destructor ("terminate called without an active exception",
SIGABRT). So the pool is released before ``destroy_process_group()`` (:func:`megashard.state.end_distributed`)
and, for scripts that never call it, at exit (``atexit``), while Python is fully alive.
"""
from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["pooled_group", "balance_world_group_count", "before_release_at_exit", "pooled_group_count", "register_user", "release_idle_groups", "release_process_groups"]

_POOL: dict[tuple, dist.ProcessGroup] = {}
_POOL_WORLD: list = [None]  # the default group the pool belongs to
_RELEASE_AT_EXIT: list = [False]
_PLACEHOLDERS: list = [0]  # placeholder groups created so far (their pool keys)
_BEFORE_RELEASE: list = []  # what runs at exit before the pool is released (before_release_at_exit)
#: objects whose ``pooled_groups_in_use()`` name the groups they still use (live ParallelStates): release_idle_groups
#: keeps those
_USERS: "weakref.WeakSet" = weakref.WeakSet()


def register_user(user: Any) -> None:
    """Record an object (a ParallelState) whose ``pooled_groups_in_use()`` lists pooled groups it still uses."""
    _USERS.add(user)


def release_idle_groups() -> int:
    """Destroy every pooled communicator no live user (ParallelState) uses — Megatron's ``destroy_model_parallel``
    semantics: no groups left behind; returns how many. The names stay taken (``destroy_group_keep_name``), so a
    later state creates fresh groups safely."""
    from megashard._compat import destroy_group_keep_name

    in_use = {id(pg) for user in list(_USERS) for pg in user.pooled_groups_in_use()}
    idle = [k for k, pg in _POOL.items() if id(pg) not in in_use]
    for key in idle:
        pg = _POOL.pop(key)
        try:
            destroy_group_keep_name(pg)
        except (ValueError, RuntimeError, AssertionError):  # already destroyed with its default group
            pass
    return len(idle)


def pooled_group(ranks: tuple[int, ...], timeout: timedelta, backend: str | None, desc: str,
                 pg_options: Any = None, *, options_key: tuple | None = None) -> tuple[dist.ProcessGroup, bool]:
    """The pooled group for ``ranks`` (created by its members only on first use, ``backend`` None = the default
    group's); returns ``(group, created_now)``. Only members may call it: no rank waits on groups it is not in.
    ``pg_options`` (e.g. ``ProcessGroupNCCL.Options``) go to ``new_group``; ``options_key`` is their hashable form
    (groups with different options are different communicators; without a key the options object itself is the
    key: the same object shares the communicator, another one gets its own)."""
    world = dist.group.WORLD
    if _POOL_WORLD[0] is not world:  # a new default group: the old communicators died with the old one
        _POOL.clear()
        _POOL_WORLD[0] = world
    key = (ranks, timeout.total_seconds(), backend, options_key if options_key is not None else pg_options)
    pg = _POOL.get(key)
    if pg is not None:
        return pg, False
    from megashard._compat import members_only_options, options_with_timeout

    # the timeout NCCL gets (without torch's warning); made among the members, never split from the default group
    opts = members_only_options(options_with_timeout(pg_options, timeout), backend)
    pg = dist.new_group(list(ranks), timeout=timeout, backend=backend, pg_options=opts,
                        use_local_synchronization=True, group_desc=desc)
    _POOL[key] = pg
    if not _RELEASE_AT_EXIT[0]:
        atexit.register(_release_at_exit)  # before interpreter shutdown, whatever the script does
        _RELEASE_AT_EXIT[0] = True
    return pg, True


def placeholder_groups(rank: int, n: int, timeout: timedelta) -> int:
    """Create ``n`` never-used one-rank groups of ``rank`` (kept in the pool, released with it) so that this process
    holds as many groups as its peers (see ParallelState._balance_group_count); returns ``n``."""
    for _ in range(n):
        _PLACEHOLDERS[0] += 1
        key = (("placeholder", _PLACEHOLDERS[0]), timeout.total_seconds(), None, None)
        # gloo where available: a one-rank gloo group holds no GPU memory even where NCCL initialises eagerly
        _POOL[key] = dist.new_group([rank], timeout=timeout, backend="gloo" if dist.is_gloo_available() else None,
                                    use_local_synchronization=True, group_desc="megashard:placeholder")
    return max(n, 0)


def balance_world_group_count(created: int, timeout: timedelta) -> int:
    """Pad this rank with placeholder groups up to the most groups any rank of the world created (``created``: this
    rank's count); returns how many. Collective over the default group. For initialisations where some ranks make
    groups and others none (a layout on part of the world): torch names a members-only group by its ranks and the
    number of groups the process holds, so every rank must hold as many before the next group spanning them."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return 0
    import torch

    # nccl reduces CUDA tensors only (the current device, as init_distributed set it); everything else the CPU's
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    t = torch.tensor([created], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return placeholder_groups(dist.get_rank(), int(t.item()) - created, timeout)


def pooled_group_count() -> int:
    """How many communicators megashard holds in this process (for tests and benchmarks)."""
    return len(_POOL)


def release_process_groups() -> None:
    """Destroy every pooled communicator and drop the pool's references, so their backend threads end now (at
    shutdown, before ``destroy_process_group()``; also registered with ``atexit``). Idempotent.

    Do not initialise megashard again in the same default group afterwards: re-created groups would get
    the released groups' names (see the module note).
    """
    pgs = list(_POOL.values())
    _POOL.clear()
    _POOL_WORLD[0] = None
    for pg in pgs:
        try:
            dist.destroy_process_group(pg)
        except (ValueError, RuntimeError, AssertionError):  # already destroyed with its default group
            pass


def before_release_at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit before the pool is released (:mod:`megashard.state.current` registers its ``destroy``, so
    the current state's meshes let go of their groups first) — without this module importing the current state."""
    _BEFORE_RELEASE.append(fn)


def _release_at_exit() -> None:
    """At exit, for scripts that end without ``megashard.destroy()`` / ``end_distributed()``: the current state's
    meshes and the pool let go of their groups while Python is still fully alive."""
    for fn in _BEFORE_RELEASE:
        fn()
    release_process_groups()
