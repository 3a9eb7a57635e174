"""``megashard plan CONFIG --suggest --world-size N --device-memory 80GiB``: the layouts that fit, fastest first.

The options are checked first (one line each), then the job is read once as ``megashard plan`` reads it (every
section checked), then :func:`megashard.advisor.search.suggest` enumerates, validates, sizes and times the layouts;
the report is :mod:`megashard.advisor.report` (table or JSON) and, with ``--svg``, the plan picture of the best layout
(:mod:`megashard.layout.plan_svg`). No torch import, no process.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

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
                        "(default 1.1, top-1 routing 1.3; X = ep·min(top_k, experts/ep)/top_k is the worst case)")
    g.add_argument("--check-collectives", action="store_true",
                   help="rehearse every rank of each listed layout and drop those whose collectives would hang "
                        "(docs/rehearse.md)")
    g.add_argument("--trace", type=int, default=5, metavar="K",
                   help="trace the memory of the K best layouts (default 5; 0 = none): one training step of the rank "
                        "that peaks, on the fake backend, its live bytes counted; a traced figure decides whether a "
                        "layout fits (with plan --memory: the layout's own)")
    g.add_argument("--no-trace", action="store_true", help="no tracing (the same as --trace 0)")
    g.add_argument("--trace-limit", metavar="SIZE", default="1GiB",
                   help="trace only layouts whose modelled peak is at most SIZE (default 1GiB): a trace allocates the "
                        "rank's tensors on this machine's CPU and runs its step there")
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
    if getattr(args, "check_collectives", False):
        used.append("--check-collectives")
    if getattr(args, "calibration", None) is not None:
        used.append("--calibration")
    if getattr(args, "trace", 5) != 5 and not getattr(args, "memory", False):
        used.append("--trace")
    if used:
        raise ConfigError(f"{', '.join(used)} only appl{'ies' if len(used) == 1 else 'y'} with --suggest (the layout advisor); add --suggest or drop them")


def _hardware_flags(args: argparse.Namespace) -> dict[str, float]:
    """The hardware numbers given as flags (checked), by :class:`~megashard.advisor.cost.Hardware` field."""
    kw = {}
    for flag, dest, _, _ in _HW_FLAGS:
        v = getattr(args, f"hw_{dest}")
        if v is None:
            continue
        if not v > 0 or v != v or v == float("inf") or (dest == "mfu" and v > 1):
            rule = "in (0, 1]" if dest == "mfu" else "a positive number"
            raise ConfigError(f"{flag} {v}: must be {rule}")
        kw[dest] = v
    return kw


def job_machine(job: Any, world_size: Optional[int], ranks_per_node: Optional[int], memory: Optional[int],
                hw_flags: dict[str, float]) -> tuple[int, int, int, Any, list[str]]:
    """``(world size, ranks per node, bytes per rank, Hardware, notes)`` of ``--suggest``: what is given wins, the
    rest comes from the job's config (``launch``, ``parallel.device``, ``train.dtype``) and this machine
    (:mod:`megashard.advisor.machine`); ``notes`` say where each came from (the report prints them)."""
    import dataclasses

    from megashard.advisor.machine import describe_machine, job_device

    notes = []
    launch = job.launch
    if world_size is None:
        nnodes = launch.nnodes
        if isinstance(nnodes, str):  # an elastic range MIN:MAX: plan its largest world
            from megashard.train.sections import parse_node_range

            nnodes = parse_node_range(nnodes)[1]
        world_size = int(nnodes) * launch.nproc_per_node
        notes.append(f"world size {world_size} from the config (launch.nnodes {launch.nnodes} × launch.nproc_per_node "
                     f"{launch.nproc_per_node}; --world-size N plans another)")
    if ranks_per_node is None:
        ranks_per_node = launch.nproc_per_node
        notes.append(f"{ranks_per_node} ranks per node from launch.nproc_per_node (--ranks-per-node G)")
    device = job_device(job.parallel)
    info = describe_machine(device, ranks_per_node, job.train.dtype, measure="tflops" not in hw_flags)
    hw = dataclasses.replace(info.hardware, **hw_flags) if hw_flags else info.hardware
    notes.append(f"device {device} (parallel.device={job.parallel.device}); {info.hardware_note}"
                 + (f"; given: {', '.join(f'{k}={v:g}' for k, v in hw_flags.items())}" if hw_flags else ""))
    if memory is None:
        if info.memory_per_rank is None:
            raise ConfigError(f"--suggest needs --device-memory SIZE here: the job runs on {device} "
                              f"(parallel.device={job.parallel.device}) and {info.memory_note}; give the memory a rank "
                              "may use, e.g. 80GiB for an H100")
        memory = info.memory_per_rank
        notes.append(f"memory per rank {memory / 2**30:.2f} GiB: {info.memory_note} (--device-memory SIZE)")
    return world_size, ranks_per_node, memory, hw, notes


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
    memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory is not None else None
    if args.world_size is not None:
        check_count("--world-size", args.world_size, 1, 1 << 16, note=WORLD_NOTE)
    if args.ranks_per_node is not None:
        check_int("--ranks-per-node", args.ranks_per_node, 1)
    check_int("--top", args.top, 1)
    check_int("--svg-max-ranks", args.svg_max_ranks, 1)
    if args.svg:
        check_output_path("--svg", args.svg)
    _check_calibration_counts(args)
    hw_flags = _hardware_flags(args)
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
    world, ranks_per_node, memory, hw, notes = job_machine(job, args.world_size, args.ranks_per_node, memory,
                                                           hw_flags)
    args.world_size, args.ranks_per_node = world, ranks_per_node
    _check_calibration_file(args)
    check_count("--trace", args.trace, 0, 64, note=" (layouts to trace)")
    timings_read = None
    if args.calibrate is None and args.calibration is not None:  # read (and refused) before anything is traced
        from megashard.advisor.calibrate import load_calibration
        from megashard.advisor.shape import JobShape

        timings_read = load_calibration(args.calibration, JobShape.from_job(job), args.world_size)
    shape = None
    if args.moe_imbalance is not None:
        import dataclasses
        import math

        from megashard.advisor.shape import JobShape

        if not (math.isfinite(args.moe_imbalance) and args.moe_imbalance >= 1):
            raise ConfigError(f"--moe-imbalance {args.moe_imbalance}: must be a number >= 1 (1 = perfectly balanced "
                              "routing)")
        shape = dataclasses.replace(JobShape.from_job(job), moe_imbalance=args.moe_imbalance)
    result = suggest(job, world, memory, ranks_per_node, hw, shape=shape)
    result.notes = notes
    if args.trace and not args.no_trace and result.ranked:
        from megashard.advisor.trace import certify

        print(f"megashard plan: tracing the memory of the {min(args.trace, len(result.ranked))} best layout(s): one "
              "step of the rank that peaks, on the fake backend", file=sys.stderr, flush=True)
        certify(result, doc, job.name, args.trace,
                log=lambda line: print(f"megashard plan: {line}", file=sys.stderr, flush=True),
                limit=parse_bytes(args.trace_limit, "--trace-limit"))
    source = " ".join([args.config or "(defaults)", *args.overrides]).strip()
    if args.check_collectives:  # the check before launch refuses none of the listed layouts (megashard.rehearse)
        from megashard.rehearse.suggest_check import drop_refused

        drop_refused(result, job, args.top, log=lambda line: print(f"megashard plan: {line}", file=sys.stderr))
    if args.calibrate is not None or args.calibration is not None:
        _calibrate(args, doc, job, result, source, timings_read)
        if args.trace and not args.no_trace and result.ranked and result.ranked[0].traced is None:
            from megashard.advisor.trace import certify  # the measured #1 gets a traced figure too

            certify(result, doc, job.name, 1, log=lambda line: print(f"megashard plan: {line}", file=sys.stderr,
                                                                      flush=True),
                    limit=parse_bytes(args.trace_limit, "--trace-limit"))
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


def _check_calibration_counts(args: argparse.Namespace) -> None:
    """The calibration flags' counts, before anything is read."""
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


