"""``megashard plan CONFIG --suggest --world-size N --device-memory 80GiB``: the layouts that fit, fastest first.

The options are checked first (one line each), then the job is read once as ``megashard plan`` reads it (every
section checked), then :func:`megashard.advisor.search.suggest` enumerates, validates, sizes and times the layouts;
the report is :mod:`megashard.advisor.report` (table or JSON) and, with ``--svg``, the plan picture of the best layout
(:mod:`megashard.layout.plan_svg`). No torch import, no process.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from megashard.errors import ConfigError

#: Options that only ``--suggest`` reads: (flag, dest, type, default, help).
_HW_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--tflops", "tflops", float, "peak bf16 TFLOP/s per device (default 989, H100 SXM)"),
    ("--mfu", "mfu", float, "share of the peak a step sustains (default 0.45)"),
    ("--intra-gbps", "intra_gbps", float, "collective bandwidth inside a node, GB/s per rank (default 360)"),
    ("--inter-gbps", "inter_gbps", float, "collective bandwidth across nodes, GB/s per rank (default 40)"),
    ("--latency-us", "latency_us", float, "fixed cost of one collective, µs (default 10)"),
)


def add_suggest_options(p: argparse.ArgumentParser) -> None:
    """The ``--suggest`` option group of ``megashard plan``."""
    g = p.add_argument_group(
        "layout advisor (--suggest)",
        "list every layout of CONFIG's job for --world-size ranks that `megashard run` accepts and that fits "
        "--device-memory, fastest first by a roofline estimate (docs/advisor.md); CONFIG may be omitted, then the "
        "job is the defaults plus key=value overrides such as model.hidden=2048")
    g.add_argument("--suggest", action="store_true", help="suggest layouts instead of showing one")
    g.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="memory a rank may use on its device, e.g. 80GiB, 141GB (required with --suggest); a number "
                        "without a unit is bytes, below 1 MiB refused")
    g.add_argument("--top", type=int, default=10, metavar="K", help="layouts shown (default 10)")
    for flag, dest, kind, help_ in _HW_FLAGS:
        g.add_argument(flag, dest=f"hw_{dest}", type=kind, default=None, metavar="X", help=help_)
    g.add_argument("--moe-imbalance", type=float, default=None, metavar="X",
                   help="MoE memory: the busiest ep rank gets at most X times the even share of routed tokens "
                        "(default 1.1; X = ep·min(top_k, experts/ep)/top_k is the worst case)")
    g.add_argument("--calibrate", nargs="?", const=4, type=int, default=None, metavar="K",
                   help="time the K best layouts (default 4) on this machine — real `megashard run`s of a few steps, "
                        "interleaved — and rank by the measured step time (writes --calibration FILE if given)")
    g.add_argument("--calibration", metavar="FILE", default=None,
                   help="with --calibrate: write the timings to FILE; alone: rank by the timings FILE holds")
    g.add_argument("--calibrate-steps", type=int, default=None, metavar="N",
                   help="steps of each calibration run; the first 2 are warm-up (default 5)")
    g.add_argument("--calibrate-rounds", type=int, default=None, metavar="R",
                   help="runs of each layout, interleaved; its time is the median step over all (default 2)")


def check_not_suggest(args: argparse.Namespace) -> None:
    """ConfigError for an advisor option given without ``--suggest``."""
    used = [f for f, d, _, _ in _HW_FLAGS if getattr(args, f"hw_{d}", None) is not None]
    if args.device_memory is not None:
        used.insert(0, "--device-memory")
    if getattr(args, "moe_imbalance", None) is not None:
        used.append("--moe-imbalance")
    if getattr(args, "calibrate", None) is not None:
        used.append("--calibrate")
    if getattr(args, "calibration", None) is not None:
        used.append("--calibration")
    if used:
        raise ConfigError(f"{', '.join(used)} only appl{'ies' if len(used) == 1 else 'y'} with --suggest (the layout advisor); add --suggest or drop them")


def _hardware(args: argparse.Namespace) -> Any:
    from megashard.advisor.cost import Hardware

    kw = {}
    for flag, dest, _, _ in _HW_FLAGS:
        v = getattr(args, f"hw_{dest}")
        if v is None:
            continue
        if not v > 0 or v != v or v == float("inf") or (dest == "mfu" and v > 1):
            rule = "in (0, 1]" if dest == "mfu" else "a positive number"
            raise ConfigError(f"{flag} {v}: must be {rule}")
        kw[dest] = v
    return Hardware(**kw)


def cmd_suggest(args: argparse.Namespace) -> int:
    """``megashard plan --suggest``."""
    import os

    from megashard.advisor.report import format_suggestion, suggestion_dict
    from megashard.advisor.units import check_count, parse_bytes
    from megashard.advisor.search import WORLD_NOTE, suggest
    from megashard.cli.options import check_int, check_output_path, flags_text, size_flags, write_svg
    from megashard.config import yamlfile

    flags = size_flags(args)
    if flags:
        raise ConfigError(f"{flags_text(flags)}: --suggest chooses the parallel sizes itself; drop the size flags "
                          "(or plan that layout without --suggest)")
    for flag, given in (("--rank", args.rank != 0), ("--groups", args.groups is not None),
                        ("--all-groups", args.all_groups), ("--strict", args.strict)):
        if given:
            raise ConfigError(f"{flag} describes one layout's groups; it does not apply with --suggest")
    if args.device_memory is None:
        raise ConfigError("--suggest needs --device-memory SIZE, the memory a rank may use (e.g. 80GiB for an H100)")
    memory = parse_bytes(args.device_memory, "--device-memory")
    if args.world_size is None:
        raise ConfigError("--suggest needs --world-size N (the number of ranks to lay out)")
    check_count("--world-size", args.world_size, 1, 1 << 16, note=WORLD_NOTE)
    check_int("--ranks-per-node", args.ranks_per_node, 1)
    check_int("--top", args.top, 1)
    check_int("--svg-max-ranks", args.svg_max_ranks, 1)
    if args.svg:
        check_output_path("--svg", args.svg)
    _check_calibration_flags(args)
    hw = _hardware(args)
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        args.overrides, args.config = [args.config, *args.overrides], None  # `plan --suggest model.hidden=2048`
    from megashard.train.config import JobConfig

    if args.config is None:
        doc = yamlfile.apply_overrides({}, list(args.overrides))
        job = JobConfig.from_dict(doc, name="suggest")
        job.validate_sections()
    else:
        doc = yamlfile.load_yaml(args.config)
        if not isinstance(doc, dict) or "modules" in doc:
            raise ConfigError(f"{args.config}: --suggest plans one job YAML (model, train and parallel sections), "
                              "not a multi-module config")
        doc = yamlfile.apply_overrides(doc, list(args.overrides))
        job = JobConfig.from_dict(doc, name=os.path.splitext(os.path.basename(args.config))[0])
        job.validate_sections()
    shape = None
    if args.moe_imbalance is not None:
        import dataclasses
        import math

        from megashard.advisor.shape import JobShape

        if not (math.isfinite(args.moe_imbalance) and args.moe_imbalance >= 1):
            raise ConfigError(f"--moe-imbalance {args.moe_imbalance}: must be a number >= 1 (1 = perfectly balanced "
                              "routing)")
        shape = dataclasses.replace(JobShape.from_job(job), moe_imbalance=args.moe_imbalance)
    result = suggest(job, args.world_size, memory, args.ranks_per_node, hw, shape=shape)
    source = " ".join([args.config or "(defaults)", *args.overrides]).strip()
    if args.calibrate is not None or args.calibration is not None:
        _calibrate(args, doc, job, result, source)
    if args.format == "json":
        import json

        sys.stdout.write(json.dumps(suggestion_dict(result, args.top, source)) + "\n")
    else:
        sys.stdout.write(format_suggestion(result, args.top, source))
    if args.svg:
        if not result.ranked:
            print("megashard plan: no layout fits, so no picture was written", file=sys.stderr)
            return 1
        from megashard.layout import RankLayout, locality
        from megashard.layout.plan_svg import render_svg

        best = result.ranked[0]
        layout = RankLayout(best.resolved)
        svg = render_svg(layout, None, 0, args.ranks_per_node, args.svg_max_ranks,
                         locality(layout, args.ranks_per_node))
        if not write_svg(args.svg, svg, f" (layout #1: {best.label()})"):
            return 1
    return 0 if result.ranked else 1


def _check_calibration_flags(args: argparse.Namespace) -> None:
    """The calibration flags, before anything runs: counts in range, one node, a FILE that can be written (or is one
    of megashard's calibration files)."""
    import os

    from megashard.advisor.units import check_count

    if args.calibrate is None:
        # given at all (even at its default value) without --calibrate: said, never silently ignored
        for flag, value in (("--calibrate-steps", args.calibrate_steps), ("--calibrate-rounds", args.calibrate_rounds)):
            if value is not None:
                raise ConfigError(f"{flag} only applies with --calibrate (given: {value}; it sets how each layout is "
                                  "timed): add --calibrate, or drop it")
        return
    args.calibrate_steps = 5 if args.calibrate_steps is None else args.calibrate_steps
    args.calibrate_rounds = 2 if args.calibrate_rounds is None else args.calibrate_rounds
    check_count("--calibrate", args.calibrate, 1, 64, note=" (layouts to time)")
    check_count("--calibrate-steps", args.calibrate_steps, 3, 1000, note=" (the first 2 are warm-up)")
    check_count("--calibrate-rounds", args.calibrate_rounds, 1, 100)
    if args.world_size > args.ranks_per_node:
        raise ConfigError(f"--calibrate times the layouts on this machine, as one node: --world-size {args.world_size} "
                          f"is more than --ranks-per-node {args.ranks_per_node}; calibrate a world of one node, or "
                          "drop --calibrate")
    if args.calibration is not None:
        if os.path.exists(args.calibration):
            from megashard.advisor.calibrate import _read

            _read(args.calibration, "--calibration")  # only a calibration file of ours is replaced
        else:
            from megashard.outputs import check_output_file

            check_output_file("--calibration", args.calibration, example="calibration.json")


def _calibrate(args: argparse.Namespace, doc: Any, job: Any, result: Any, source: str) -> None:
    """Time the top layouts (``--calibrate``) or read their times (``--calibration FILE``) and rank by them."""
    from megashard.advisor.calibrate import apply_timings, load_calibration, save_calibration, time_layouts
    from megashard.advisor.shape import JobShape

    shape = JobShape.from_job(job)
    if args.calibrate is None:
        timings = load_calibration(args.calibration, shape, args.world_size)
        if timings and not apply_timings(result, timings):  # a file that matches no layout: said, not ignored
            print(f"megashard plan: note: --calibration {args.calibration}: none of its {len(timings)} timed layout(s) "
                  "is among this job's layouts, so it is unused and the ranking is the estimate's; calibrate this "
                  "job (--calibrate)", file=sys.stderr)
            return
    else:
        top = result.ranked[:args.calibrate]
        print(f"megashard plan: calibrating: {len(top)} layout(s) × {args.calibrate_rounds} round(s) of "
              f"{args.calibrate_steps} steps on this machine", file=sys.stderr, flush=True)
        timings = time_layouts(doc, job.name, top, args.world_size, steps=args.calibrate_steps,
                               rounds=args.calibrate_rounds,
                               log=lambda line: print(f"megashard plan: {line}", file=sys.stderr, flush=True))
        if args.calibration is not None:
            save_calibration(args.calibration, timings, shape, args.world_size, source, args.calibrate_steps,
                             args.calibrate_rounds, job.parallel.device)
            print(f"megashard plan: wrote {args.calibration} (timings of {len(timings)} layout(s))", file=sys.stderr)
    apply_timings(result, timings)
