"""``megashard check SCRIPT [ARGS...] --world-size N``: every rank of a user's script rehearsed without peers, and
their collectives checked against each other before the job is launched (:mod:`megashard.rehearse`). The training
job's own check is ``megashard run CONFIG --dry-run --collectives`` (:mod:`megashard.rehearse.before_launch`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from megashard.cli.options import add_command
from megashard.errors import ConfigError

#: ``megashard check``'s own options (anything else after SCRIPT is the script's): flag -> (dest, type, default).
_OPTIONS = {"--world-size": ("world_size", int, None), "--jobs": ("jobs", int, None),
            "--steps": ("steps", int, 1), "--max-calls": ("max_calls", int, None),
            "--format": ("format", str, "table"), "--log-dir": ("log_dir", str, None)}
MAX_WORLD = 1 << 16


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard check``."""
    p = add_command(
        sub, "check",
        help="rehearse every rank of a script without peers and check its collectives before launch",
        description=(
            "Run SCRIPT as each rank of a world of --world-size ranks, one process per rank on the 'fake' backend "
            "(no peer, no device, no data moved; a few ranks at a time), record every collective and point-to-point "
            "call (group, peers, dtype, shape, order, source line), and check them against each other: every "
            "member of a group issues the same calls in the same order, every send has its receive, no wait-for "
            "cycle between ranks, no collective on a group of another layout than the current one. The script is "
            "any script torchrun would start (megashard.initialize, or Megatron's initialize_model_parallel after "
            "megashard.megatron.install()); it ends after --steps steps when it calls megashard.doctor.set_step, "
            "else when it ends (or after --max-calls calls). Its output goes to --log-dir DIR/rank_<r>.log if given. "
            "See docs/rehearse.md."),
        epilog=(
            "examples:\n"
            "  megashard check examples/own_script.py --world-size 4\n"
            "  megashard check examples/own_script.py --tp 1 --world-size 8 --jobs 2   # --tp 1: the script's option\n"
            "  (megashard check train.py --world-size 16 -- --world-size 4: after --, every option is the script's)\n"
            "\nexit codes: 0 every rank's calls agree, 1 a problem found (each printed with ranks, operation and "
            "source line), 2 bad usage"),
    )
    p.add_argument("script_and_args", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                   help="the script and its arguments")
    for flag, (dest, kind, default) in _OPTIONS.items():  # shown in --help; parsed from the remainder below
        p.add_argument(flag, dest=f"opt_{dest}", type=kind, default=None, metavar=dest.upper(),
                       help=f"(default {default})")
    p.set_defaults(handler=_cmd_check, parser=p)


def _split(items: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """``megashard check``'s options out of the items after SCRIPT (up to a ``--``); the rest is the script's."""
    opts = {dest: getattr(args, f"opt_{dest}") if getattr(args, f"opt_{dest}") is not None else default
            for dest, _, default in _OPTIONS.values()}
    rest: list[str] = []
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--":
            rest += items[i + 1:]
            break
        flag, eq, value = item.partition("=")
        if flag in _OPTIONS:
            dest, kind, _ = _OPTIONS[flag]
            if not eq:
                if i + 1 >= len(items):
                    raise ConfigError(f"{flag} needs a value")
                value = items[i + 1]
                i += 1
            try:
                opts[dest] = kind(value)
            except ValueError:
                raise ConfigError(f"{flag} {value!r}: must be {'an integer' if kind is int else 'a string'}") from None
            i += 1
            continue
        rest.append(item)
        i += 1
    return opts, rest


def _cmd_check(args: argparse.Namespace) -> int:
    import os

    from megashard.advisor.units import check_count

    items = list(args.script_and_args)
    if items and items[0] == "--":
        items = items[1:]
    if not items:
        raise ConfigError("check needs SCRIPT (a Python file, e.g. train.py) and --world-size N")
    script, rest = items[0], items[1:]
    opts, script_args = _split(rest, args)
    if script.startswith("-"):
        raise ConfigError(f"{script}: SCRIPT comes first (a Python file), then its arguments and --world-size N")
    if not os.path.isfile(script):
        raise ConfigError(f"SCRIPT {script!r} is not a file; give the path of the Python script torchrun would run")
    if opts["world_size"] is None:
        raise ConfigError("check needs --world-size N (the ranks to rehearse, e.g. --world-size 8)")
    check_count("--world-size", opts["world_size"], 1, MAX_WORLD)
    if opts["jobs"] is not None:
        check_count("--jobs", opts["jobs"], 1, 1024)
    check_count("--steps", opts["steps"], 1, 1000)
    if opts["max_calls"] is not None:
        check_count("--max-calls", opts["max_calls"], 1, 10**9)
    if opts["format"] not in ("table", "json"):
        raise ConfigError(f"--format {opts['format']!r}: must be table or json")
    from megashard.rehearse import Broker
    from megashard.rehearse.script import ScriptRank

    log_dir = opts["log_dir"]
    if log_dir is not None:
        from megashard.outputs import check_output_dir

        check_output_dir("--log-dir", log_dir)
    body = ScriptRank(script, script_args, opts["world_size"], steps=opts["steps"], max_calls=opts["max_calls"],
                      log_dir=log_dir)
    print(f"megashard check: rehearsing {opts['world_size']} rank{'s' if opts['world_size'] != 1 else ''} of "
          f"{script}" + (f" (its output: {log_dir}/rank_<r>.log)" if log_dir else ""), file=sys.stderr, flush=True)
    import time

    from megashard.rehearse.before_launch import print_result

    t0 = time.perf_counter()
    traces = Broker(body, opts["world_size"], jobs=opts["jobs"]).run()
    return print_result(traces, "check", opts["format"], seconds=time.perf_counter() - t0)
