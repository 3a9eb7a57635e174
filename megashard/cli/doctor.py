"""``megashard doctor RUN_DIR``: the hangs a job's ranks recorded, after the fact (:mod:`megashard.doctor`)."""
from __future__ import annotations

import argparse
import json
import os
import re
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
            "that waited, and the ranks that never reached it with what each was doing instead (a rank that died "
            "inside it is said so, and one in its own code since which call returned), mismatched calls rank by rank "
            "and deadlocks; a rank killed while the launcher stopped the others (no rank waited for it) is named with "
            "where it died; a world that ended in a world change (an elastic job's node left or joined, a restart) "
            "says which ranks it lost, not a hang; ranks that left no record after their start are named; then the "
            "stragglers (per group the rank that arrives last most often and by how much, "
            "and the ranks named slow). Only the newest run's records are read; a damaged record is named and skipped. "
            "See docs/doctor.md."
        ),
        epilog=("examples:\n  megashard doctor runs/default\n  megashard doctor runs/default --format json\n"
                "\nexit codes: 0 no hang recorded (a world change or an orderly end is none), 1 hangs or a rank's death "
                "recorded (the table), 2 usage or no records in RUN_DIR"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's output directory (train.out_dir), or its doctor/")
    p.add_argument("--format", "-f", choices=("table", "json"), default="table")
    p.set_defaults(handler=_cmd_doctor, parser=p)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from megashard.doctor.records import format_table, read_attempts, summarize
    from megashard.errors import ConfigError

    if not os.path.isdir(args.run_dir):
        raise ConfigError(f"RUN_DIR {args.run_dir}: no such directory; give a job's train.out_dir (e.g. runs/default)")
    found = read_attempts(args.run_dir)
    for path, problem in found.damaged:
        print(f"megashard doctor: warning: {path}: {problem}: skipped", file=sys.stderr)
    if not found.kept:
        if found.damaged:
            raise ConfigError(f"RUN_DIR {args.run_dir}: every doctor record found ({len(found.damaged)} file(s), "
                              "named above) is damaged or not a doctor record: nothing to diagnose")
        raise ConfigError(f"RUN_DIR {args.run_dir}: no doctor records (doctor/rank_<r>.json); the job ran without "
                          "the hang doctor (train.doctor=false) or never started")
    # every world but the newest was followed by another of the job (a world change, a restart): planned ends
    attempts = [(a.label, a.directory, summarize(a.records, followed=i < len(found.kept) - 1))
                for i, a in enumerate(found.kept)]
    damaged_ranks: dict = {}  # directory -> ranks whose rank_<r>.json there was skipped
    for path, _ in found.damaged:
        m = re.match(r"rank_(\d+)\.json$", os.path.basename(path))
        if m:
            damaged_ranks.setdefault(os.path.dirname(path), set()).add(int(m.group(1)))
    ignored = sum(len(v) for v in found.other_runs.values())
    ignored_line = (f"ignored {ignored} record(s) of {len(found.other_runs)} other run(s) in {args.run_dir} "
                    f"(run {', '.join(sorted(found.other_runs))[:120]}): an earlier job's files, not this run's"
                    if ignored else "")
    from megashard.doctor.stragglers import format_report, from_records

    slow = [from_records(a.records) for a in found.kept]
    if args.format == "json":
        out = [dict(s, attempt=label, dir=d, run=found.kept[i].records[min(found.kept[i].records)].get("run"),
                    stragglers=slow[i].report())
               for i, (label, d, s) in enumerate(attempts)]
        data = out[0] if len(out) == 1 else out
        if isinstance(data, dict):
            data = dict(data, ignored_other_runs=found.other_runs, damaged=[p for p, _ in found.damaged])
        print(json.dumps(data, indent=1))
    for i, (label, d, s) in enumerate(attempts if args.format == "table" else ()):
        where = args.run_dir if len(attempts) == 1 else f"{args.run_dir} ({label})"
        died = f"; {len(s['deaths'])} rank(s) died" if s["deaths"] else ""
        changed = "; ended in a world change" if s["world_end"] else ""
        print(f"megashard doctor: {where}: records of {len(s['ranks']) - len(s['started_only'])} of "
              f"{s['world_size']} ranks; {len(s['rows'])} hung operation(s){died}{changed}")
        print(format_table(s))
        unreadable = sorted(set(s["no_record"]) & damaged_ranks.get(d, set()))
        if unreadable:  # their file is there but was skipped: not a rank that was killed
            print(f"rank(s) {', '.join(map(str, unreadable))}: the record is damaged (named above), so what they did "
                  "is unknown")
        no_record = [r for r in s["no_record"] if r not in unreadable]
        if no_record:
            shown = ", ".join(map(str, no_record[:16])) + (" …" if len(no_record) > 16 else "")
            # a world followed by another of the job ended when torchrun stopped its workers (a restart, a node that
            # joined or left): its ranks were stopped, not necessarily killed by a fault
            why = ("stopped before they could write one (the job went on in a new world: torchrun stops the workers "
                   "of the old one) or killed" if i < len(attempts) - 1 else "killed before they could write one")
            print(f"no record from rank(s) {shown} after their start: {why} (e.g. SIGKILL, out of memory)"
                  + (" or never started the doctor" if set(no_record) - set(s["started_only"]) else ""))
        if slow[i].steps or not (s["rows"] or len(s["started_only"]) == len(s["ranks"])):
            print(format_report(slow[i]))
    if ignored_line and args.format == "table":
        print(ignored_line)
    # a hang in any world, or a rank that died in the job's last world (nothing went on after it); a world change
    # (ranks lost, the job went on) and an orderly end are not
    return 1 if any(s["rows"] or s["deaths"] for _, _, s in attempts) else 0