def _check_calibration_file(args: argparse.Namespace) -> None:
    """With the world known: one node to calibrate on, a FILE that can be written (or is one of megashard's
    calibration files)."""
    import os

    if args.calibrate is None:
        if args.calibration is not None:  # ranks by a file: it must be one of ours, read before anything runs
            from megashard.advisor.calibrate import _read

            _read(args.calibration, "--calibration")
        return
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


def _calibrate(args: argparse.Namespace, doc: Any, job: Any, result: Any, source: str,
               timings_read: Optional[list] = None) -> None:
    """Time the top layouts (``--calibrate``) or rank by the times read from ``--calibration FILE`` (``timings_read``,
    read before tracing so a bad file is refused first)."""
    from megashard.advisor.calibrate import apply_timings, pick_layouts, save_calibration, time_layouts
    from megashard.advisor.shape import JobShape

    shape = JobShape.from_job(job)
    if args.calibrate is None:
        timings = timings_read
        if timings and not apply_timings(result, timings):  # a file that matches no layout: said, not ignored
            print(f"megashard plan: note: --calibration {args.calibration}: none of its {len(timings)} timed layout(s) "
                  "is among this job's layouts, so it is unused and the ranking is the estimate's; calibrate this "
                  "job (--calibrate)", file=sys.stderr)
            return
    else:
        top = pick_layouts(result.ranked, args.calibrate)
        print(f"megashard plan: calibrating: {len(top)} layout(s) that differ × {args.calibrate_rounds} round(s) of "
              f"{args.calibrate_steps} steps on this machine", file=sys.stderr, flush=True)
        timings = time_layouts(doc, job.name, top, args.world_size, steps=args.calibrate_steps,
                               rounds=args.calibrate_rounds,
                               log=lambda line: print(f"megashard plan: {line}", file=sys.stderr, flush=True))
        if args.calibration is not None:
            save_calibration(args.calibration, timings, shape, args.world_size, source, args.calibrate_steps,
                             args.calibrate_rounds, job.parallel.device)
            print(f"megashard plan: wrote {args.calibration} (timings of {len(timings)} layout(s))", file=sys.stderr)
    apply_timings(result, timings)


