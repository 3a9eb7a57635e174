"""``megashard plan CONFIG``: the rank layout of a job YAML for any world size, without processes.

The file is read once (:func:`load_config`: every section checked as ``megashard run`` checks it, only the
parallel layout resolved), the layout resolved once, and the report built by :mod:`megashard.layout.plan`
(table or JSON) and :mod:`megashard.layout.plan_svg` (picture).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Iterable

from megashard.cli.options import DEFAULT_CONFIG, add_config_arguments, check_int, check_output_path
from megashard.config import ParallelConfig, check_world_size, parallel_section, yamlfile
from megashard.errors import ConfigError

#: The keys of a bare parallel config (a YAML file without sections).
_PARALLEL_KEYS = frozenset(f.name for f in dataclasses.fields(ParallelConfig))


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
    """:func:`load_job` without the job."""
    config, world_size, _ = load_job(path, overrides, world_size)
    return config, world_size


def load_job(path: str, overrides: Iterable[str] = (), world_size: int | None = None) -> tuple[ParallelConfig, int, Any]:
    """The job's ParallelConfig (``parallel:`` section, overrides applied) and its world size.

    Every section of a job YAML is checked as ``megashard run`` checks it (unknown sections and keys, types,
    per-section rules), but only the parallel layout is resolved against the world size: a plan for another
    world size need not fit the job's model or batch. A bare parallel config (only ParallelConfig keys) is
    accepted too. ``world_size`` wins; otherwise it is ``launch.nnodes · launch.nproc_per_node`` from the file.
    Raises ConfigError when neither is available or anything is invalid. The third item is the
    :class:`~megashard.train.config.JobConfig` (None for a bare parallel config).
    """
    overrides = list(overrides)
    job = None
    doc = yamlfile.apply_overrides(yamlfile.load_yaml(path), overrides)  # the one read of the file
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
    return config, world_size, job


def parse_group_names(spec: str | None) -> list[str] | None:
    """``"tp,dp"`` → ["tp", "dp"]; None/empty → None (all). Names are checked by the layout."""
    if not spec:
        return None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    return names or None


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard plan``."""
    p = sub.add_parser(
        "plan",
        help="show the rank layout of a config for any world size (no processes)",
        description=(
            "Resolve the parallel sizes of CONFIG's 'parallel:' section for a world size and show which ranks "
            "form every group (Megatron-LM RankGenerator order), which groups cross node boundaries, and "
            "optionally an SVG picture of the rank grid. Pure arithmetic: 131,072 ranks take well under a second."
        ),
        epilog=(
            "examples:\n"
            f"  megashard plan {DEFAULT_CONFIG}\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 16 parallel.tp=2 parallel.pp=4 parallel.dp_shard=-1 --rank 5\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 131072 parallel.tp=8 parallel.dp_shard=-1 --format json --groups tp,pp\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 64 parallel.dp_shard=-1 parallel.ep=4 --svg layout.svg\n"
            "\nexit codes: 0 ok, 1 --strict and locality warnings (or output not writable), 2 invalid config or usage"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(
        p, f"job YAML with a 'parallel:' section (e.g. {DEFAULT_CONFIG})",
        "dotted overrides applied to the YAML before validation, e.g. parallel.tp=4 launch.nnodes=2",
    )
    p.add_argument(
        "--world-size", "-w", type=int, default=None, metavar="N",
        help="number of ranks (default: launch.nnodes × launch.nproc_per_node from CONFIG)",
    )
    p.add_argument("--rank", "-r", type=int, default=0, metavar="R", help="rank whose groups are shown (default 0)")
    p.add_argument(
        "--ranks-per-node", "-g", type=int, default=8, metavar="G",
        help="ranks per node for the locality report and the picture; node = rank // G (default 8)",
    )
    p.add_argument(
        "--format", "-f", choices=("table", "json"), default="table",
        help="table: sizes, the rank's groups, locality; json: the same plus every group of every name",
    )
    p.add_argument(
        "--groups", metavar="NAMES", default=None,
        help="comma-separated group names to show (default: all; for JSON of huge worlds restrict e.g. tp,dp); "
        "also the panels of --svg",
    )
    p.add_argument("--all-groups", action="store_true", help="table format: also list every group of each name")
    p.add_argument(
        "--max-members", type=int, default=16, metavar="K",
        help="table format: abbreviate groups longer than K ranks (0 = never; default 16)",
    )
    p.add_argument("--svg", metavar="FILE", default=None, help="write a picture of the rank grid coloured by group")
    p.add_argument(
        "--svg-max-ranks", type=int, default=512, metavar="M",
        help="largest number of ranks drawn; bigger worlds show their first whole nodes (default 512)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when the locality report has warnings")
    p.set_defaults(handler=_cmd_plan, parser=p, accepts_overrides=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    from megashard.layout import GROUP_NAMES, RankLayout, locality
    from megashard.layout.plan import MAX_LISTED_RANKS, build_plan, check_listing, format_table, plan_to_json
    from megashard.layout.plan_svg import MAX_SVG_RANKS, render_svg

    # Options first (cheap, and each names itself), then the config.
    check_int("--max-members", args.max_members, 0, note=" (0 = never abbreviate)")
    check_int("--ranks-per-node", args.ranks_per_node, 1)
    check_int("--svg-max-ranks", args.svg_max_ranks, 1, MAX_SVG_RANKS)
    if args.world_size is not None:
        from megashard.config import MAX_WORLD_SIZE

        check_int("--world-size", args.world_size, 1, MAX_WORLD_SIZE, note=" (megashard's largest world, 2^24)")
    names = parse_group_names(args.groups)
    if args.groups is not None and not names:
        raise ConfigError(f"--groups {args.groups!r} names no group; give names such as tp,dp (valid: {', '.join(GROUP_NAMES)})")
    if args.svg:
        check_output_path("--svg", args.svg)
    config, world_size, job = load_job(args.config, args.overrides, args.world_size)
    sizes = config.resolve(world_size)  # the one resolve of this process
    layout = RankLayout(sizes)
    check_int("--rank", args.rank, 0, world_size - 1, note=f" (the world has {world_size:,} ranks)")
    as_json = args.format == "json"
    shown = names or list(GROUP_NAMES)
    for n in shown:
        layout.size(n)  # an unknown name fails here, before any listing
    if as_json or args.all_groups:
        check_listing(layout, shown, rank_groups=as_json)
    elif args.max_members == 0 and sum(layout.size(n) for n in shown) > MAX_LISTED_RANKS:
        raise ConfigError(f"--max-members 0 would print {sum(layout.size(n) for n in shown):,} rank ids for rank "
                          f"{args.rank}'s groups, more than {MAX_LISTED_RANKS:,}; abbreviate (e.g. --max-members 16) "
                          "or name fewer groups with --groups")
    report = locality(layout, args.ranks_per_node)
    plan = build_plan(layout, args.rank, args.ranks_per_node, names, all_groups=as_json or args.all_groups,
                      report=report)
    svg = None
    if args.svg:
        svg = render_svg(layout, names, args.rank, args.ranks_per_node, args.svg_max_ranks, report)
    placement = None
    if job is not None:
        from megashard.train.stages import format_placement, model_placement

        placement = model_placement(job, sizes.pp, sizes.vpp or 1, sizes.ep)
        plan["model_placement"] = placement
    if as_json:
        plan = {"config": args.config, "overrides": list(args.overrides), **plan}
        sys.stdout.write(plan_to_json(plan) + "\n")
    else:
        source = args.config + ("".join(f" {o}" for o in args.overrides))
        table = format_table(plan, args.max_members, source)
        if placement is not None:
            table += "\n".join(format_placement(placement)) + "\n"
        sys.stdout.write(table)
    if svg is not None:
        try:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(svg)
        except OSError as e:
            print(f"megashard plan: cannot write {args.svg}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"megashard plan: wrote {args.svg}", file=sys.stderr)
    if args.strict and plan["locality"]["warnings"]:
        return 1
    return 0
