"""The current :class:`~megashard.state.ParallelState`: what the module-level functions and Megatron's facade use.

``initialize()`` creates a state and makes it current, ``get_parallel_state()`` returns it, ``set_parallel_state()``
swaps it (e.g. while running one module of a multi-module model), ``destroy()`` tears it down. Other states can
exist next to it — pass them around explicitly.

:func:`current_locals` is the per-layout state (RNG tracker, memory buffer, virtual-pipeline rank) the Megatron-style
functions act on: the current state's, or, without a current state, a *detached* one of the process, so that
``get_cuda_rng_tracker()`` and ``get_global_memory_buffer()`` work before ``initialize()`` as they do in
Megatron-LM. ``initialize()`` hands the detached one's contents to the state it creates (a tracker seeded before
it keeps its streams), and ``destroy()`` empties both.
"""
from __future__ import annotations

from typing import Any, Mapping

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError
from megashard.layout import RankLayout
from megashard.state.core import ParallelState
from megashard.state.devices import init_distributed
from megashard.state.layout_locals import LayoutLocals
from megashard.state.pool import before_release_at_exit

__all__ = ["current_locals", "destroy", "get_parallel_state", "initialize", "is_initialized", "set_parallel_state"]

_CURRENT: ParallelState | None = None
#: The per-layout state used while no state is current (before initialize, after destroy).
_DETACHED = LayoutLocals()


def initialize(config: ParallelConfig | None = None, *, layout: RankLayout | None = None,
               agree_on: Mapping[str, Any] | None = None, rank_offset: int | None = None,
               **sizes: Any) -> ParallelState:
    """Create the current :class:`ParallelState` (initialising torch.distributed from the environment if needed).

    ``initialize(ParallelConfig(tp=2))`` or ``initialize(tp=2, pp=2)``. ``layout``: the config's
    :class:`~megashard.layout.RankLayout` when already resolved (not resolved again); ``agree_on``: more fields
    every rank must agree on; ``rank_offset``: the layout covers the global ranks ``rank_offset ..
    rank_offset + layout.world_size - 1`` only, and only they call this (see :class:`ParallelState`).
    """
    global _CURRENT
    from megashard.config.argcheck import check_arg

    if config is not None and not isinstance(config, ParallelConfig):
        raise ConfigError(f"initialize: config={config!r} (type {type(config).__name__}) must be a ParallelConfig "
                          "(or give sizes: initialize(tp=2, pp=2))")
    if layout is not None and not isinstance(layout, RankLayout):
        raise ConfigError(f"initialize: layout={layout!r} (type {type(layout).__name__}) must be a RankLayout or None")
    if agree_on is not None and not isinstance(agree_on, Mapping):
        raise ConfigError(f"initialize: agree_on={agree_on!r} (type {type(agree_on).__name__}) must be a mapping of "
                          "field names to values, or None")
    check_arg("initialize", "rank_offset", rank_offset, "int>=0?")
    if config is None:
        config = ParallelConfig.from_dict(sizes)
    elif sizes:
        raise ConfigError(f"pass either a ParallelConfig or sizes, not both (got extra {sorted(sizes)})")
    if _CURRENT is not None:
        raise StateError(
            "megashard is already initialised; call megashard.destroy() first (or keep the returned "
            "ParallelState and create another one directly with ParallelState(config))"
        )
    init_distributed(config)
    state = ParallelState(config, layout, agree_on=agree_on, rank_offset=rank_offset)
    state.locals.take_over(_DETACHED)  # what the facade set up before initialize() belongs to this state now
    _CURRENT = state
    return state


def is_initialized() -> bool:
    """Whether a current state exists."""
    return _CURRENT is not None


def get_parallel_state() -> ParallelState:
    """The current state; raises StateError before `initialize` or after `destroy`."""
    if _CURRENT is None:
        raise StateError("megashard parallel state is not initialised: call megashard.initialize(config) first")
    return _CURRENT


def set_parallel_state(state: ParallelState | None) -> ParallelState | None:
    """Make ``state`` current (e.g. while running one module of a multi-module model); returns the previous one.
    ``state``: a :class:`ParallelState` (from :func:`initialize` or :func:`get_parallel_state`) or None."""
    global _CURRENT
    if state is not None and not isinstance(state, ParallelState):
        from megashard.errors import StateError

        hint = (" (a group name: give the state itself, e.g. megashard.get_parallel_state(), and use "
                "state.group(name) for a group)") if isinstance(state, str) else ""
        raise StateError(f"set_parallel_state({state!r}): expects a ParallelState (from megashard.initialize) or "
                         f"None, got {type(state).__name__}{hint}")
    prev, _CURRENT = _CURRENT, state
    return prev


def current_locals() -> LayoutLocals:
    """The RNG tracker, memory buffer and virtual-pipeline rank the module-level functions use: the current
    state's, or the process's detached ones when no state is current."""
    state = _CURRENT
    return state.locals if state is not None else _DETACHED


def destroy() -> None:
    """Tear down the current state: its groups, meshes, RNG tracker, memory buffer and virtual-pipeline rank (and
    whatever the module-level functions held without a state). Safe to call twice."""
    global _CURRENT
    state, _CURRENT = _CURRENT, None
    if state is not None:
        state.destroy()
    _DETACHED.reset()


before_release_at_exit(destroy)  # at exit: the current state's meshes first, then the pool's groups
