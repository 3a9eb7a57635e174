"""The report of ``megashard plan``: one rank's groups in a layout of any world size, as a table or JSON.

Everything here is arithmetic over :class:`~megashard.layout.RankLayout` (no torch.distributed), and
nothing of the world's size is listed for one rank's report, so its cost does not grow with the world
size (2^24 ranks: milliseconds; benchmarks/plan_scale.py):

- :func:`build_plan` — resolved sizes, the groups (:class:`~megashard.layout.GroupMembers`) and
  coordinates of one rank, optionally every group of every name, and the node-locality report
  (:mod:`megashard.layout.node_locality`);
- :func:`check_listing` — the bound (MAX_LISTED_RANKS) on listing every group, with how to narrow it;
- :func:`plan_to_json` / :func:`format_table` — the plan as JSON or as human-readable text.

The picture of the rank grid is :mod:`megashard.layout.plan_svg`; reading the job YAML is the CLI's
(:mod:`megashard.cli.plan`).
"""
from __future__ import annotations

from typing import Any, Sequence

from megashard.errors import ConfigError
from megashard.layout.grid import GroupMembers
from megashard.layout.groups import DENSE_MESH_AXES, EXPERT_MESH_AXES, GROUP_NAMES, NODE_LOCAL_GROUPS
from megashard.layout.node_locality import LocalityReport
from megashard.layout.rank_layout import RankLayout

#: Most rank ids a plan may list in full (every group of the shown names for --format json or --all-groups,
#: plus the rank's own groups in JSON): 2^22, e.g. all 20 group names of a 131,072-rank world (~20 MB of JSON).
MAX_LISTED_RANKS = 1 << 22
#: Sizes shown by the plan, in this order.
SIZE_KEYS = ("world_size", "tp", "cp", "pp", "vpp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp", "order")
#: Shown only when set: hierarchical cp levels, the gtp_remat axes, hybrid context parallelism.
OPTIONAL_SIZE_KEYS = ("hierarchical_cp", "gtp_remat", "expt_gtp_remat", "hybrid_cp")


def build_plan(
    layout: RankLayout,
    rank: int = 0,
    ranks_per_node: int = 8,
    names: Sequence[str] | None = None,
    all_groups: bool = False,
    report: LocalityReport | None = None,
) -> dict[str, Any]:
    """The plan as a JSON-ready dict.

    Keys: ``sizes`` (every resolved size, ``order`` as a string), ``mesh`` (dense and expert mesh
    axes → sizes), ``rank``, ``coords`` (the rank's index on every axis), ``rank_groups`` (name →
    ``{"ranks", "rank_in_group", "group_index", "num_groups"}``; ``ranks`` is a
    :class:`~megashard.layout.GroupMembers`, equal to the list, listed by :func:`plan_to_json`), ``locality`` (``ranks_per_node``,
    ``crossing``: name → [groups crossing nodes, groups], ``warnings``) and, with ``all_groups``,
    ``groups`` (name → every group, Megatron order). ``names`` restricts the group names (default:
    every name in GROUP_NAMES, then the configured hierarchical cp levels and hybrid dp·cp slices).
    ``report``: a :func:`locality` result to reuse (computed if None).
    """
    names = list(names) if names else default_names(layout)
    sizes = layout.sizes.as_dict()
    rank_groups = {}
    for n in names:
        members = layout.members(n, rank)  # validates rank and name (ConfigError); O(axes), not O(group)
        rank_groups[n] = {
            "ranks": members,
            "rank_in_group": layout.rank_in(n, rank),
            "group_index": layout.group_index(n, rank),
            "num_groups": layout.num_groups(n),
        }
    report = report or layout.locality(ranks_per_node)
    plan: dict[str, Any] = {
        "sizes": {k: sizes[k] for k in SIZE_KEYS + OPTIONAL_SIZE_KEYS if k in sizes},
        "mesh": {
            "dense": dict(zip(DENSE_MESH_AXES, layout.mesh_shape(expert=False))),
            "expert": dict(zip(EXPERT_MESH_AXES, layout.mesh_shape(expert=True))),
        },
        "rank": rank,
        "coords": layout.coords(rank),
        "rank_groups": rank_groups,
        "locality": {
            "ranks_per_node": report.ranks_per_node,
            "crossing": {k: list(v) for k, v in report.crossing.items()},
            "warnings": list(report.warnings),
        },
    }
    if all_groups:
        check_listing(layout, names, rank_groups=False)
        plan["groups"] = {n: layout.groups(n) for n in names}
    return plan


