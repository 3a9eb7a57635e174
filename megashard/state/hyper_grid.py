"""Megatron-LM's ``HyperCommGrid`` over megashard's rank grid and communicator pool: member-only group creation.

    grid = HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])   # dim_names[0] varies fastest
    dp = grid.create_pg("dp")                  # this rank's dp group (None on a rank outside the grid)
    dp_cp = grid.create_pg(["cp", "dp"], group_desc="WEIGHT_GRADIENT_COMM_GROUP")
    grid.get_pg(["dp", "cp"]) is dp_cp        # dims in any order
    grid.get_rank_enum("pp")                   # every pp group, as create_pg would enumerate them

Same constructor, methods, rank order and errors as Megatron-LM 0.19 (``megatron/core/hyper_comm_grid.py``), with
two differences by design:

- **Members only.** Megatron's ``create_pg`` calls ``new_subgroups_by_enumeration``, so every rank creates every
  subgroup of the enumeration (``world / group_size`` communicators per call). Here a rank creates only the group it
  belongs to, through :mod:`megashard.state.pool`: ``new_group(..., use_local_synchronization=True)`` by its members.
  Ranks outside the grid (``rank_offset``) create nothing and get ``None``, as in Megatron.
- **One communicator per rank set.** The pool is shared with every :class:`~megashard.state.ParallelState` of the
  process: a grid's ``dp`` group with the same members, timeout, backend and options as a state's *is* that
  state's communicator. Hence :meth:`HyperCommGrid.destroy` forgets the grid's groups without destroying the
  communicators (others may use them); :func:`megashard.state.release_process_groups` (or ``end_distributed``)
  destroys them at the end.

The rank arithmetic is :class:`~megashard.layout.grid.RankGrid`'s (DESIGN §6): a view is a ``RankGrid`` over its
``dim_names`` (first fastest), shifted by ``rank_offset``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch.distributed as dist

from megashard.errors import ConfigError, RankGridError, RankGridKeyError, StateError
from megashard.layout.grid import RankGrid
from megashard.state.pool import pooled_group

__all__ = ["HyperCommGrid"]

_BASE = "base"
_CREATE_PG_OPTIONS = ("timeout", "pg_options", "group_desc")
Dims = Union[str, Sequence[str]]


@dataclass
class _View:
    """One factorisation of the grid's ranks: ``RankGrid`` over ``dim_names`` (first fastest)."""

    name: str
    shape: list[int]
    dim_names: list[str]
    shared_dims: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.grid = RankGrid(list(zip(self.dim_names, self.shape)))


