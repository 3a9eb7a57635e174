"""The report of ``megashard plan`` for a multi-module job: each module's rank range, sizes and groups (global
ranks), and the pairing across every seam (:func:`megashard.layout.modules.pair_modules`). Pure arithmetic."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from megashard.errors import ConfigError
from megashard.layout.modules import MultiModuleLayout
from megashard.layout.plan import MAX_LISTED_RANKS, SIZE_KEYS, _align, format_members

__all__ = ["DEFAULT_MODULE_GROUPS", "build_modules_plan", "format_modules_table"]

#: Groups shown per module unless --groups names others.
DEFAULT_MODULE_GROUPS = ("tp", "cp", "pp", "dp", "ep", "expt_dp")


def build_modules_plan(multi: MultiModuleLayout, names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """``{"world_size", "idle_ranks", "modules": [{name, ranks: [first, last], sizes, groups: {name: [...]}}],
    "seams": [{src, dst, links: [{src, dst, src_part, dst_part}]}]}`` (parts as ``"i/n"``)."""
    names = list(names or DEFAULT_MODULE_GROUPS)
    total = sum(m.world_size for m in multi) * len(names)
    if total > MAX_LISTED_RANKS:
        raise ConfigError(f"listing every group of {', '.join(names)} in every module would print {total:,} rank ids, "
                          f"more than {MAX_LISTED_RANKS:,}; name fewer groups with --groups")
    modules = []
    for m in multi:
        for n in names:
            m.layout.size(n)  # an unknown name fails here, naming the valid ones
        sizes = m.layout.sizes.as_dict()
        modules.append({
            "name": m.name,
            "ranks": [m.ranks.start, m.ranks.stop - 1],
            "sizes": {k: sizes.get(k) for k in SIZE_KEYS},
            "groups": {n: m.groups(n) for n in names},
        })
    seams = []
    for src, dst in multi.connections:
        links = [{"src": l.src, "dst": l.dst, "src_part": f"{l.src_part}/{l.src_parts}",
                  "dst_part": f"{l.dst_part}/{l.dst_parts}"} for l in multi.links(src, dst)]
        seams.append({"src": src, "dst": dst, "links": links})
    return {"world_size": multi.world_size, "idle_ranks": multi.idle_ranks, "modules": modules, "seams": seams}


def format_modules_table(plan: dict[str, Any], max_members: int = 16, source: str = "", max_groups: int = 8) -> str:
    """The multi-module plan as aligned text."""
    mods = plan["modules"]
    out = [f"megashard plan{': ' + source if source else ''} — {plan['world_size']} ranks, {len(mods)} modules", ""]
    keys = [k for k in SIZE_KEYS if k != "world_size"]
    rows = [("module", "ranks", *keys[:-1], "order")]
    for m in mods:
        s = m["sizes"]
        rows.append((m["name"], f"{m['ranks'][0]}-{m['ranks'][1]}",
                     *("none" if s[k] is None else str(s[k]) for k in keys[:-1]), s["order"]))
    out.append("modules")
    out += _align(rows)
    if plan["idle_ranks"]:
        out.append(f"  ({plan['idle_ranks']} ranks belong to no module)")
    for m in mods:
        out += ["", f"groups of {m['name']} (global ranks)"]
        grows = []
        for n, groups in m["groups"].items():
            shown = ", ".join(format_members(g, max_members) for g in groups[:max_groups])
            more = f", … ({len(groups)} groups)" if len(groups) > max_groups else ""
            grows.append((n, f"{len(groups[0])}", shown + more))
        out += _align([("name", "size", "groups"), *grows])
    for seam in plan["seams"]:
        out += ["", f"seam {seam['src']} -> {seam['dst']} (last pipeline stage of {seam['src']} -> first of "
                f"{seam['dst']}; batch parts i/n along dim 0)"]
        out += _align([("send", "recv", "sends part", "as part"),
                       *((str(l["src"]), str(l["dst"]), l["src_part"], l["dst_part"]) for l in seam["links"])])
    return "\n".join(out) + "\n"
