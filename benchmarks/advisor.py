"""`megashard plan --suggest`: how long the advisor takes per layout, against planning each layout one by one.

For a few jobs and world sizes the advisor (``megashard.advisor.search.suggest``: enumerate, validate with the job's
own rules, estimate memory and step time) runs in this process; reported are the layouts considered, the wall time
(median of ``--repeat``), the time per layout, and the time for 1,024 layouts. The baseline is what a user would do
without it: ``megashard plan CONFIG --world-size N parallel.tp=…`` (in-process ``main``) for each layout, which
validates and lays out one layout and says nothing of memory or time; it runs for the first ``--baseline`` layouts
and is reported per layout, with the ratio. Also: whether torch was imported (it must not be).

Usage: ``python benchmarks/advisor.py [--repeat 3] [--baseline 40] [--quick]``; writes
``benchmarks/results/advisor.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "advisor.json")
CASES = [  # (name, config, overrides, world size)
    ("default gpt", "configs/default.yaml", [], 64),
    ("moe 8 experts", "configs/moe-ep.yaml", ["model.num_experts=8", "model.layers=8", "train.global_batch=64"], 64),
    ("llama 1b", "configs/llama-1b.yaml", ["train.global_batch=256"], 512),
]


def run_case(config: str, overrides: list[str], world: int, repeat: int) -> tuple[float, object]:
    from megashard.advisor.search import suggest
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(os.path.join(ROOT, config), overrides)
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = suggest(job, world, 80 << 30, 8)
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def baseline(config: str, overrides: list[str], world: int, result: object, n: int) -> float:
    """Seconds per layout of `megashard plan CONFIG -w N <layout overrides>` for the first n valid layouts."""
    from megashard.cli import main

    layouts = (result.ranked + result.too_big)[:n]
    t = time.perf_counter()
    for c in layouts:
        argv = ["plan", os.path.join(ROOT, config), "-w", str(world), *overrides,
                *[o for o in c.overrides() if o.startswith("parallel.")]]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
    return (time.perf_counter() - t) / max(1, len(layouts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=int, default=40, help="layouts planned one by one for the baseline")
    ap.add_argument("--quick", action="store_true", help="one repeat, 10 baseline layouts")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.baseline = 1, 10
    rows = []
    for name, config, overrides, world in CASES:
        sec, result = run_case(config, overrides, world, args.repeat)
        per = sec / result.considered
        base = baseline(config, overrides, world, result, args.baseline)
        rows.append({"case": name, "world_size": world, "considered": result.considered, "fit": len(result.ranked),
                     "refused": len(result.rejected), "seconds": sec, "us_per_layout": per * 1e6,
                     "seconds_per_1024": per * 1024, "baseline_us_per_layout": base * 1e6,
                     "speedup": base / per if per else None})
    torch_loaded = "torch" in sys.modules
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"| case | world | layouts | fit | refused | advisor s | µs/layout | s per 1,024 | `plan` µs/layout | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['world_size']} | {r['considered']:,} | {r['fit']:,} | {r['refused']:,} | "
              f"{r['seconds']:.3f} | {r['us_per_layout']:.0f} | {r['seconds_per_1024']:.3f} | "
              f"{r['baseline_us_per_layout']:.0f} | {r['speedup']:.1f}× |")
    print(f"\ntorch imported: {torch_loaded}; load average {load}; python {platform.python_version()}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"rows": rows, "torch_imported": torch_loaded, "loadavg": load, "repeat": args.repeat,
                   "python": platform.python_version(), "machine": platform.machine()}, f, indent=1)


if __name__ == "__main__":
    main()
