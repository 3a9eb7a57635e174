"""``megashard plan CONFIG`` for an elastic job (``launch.nnodes: MIN:MAX``): the layout at every world size in range.

One row per node count: the resolved sizes, the sequences each rank takes per step and in how many microbatches, or
why the job cannot run there (what ``megashard run`` and the workers of such a round say:
:mod:`megashard.train.elastic`). ``--world-size N`` plans one world size with every group, as for any config.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from megashard.train.elastic import MAX_LISTED, absorbing_axis, refusals_text, valid_sizes_text, world_options

__all__ = ["range_plan", "format_range", "cmd_plan_range"]

_COLUMNS = ("tp", "cp", "pp", "vpp", "dp_outer", "dp_shard", "ep", "expt_dp")


def range_plan(job: Any, source: str) -> dict[str, Any]:
    """The JSON-ready plan of every world size of ``job``'s node range."""
    la = job.launch
    lo, hi = la.node_range
    worlds = []
    for o in world_options(job):
        row: dict[str, Any] = {"nodes": o.nodes, "world_size": o.world_size}
        if o.sizes is not None:
            s = o.sizes
            row["sizes"] = {k: getattr(s, k) for k in ("tp", "cp", "pp", "vpp", "dp", "dp_outer", "dp_shard", "ep",
                                                        "expt_tp", "expt_dp")}
            row["sequences_per_rank"] = job.train.global_batch // s.dp
            row["microbatches"] = job.microbatches(s.pp, s.dp)
            if la.recovery == "live":
                row["live_copies_bytes_per_rank"] = _live_copies(job, s, o.nodes)
        else:
            row["refused"] = o.refusal
        worlds.append(row)
    return {"config": source, "nnodes": f"{lo}:{hi}", "nproc_per_node": la.nproc_per_node,
            "absorbing_axis": absorbing_axis(job), "global_batch": job.train.global_batch,
            "unfillable_world": la.unfillable_world, "recovery": la.recovery,
            "memory_copies": job.checkpoint.memory_copies, "worlds": worlds}


def _live_copies(job: Any, sizes: Any, nodes: int) -> int:
    """Host memory per rank of live recovery's copies at this world (no copy on a single node: none to keep it)."""
    from megashard.advisor.memory import live_copies_bytes
    from megashard.advisor.shape import JobShape

    return live_copies_bytes(JobShape.from_job(job), sizes, job.checkpoint.memory_copies if nodes > 1 else 0)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def format_range(plan: dict[str, Any]) -> str:
    """The range plan as aligned text."""
    out = [f"megashard plan: {plan['config']} — elastic, launch.nnodes={plan['nnodes']} × {plan['nproc_per_node']} "
           f"processes per node; parallel.{plan['absorbing_axis']} absorbs the world size, train.global_batch="
           f"{plan['global_batch']} stays", ""]
    ok = [w["sizes"] for w in plan["worlds"] if "sizes" in w]
    cols = [k for k in _COLUMNS if k in ("tp", "pp", "dp_outer", "dp_shard")
            or any(s[k] is not None and s[k] != 1 for s in ok) and (k != "expt_dp" or any(s["ep"] > 1 for s in ok))]
    head = ("nodes", "world") + tuple(cols) + ("seq/rank", "microbatches")
    rows: list[tuple[str, ...]] = [head]
    refused = []
    worlds = plan["worlds"]
    skipped: list = []
    if len(worlds) > MAX_LISTED:  # thousands of node counts: the ends listed, the middle summarised
        half, quarter = MAX_LISTED // 2, MAX_LISTED // 4
        worlds, skipped = worlds[:half] + worlds[-quarter:], worlds[half:-quarter]
    for w in worlds:
        if "sizes" in w:
            s = w["sizes"]
            rows.append((str(w["nodes"]), str(w["world_size"]), *("-" if s[k] is None else str(s[k]) for k in cols),
                         str(w["sequences_per_rank"]), str(w["microbatches"])))
        else:
            rows.append((str(w["nodes"]), str(w["world_size"])))
            refused.append(w)
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    for i, r in enumerate(rows):
        cells = [c.ljust(widths[i]) for i, c in enumerate(r)] + (["refused (below)"] if len(r) == 2 else [])
        out.append("  " + "  ".join(cells).rstrip())
        if skipped and i == MAX_LISTED // 2:
            run = [w["world_size"] for w in skipped if "sizes" in w]
            out.append(f"  … {len(skipped):,} more node counts ({skipped[0]['nodes']}..{skipped[-1]['nodes']}) not "
                       f"listed: {len(run)} run{' (world sizes ' + ', '.join(map(str, run[:12])) + (', …' if len(run) > 12 else '') + ')' if run else ''}, "
                       f"{len(skipped) - len(run)} refused (--format json lists every one)")
    out.append("")
    if len(refused) > MAX_LISTED // 2:  # one line per distinct reason, not per world
        from megashard.train.elastic import WorldOption

        opts = [WorldOption(w["nodes"], w["world_size"], refusal=w["refused"]) for w in plan["worlds"] if "refused" in w]
        out.append(f"{len(opts):,} world sizes are refused: {refusals_text(opts, limit=4)}")
        refused = []
    for w in refused:
        out.append(f"world {w['world_size']} ({w['nodes']} node{'s' if w['nodes'] != 1 else ''}) is refused: "
                   f"{w['refused']}")
    if refused:
        what = "waits there for a node to join or leave" if plan["unfillable_world"] == "wait" else "stops there"
        out.append(f"a rendezvous that forms a refused world size: the job {what} "
                   f"(launch.unfillable_world={plan['unfillable_world']})")
        out.append("")
    live = [w for w in plan["worlds"] if "live_copies_bytes_per_rank" in w]
    if live:
        out.append(f"live recovery (launch.recovery=live, checkpoint.memory_copies={plan['memory_copies']}): host "
                   "memory per rank for the copies of the model and optimizer state: "
                   + ", ".join(f"{_mib(w['live_copies_bytes_per_rank'])} at world {w['world_size']}" for w in live))
    out.append("every group at one world size: megashard plan CONFIG --world-size N")
    return "\n".join(out) + "\n"


def cmd_plan_range(args: Any, job: Any) -> int:
    """``megashard plan`` of an elastic config without ``--world-size``."""
    from megashard.errors import ConfigError

    one = [f for f, given in (("--svg", args.svg), ("--groups", args.groups), ("--all-groups", args.all_groups),
                              ("--rank", args.rank != 0), ("--strict", args.strict)) if given]
    if one:  # flags of one layout's groups: refused, never silently unused
        raise ConfigError(f"{', '.join(one)} show{'s' if len(one) == 1 else ''} one layout: add --world-size N to plan "
                          f"one world size of launch.nnodes={job.launch.nnodes}")
    source = " ".join([args.config or "", *args.overrides]).strip()
    plan = range_plan(job, source)
    if not any("sizes" in w for w in plan["worlds"]):
        opts = world_options(job)
        raise ConfigError(f"launch.nnodes={job.launch.nnodes}: no world size in range can run this job "
                          f"({valid_sizes_text(opts)} run); {refusals_text(opts)}")
    if args.format == "json":
        sys.stdout.write(json.dumps(plan, indent=1) + "\n")
    else:
        sys.stdout.write(format_range(plan))
    return 0
