"""Which layout a process group belongs to: every group megashard makes is held by a
:class:`~megashard.state.ParallelState` (or a module's state of a multi-module job), and a state is a layout.

    names, layouts = layouts_of(pg)       # (("dp",), ("layout tp2·dp4 on ranks 0-7",)), or ((), ()) for a group
                                          # no live state holds
    current_layout()                      # the label of the current state (megashard.get_parallel_state())

Communicators are pooled (:mod:`megashard.state.pool`): two layouts with one rank set share one group, which then
belongs to both. A collective on a group of a layout other than the current one — a ``pg_collection`` of another
grid, another module's groups — is named by the rehearsal (:mod:`megashard.rehearse.recorder`) and, at run time,
by the hang doctor (:mod:`megashard.doctor.intercept`: :func:`foreign_group_note`).
"""
from __future__ import annotations

from typing import Any, Optional

import weakref

__all__ = ["current_layout", "foreign_group_note", "layout_label", "layouts_of", "register_grid", "remember_grid_group"]

_GRIDS: "weakref.WeakSet" = weakref.WeakSet()  # live HyperCommGrids (Megatron's pg_collection grids)
#: group -> {grid label: its name there}: what a grid's groups keep of it after the grid object itself is gone (a
#: pg_collection holds the groups, not the grid)
_GRID_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register_grid(grid: Any) -> None:
    """A :class:`~megashard.state.hyper_grid.HyperCommGrid` whose groups belong to it (its constructor calls this)."""
    _GRIDS.add(grid)


def remember_grid_group(grid: Any, key: Any, pg: Any) -> None:
    """Group ``pg`` (``key`` in the grid's table) was made by ``grid`` (``HyperCommGrid.create_pg`` calls this)."""
    try:
        _GRID_GROUPS.setdefault(pg, {})[_grid_label(grid)] = key if isinstance(key, str) else "-".join(key[1])
    except TypeError:  # a group object that cannot be weakly referenced
        pass


def _remember_grid_groups() -> None:
    for grid in list(_GRIDS):
        for k, g in list(getattr(grid, "_pgs", {}).items()):
            if g is not None:
                try:
                    _GRID_GROUPS.setdefault(g, {})[_grid_label(grid)] = k if isinstance(k, str) else "-".join(k[1])
                except TypeError:  # a group object that cannot be weakly referenced
                    pass


def _grid_label(grid: Any) -> str:
    dims = "·".join(f"{n}{s}" for n, s in zip(grid.dim_names, grid.shape) if s > 1) or "1"
    return f"grid {dims} on ranks {grid.rank_offset}-{grid.rank_offset + grid.size - 1}"


def layout_label(state: Any) -> str:
    """``layout tp2·pp2·dp2 on ranks 0-7``: the sizes above 1 of a state's layout and its ranks."""
    sizes = state.sizes.as_dict() if hasattr(state.sizes, "as_dict") else {}
    shown = [f"{k}{v}" for k, v in sizes.items() if isinstance(v, int) and v > 1 and k in
             ("tp", "cp", "pp", "vpp", "dp_outer", "dp_shard", "ep", "expt_tp")]
    first = getattr(state, "rank_offset", 0)
    return f"layout {'·'.join(shown) or 'dp1'} on ranks {first}-{first + state.world_size - 1}"


def _states() -> list:
    from megashard.state.pool import _USERS

    return [s for s in list(_USERS) if not getattr(s, "_destroyed", False) and hasattr(s, "named_groups")]


def layouts_of(pg: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """megashard's names of ``pg`` and the labels of the live layouts that hold it (empty: no state holds it)."""
    names: list[str] = []
    layouts: list[str] = []
    for state in _states():
        try:
            groups = state.named_groups()
        except Exception:  # noqa: BLE001 - a state being destroyed
            continue
        mine = [n for n, g in groups.items() if g is pg]
        if mine:
            names += [n for n in mine if n not in names]
            label = layout_label(state)
            if label not in layouts:
                layouts.append(label)
    _remember_grid_groups()
    try:
        owners = _GRID_GROUPS.get(pg) or {}
    except TypeError:
        owners = {}
    for label, name in owners.items():
        if name not in names:
            names.append(name)
        if label not in layouts:
            layouts.append(label)
    return tuple(names), tuple(layouts)


def current_layout() -> Optional[str]:
    """The label of the current ParallelState, or None when megashard is not initialised."""
    from megashard.state.current import get_parallel_state, is_initialized

    if not is_initialized():
        return None
    return layout_label(get_parallel_state())


def foreign_group_note(pg: Any) -> str:
    """``a group of layout X while layout Y is current`` when ``pg`` belongs only to layouts other than the current
    one; "" otherwise (the default group, a group of the current layout, a group no layout holds)."""
    import torch.distributed as dist

    if pg is None or pg is dist.group.WORLD:
        return ""
    cur = current_layout()
    if cur is None:
        return ""
    _, layouts = layouts_of(pg)
    if not layouts or cur in layouts:
        return ""
    return f"a group of {layouts[0]} while {cur} is current"
