"""Checkpoint benchmarks.

Section ``distribution``: ``distribute_shards_to_ranks`` on 100,000 shards x 64 ranks in three holder
regimes (1-8 random holders per shard, all 64, 1-64), against two baselines run in the same process:

* ``reference`` — the plain O(shards · holders) statement of the rule (sort with a tuple key, then
  ``min`` over each shard's holders); megashard's own ``_distribute_reference``.
* ``megatron-shape`` — the loop shape of Megatron-LM's implementation: for every shard, scan all
  ranks and test membership in the holder tuple, O(shards · ranks · holders). Written here from the
  documented rule, not copied.

All three must return the same assignment (checked). Reported: best-of-``--repeat`` wall time, the
speed-up ratios and max/mean bytes per rank of the assignment.

Section ``save_load`` (planned): DCP save/load throughput of uneven DTensors; register it in
``SECTIONS`` below. Both sections merge their results into ``benchmarks/results/checkpoint.json``.

Usage: ``python benchmarks/checkpoint.py [--quick] [--only distribution]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Callable, Dict, List

import torch

from megashard.checkpoint.exchange import _distribute_reference, distribute_shards_to_ranks

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint.json")

# Megatron-LM 0.19.2 on this kind of machine, 100,000 shards x 64 ranks (see /work/shared/ANCHORS.md).
MEGATRON_ANCHOR_S = {"1-8": 0.70, "all": 2.75, "1-64": 2.29}
REGIMES = {"1-8": (1, 8), "all": (None, None), "1-64": (1, None)}


def megatron_shape(shard_to_ranks, shard_to_size, num_ranks, cross_parallelization_group_loads=()):
    """Same rule, Megatron's loop shape: every shard scans every rank (ties to the lower rank)."""
    cross = cross_parallelization_group_loads
    holders = {k: tuple(v) for k, v in shard_to_ranks.items()}
    order = sorted(holders, key=lambda k: (k in cross, len(holders[k]), -shard_to_size[k], k))
    load = [(0, r) for r in range(num_ranks)]
    out = {}
    for k in order:
        h = holders[k]
        best = min(entry for entry in load if entry[1] in h)
        out[k] = best[1]
        load[best[1]] = (best[0] + shard_to_size[k], best[1])
    return out


def make_case(regime: str, num_shards: int, num_ranks: int, seed: int = 0):
    """Shard ids like Megatron's ``(key, global_offset, None)``; sizes 4 B .. 4 MiB; sorted holder lists."""
    rng = random.Random(seed)
    lo, hi = REGIMES[regime]
    lo = num_ranks if lo is None else lo
    hi = num_ranks if hi is None else min(hi, num_ranks)
    everyone = list(range(num_ranks))
    shard_to_ranks, shard_to_size = {}, {}
    for i in range(num_shards):
        sid = (f"decoder.layers.{i // 16}.mlp.fc{i % 16}.weight", ((i % 16) * 256, 0), None)
        k = rng.randint(lo, hi)
        shard_to_ranks[sid] = everyone[:] if k == num_ranks else sorted(rng.sample(everyone, k))
        shard_to_size[sid] = 4 * rng.randint(1, 1 << 20)
    return shard_to_ranks, shard_to_size


def _best_time(fn: Callable[[], Dict], repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def _max_over_mean(assign, sizes, num_ranks) -> float:
    loads = [0] * num_ranks
    for k, r in assign.items():
        loads[r] += sizes[k]
    return max(loads) / (sum(loads) / num_ranks)


def bench_distribution(args) -> Dict:
    rows: List[Dict] = []
    for regime in REGIMES:
        s2r, s2s = make_case(regime, args.shards, args.ranks)
        t_ms, got = _best_time(lambda: distribute_shards_to_ranks(s2r, s2s, args.ranks, set()), args.repeat)
        t_ref, ref = _best_time(lambda: _distribute_reference(s2r, s2s, args.ranks, set()), args.repeat)
        row = {
            "regime": regime, "shards": args.shards, "ranks": args.ranks,
            "megashard_s": t_ms, "reference_s": t_ref, "speedup_vs_reference": t_ref / t_ms,
            "max_over_mean_load": _max_over_mean(got, s2s, args.ranks), "equal_to_reference": got == ref,
        }
        if not args.skip_megatron_shape:
            t_meg, meg = _best_time(lambda: megatron_shape(s2r, s2s, args.ranks, set()), args.megatron_repeat)
            row.update(megatron_shape_s=t_meg, speedup_vs_megatron_shape=t_meg / t_ms, equal_to_megatron_shape=got == meg)
        if args.shards == 100_000 and args.ranks == 64:
            row["speedup_vs_megatron_anchor"] = MEGATRON_ANCHOR_S[regime] / t_ms
        rows.append(row)

    print(f"\ndistribute_shards_to_ranks: {args.shards:,} shards x {args.ranks} ranks (best of {args.repeat})")
    head = f"{'holders':>8} {'megashard':>10} {'reference':>10} {'x ref':>6}"
    if not args.skip_megatron_shape:
        head += f" {'megatron-shape':>15} {'x meg':>6}"
    head += f" {'max/mean':>9} {'equal':>6}"
    print(head)
    for r in rows:
        line = f"{r['regime']:>8} {r['megashard_s']:>9.3f}s {r['reference_s']:>9.3f}s {r['speedup_vs_reference']:>5.1f}x"
        equal = r["equal_to_reference"]
        if "megatron_shape_s" in r:
            line += f" {r['megatron_shape_s']:>14.3f}s {r['speedup_vs_megatron_shape']:>5.1f}x"
            equal = equal and r["equal_to_megatron_shape"]
        line += f" {r['max_over_mean_load']:>9.6f} {str(equal):>6}"
        print(line)
    if all("speedup_vs_megatron_anchor" in r for r in rows):
        print("vs Megatron-LM anchor timings (0.70 / 2.75 / 2.29 s): "
              + ", ".join(f"{r['regime']} {r['speedup_vs_megatron_anchor']:.1f}x" for r in rows))
    if not all(r["equal_to_reference"] and r.get("equal_to_megatron_shape", True) for r in rows):
        raise SystemExit("megashard's assignment differs from a baseline")
    return {"rows": rows, "repeat": args.repeat, "megatron_anchor_s": MEGATRON_ANCHOR_S}


# name -> function(args) -> JSON-able dict. The save/load-throughput section goes here as "save_load".
SECTIONS: Dict[str, Callable] = {"distribution": bench_distribution}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10,000 shards, one repeat (a smoke run)")
    p.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    p.add_argument("--shards", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="best-of repeats for megashard and the reference")
    p.add_argument("--megatron-repeat", type=int, default=1, help="repeats of the slow megatron-shape baseline")
    p.add_argument("--skip-megatron-shape", action="store_true")
    p.add_argument("--json", default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.shards, args.repeat = 10_000, 1
    torch.set_num_threads(1)
    results = {}
    if os.path.exists(args.json):  # keep the other sections' last results
        with open(args.json) as f:
            results = json.load(f)
    for name in args.only or SECTIONS:
        results[name] = SECTIONS[name](args)
        results[name]["env"] = {
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "loadavg_1min": os.getloadavg()[0], "quick": args.quick, "argv": sys.argv[1:],
        }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
