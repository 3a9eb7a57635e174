"""`megashard plan`: the report of a parallel layout for any world size, without processes.

Everything here is arithmetic over :class:`~megashard.layout.RankLayout` (no torch.distributed), and
nothing of the world's size is listed for one rank's report, so its cost does not grow with the world
size (2^24 ranks: milliseconds; benchmarks/plan_scale.py):

- :func:`load_config` — a job YAML checked section by section, its parallel config and world size;
- :func:`build_plan` — resolved sizes, the groups (:class:`~megashard.layout.GroupMembers`) and
  coordinates of one rank, optionally every group of every name, and the node-locality report;
- :func:`check_listing` — the bound (MAX_LISTED_RANKS) on listing every group, with how to narrow it;
- :func:`plan_to_json` / :func:`format_table` — the plan as JSON or as human-readable text;
- :func:`locality` — which groups cross node boundaries (arithmetic on group bases, never group lists);
- :func:`render_svg` — a picture of the rank grid, one panel per group name, cells coloured by group.
"""
from __future__ import annotations

import colorsys
import dataclasses
import math
from typing import Any, Iterable, Sequence
from xml.sax.saxutils import escape

from megashard.config import ParallelConfig, check_world_size, parallel_section
from megashard.errors import ConfigError
from megashard.layout import (
    DENSE_MESH_AXES,
    EXPERT_GROUPS,
    EXPERT_MESH_AXES,
    GROUP_NAMES,
    NODE_LOCAL_GROUPS,
    GroupMembers,
    LocalityReport,
    RankLayout,
    locality_warning,
)
from megashard.yamlcfg import apply_overrides, load_yaml

#: Group names drawn by default in the SVG (size > 1 only; a duplicate of an earlier panel becomes its alias).
SVG_DEFAULT_GROUPS = ("tp", "cp", "dp", "dp_shard", "dp_outer", "pp", "ep", "expt_tp", "expt_dp")
#: Most rank ids a plan may list in full (every group of the shown names for --format json or --all-groups,
#: plus the rank's own groups in JSON): 2^22, e.g. all 20 group names of a 131,072-rank world (~20 MB of JSON).
MAX_LISTED_RANKS = 1 << 22
#: Most ranks an SVG picture may draw (each rank is one cell per panel).
MAX_SVG_RANKS = 1 << 14
#: The keys of a bare parallel config (a YAML file without sections).
_PARALLEL_KEYS = frozenset(f.name for f in dataclasses.fields(ParallelConfig))
#: Sizes shown by the plan, in this order.
SIZE_KEYS = ("world_size", "tp", "cp", "pp", "vpp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp", "order")


# ---------------------------------------------------------------------------------------------- config
def launch_world_size(doc: dict[str, Any], path: str = "config") -> int | None:
    """World size from the launcher section ``launch: {nnodes, nproc_per_node}`` (None if absent)."""
    launch = doc.get("launch")
    if launch is None:
        return None
    if not isinstance(launch, dict):
        raise ConfigError(f"{path}: 'launch' must be a mapping such as {{nnodes: 1, nproc_per_node: 4}}, got {launch!r}")
    vals = {}
    for key, default in (("nnodes", 1), ("nproc_per_node", None)):
        v = launch.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{path}: launch.{key}={v!r} must be a positive integer")
        vals[key] = v
    return vals["nnodes"] * vals["nproc_per_node"]


def load_config(path: str, overrides: Iterable[str] = (), world_size: int | None = None) -> tuple[ParallelConfig, int]:
    """The job's ParallelConfig (``parallel:`` section, overrides applied) and its world size.

    Every section of a job YAML is checked as ``megashard run`` checks it (unknown sections and keys, types,
    per-section rules), but only the parallel layout is resolved against the world size: a plan for another
    world size need not fit the job's model or batch. A bare parallel config (only ParallelConfig keys) is
    accepted too. ``world_size`` wins; otherwise it is ``launch.nnodes · launch.nproc_per_node`` from the file.
    Raises ConfigError when neither is available or anything is invalid.
    """
    overrides = list(overrides)
    doc = apply_overrides(load_yaml(path), overrides)
    if "parallel" in doc or not all(k in _PARALLEL_KEYS for k in doc):
        from megashard.train.config import JobConfig

        job = JobConfig.from_dict(doc, name="plan")
        job.validate_sections()
        config = job.parallel
    else:  # a bare parallel config
        config = ParallelConfig.from_dict(parallel_section(doc, path))
    what = "world size"
    if world_size is None:
        world_size = launch_world_size(doc, path)
        what = "world size launch.nnodes × launch.nproc_per_node ="
        if world_size is None:
            raise ConfigError(
                f"{path}: no world size: pass --world-size N or add 'launch: {{nnodes: 1, nproc_per_node: N}}' to the config"
            )
    check_world_size(world_size, what)
    return config, world_size


