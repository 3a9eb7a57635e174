"""Elastic jobs: the world size is an input of the layout (``launch.nnodes: MIN:MAX``; docs/elastic.md).

    sizes = validate_range(job)            # ConfigError unless some world size of the range can be laid out
    for o in world_options(job):           # every node count MIN..MAX: its layout, or why it is refused
        print(o.nodes, o.world_size, o.sizes or o.refusal)

Each rendezvous round resolves the layout again for the world it formed: the axes the config fixes (tp, cp, pp, ep,
expt_tp) stay, the free data-parallel axis absorbs the change (``dp_shard: auto`` by default, ``dp_outer: auto`` for
HSDP), ``train.global_batch`` stays and the microbatches per rank follow (:meth:`JobConfig.microbatches`). A world
size the fixed axes or the batch cannot fill is refused with the valid sizes named — at launch (``megashard run``,
``--dry-run``, ``megashard plan``) and by the workers of a round that formed one (:func:`unfillable_line`).

Pure arithmetic over :meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>`: no torch, no processes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megashard.errors import ConfigError

if TYPE_CHECKING:
    from megashard.config import ResolvedSizes

#: A :class:`megashard.train.config.JobConfig` (which calls :func:`validate_range`: named, not imported, here).
JobConfig = Any

__all__ = ["WorldOption", "world_options", "validate_range", "absorbing_axis", "layout_text", "valid_sizes_text",
           "unfillable_line", "FIXED_AXES", "refusals_text", "shown_options", "MAX_LISTED"]

#: Axes an elastic job keeps for every world size: they shape the model's shards and the pipeline.
FIXED_AXES = ("tp", "cp", "pp", "ep", "expt_tp")


@dataclass
class WorldOption:
    """One node count of an elastic range: its layout, or why the job cannot run there."""

    nodes: int
    world_size: int
    sizes: Optional["ResolvedSizes"] = None
    refusal: Optional[str] = None
    """The ConfigError of :meth:`JobConfig.validate` at this world size (None when it runs)."""


def absorbing_axis(job: JobConfig) -> str:
    """The data-parallel axis that absorbs the world size of an elastic job; ConfigError (one line) when the config
    leaves a fixed axis free (``tp: -1`` would re-shard the model at every change) or no data-parallel axis free."""
    p, la = job.parallel, job.launch
    free = [a for a in FIXED_AXES if getattr(p, a) == -1]
    if free:
        raise ConfigError(
            f"launch.nnodes={la.nnodes} is elastic: only data-parallel axes may absorb the world size, but "
            f"{', '.join(f'parallel.{a}=-1' for a in free)} would change with it; give "
            f"{'it a fixed size' if len(free) == 1 else 'them fixed sizes'} and leave parallel.dp_shard (or dp_outer "
            "for HSDP) auto")
    if p.dp == -1:
        if p.dp_shard == -1:
            return "dp_shard"
        if p.dp_outer == -1:
            return "dp_outer"
    fixed = f"parallel.dp={p.dp}" if p.dp != -1 else f"parallel.dp_outer={p.dp_outer} × dp_shard={p.dp_shard}"
    raise ConfigError(
        f"launch.nnodes={la.nnodes} is elastic, but {fixed} fixes the data-parallel size: set parallel.dp_shard=auto "
        f"(FSDP absorbs the world size){'' if p.dp == -1 else ' and parallel.dp=auto'} or, for HSDP, "
        "parallel.dp_outer=auto with a fixed dp_shard")


def world_options(job: JobConfig) -> list[WorldOption]:
    """Every node count of ``launch.nnodes`` with its layout or its refusal (the data files are checked once, by
    :func:`validate_range`, not per world size)."""
    lo, hi = job.launch.node_range
    if hi - lo + 1 > MAX_NODE_COUNTS:  # each is a layout resolved: millions would take hours
        raise ConfigError(f"launch.nnodes={job.launch.nnodes} spans {hi - lo + 1:,} node counts; an elastic range may "
                          f"span at most {MAX_NODE_COUNTS:,} (MAX - MIN < {MAX_NODE_COUNTS:,}): narrow it to the node "
                          "counts the job may really run on")
    out = []
    for n in range(lo, hi + 1):
        w = n * job.launch.nproc_per_node
        try:
            out.append(WorldOption(n, w, sizes=job.validate(w, data=False)))
        except ConfigError as e:
            out.append(WorldOption(n, w, refusal=str(e)))
    return out


def _listed(options: list[WorldOption]) -> str:
    sizes = [str(o.world_size) for o in options]
    return ", ".join(sizes) if len(sizes) <= 12 else ", ".join(sizes[:6]) + ", …, " + ", ".join(sizes[-3:])


def valid_sizes_text(options: list[WorldOption]) -> str:
    """``"4 (2 nodes), 8 (4 nodes)"``: the world sizes of ``options`` that run."""
    ok = [o for o in options if o.sizes is not None]
    text = ", ".join(f"{o.world_size} ({o.nodes} node{'s' if o.nodes > 1 else ''})" for o in ok[:24]) or "none"
    return text + (f" and {len(ok) - 24} more" if len(ok) > 24 else "")


#: Most node counts an elastic range may span (each is a layout checked; 65,536 take seconds).
MAX_NODE_COUNTS = 1 << 16
#: Node counts an elastic plan or dry run lists one line each; a longer range is summarised (:func:`shown_options`).
MAX_LISTED = 40


def _rule(text: str) -> str:
    """A refusal with its numbers blanked: two worlds refused by the same rule (at other sizes) compare equal."""
    return re.sub(r"\d+", "#", text.split("; valid")[0])


def refusals_text(options: list[WorldOption], limit: int = 3) -> str:
    """``"at world size 6: <why>; at world sizes 2, 4: <why>"``: every distinct reason the refused worlds of
    ``options`` have (the largest world's first, then in order), so that each setting that blocks a world is named."""
    groups: dict[str, list[WorldOption]] = {}
    for o in options:
        if o.refusal is not None:
            groups.setdefault(_rule(o.refusal), []).append(o)
    if not groups:
        return ""
    ordered = sorted(groups.values(), key=lambda g: g[-1] is not options[-1])  # the largest world's reason first
    parts = []
    for g in ordered[:limit]:
        others = [str(o.world_size) for o in g[:-1]]
        alike = ("" if not others else f" (alike at world size{'s' if len(others) > 1 else ''} "
                 + ", ".join(others[:6]) + (f" and {len(others) - 6:,} more" if len(others) > 6 else "") + ")")
        parts.append(f"at world size {g[-1].world_size}: {g[-1].refusal}{alike}")
    more = len(ordered) - limit
    return "; ".join(parts) + (f"; and {more} other reason{'s' if more > 1 else ''} (megashard plan lists them)"
                               if more > 0 else "")


def shown_options(options: list[WorldOption], limit: int = MAX_LISTED) -> tuple[list[WorldOption], str]:
    """The node counts to list one line each, and a summary line of the rest ("" when every one is listed): a range
    of thousands of node counts is not printed line by line."""
    if len(options) <= limit:
        return options, ""
    head, tail = options[: limit // 2], options[-(limit // 4):]
    middle = options[limit // 2: -(limit // 4)]
    run = [o for o in middle if o.sizes is not None]
    runs = (f"{len(run)} run (world sizes {', '.join(str(o.world_size) for o in run[:12])}"
            f"{', …' if len(run) > 12 else ''})" if run else "none runs")
    refused = [o for o in middle if o.sizes is None]
    why = f"; {len(refused)} refused, {refusals_text(refused, limit=2)}" if refused else ""
    return head + tail, (f"… {len(middle):,} more node counts ({middle[0].nodes}..{middle[-1].nodes}) not listed: "
                         f"{runs}{why} (--format json lists every one)")


def validate_range(job: JobConfig, *, data: bool = True) -> "ResolvedSizes":
    """:meth:`JobConfig.validate` of an elastic job: the absorbing axis, every world size of the range (at least one
    must run), the data once; returns the sizes at the largest world that runs. ConfigError (one line) otherwise."""
    absorbing_axis(job)
    options = world_options(job)
    ok = [o for o in options if o.sizes is not None]
    if not ok:  # every reason named, the largest world's first (the sizes the config was most likely written for)
        raise ConfigError(
            f"launch.nnodes={job.launch.nnodes} × launch.nproc_per_node={job.launch.nproc_per_node}: no world size in "
            f"range can run this job ({_listed(options)}); {refusals_text(options)}")
    if data:
        job.validate(ok[-1].world_size, data=True)  # the data files and samples: the same for every layout
    return ok[-1].sizes  # type: ignore[return-value]


def layout_text(job: JobConfig, sizes: "ResolvedSizes", *, per_rank: bool = False) -> str:
    """``"tp=2, pp=2, dp_shard=1 (1f1b, 4 microbatches)"``; with ``per_rank`` the batch each rank takes:
    ``"tp=2, dp_shard=2 (8 sequences per rank in 1 microbatch)"``."""
    s = sizes
    keys = ("tp", "cp", "pp", "dp_outer", "dp_shard") + (("ep", "expt_dp") if s.ep > 1 else ())
    text = ", ".join(f"{k}={getattr(s, k)}" for k in keys if getattr(s, k) > 1 or k == "dp_shard")
    if s.pp > 1 and (s.vpp or 1) > 1:
        text += f", vpp={s.vpp}"
    mb = job.microbatches(s.pp, s.dp)
    if not per_rank:
        return text + (f" ({job.train.pipeline_schedule}, {mb} microbatches)" if s.pp > 1 else "")
    n = job.train.global_batch // max(1, s.dp)
    text += f" ({n} sequence{'s' if n != 1 else ''} per rank in {mb} microbatch{'es' if mb != 1 else ''}"
    return text + (f", {job.train.pipeline_schedule})" if s.pp > 1 else ")")


def unfillable_line(job: JobConfig, world_size: int, error: str) -> str:
    """The one line the workers of a round that formed an unfillable world print (``launch.unfillable_world``)."""
    options = world_options(job)
    action = ("waiting for a node to join or leave (launch.unfillable_world=wait; nothing is written)"
              if job.launch.unfillable_world == "wait" else "stopping (launch.unfillable_world=stop)")
    nodes = world_size // job.launch.nproc_per_node
    return (f"the rendezvous formed a world of {world_size} processes ({nodes} node{'s' if nodes != 1 else ''}), "
            f"which this job cannot fill: {error}; world sizes that run: {valid_sizes_text(options)}; {action}")
