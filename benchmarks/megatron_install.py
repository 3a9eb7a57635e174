"""Megatron-LM's own ``initialize_model_parallel`` with and without ``megashard.megatron.install()``.

One process simulates rank 0 of a 4,096 … 65,536-rank world on the ``fake`` backend (every group a rank creates is
really constructed, nothing is communicated). Each measurement runs in a FRESH subprocess; the time is that of the
``megatron.core.parallel_state.initialize_model_parallel(...)`` call alone (imports, ``install()`` and
``init_process_group`` excluded), best of ``--repeats``; ``new_group`` calls are counted by wrapping it.
Megatron's gloo groups are off on both sides (a ``fake`` world has none; megashard creates none there either).

Layout: Megatron keyword arguments tp=8, cp=2, pp=4, ep=8, expert tp=1 (benchmarks/init_scale.py's ``tp8 cp2 pp4
ep8``). Needs megatron-core (``pip install -e '.[megatron-test]'``). Prints a markdown table and writes
``benchmarks/results/megatron_install.json``.

    python benchmarks/megatron_install.py [--worlds 4096 65536] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "megatron_install.json")
KWARGS = dict(tensor_model_parallel_size=8, context_parallel_size=2, pipeline_model_parallel_size=4,
              expert_model_parallel_size=8, expert_tensor_parallel_size=1, create_gloo_process_groups=False)
IMPLS = ("megatron", "megatron+install")


def worker(impl: str, world: int) -> dict[str, Any]:
    import time
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megatron.core.parallel_state as mps

    if impl == "megatron+install":
        import megashard.megatron

        megashard.megatron.install()
    calls = [0]
    orig = dist.new_group

    def counted(*a, **k):
        calls[0] += 1
        return orig(*a, **k)

    dist.new_group = counted
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t0, c0 = time.perf_counter(), time.process_time()
    mps.initialize_model_parallel(**KWARGS)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tp = dist.get_process_group_ranks(mps.get_tensor_model_parallel_group())
    dp = mps.get_data_parallel_world_size()
    return {"impl": impl, "world": world, "wall_s": wall, "cpu_s": cpu, "new_group_calls": calls[0],
            "tp_group": tp, "dp_size": dp}


def measure(impl: str, world: int, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for _ in range(repeats):
        p = subprocess.run([sys.executable, __file__, "--worker", impl, "--world", str(world)], env=env,
                           capture_output=True, text=True, check=False)
        if p.returncode:
            raise RuntimeError(f"{impl} at {world} ranks failed:\n{p.stderr[-2000:]}")
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["wall_s"])
    best["runs_wall_s"] = [r["wall_s"] for r in runs]
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.world)))
        return 0
    rows = []
    for world in args.worlds:
        got = {impl: measure(impl, world, args.repeats) for impl in IMPLS}
        a, b = got["megatron"], got["megatron+install"]
        assert a["tp_group"] == b["tp_group"] and a["dp_size"] == b["dp_size"], (a, b)  # the same layout
        rows.append({"world": world, "megatron": a, "megatron+install": b, "speedup": a["wall_s"] / b["wall_s"]})
    lines = ["| world | Megatron init (s) | with install() (s) | speed-up | new_group calls Megatron / install() |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        a, b = r["megatron"], r["megatron+install"]
        lines.append(f"| {r['world']:,} | {a['wall_s']:.3f} | {b['wall_s']:.3f} | {r['speedup']:.1f}x | "
                     f"{a['new_group_calls']:,} / {b['new_group_calls']:,} |")
    print("\n".join(lines))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    import megatron.core

    doc = {"layout": KWARGS, "rank": 0, "rows": rows, "load_1min": load, "python": platform.python_version(),
           "megatron_core": megatron.core.__version__}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {RESULTS} (load {load})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