def default_names(layout: RankLayout) -> list[str]:
    """The group names a plan shows by default: GROUP_NAMES and the layout's configured extras (hcp levels, hybrid
    dp·cp slices)."""
    return list(GROUP_NAMES) + list(layout.extra_names())


def check_listing(layout: RankLayout, names: Sequence[str], rank_groups: bool) -> None:
    """ConfigError when listing every group of ``names`` (and, with ``rank_groups``, the rank's own groups)
    would exceed MAX_LISTED_RANKS rank ids; the message says how to narrow it."""
    total = layout.world_size * len(names)
    if rank_groups:
        total += sum(layout.size(n) for n in names)
    if total > MAX_LISTED_RANKS:
        per_name = layout.world_size + (max(layout.size(n) for n in names) if rank_groups else 0)
        fit = MAX_LISTED_RANKS // per_name
        if fit:
            fix = f"name at most {fit} with --groups (e.g. --groups {'tp,pp' if fit > 1 else 'tp'})"
        else:
            fix = f"even one name is too many at {layout.world_size:,} ranks"
        raise ConfigError(
            f"listing every group of {len(names)} group name(s) for {layout.world_size:,} ranks means {total:,} rank "
            f"ids, more than the {MAX_LISTED_RANKS:,} a plan lists: {fix}; the table format without --all-groups "
            "shows one rank's groups for any world size"
        )


def plan_to_json(plan: dict[str, Any]) -> str:
    """The plan as one line of JSON (group members listed in full)."""
    import json

    return json.dumps(plan, default=list)


def format_members(ranks: Sequence[int], limit: int = 16) -> str:
    """``[0, 1]``; long groups abbreviated: ``[0, 8, 16, …, 1016] (128 ranks, stride 8)``."""
    if limit <= 0 or len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    head = ", ".join(map(str, ranks[:3]))
    step = ranks[1] - ranks[0]
    if isinstance(ranks, GroupMembers):  # O(1): never list a huge group
        progression = ranks.stride is not None
    else:  # C-speed progression check
        progression = step > 0 and list(ranks) == list(range(ranks[0], ranks[-1] + 1, step))
    if progression:
        return f"[{head}, …, {ranks[-1]}] ({len(ranks)} ranks, stride {step})"
    return f"[{head}, …, {ranks[-2]}, {ranks[-1]}] ({len(ranks)} ranks)"


def format_table(plan: dict[str, Any], max_members: int = 16, source: str = "") -> str:
    """The plan dict as aligned text: sizes, meshes, the rank's coordinates and groups, locality."""
    s = plan["sizes"]
    out = [f"megashard plan{': ' + source if source else ''} — {s['world_size']} ranks"]
    out.append("")
    out.append("resolved sizes")
    for k in SIZE_KEYS + OPTIONAL_SIZE_KEYS:
        if k in s:
            v = s[k]
            out.append(f"  {k:<11} {'none' if v is None else v}")
    out.append("")
    out.append("meshes")
    for kind, axes in plan["mesh"].items():
        out.append(f"  {kind:<7} ({', '.join(axes)}) = ({', '.join(str(v) for v in axes.values())})")
    r = plan["rank"]
    out.append("")
    out.append(f"rank {r}")
    out.append("  coords  " + " ".join(f"{k}={v}" for k, v in plan["coords"].items()))
    out.append("")
    rows = [("group", "size", "rank_in", "group#", "members")]
    for n, g in plan["rank_groups"].items():
        rows.append((n, str(len(g["ranks"])), str(g["rank_in_group"]), f"{g['group_index']}/{g['num_groups']}",
                     format_members(g["ranks"], max_members)))
    out.append(f"groups of rank {r}")
    out += _align(rows)
    if "groups" in plan:
        for n, gs in plan["groups"].items():
            out.append("")
            out.append(f"all {n} groups ({len(gs)})")
            for i, g in enumerate(gs):
                out.append(f"  {i:>6}  {format_members(g, max_members)}")
    loc = plan["locality"]
    out.append("")
    out.append(f"node locality ({loc['ranks_per_node']} ranks per node; node = rank // {loc['ranks_per_node']})")
    rows = [("group", "size", "crossing/groups")]
    world = s["world_size"]
    rows += [(n, str(world // t), f"{c}/{t}") for n, (c, t) in loc["crossing"].items() if t < world]
    out += _align(rows) if len(rows) > 1 else ["  (every group has size 1)"]
    out.append("")
    if loc["warnings"]:
        out += [f"WARNING: {w}" for w in loc["warnings"]]
    else:
        out.append("no locality warnings (" + ", ".join(NODE_LOCAL_GROUPS) + " stay inside a node)")
    return "\n".join(out) + "\n"


def _align(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