def _check_shape(what: str, shape: Sequence[int], dim_names: Sequence[str]) -> None:
    if len(shape) != len(dim_names):
        raise ConfigError(f"len(shape) {list(shape)} != len(dim_names) {list(dim_names)}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
        raise ConfigError(f"{what} shape must be positive ints, got {list(shape)}")
    if any(not isinstance(n, str) for n in dim_names):
        raise ConfigError(f"{what} dim_names must be strings, got {list(dim_names)}")
    if len(set(dim_names)) != len(dim_names):
        raise ConfigError(f"{what} has duplicate dim_names: {list(dim_names)}")


class HyperCommGrid:
    r"""An N-dimensional grid of ranks with named dims; process groups over any combination of dims.

    Args:
        shape: size of each dim.
        dim_names: name of each dim; the first varies fastest (Megatron's ``order``: ``["tp", "cp", "dp", "pp"]``
            is ``order="tp-cp-dp-pp"``).
        rank_offset: first global rank of the grid when it does not start at 0 (several grids on disjoint rank
            ranges of one job, e.g. an encoder and a language model).
        backend: backend of the groups (None: the default group's).

    The world size is ``WORLD_SIZE`` from the environment, else the default group's (as Megatron, so a grid can be
    planned without processes); ``create_pg`` needs an initialised default group.

    Raises (Megatron's types): ValueError (:class:`~megashard.errors.ConfigError`) for mismatched or invalid
    shape/dim names and a negative offset; RuntimeError (:class:`~megashard.errors.RankGridError`) when the world
    size is unknown or the grid does not fit it; KeyError (:class:`~megashard.errors.RankGridKeyError`) for a group
    created twice or fetched before it was created, or an unknown view.
    """

    def __init__(self, shape: list[int], dim_names: list[str], rank_offset: int = 0,
                 backend: Optional[str] = None) -> None:
        _check_shape("grid", shape, dim_names)
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RankGridError(
                "Cannot determine world size: WORLD_SIZE environment variable not set and torch.distributed is not "
                "initialized. Please either set WORLD_SIZE or initialize torch.distributed before creating HyperCommGrid.")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ConfigError(f"rank_offset must be non-negative, got {rank_offset}")
        self.rank_offset = rank_offset
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        base = _View(_BASE, self.shape, self.dim_names)
        self.size = base.grid.world_size
        if self.size > world_size - rank_offset:
            raise RankGridError(f"Grid shape {self.shape} is over sized with world size {world_size} and rank offset "
                                f"{rank_offset}")
        self._views: dict[str, _View] = {_BASE: base}
        self._pgs: dict[Union[str, tuple[str, tuple[str, ...]]], Optional[dist.ProcessGroup]] = {}
        #: communicators this rank created through this grid (0 when all were pooled already)
        self.groups_created = 0
        from megashard.state.identity import register_grid

        register_grid(self)  # its groups know their grid (megashard.state.identity)

    # ------------------------------------------------------------------ views
    def register_view(self, name: str, shape: list[int], dim_names: list[str],
                      shared_dims: Optional[list[str]] = None) -> None:
        """Register a second factorisation of the same ranks (e.g. ``[tp, ep, edp, pp]`` beside
        ``[tp, cp, dp, pp]``); target it with ``view=name``. Each of ``shared_dims`` (and all of them together)
        must group the ranks exactly as the base view does; their groups are then the base view's."""
        if name in self._views:
            raise ConfigError(f"View {name!r} is already registered")
        _check_shape(f"View {name!r}", shape, dim_names)
        view = _View(name, list(shape), list(dim_names))
        if view.grid.world_size != self.size:
            raise ConfigError(f"View {name!r} shape {list(shape)} has size {view.grid.world_size}, but the grid size "
                              f"is {self.size}")
        shared = list(shared_dims) if shared_dims is not None else []
        if len(set(shared)) != len(shared):
            raise ConfigError(f"View {name!r} has duplicate shared_dims: {shared}")
        base = self._views[_BASE]
        for dim in shared:
            if dim not in base.dim_names:
                raise ConfigError(f"Shared dim {dim!r} of view {name!r} is not in the base view {base.dim_names}")
            if dim not in view.dim_names:
                raise ConfigError(f"Shared dim {dim!r} of view {name!r} is not in the view's dim_names {view.dim_names}")
        for dims in [[d] for d in shared] + ([shared] if len(shared) > 1 else []):
            b, v = base.grid.groups(dims), view.grid.groups(dims)
            if b != v:
                what = f"Shared dim {dims[0]!r} has" if len(dims) == 1 else f"Shared dims {dims!r} have"
                raise ConfigError(f"{what} different membership across views: base enumeration {b} != view "
                                  f"{name!r} enumeration {v}")
        view.shared_dims = shared
        self._views[name] = view

    def _view(self, view: Optional[str]) -> _View:
        name = _BASE if view is None else view
        if name not in self._views:
            raise RankGridKeyError(f"View {name!r} is not registered. Registered views: {sorted(self._views)}")
        return self._views[name]

    @staticmethod
    def _ordered(view: _View, dims: Dims) -> list[str]:
        """``dims`` slowest first (Megatron's key order), checked against the view."""
        requested = [dims] if isinstance(dims, str) else list(dims)
        missing = [d for d in requested if d not in view.dim_names]
        if missing:
            raise ConfigError(f"{missing[0]!r} is not in view {view.name!r} with dim_names {view.dim_names}")
        if len(set(requested)) != len(requested):
            raise ConfigError(f"dims {requested} repeat a dim; name each dim once")
        rev = view.dim_names[::-1]
        return sorted(requested, key=rev.index)

    def _key(self, view: _View, ordered: list[str]) -> tuple[Union[str, tuple[str, tuple[str, ...]]], _View]:
        """The storage key and the view that enumerates the group: a view's group over shared dims only is the
        base view's group (one key, one communicator)."""
        if view.name == _BASE:
            return "-".join(ordered), view
        if ordered and all(d in view.shared_dims for d in ordered):
            base = self._views[_BASE]
            return "-".join(self._ordered(base, ordered)), base
        return (view.name, tuple(ordered)), view

    # ------------------------------------------------------------------ rank enumeration (pure)
    def get_rank_enum(self, dims: Dims, *, view: Optional[str] = None) -> list[list[int]]:
        """Every group over ``dims`` (members with the fastest dim fastest; groups in the order of the other dims),
        global ranks: the enumeration ``create_pg`` uses for the same dims."""
        v = self._view(view)
        groups = v.grid.groups(self._ordered(v, dims))
        off = self.rank_offset
        return [[r + off for r in g] for g in groups] if off else groups

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        """Megatron's private name for :meth:`get_rank_enum` on the base view (used by its bridge communicator)."""
        return self.get_rank_enum(dims)

    def is_current_rank_in_grid(self) -> bool:
        """Whether this process's rank is in ``[rank_offset, rank_offset + size)``."""
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    # ------------------------------------------------------------------ process groups
    def create_pg(self, dims: Dims, *, view: Optional[str] = None, **kwargs: Any) -> Optional[dist.ProcessGroup]:
        """Create this rank's group over ``dims`` (members only, pooled) and return it; ``None`` on a rank outside
        the grid. Options as Megatron's (``new_subgroups_by_enumeration``'s): ``timeout`` (timedelta; default: the
        current ParallelState's timeout, else the default group's), ``pg_options``, ``group_desc``.

        Raises KeyError (:class:`~megashard.errors.RankGridKeyError`) when the group of these dims was created
        before (Megatron cannot check that the options match, so it refuses)."""
        bad = sorted(set(kwargs) - set(_CREATE_PG_OPTIONS))
        if bad:
            raise ConfigError(f"create_pg: unknown option(s) {', '.join(bad)}; allowed: {', '.join(_CREATE_PG_OPTIONS)}")
        v = self._view(view)
        ordered = self._ordered(v, dims)
        key, enum_view = self._key(v, ordered)
        if key in self._pgs:
            where = "" if isinstance(key, str) else f" for view {v.name!r}"
            raise RankGridKeyError(
                f"Process group {dims}{where} has already been created. Because there is no way to check whether "
                "options to create process group matches the first, we error out instead of returning the process "
                "group that has already been created before.")
        if not dist.is_initialized():
            raise StateError("HyperCommGrid.create_pg needs torch.distributed: call init_process_group first")
        rank = dist.get_rank()
        pg: Optional[dist.ProcessGroup] = None
        if self.rank_offset <= rank < self.rank_offset + self.size:
            enum_dims = self._ordered(enum_view, ordered)
            local = rank - self.rank_offset
            ranks = tuple(r + self.rank_offset for r in enum_view.grid.group_of(enum_dims, local))
            pg = self._group(ranks, kwargs, f"hypercommgrid:{'-'.join(ordered) or 'self'}")
        self._pgs[key] = pg
        if pg is not None:
            from megashard.state.identity import remember_grid_group

            remember_grid_group(self, key, pg)
        return pg

    def _group(self, ranks: tuple[int, ...], options: dict[str, Any], desc: str) -> dist.ProcessGroup:
        pg_options = options.get("pg_options")
        if len(ranks) == dist.get_world_size() and self.backend is None and pg_options is None:
            return dist.group.WORLD  # as a ParallelState: the default group already spans these ranks
        timeout = options.get("timeout")
        if timeout is None:
            timeout = _default_timeout()
        elif not isinstance(timeout, timedelta):
            raise ConfigError(f"create_pg: timeout={timeout!r} must be a datetime.timedelta")
        pg, new = pooled_group(ranks, timeout, self.backend, options.get("group_desc") or desc, pg_options)
        self.groups_created += new
        return pg

    def get_pg(self, dims: Dims, *, view: Optional[str] = None) -> Optional[dist.ProcessGroup]:
        """The group :meth:`create_pg` created for ``dims`` (None on ranks outside the grid); KeyError before."""
        v = self._view(view)
        key, _ = self._key(v, self._ordered(v, dims))
        if key not in self._pgs:
            if isinstance(key, str):
                raise RankGridKeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
            raise RankGridKeyError(f"Process group {dims} for view {v.name!r} hasn't been created. Call create_pg first.")
        return self._pgs[key]

    def destroy(self) -> None:
        """Forget every group of this grid. The communicators stay in megashard's pool (a ParallelState or another
        grid may share them) and are destroyed by :func:`~megashard.state.release_process_groups`."""
        self._pgs.clear()

    def __repr__(self) -> str:
        return f"HyperCommGrid(shape={self.shape}, dim_names={self.dim_names}, rank_offset={self.rank_offset})"


def _default_timeout() -> timedelta:
    """The current ParallelState's timeout (so that the grid's groups and the state's share communicators), else
    the ParallelConfig default."""
    from megashard.config import ParallelConfig
    from megashard.state.current import get_parallel_state, is_initialized

    seconds = get_parallel_state().config.timeout if is_initialized() else ParallelConfig().timeout
    return timedelta(seconds=seconds)
