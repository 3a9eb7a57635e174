"""The summary of ``tools/gpu-check.sh``: one table of every check (passed, failed, skipped with its reason) from
pytest's JUnit XML and the script's own steps, printed and written as JSON. Standard library only.

    python tools/gpu_check_report.py --junit OUT/tests.xml --steps OUT/steps.tsv --json OUT/summary.json
        [--bench benchmarks/results/gpu.json] [--machine KEY=VALUE ...]

``steps.tsv``: one line per script step, ``name<TAB>passed|failed|skipped<TAB>detail``. Exit status 1 when any check
failed (or pytest reported nothing at all), else 0: skips are not failures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

RESULTS = ("passed", "failed", "skipped")


def _one_line(text: str | None, limit: int = 160) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def junit_rows(path: str) -> list[dict]:
    """One row per test case of a pytest JUnit XML file (errors count as failures)."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        name = name.replace("tests/gpu/", "", 1) if name.startswith("tests/gpu/") else name
        result, detail = "passed", f"{float(case.get('time', 0)):.1f} s"
        for child in case:
            if child.tag in ("failure", "error"):
                result, detail = "failed", _one_line(child.get("message") or child.text)
                break
            if child.tag == "skipped":
                msg = child.get("message") or ""
                result, detail = "skipped", _one_line(msg.split(": ", 1)[1] if msg.startswith("Skipped: ") else msg)
        rows.append({"check": name, "result": result, "detail": detail})
    return rows


def step_rows(path: str) -> list[dict]:
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    name, result, detail = (line.rstrip("\n").split("\t", 2) + ["", ""])[:3]
                    if result not in RESULTS:
                        result, detail = "failed", f"unknown result {result!r}: {detail}"
                    rows.append({"check": name, "result": result, "detail": _one_line(detail)})
    return rows


def table(rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{width}}  {'result':<7}  detail", f"{'-' * width}  {'-' * 7}  {'-' * 40}"]
    lines += [f"{r['check']:<{width}}  {r['result']:<7}  {r['detail']}" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", required=True, help="pytest --junitxml file of tests/gpu")
    ap.add_argument("--steps", required=True, help="the script's steps (name, result, detail per line)")
    ap.add_argument("--json", required=True, help="where to write the summary")
    ap.add_argument("--bench", default=None, help="benchmarks/gpu.py's JSON (its rows are copied into the summary)")
    ap.add_argument("--machine", action="append", default=[], help="KEY=VALUE facts about the machine")
    args = ap.parse_args(argv)
    setup = [r for r in step_rows(args.steps) if r["check"].startswith("setup")]
    later = [r for r in step_rows(args.steps) if not r["check"].startswith("setup")]
    if os.path.exists(args.junit):
        tests = junit_rows(args.junit)
    else:
        tests = [{"check": "tests/gpu", "result": "failed", "detail": f"pytest wrote no report ({args.junit})"}]
    if not tests:
        tests = [{"check": "tests/gpu", "result": "failed", "detail": "pytest collected no test"}]
    rows = setup + tests + later
    counts = {k: sum(r["result"] == k for r in rows) for k in RESULTS}
    machine = dict(kv.split("=", 1) for kv in args.machine if "=" in kv)
    bench = None
    if args.bench and os.path.exists(args.bench):
        with open(args.bench, encoding="utf-8") as f:
            bench = json.load(f)
    status = 1 if counts["failed"] else 0
    print(table(rows))
    print(f"gpu-check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"({', '.join(f'{k}: {v}' for k, v in machine.items())})")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"machine": machine, "counts": counts, "rows": rows, "benchmarks": bench, "exit": status}, f, indent=2)
    print(f"gpu-check: summary written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