def layout_memory(job: Any, sizes: Any, refusal: Optional[str], trace: bool = True,
                  limit: int = 1 << 30) -> tuple[dict, list[str]]:
    """``megashard plan CONFIG --memory``: the memory per rank of the config's own layout — modelled, traced (every
    pipeline rank's first rank, at most 4; :mod:`megashard.advisor.trace`) and host — as JSON-ready data and lines."""
    from megashard.advisor.host import estimate_host
    from megashard.advisor.machine import job_device
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.report import memory_lines
    from megashard.advisor.search import Candidate
    from megashard.advisor.shape import JobShape

    shape = JobShape.from_job(job)
    m = job.model
    c = Candidate({}, m.recompute, job.microbatches(sizes.pp, sizes.dp), job.train.pipeline_schedule)
    c.memory = estimate_memory(shape, sizes, m.recompute, m.distribute_saved_activations and m.recompute)
    device = job_device(job.parallel)
    lines = []
    if refusal:
        lines.append(f"memory per rank, traced: not traced (megashard run would refuse this job: {refusal})")
    elif trace:
        from megashard.advisor.trace import exact_wanted, trace_budget, trace_memory

        budget = min(limit, trace_budget())
        if c.memory.peak > budget:
            lines.append(f"memory per rank, traced: not traced (modelled {c.memory.peak / 2**30:.2f} GiB: more than "
                         f"{budget / 2**30:.2f} GiB, the most a trace allocates here; --trace-limit)")
        else:
            pp_ranks = sorted({c.memory.rank, 0, sizes.pp - 1}) if sizes.pp > 4 else list(range(sizes.pp))
            # MoE over ep ranks: every rank with values, when their real tensors fit together (else one, partial)
            exact = exact_wanted(job, sizes, sizes.world_size) and c.memory.peak * sizes.world_size <= budget
            peaks = trace_memory(job, sizes.world_size, pp_ranks, exact=exact)
            good = [p for p in peaks if p.peak is not None]
            c.traced = max(good, key=lambda p: p.peak) if good else None
            c.trace_error = None if good else (peaks[0].error if peaks else "no rank traced")
    c.host = estimate_host(shape, device, c.traced.peak if c.traced is not None else c.memory.peak)
    unit = ("MiB", 1 << 20) if c.memory.peak < (1 << 30) // 10 else ("GiB", 1 << 30)
    lines = [""] + memory_lines(c, unit) + lines
    data = {"modelled_bytes": c.memory.peak, "phase": c.memory.phase, "pp_rank": c.memory.rank,
            "parts": c.memory.parts, "traced_bytes": c.traced.peak if c.traced is not None else None,
            "traced_rank": c.traced.rank if c.traced is not None else None, "trace_error": c.trace_error,
            "traced_exact": c.traced.exact if c.traced is not None else None,
            "traced_partial": c.traced.partial if c.traced is not None else None,
            "host_bytes": c.host.peak, "host_parts": c.host.parts, "device": device}
    return data, lines
