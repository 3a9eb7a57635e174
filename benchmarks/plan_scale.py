"""`megashard plan` for one rank, against world size: megashard's arithmetic plan vs listing the groups.

For each world size (2^10 .. 2^24 ranks; layout tp=8 × pp=4 × dp_shard=-1, rank = world - 1, 8 ranks per
node) the same report — every group name's group of the rank, its rank-in-group and group index, and the
node-locality counts of every group name — is computed two ways, in this process (no interpreter start):

* ``megashard``  ``megashard.cli.main(["plan", ...])`` as a user runs it (output to a null stream): the
                 rank's groups as ``GroupMembers`` (arithmetic), locality from residues / node boundaries;
* ``listing``    the straightforward way (what ``plan`` did before): the same config loading, then
                 ``RankLayout.group_of`` lists every group of the rank and the locality counts list every
                 group of every name (``RankLayout.groups``). Run only up to 2^20 ranks (2^22 took 26 s and 1.3 GB).

Reported: median wall time of ``--repeat`` runs, peak Python memory (tracemalloc, one extra run), the
speed-up, and once per size the wall time of ``python -m megashard plan`` in a subprocess (with the
interpreter start). Usage: ``python benchmarks/plan_scale.py [--repeat N] [--max-log2 24]``; writes
``benchmarks/results/plan_scale.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "plan_scale.json")
CONFIG = os.path.join(ROOT, "configs", "default.yaml")
SIZES = ("parallel.tp=8", "parallel.pp=4", "parallel.dp_shard=-1")
LISTING_MAX = 1 << 20


def megashard_plan(world: int) -> None:
    from megashard.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["plan", CONFIG, "-w", str(world), *SIZES, "--rank", str(world - 1)])
    assert code == 0


def listing_plan(world: int) -> None:
    from megashard.cli.plan import load_config
    from megashard.layout import GROUP_NAMES, RankLayout
    from megashard.layout.plan import format_members

    config, world = load_config(CONFIG, SIZES, world)  # the same parsing and checks as the CLI
    layout = RankLayout(config.resolve(world))
    rank = world - 1
    rows = {n: (layout.group_of(n, rank), layout.rank_in(n, rank), layout.group_index(n, rank)) for n in GROUP_NAMES}
    text = [format_members(g) for g, _, _ in rows.values()]
    crossing = {n: sum(1 for g in layout.groups(n) if min(g) // 8 != max(g) // 8) for n in GROUP_NAMES}
    assert len(text) == len(GROUP_NAMES) and crossing


def timed(fn, world: int, repeat: int) -> tuple[float, float]:
    """(median seconds, peak MB of Python allocations)."""
    fn(world)  # warm-up (imports)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(world)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    fn(world)
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return statistics.median(times), peak


def cli_wall(world: int) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megashard", "plan", CONFIG, "-w", str(world), *SIZES, "--rank",
                    str(world - 1)], check=True, capture_output=True, env=env, cwd=ROOT)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-log2", type=int, default=24)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    for log2 in (10, 14, 17, 20, 22, 24):
        if log2 > args.max_log2:
            break
        world = 1 << log2
        ms_t, ms_mb = timed(megashard_plan, world, args.repeat)
        if world <= LISTING_MAX:
            li_t, li_mb = timed(listing_plan, world, max(1, args.repeat // 2) if world > 1 << 17 else args.repeat)
        else:
            li_t = li_mb = None
        rows.append({"world": world, "megashard_s": ms_t, "megashard_peak_mb": ms_mb, "listing_s": li_t,
                     "listing_peak_mb": li_mb, "speedup": (li_t / ms_t) if li_t else None,
                     "cli_wall_s": cli_wall(world)})
    load_after = os.getloadavg()

    print(f"megashard plan, one rank, tp=8 pp=4 dp_shard=-1, 8 ranks per node; load {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} ({os.cpu_count()} cores)")
    print(f"{'world':>12} | {'megashard':>10} | {'peak MB':>7} | {'listing':>9} | {'peak MB':>8} | {'speed-up':>8} | "
          f"{'python -m megashard plan':>24}")
    for r in rows:
        li = f"{r['listing_s']:.3f} s" if r["listing_s"] is not None else "—"
        li_mb = f"{r['listing_peak_mb']:.1f}" if r["listing_peak_mb"] is not None else "—"
        sp = f"{r['speedup']:.1f}×" if r["speedup"] else "—"
        print(f"{r['world']:>12,} | {r['megashard_s'] * 1e3:>7.2f} ms | {r['megashard_peak_mb']:>7.2f} | {li:>9} | "
              f"{li_mb:>8} | {sp:>8} | {r['cli_wall_s']:>22.2f} s")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"benchmark": "plan_scale", "rows": rows, "load_before": load_before, "load_after": load_after,
                   "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
                  f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
