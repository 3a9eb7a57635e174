"""The group names a layout answers for: which grid axes each spans, the mesh axes, the node-local names.

Two grids share the ranks (:class:`~megashard.layout.RankLayout`): the *dense* one over
``(tp, cp, dp_shard, dp_outer, pp)`` and the *expert* one over ``(expt_tp, ep, expt_dp, pp)``. A new group is a
new entry here that the grids answer for any rank, not new rank arithmetic.
"""
from __future__ import annotations

#: Named groups: name -> (layout, axes). Axes are listed for documentation; membership order comes from `order`.
DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp_shard", "dp_outer"),
    "dp_shard": ("dp_shard",),
    "dp_outer": ("dp_outer",),
    "dp_cp": ("cp", "dp_shard", "dp_outer"),
    "dp_shard_cp": ("cp", "dp_shard"),
    "hsdp": ("cp", "dp_shard", "dp_outer"),
    "tp_cp": ("tp", "cp"),
    "tp_dp": ("tp", "dp_shard", "dp_outer"),
    "tp_dp_cp": ("tp", "cp", "dp_shard", "dp_outer"),
    "mp": ("tp", "pp"),
    "world": ("tp", "cp", "dp_shard", "dp_outer", "pp"),
}
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
    "expt_pp": ("pp",),
}
GROUP_NAMES: tuple[str, ...] = tuple(DENSE_GROUPS) + tuple(EXPERT_GROUPS)
DENSE_MESH_AXES = ("pp", "dp_outer", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "expt_dp", "ep", "expt_tp")
#: Groups that should stay inside a node (their collectives sit on the critical path).
NODE_LOCAL_GROUPS = ("tp", "ep", "expt_tp")
