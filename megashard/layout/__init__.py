"""The second step of the flow: which ranks form each group, for resolved sizes — pure arithmetic, no processes.

    layout = RankLayout(ParallelConfig(tp=2, pp=4).resolve(16))
    layout.group_of("pp", 5)        # [1, 5, 9, 13]
    layout.locality(8).warnings     # groups that should stay inside a node but cross one

Modules: ``groups`` (the group names and the grid axes they span), ``grid`` (mixed-radix rank arithmetic,
:class:`GroupMembers`), ``rank_layout`` (:class:`RankLayout`), ``node_locality`` (node-boundary counts),
``rank_generator`` (Megatron's :class:`RankGenerator` over the same grid), ``modules`` (layouts on disjoint rank
ranges and the pairing across their seams), ``plan`` (the report of ``megashard plan``) and ``plan_svg`` (its
picture). :class:`~megashard.state.ParallelState` creates its process groups from a :class:`RankLayout`.
"""
from megashard.layout.grid import GroupMembers, RankGrid
from megashard.layout.groups import (
    DENSE_GROUPS,
    DENSE_MESH_AXES,
    EDGE_GROUPS,
    EXPERT_GROUPS,
    EXPERT_HSDP_MESH_AXES,
    EXPERT_MESH_AXES,
    GROUP_ALIASES,
    GROUP_NAMES,
    NODE_LOCAL_GROUPS,
)
from megashard.layout.modules import Link, ModuleLayout, MultiModuleLayout, pair_modules
from megashard.layout.node_locality import LocalityReport, locality_warning
from megashard.layout.rank_generator import RankGenerator
from megashard.layout.rank_layout import RankLayout, default_embedding_ranks, default_position_embedding_ranks, locality

__all__ = [
    "DENSE_GROUPS", "DENSE_MESH_AXES", "EDGE_GROUPS", "EXPERT_GROUPS", "EXPERT_HSDP_MESH_AXES", "EXPERT_MESH_AXES",
    "GROUP_ALIASES", "GROUP_NAMES", "NODE_LOCAL_GROUPS", "GroupMembers", "Link", "LocalityReport", "ModuleLayout",
    "MultiModuleLayout", "RankGenerator", "RankGrid", "RankLayout", "default_embedding_ranks",
    "default_position_embedding_ranks", "locality", "locality_warning", "pair_modules",
]
