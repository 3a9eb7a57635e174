"""A picture of a rank layout (``megashard plan --svg``): one panel per group name, each rank one cell.

:func:`render_svg` draws the rank grid of a :class:`~megashard.layout.RankLayout`, cells coloured by their group
of the panel's name, nodes outlined, one rank marked; worlds beyond ``max_ranks`` show their first whole nodes.
"""
from __future__ import annotations

import colorsys
import math
from typing import Sequence
from xml.sax.saxutils import escape

from megashard.errors import ConfigError
from megashard.layout.groups import EXPERT_GROUPS
from megashard.layout.node_locality import LocalityReport
from megashard.layout.plan import format_members
from megashard.layout.rank_layout import RankLayout

#: Group names drawn by default in the SVG (size > 1 only; a duplicate of an earlier panel becomes its alias).
SVG_DEFAULT_GROUPS = ("tp", "cp", "dp", "dp_shard", "dp_outer", "pp", "ep", "expt_tp", "expt_dp")
#: Most ranks an SVG picture may draw (each rank is one cell per panel).
MAX_SVG_RANKS = 1 << 14


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
    report = report or layout.locality(G)

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