def parse_group_names(spec: str | None) -> list[str] | None:
    """``"tp,dp"`` → ["tp", "dp"]; None/empty → None (all). Names are checked by the layout."""
    if not spec:
        return None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    return names or None


# ---------------------------------------------------------------------------------------------- locality
def _base_residues(dims: Iterable[tuple[int, int]], G: int) -> dict[int, int]:
    """How many group bases (all sums of ``i·stride``, ``0 <= i < size`` per dim) have each residue mod G.

    ``i·stride mod G`` repeats with period ``G / gcd(stride, G)``, so each dim costs O(G²) at most, not
    O(size): a 131,072-rank world takes well under a millisecond per group name.
    """
    counts = {0: 1}
    for size, stride in dims:
        if size > 1:
            period = G // math.gcd(stride, G)
            # multiplicity of each step i < period among 0..size-1
            steps = {(i * stride) % G: (size - i + period - 1) // period for i in range(min(size, period))}
            nxt: dict[int, int] = {}
            for r, c in counts.items():
                for k, m in steps.items():
                    key = (r + k) % G
                    nxt[key] = nxt.get(key, 0) + c * m
            counts = nxt
    return counts


def _residue_cost(dims: Iterable[tuple[int, int]], G: int) -> int:
    """An upper bound of the dictionary updates :func:`_base_residues` makes."""
    cost, n = 0, 1
    for size, stride in dims:
        if size > 1:
            steps = min(size, G // math.gcd(stride, G))
            cost += n * steps
            n = min(G, n * steps)
    return cost


def _bases_below(x: int, masked: Sequence[tuple[int, int]], rest: Sequence[tuple[int, int]]) -> int:
    """How many group bases (ranks whose coordinates on the ``masked`` dims are 0) are < ``x``; O(dims)."""
    dims = sorted([(s, d, True) for s, d in masked if s > 1] + [(s, d, False) for s, d in rest if s > 1],
                  key=lambda t: t[1])
    free_below = [1]  # bases per value of the lower digits
    for size, _, is_masked in dims:
        free_below.append(free_below[-1] * (1 if is_masked else size))
    count = 0
    for k in range(len(dims) - 1, -1, -1):  # most significant digit first
        size, stride, is_masked = dims[k]
        digit = (x // stride) % size
        count += (min(digit, 1) if is_masked else digit) * free_below[k]
        if is_masked and digit:
            return count
    return count


def locality(layout: RankLayout, ranks_per_node: int, names: Iterable[str] = GROUP_NAMES) -> LocalityReport:
    """Same result as ``layout.locality(ranks_per_node, names)``, computed without listing any group.

    A group is ``base + offsets`` with the smallest offset 0 and the largest ``span``, so (when
    ``span < G``) it crosses a node boundary iff ``base % G + span >= G``. Either the residues of the
    group bases mod G are counted (cost independent of the world size, at most ~G² per axis) or, when
    fewer, the bases in the ``span`` ranks before every node boundary (O(world / G)) — whichever is
    cheaper: a 16,777,216-rank report takes milliseconds.
    """
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node={ranks_per_node!r} must be a positive integer")
    G, W = ranks_per_node, layout.world_size
    crossing: dict[str, tuple[int, int]] = {}
    warnings = []
    for name in names:
        if name == "world":
            continue
        masked, rest = layout.group_dims(name)  # also validates the name
        size = math.prod(s for s, _ in masked)
        n_groups = W // size
        span = sum((s - 1) * d for s, d in masked)
        if size == 1 or G >= W:
            n_cross = 0
        elif span >= G:
            n_cross = n_groups
        elif _residue_cost(rest, G) <= 4 * (W // G):
            residues = _base_residues(rest, G)
            n_cross = sum(c for r, c in residues.items() if r >= G - span)
        else:  # bases in [p - span, p) for every node boundary p (disjoint ranges since span < G)
            n_cross = sum(_bases_below(p, masked, rest) - _bases_below(p - span, masked, rest)
                          for p in range(G, W, G))
        crossing[name] = (n_cross, n_groups)
        if n_cross and name in NODE_LOCAL_GROUPS:
            warnings.append(locality_warning(name, size, n_cross, n_groups, G))
    return LocalityReport(G, crossing, tuple(warnings))


# ---------------------------------------------------------------------------------------------- report
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
    every name in GROUP_NAMES). ``report``: a :func:`locality` result to reuse (computed if None).
    """
    names = list(names) if names else list(GROUP_NAMES)
    sizes = layout.sizes.as_dict()
    rank_groups = {}
    for n in names:
        members = layout.members(n, rank)  # validates rank and name (ConfigError); O(axes), not O(group)
        rank_groups[n] = {
            "ranks": members,
            "rank_in_group": layout.rank_in(n, rank),
            "group_index": layout.group_index(n, rank),
            "num_groups": layout.world_size // len(members),
        }
    report = report or locality(layout, ranks_per_node)
    plan: dict[str, Any] = {
        "sizes": {k: sizes[k] for k in SIZE_KEYS},
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
    for k in SIZE_KEYS:
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


# ---------------------------------------------------------------------------------------------- SVG
def _palette(n: int) -> list[str]:
    """``n`` distinct hex colours; consecutive indices far apart in hue (golden angle), three lightnesses.

    A lightness/saturation pair holds ~500 distinct hues; once one is full, further colours come from a
    bijection of the index into RGB (distinct, not pretty), so thousands of groups cost milliseconds.
    """
    out: list[str] = []
    seen: set[str] = set()
    full: set[tuple[float, float]] = set()
    for k in range(n):
        h = (k * 137.508) % 360.0
        light = (0.62, 0.78, 0.48)[(k // 7) % 3]
        sat = (0.65, 0.45)[(k // 21) % 2]
        c = ""
        if (light, sat) not in full:
            for _ in range(520):  # 360 / 0.7 nudges go once round the hue circle
                r, g, b = colorsys.hls_to_rgb(h / 360.0, light, sat)
                c = "#%02x%02x%02x" % (round(r * 255), round(g * 255), round(b * 255))
                if c not in seen:
                    break
                h = (h + 0.7) % 360.0  # rounding collision: nudge the hue
            else:
                full.add((light, sat))
        j = k
        while not c or c in seen:  # odd multiplier: a bijection of 0..2^24-1, so this ends quickly
            c = "#%06x" % ((j * 2654435761) % (1 << 24))
            j += n
        seen.add(c)
        out.append(c)
    return out


def _text_width(text: str, font_size: float) -> int:
    """Rough rendered width of sans-serif text in px (average glyph ≈ 0.6 em)."""
    return int(len(text) * font_size * 0.6) + 1


def _text_colour(fill: str) -> str:
    r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "#ffffff"


def default_svg_groups(layout: RankLayout, shown: int) -> dict[str, list[str]]:
    """Panels drawn by default: name -> other names with the same colouring of the shown ranks.

    Names of SVG_DEFAULT_GROUPS with size > 1 (expert ones only when ep > 1); a name whose groups of
    the shown ranks equal an earlier panel's becomes its alias (e.g. dp_shard = dp without HSDP).
    ``{"tp": []}`` when every size is 1.
    """
    chosen: dict[str, list[str]] = {}
    seen: dict[tuple, str] = {}
    for n in SVG_DEFAULT_GROUPS:
        if layout.size(n) == 1 or (n in EXPERT_GROUPS and layout.size("ep") == 1):
            continue
        first: dict[int, int] = {}
        # Same colouring of the shown ranks, same size and same first/last groups: an alias, not a panel.
        key = (layout.size(n), layout.members(n, 0), layout.members(n, layout.world_size - 1),
               tuple(first.setdefault(layout.group_index(n, r), len(first)) for r in range(shown)))
        if key in seen:
            chosen[seen[key]].append(n)
            continue
        seen[key] = n
        chosen[n] = []
    return chosen or {"tp": []}


def render_svg(
    layout: RankLayout,
    names: Sequence[str] | None = None,
    rank: int = 0,
    ranks_per_node: int = 8,
    max_ranks: int = 512,
    report: LocalityReport | None = None,
) -> str:
    """An SVG picture of the rank grid: one panel per group name, each rank one labelled cell
    (``<rect class="cell" data-rank=… data-group=…>`` with a ``<title>`` tooltip), coloured by its
    group of that name; nodes (``ranks_per_node`` consecutive ranks) are outlined; ``rank`` is marked.

    Worlds larger than ``max_ranks`` show only their first whole nodes (at least ``max_ranks`` ranks
    when a node alone is larger), with a note in the title.
    """
    W, G = layout.world_size, ranks_per_node
    if G < 1:
        raise ConfigError(f"ranks_per_node={G} must be a positive integer")
    if not 1 <= max_ranks <= MAX_SVG_RANKS:
        raise ConfigError(f"svg max_ranks={max_ranks} must be in 1..{MAX_SVG_RANKS:,} (bigger worlds show their "
                          "first whole nodes)")
    if W <= max_ranks:
        shown = W
    else:
        shown = (max_ranks // G) * G or max_ranks
    panels = {n: [] for n in names} if names else default_svg_groups(layout, shown)
    report = report or locality(layout, G)

    # Geometry: a node is a block of cpr columns; rows of blocks fill ~32 cells of width.
    cell = 30 if shown <= 128 else 22 if shown <= 512 else 16
    label = cell >= 20
    cpr = min(G, 32)
    rows_per_node = math.ceil(G / cpr)
    npr = max(1, 32 // cpr)
    n_nodes = math.ceil(shown / G)
    block_w, block_h, gap, margin = cpr * cell, rows_per_node * cell, 6, 12
    grid_w = min(npr, n_nodes) * (block_w + gap) - gap
    grid_h = math.ceil(n_nodes / npr) * (block_h + gap) - gap
    head = 34
    panel_h = head + grid_h + 18
    title_h = 62
    height = title_h + len(panels) * panel_h + margin

    s = layout.sizes
    dims = " ".join(f"{k}={getattr(s, k)}" for k in ("tp", "cp", "pp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp"))
    title = f"megashard plan: {W:,} ranks, order {'-'.join(s.order)}"
    if shown < W:
        note = f"showing the first {shown:,} of {W:,} ranks ({n_nodes} node{'s' if n_nodes > 1 else ''} of {G})"
    else:
        note = f"all ranks; {G} ranks per node (outlined)"
    note += f"; rank {rank} marked"
    width = max(grid_w + 2 * margin, _text_width(dims, 11) + 2 * margin, _text_width(note, 11) + 2 * margin,
                _text_width(title, 13) + 2 * margin)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="DejaVu Sans, Arial, sans-serif">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{margin}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<text x="{margin}" y="35" font-size="11">{escape(dims)}</text>',
        f'<text x="{margin}" y="51" font-size="11" fill="#444444">{escape(note)}</text>',
    ]

    def cell_xy(r: int) -> tuple[int, int]:
        node, i = divmod(r, G)
        bx = margin + (node % npr) * (block_w + gap)
        by = (node // npr) * (block_h + gap)
        return bx + (i % cpr) * cell, by + (i // cpr) * cell

    for p, (name, aliases) in enumerate(panels.items()):
        top = title_h + p * panel_h
        size = layout.size(name)
        n_groups = W // size
        cross = report.crossing.get(name)
        extra = f", {cross[0]:,} crossing nodes" if cross and cross[0] else ""
        mine = layout.members(name, rank)  # also validates rank and name
        alias = f" (= {', '.join(aliases)})" if aliases else ""
        caption = f"{name}{alias}: size {size}, {n_groups:,} group{'s' if n_groups > 1 else ''}{extra}"
        parts.append(f'<g class="panel" data-group-name="{escape(name)}" transform="translate(0,{top})">')
        parts.append(f'<text x="{margin}" y="16" font-size="12" font-weight="bold">{escape(caption)}</text>')
        parts.append(
            f'<text x="{margin}" y="29" font-size="10" fill="#444444">'
            f"{escape(f'rank {rank} is in {name} group {layout.group_index(name, rank)}: {format_members(mine, 12)}')}"
            "</text>"
        )
        parts.append(f'<g transform="translate(0,{head})">')
        idx = [layout.group_index(name, r) for r in range(shown)]
        order = {g: k for k, g in enumerate(dict.fromkeys(idx))}  # colour by first appearance
        colours = _palette(len(order))
        for r in range(shown):
            x, y = cell_xy(r)
            g = idx[r]
            fill = colours[order[g]]
            tip = f"rank {r}: {name} group {g}, index {layout.rank_in(name, r)} of {size}"
            parts.append(
                f'<rect class="cell" data-rank="{r}" data-group="{g}" x="{x}" y="{y}" width="{cell}" height="{cell}" '
                f'fill="{fill}" stroke="#ffffff" stroke-width="1"><title>{escape(tip)}</title></rect>'
            )
            if label:
                fs = 10 if r < 1000 else 8 if r < 10000 else 6
                parts.append(
                    f'<text x="{x + cell / 2:g}" y="{y + cell / 2 + fs / 3:g}" font-size="{fs}" text-anchor="middle" '
                    f'fill="{_text_colour(fill)}">{r}</text>'
                )
        for node in range(n_nodes):
            x, y = cell_xy(node * G)
            in_node = min(G, shown - node * G)
            h = math.ceil(in_node / cpr) * cell
            parts.append(
                f'<rect class="node" x="{x}" y="{y}" width="{block_w}" height="{h}" fill="none" '
                f'stroke="#333333" stroke-width="1.5"/>'
            )
        if rank < shown:
            x, y = cell_xy(rank)
            parts.append(
                f'<rect class="marker" x="{x + 1}" y="{y + 1}" width="{cell - 2}" height="{cell - 2}" fill="none" '
                f'stroke="#000000" stroke-width="2.5"/>'
            )
        parts.append("</g></g>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
