"""``megashard doctor RUN_DIR``: the hangs a job's ranks recorded, after the fact (:mod:`megashard.doctor`)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard doctor``."""
    p = sub.add_parser(
        "doctor",
        help="which ranks a hung collective waited for, from the records the ranks left in a run directory",
        description=(
            "Read RUN_DIR/doctor/rank_<r>.json (written by every rank of a job with the hang doctor on: train.doctor, "
            "or megashard.doctor.enable(out_dir=...)) and print, for every collective that did not finish within "
            "parallel.timeout, its group and ranks, the operation and its number on that group, the step, the ranks "
            "that waited, and the ranks that never reached it with what each was doing instead. Ranks that left no "
            "record are named (a process killed by SIGKILL writes none). See docs/doctor.md."
        ),
        epilog=("examples:\n  megashard doctor runs/default\n  megashard doctor runs/default --format json\n"
                "\nexit codes: 0 no hang recorded, 1 hangs recorded (the table), 2 usage or no records in RUN_DIR"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's output directory (train.out_dir), or its doctor/")
    p.add_argument("--format", "-f", choices=("table", "json"), default="table")
    p.set_defaults(handler=_cmd_doctor, parser=p)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from megashard.doctor.diagnose import attempt_dirs, format_table, read_run_dir, summarize
    from megashard.errors import ConfigError

    if not os.path.isdir(args.run_dir):
        raise ConfigError(f"RUN_DIR {args.run_dir}: no such directory; give a job's train.out_dir (e.g. runs/default)")
    attempts = []
    for label, d in attempt_dirs(args.run_dir):
        records, bad = read_run_dir(d)
        for path in bad:
            print(f"megashard doctor: warning: {path} is damaged or not a doctor record: skipped", file=sys.stderr)
        if records:
            attempts.append((label, d, summarize(records)))
    if not attempts:
        raise ConfigError(f"RUN_DIR {args.run_dir}: no doctor records (doctor/rank_<r>.json); the job ran without "
                          "the hang doctor (train.doctor=false) or never started")
    if args.format == "json":
        out = [dict(s, attempt=label, dir=d) for label, d, s in attempts]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    for label, d, s in attempts if args.format == "table" else ():
        where = args.run_dir if len(attempts) == 1 else f"{args.run_dir} ({label})"
        print(f"megashard doctor: {where}: records of {len(s['ranks'])} of {s['world_size']} ranks; "
              f"{len(s['rows'])} hung operation(s)")
        print(format_table(s))
        if s["no_record"]:
            shown = ", ".join(map(str, s["no_record"][:16])) + (" …" if len(s["no_record"]) > 16 else "")
            print(f"no record from rank(s) {shown}: killed before they could write one (e.g. SIGKILL, out of memory) "
                  "or never started the doctor")
    return 1 if any(s["rows"] for _, _, s in attempts) else 0
