"""``megashard plan [CONFIG] [--tp N --pp N ...]``: the rank layout of a job for any world size, without processes.

The sizes come from a job YAML, from flags (``--tp 8 --pp 4 --world-size 128``, no YAML needed) or both (flags
win); a multi-module YAML (``modules:``) is planned by :mod:`megashard.cli.plan_modules`.

The file is read once (:func:`load_config`: every section checked as ``megashard run`` checks it, only the
parallel layout resolved), the layout resolved once, and the report built by :mod:`megashard.layout.plan`
(table or JSON) and :mod:`megashard.layout.plan_svg` (picture).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Iterable

from megashard.cli.options import (  # noqa: F401 - SIZE_FLAGS, size_flags, flags_text: re-exported
    DEFAULT_CONFIG,
    SIZE_FLAGS,
    add_command,
    check_int,
    check_output_path,
    flags_text,
    size_flags,
    write_svg,
)
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
        if key == "nnodes" and isinstance(v, str):  # an elastic range MIN:MAX: the largest world
            from megashard.train.sections import parse_node_range

            v = parse_node_range(v)[1]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{path}: launch.{key}={v!r} must be a positive integer")
        vals[key] = v
    return vals["nnodes"] * vals["nproc_per_node"]


def load_config(path: str, overrides: Iterable[str] = (), world_size: int | None = None,
                doc: dict[str, Any] | None = None) -> tuple[ParallelConfig, int]:
    """:func:`load_job` without the job."""
    config, world_size, _ = load_job(path, overrides, world_size, doc)
    return config, world_size


def load_job(path: str, overrides: Iterable[str] = (), world_size: int | None = None,
             doc: dict[str, Any] | None = None) -> tuple[ParallelConfig, int, Any]:
    """The job's ParallelConfig (``parallel:`` section, overrides applied) and its world size.

    Every section of a job YAML is checked as ``megashard run`` checks it (unknown sections and keys, types,
    per-section rules), but only the parallel layout is resolved against the world size: a plan for another
    world size need not fit the job's model or batch. A bare parallel config (only ParallelConfig keys) is
    accepted too. ``world_size`` wins; otherwise it is ``launch.nnodes · launch.nproc_per_node`` from the file.
    Raises ConfigError when neither is available or anything is invalid. ``doc``: the file's parsed content when the
    caller has read it already (it is not read again). The third item is the
    :class:`~megashard.train.config.JobConfig` (None for a bare parallel config).
    """
    overrides = list(overrides)
    job = None
    doc = yamlfile.apply_overrides(yamlfile.load_yaml(path) if doc is None else doc, overrides)
    if "parallel" in doc or not all(k in _PARALLEL_KEYS for k in doc):
        from megashard.train.config import JobConfig

        job = JobConfig.from_dict(doc, name="plan")
        job.validate_sections()
        config = job.parallel
    else:  # a bare parallel config
        config = ParallelConfig.from_dict(parallel_section(doc, path), yaml_words=True)
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
    p = add_command(
        sub, "plan",
        help="show the rank layout of a config for any world size (no processes)",
        description=(
            "Resolve the parallel sizes of CONFIG's 'parallel:' section for a world size and show which ranks "
            "form every group (Megatron-LM RankGenerator order), which groups cross node boundaries, and "
            "optionally an SVG picture of the rank grid. Pure arithmetic: 131,072 ranks take well under a second."
        ),
        epilog=(
            "examples:\n"
            "  megashard plan --tp 8 --pp 4 --world-size 128\n"
            "  megashard plan --tp 2 --ep 4 --dp-outer 2 --dp-shard -1 --world-size 64 --rank 9\n"
            f"  megashard plan {DEFAULT_CONFIG}\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 32 --tp 4\n"
            "  megashard plan configs/modules/vision-llm.yaml\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 16 parallel.tp=2 parallel.pp=4 model.layers=4 parallel.dp_shard=-1 --rank 5\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 131072 parallel.tp=8 parallel.dp_shard=-1 --format json --groups tp,pp\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 64 parallel.dp_shard=-1 parallel.ep=4 --svg layout.svg\n"
            f"  megashard plan {DEFAULT_CONFIG} launch.nnodes=1:4 launch.nproc_per_node=2   # elastic: every world size\n"
            f"  megashard plan {DEFAULT_CONFIG} --suggest --trace 0\n"
            f"  megashard plan {DEFAULT_CONFIG} --memory --no-trace\n"
            "  megashard plan configs/llama-1b.yaml --suggest --world-size 64 --device-memory 80GiB --ranks-per-node 8\n"
            "\nsize flags win over CONFIG's values; a multi-module CONFIG (modules: list) shows every module and seam\n"
            "\na job that `megashard run` would refuse (e.g. more pipeline stages than layers) gets a warning line\n"
            "\nexit codes: 0 ok, 1 --strict and locality warnings (or output not writable), 2 invalid config or usage"
        ),
    )
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help=f"job YAML with a 'parallel:' section (e.g. {DEFAULT_CONFIG}), a bare parallel config, or a "
                   "multi-module YAML ('modules:' list, docs/multi_module.md); optional when the sizes are given "
                   "as flags (--tp 8 --pp 4 --world-size N)")
    p.add_argument("overrides", metavar="key=value", nargs="*",
                   help="dotted overrides applied to the YAML before validation, e.g. parallel.tp=4 launch.nnodes=2")
    sizes = p.add_argument_group(
        "parallel sizes as flags", "every ParallelConfig size (and order); without CONFIG they make the whole config "
        "(other fields at their defaults), with CONFIG they win over its values")
    for field, kind, help_ in SIZE_FLAGS:
        flag = "--" + field.replace("_", "-")
        names = [flag] if flag == "--" + field else [flag, "--" + field]
        sizes.add_argument(*names, dest=f"size_{field}", type=kind, default=None,
                           metavar="N" if kind is int else "ORDER", help=help_)
    p.add_argument(
        "--world-size", "-w", type=int, default=None, metavar="N",
        help="number of ranks (default: launch.nnodes × launch.nproc_per_node from CONFIG; for an elastic range "
        "launch.nnodes: MIN:MAX, every world size in range)",
    )
    p.add_argument("--rank", "-r", type=int, default=0, metavar="R", help="rank whose groups are shown (default 0)")
    p.add_argument(
        "--ranks-per-node", "-g", type=int, default=None, metavar="G",
        help="ranks per node for the locality report and the picture; node = rank // G (default 8; with --suggest "
        "the config's launch.nproc_per_node)",
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
        "--svg-max-ranks", type=int, default=None, metavar="M",
        help="largest number of ranks drawn; bigger worlds show their first whole nodes (default 512)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when the locality report has warnings")
    p.add_argument("--memory", action="store_true",
                   help="also the memory per rank of this layout: modelled, traced (one step of the rank that peaks "
                        "on the fake backend, live tensor bytes) and host memory (peak RSS growth); docs/advisor.md")
    from megashard.cli.suggest import add_suggest_options

    add_suggest_options(p)
    p.set_defaults(handler=_cmd_plan, parser=p, accepts_overrides=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    from megashard.cli.suggest import cmd_suggest, check_not_suggest

    if args.svg_max_ranks is not None and not args.svg:  # given but unused: said (even at its default value)
        from megashard.layout.plan_svg import MAX_SVG_RANKS

        check_int("--svg-max-ranks", args.svg_max_ranks, 1, MAX_SVG_RANKS)
        raise ConfigError(f"--svg-max-ranks {args.svg_max_ranks} only applies with --svg FILE (the picture); add "
                          "--svg, or drop it")
    args.svg_max_ranks = 512 if args.svg_max_ranks is None else args.svg_max_ranks
    if args.suggest:
        return cmd_suggest(args)
    check_not_suggest(args)
    if args.ranks_per_node is None:
        args.ranks_per_node = 8
    from megashard.layout import GROUP_NAMES, RankLayout, locality
    from megashard.layout.plan import (MAX_LISTED_RANKS, build_plan, check_listing, default_names, format_table,
                                       plan_to_json)
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
    flags = size_flags(args)
    job = None
    has_model = False
    if args.config is not None and any("=" not in o for o in args.overrides):
        from megashard.cli.options import check_config_first

        check_config_first("plan", args.config, list(args.overrides))  # `plan a=1 cfg.yaml`: the file comes first
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        args.overrides, args.config = [args.config, *args.overrides], None  # `plan parallel.tp=2`: no CONFIG
    if args.config is None:
        if args.overrides:
            raise ConfigError(f"overrides {' '.join(args.overrides)} need a CONFIG file; without one give the sizes as "
                              "flags, e.g. --tp 2 --pp 4")
        if not flags:
            raise ConfigError("no config: give a CONFIG file or the sizes as flags, e.g. "
                              "megashard plan --tp 8 --pp 4 --world-size 64")
        if args.world_size is None:
            raise ConfigError(f"no world size: pass --world-size N with the size flags ({flags_text(flags)})")
        config, world_size = ParallelConfig(**flags), args.world_size
    else:
        doc = yamlfile.load_yaml(args.config)  # the one read of the file
        if isinstance(doc, dict) and "modules" in doc:
            return _cmd_plan_modules(args, doc, flags, names)
        config, world_size, job = load_job(args.config, args.overrides, args.world_size, doc=doc)
        # A file (or overrides) without a model section plans a layout: the default model is nobody's, so it is not
        # checked against the stages (nor placed, nor run's refusal reported).
        has_model = isinstance(doc, dict) and "model" in doc or any(o.strip().startswith("model.") for o in args.overrides)
        if flags:
            config = dataclasses.replace(config, **flags)  # flags win; validated again by __post_init__
            if job is not None:
                job.parallel = config
        if job is not None and job.launch.elastic and args.world_size is None:
            from megashard.cli.plan_elastic import cmd_plan_range

            return cmd_plan_range(args, job)  # every world size of launch.nnodes: MIN:MAX
    sizes = config.resolve(world_size)  # the one resolve of this process
    if job is not None:
        job.check_pipeline(sizes.pp, sizes.vpp, sizes.dp, model=has_model)  # what `run` refuses for any world size
        if not has_model:
            job = None  # the layout only
    layout = RankLayout(sizes)
    check_int("--rank", args.rank, 0, world_size - 1, note=f" (the world has {world_size:,} ranks)")
    as_json = args.format == "json"
    shown = names or default_names(layout)
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
    placement = refusal = None
    if job is not None:
        from megashard.train.placement import format_placement, model_placement

        placement = model_placement(job, sizes.pp, sizes.vpp or 1, sizes.ep, sizes.dp)
        plan["model_placement"] = placement
        refusal = run_refusal(job, sizes, launch_world_size(job.to_dict()))
        if refusal:
            plan["run_refuses"] = refusal
    memory_lines: list[str] = []
    if args.memory:
        if job is None:
            raise ConfigError("--memory sizes a job's memory: give a job config with a model section (e.g. "
                              f"{DEFAULT_CONFIG}), not only a layout")
        from megashard.cli.suggest import layout_memory

        from megashard.advisor.units import parse_bytes

        plan["memory"], memory_lines = layout_memory(job, sizes, refusal, trace=not args.no_trace and args.trace > 0,
                                                     limit=parse_bytes(args.trace_limit, "--trace-limit"))
    if as_json:
        plan = {"config": args.config, "overrides": list(args.overrides), "flags": flags, **plan}
        sys.stdout.write(plan_to_json(plan) + "\n")
    else:
        source = " ".join([args.config or "", *args.overrides, flags_text(flags)]).strip()
        table = format_table(plan, args.max_members, source)
        if placement is not None:
            table += "\n".join(format_placement(placement)) + "\n"
        if memory_lines:
            table += "\n".join(memory_lines) + "\n"
        sys.stdout.write(table)
    if refusal:
        print(f"megashard plan: warning: {refusal}", file=sys.stderr)
    if svg is not None and not write_svg(args.svg, svg):
        return 1
    if args.strict and plan["locality"]["warnings"]:
        return 1
    return 0


def run_refusal(job: Any, sizes: Any, job_world: int | None) -> str | None:
    """What ``megashard run`` would refuse in this job laid out as ``sizes`` (the same
    :meth:`~megashard.train.config.JobConfig.validate`), as one line; None when it would run."""
    try:
        job.validate(sizes=sizes)
    except ConfigError as e:
        at = "" if sizes.world_size == job_world else f" at world size {sizes.world_size}"
        return f"`megashard run` would refuse this job{at}: {e}"
    return None


def _cmd_plan_modules(args: argparse.Namespace, doc: dict[str, Any], flags: dict[str, Any], names: list[str] | None) -> int:
    """``megashard plan MODULES.yaml``: every module's ranks, sizes and groups, and the pairing across each seam."""
    from megashard.config import ModulesConfig
    from megashard.layout.modules import MultiModuleLayout
    from megashard.layout.plan import plan_to_json
    from megashard.layout.plan_modules import build_modules_plan, format_modules_table

    if flags:
        raise ConfigError(f"{flags_text(flags)}: size flags describe one layout, but {args.config} has several "
                          "modules; set each module's sizes in its 'parallel:' section")
    if args.overrides:
        raise ConfigError(f"overrides {' '.join(args.overrides)} are not supported for a multi-module config; edit "
                          f"{args.config}")
    if args.svg:
        raise ConfigError("--svg draws one layout; plan a module's own config for a picture")
    multi_config = ModulesConfig.from_dict(doc, args.config)
    world_size = args.world_size or launch_world_size(doc, args.config) or multi_config.min_world_size
    multi = MultiModuleLayout.from_config(multi_config, world_size)
    plan = build_modules_plan(multi, names)
    if args.format == "json":
        sys.stdout.write(plan_to_json({"config": args.config, **plan}) + "\n")
    else:
        sys.stdout.write(format_modules_table(plan, args.max_members, args.config))
    return 0
