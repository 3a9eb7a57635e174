"""The device meshes of a state: root views assembled over its process groups, never by ``_flatten``.

A view is a multi-axis ``DeviceMesh`` whose every axis is one of the state's groups (``DeviceMesh.from_group``),
so no rank creates a group it is not in and every group keeps the configured timeout. The rank tensor of a view
comes from the layout's grid in one permute:

- ``dense``       — axes ``(pp, dp_outer, dp_shard, cp, tp)``
- ``expert``      — axes ``(pp, expt_dp, ep, expt_tp)``
- ``fsdp``        — axes ``(pp, dp_outer, dp_shard_cp, tp)``: the root to slice for FSDP/HSDP + TP
- ``expert_hsdp`` — axes ``(pp, expt_dp_outer, expt_dp_shard, ep, expt_tp)``: the expert replica axis
- ``expert_fsdp`` — axes ``(pp, dp_outer, ep, dp_shard_cp, tp)`` with dp_outer = expt_dp_outer,
  dp_shard_cp = expt_dp_shard and tp = expt_tp (the names :class:`~megashard.state.index.FSDPDistributedIndex`
  looks up): experts shard inside an HSDP replica and replicate across replicas
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist

from megashard.layout import DENSE_MESH_AXES, EXPERT_MESH_AXES, RankLayout
from megashard.layout.groups import EXPERT_HSDP_MESH_AXES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh  # imported when a view is built (not at import)

__all__ = ["VIEW_AXES", "build_view", "view_rank_tensor"]

#: Root views built by from_group: name -> group names of their axes (outermost first).
VIEW_AXES: dict[str, tuple[str, ...]] = {
    "dense": DENSE_MESH_AXES,
    "expert": EXPERT_MESH_AXES,
    "fsdp": ("pp", "dp_outer", "dp_shard_cp", "tp"),
    "expert_hsdp": EXPERT_HSDP_MESH_AXES,
    # The expert view that FSDPDistributedIndex expects: replicas over expt_dp_outer, FSDP over expt_dp_shard,
    # TP over expt_tp.
    "expert_fsdp": ("pp", "expt_dp_outer", "ep", "expt_dp_shard", "expt_tp"),
}
# Axis names of each view: the group names, except that the expert FSDP view uses the dense names
# FSDPDistributedIndex looks up (expt_dp_outer plays dp_outer, expt_dp_shard dp_shard_cp, expt_tp tp).
_VIEW_DIM_NAMES: dict[str, tuple[str, ...]] = {
    **VIEW_AXES, "expert_fsdp": ("pp", "dp_outer", "ep", "dp_shard_cp", "tp"),
}


def view_rank_tensor(layout: RankLayout, view: str) -> torch.Tensor:
    """The rank at every coordinate of ``view`` (shape: the view's axis sizes), computed with one permute (no
    per-rank Python loop)."""
    grid = layout.grid(expert=view.startswith("expert"))
    n = len(grid.sizes)
    # Tensor dim k holds grid axis n-1-k (slowest first). A view axis merges its grid axes slowest-first,
    # which reproduces the in-group (sorted) order of the group it stands for.
    t = torch.arange(layout.world_size).reshape(list(reversed(grid.sizes)))
    perm: list[int] = []
    shape: list[int] = []
    for name in VIEW_AXES[view]:
        _, axes = layout.axes_of(name)
        idx = sorted((grid.index[a] for a in axes), reverse=True)
        perm += [n - 1 - i for i in idx]
        size = 1
        for i in idx:
            size *= grid.sizes[i]
        shape.append(size)
    return t.permute(perm).reshape(shape)


def build_view(layout: RankLayout, view: str, groups: Mapping[str, dist.ProcessGroup], device_type: str,
               rank_offset: int = 0) -> DeviceMesh:
    """The ``view`` mesh over this rank's ``groups`` (group name -> process group) of ``layout``, whose ranks start
    at global rank ``rank_offset`` (one module of a multi-module job)."""
    s = layout.sizes
    if getattr(s, "gtp_remat", 1) > 1 or getattr(s, "expt_gtp_remat", 1) > 1:
        from megashard.errors import StateError

        raise StateError(f"no '{view}' DeviceMesh with gtp_remat={s.gtp_remat}, expt_gtp_remat={s.expt_gtp_remat}: the "
                         "meshes have no weight-rematerialisation axis (Megatron's GTP path uses its process groups: "
                         "state.group(name) / state.pg_collection())")
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(
        [groups[n] for n in VIEW_AXES[view]], device_type,
        mesh=view_rank_tensor(layout, view) + rank_offset, mesh_dim_names=_VIEW_DIM_NAMES[view],
    )
