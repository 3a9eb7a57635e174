"""Cost of megashard's per-rank state helpers against the plain-PyTorch operations they wrap.

* ``fork()`` enter+exit of the RNG tracker vs the raw generator get/set it performs
  (get default, set stream, get stream, set default) — the overhead is the bookkeeping that makes
  nested forks correct.
* ``GlobalMemoryBuffer.get_tensor`` on reuse (a view, no allocation) vs ``torch.empty`` of the same size.

Runs on the device generator megashard uses (CUDA if available, else CPU). Prints a table and writes
``benchmarks/results/per_rank_state.json``.

    python benchmarks/per_rank_state.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Callable

import torch

from megashard.state.memory import GlobalMemoryBuffer
from megashard.state.rng import RNGStatesTracker, _device_generator

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "per_rank_state.json")


def paired_ns(fn_a: Callable[[int], None], fn_b: Callable[[int], None], iters: int, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` ns per call of ``fn_a(iters)`` and ``fn_b(iters)``, timed alternately.

    Alternating keeps the ratio fair on a shared machine: a burst of load hits both sides.
    """
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for k, fn in enumerate((fn_a, fn_b)):
            t0 = time.perf_counter_ns()
            fn(iters)
            best[k] = min(best[k], (time.perf_counter_ns() - t0) / iters)
    return best[0], best[1]


def bench_fork(iters: int, repeats: int) -> list[dict]:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    gen = _device_generator(-1)  # the generator the tracker drives
    stream = {"a": gen.get_state()}

    def fork_loop(n: int) -> None:
        for _ in range(n):
            with tracker.fork("a"):
                pass

    def nested_loop(n: int) -> None:
        for _ in range(n):
            with tracker.fork("a"):
                with tracker.fork("b"):
                    pass

    def raw_loop(n: int) -> None:  # what one fork does to the generator, with torch's own calls only
        for _ in range(n):
            orig = gen.get_state()
            gen.set_state(stream["a"])
            stream["a"] = gen.get_state()
            gen.set_state(orig)

    one, raw = paired_ns(fork_loop, raw_loop, iters, repeats)
    nested, raw2 = paired_ns(nested_loop, raw_loop, iters, repeats)
    raw = min(raw, raw2)
    return [
        {"case": "fork() enter+exit", "megashard_ns": one, "baseline": "raw get/set x2", "baseline_ns": raw},
        {"case": "2 nested forks", "megashard_ns": nested, "baseline": "raw get/set x4", "baseline_ns": 2 * raw},
    ]


def bench_buffer(numels: list[int], iters: int, repeats: int) -> list[dict]:
    buf = GlobalMemoryBuffer()
    rows = []
    for numel in numels:
        shape = (numel // 256, 256)
        buf.get_tensor(shape, torch.float32, "bench")  # allocate once; every timed call reuses it

        def reuse_loop(n: int) -> None:
            for _ in range(n):
                buf.get_tensor(shape, torch.float32, "bench")

        def empty_loop(n: int) -> None:
            for _ in range(n):
                torch.empty(shape, dtype=torch.float32, device=buf.device)

        reuse, empty = paired_ns(reuse_loop, empty_loop, iters, repeats)
        rows.append({
            "case": f"get_tensor reuse {numel * 4 / 2**20:g} MiB",
            "megashard_ns": reuse,
            "baseline": "torch.empty",
            "baseline_ns": empty,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke run)")
    parser.add_argument("--out", default=RESULTS, help="JSON output path")
    args = parser.parse_args()
    iters, repeats = (500, 3) if args.quick else (5000, 15)
    numels = [4096, 1 << 22] if args.quick else [4096, 1 << 20, 1 << 24]

    rows = bench_fork(iters, repeats) + bench_buffer(numels, iters // 4, repeats)
    for r in rows:
        r["ratio"] = r["megashard_ns"] / r["baseline_ns"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"per-rank state, device generator/buffer on {device}, torch {torch.__version__}, "
          f"best of {repeats}, {'quick' if args.quick else 'full'} run")
    print(f"{'case':<28} {'megashard':>12} {'baseline':>16} {'':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['case']:<28} {r['megashard_ns'] / 1e3:>9.2f} us {r['baseline']:>16} "
              f"{r['baseline_ns'] / 1e3:>9.2f} us {r['ratio']:>7.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({
            "benchmark": "per_rank_state",
            "device": device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "quick": args.quick,
            "iters": iters,
            "repeats": repeats,
            "rows": rows,
        }, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
