"""The group names a layout answers for: which grid axes each spans, the mesh axes, the node-local names.

Two grids share the ranks (:class:`~megashard.layout.RankLayout`): the *dense* one over
``(tp, cp, dp_shard, dp_outer, pp)`` and the *expert* one over ``(expt_tp, ep, expt_dp_shard, expt_dp_outer, pp)``
(the expert replica axis: ``expt_dp_outer = dp_outer``, so experts shard inside an HSDP replica and replicate
across replicas, like dense parameters). A new group is a new entry here that the grids answer for any rank, not
new rank arithmetic. Three kinds of names are not plain axis combinations: Megatron's aliases
(:data:`GROUP_ALIASES`), the pipeline-edge groups ``embd``/``pos_embd`` (a selection of each pipeline group's
ranks, :data:`EDGE_GROUPS`) and the hierarchical context-parallel levels ``hcp0``, ``hcp1``, … (sub-axes of cp,
present when ``hierarchical_context_parallel_sizes`` is set).
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
    # Megatron's tp-gtp_remat-dp(-cp) and tp-gtp_remat-pp tokens: they span the gtp_remat axis (absent at size 1).
    "tp_dp": ("tp", "gtp_remat", "dp_shard", "dp_outer"),
    "tp_dp_cp": ("tp", "gtp_remat", "cp", "dp_shard", "dp_outer"),
    "mp": ("tp", "gtp_remat", "pp"),
    "world": ("tp", "gtp_remat", "cp", "dp_shard", "dp_outer", "pp"),
    # Megatron's generalized-TP weight-rematerialisation axis (right after tp) and its full data-distribution groups
    # (replicate dp · gtp_remat: Megatron's default get_data_parallel_group); the same as gtp_remat-less ones at size 1.
    "gtp_remat": ("gtp_remat",),
    "dp_gtp_remat": ("gtp_remat", "dp_shard", "dp_outer"),
    "dp_cp_gtp_remat": ("gtp_remat", "cp", "dp_shard", "dp_outer"),
}
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp_shard", "expt_dp_outer"),
    "expt_dp_shard": ("expt_dp_shard",),
    "expt_dp_outer": ("expt_dp_outer",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
    "expt_pp": ("pp",),
    # Megatron's intra distributed-optimizer instance group: intra_partial_expert_dp consecutive tp-ep-pp
    # groups = every expert axis but the replica axis (the whole world with one optimizer instance).
    # (With gtp_remat Megatron makes it the whole world; one optimizer instance then, so it is here too.)
    "intra_dist_opt": ("expt_tp", "ep", "expt_gtp_remat", "expt_dp_shard", "pp"),
    "expt_gtp_remat": ("expt_gtp_remat",),
    "expt_dp_gtp_remat": ("expt_gtp_remat", "expt_dp_shard", "expt_dp_outer"),
    "tp_ep_pp_with_egtp_remat": ("expt_tp", "ep", "expt_gtp_remat", "pp"),
}
GROUP_NAMES: tuple[str, ...] = tuple(DENSE_GROUPS) + tuple(EXPERT_GROUPS)
#: Megatron-LM's names for groups megashard has under another name (one communicator per rank set either way):
#: intra/inter partial data-parallel groups with ``num_distributed_optimizer_instances = dp_outer``.
GROUP_ALIASES: dict[str, str] = {
    "intra_dp_cp": "dp_shard_cp",       # consecutive dp-cp slices of size dp·cp/instances
    "intra_expt_dp": "expt_dp_shard",   # hierarchical level 0 of expt_dp
    "inter_expt_dp": "expt_dp_outer",   # hierarchical level 1 of expt_dp
    "inter_dist_opt": "expt_dp_outer",  # Megatron returns the inter partial expert dp group here
}
#: Pipeline-edge groups: a selection of each pipeline group's ranks (default: first and last stage for the
#: embedding group, first stage for the position embedding), Megatron's ``get_embedding_ranks`` callables.
EDGE_GROUPS: tuple[str, ...] = ("embd", "pos_embd")
DENSE_MESH_AXES = ("pp", "dp_outer", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "expt_dp", "ep", "expt_tp")
#: The expert mesh with its replica axis (``expt_dp_outer = dp_outer``): FSDP over expt_dp_shard, replicas over
#: expt_dp_outer, as dense parameters under HSDP.
EXPERT_HSDP_MESH_AXES = ("pp", "expt_dp_outer", "expt_dp_shard", "ep", "expt_tp")
#: Groups that should stay inside a node (their collectives sit on the critical path).
NODE_LOCAL_GROUPS = ("tp", "ep", "expt_tp")
