"""The check before launch (issue 37): how long it takes, and that it refuses no layout that works.

For configs/default.yaml and configs/text.yaml at each world size (default 4, 8, 16, 64): every layout ``megashard
plan --suggest`` lists (``--top``, with ``--device-memory 80GiB``), each rehearsed rank by rank on the fake backend
(:mod:`megashard.rehearse`, ``--jobs`` processes at a time) and checked (:func:`megashard.rehearse.compare.check_traces`):
a finding on any of them is a false positive (the job runs on those layouts). Then the parity layouts of the tests
(tests/test_train_parity.py, tests/test_moe_folding.py) and a five-dimensional one (tp·cp·pp·dp·ep), and the default
job at ``--big`` ranks (1,024).

The baseline, measured in the same run: one rank's training step on the fake backend in this process with plain
PyTorch (no recorder, no processes), times the ranks; the ratio says what the rehearsal's processes, mailbox and
recording cost on top.

    python benchmarks/rehearse_check.py [--worlds 4,8,16,64] [--configs default,text] [--top 10] [--jobs 2]
                                        [--big 1024] [--skip-sweep]

Prints a table and writes ``benchmarks/results/rehearse_check.json``; the machine's load average is noted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "rehearse_check.json")
MOE = ["model.num_experts=4", "model.moe_every=2", "model.moe_top_k=2", "model.ffn_hidden=128"]
PARITY = {  # name -> (config, world, overrides): the layouts of the parity tests, and a five-dimensional one
    "tp2_dp2": ("default", 4, ["parallel.tp=2", "parallel.dp_shard=2"]),
    "dp4": ("default", 4, ["parallel.tp=1", "parallel.dp_shard=4"]),
    "hsdp": ("default", 4, ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2"]),
    "cp2": ("default", 4, ["parallel.tp=1", "parallel.cp=2", "parallel.dp_shard=2"]),
    "tp2_cp2": ("default", 4, ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1"]),
    "moe_ep2": ("default", 4, ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2"] + MOE),
    "moe_pp2_tp2_ep2": ("default", 8, MOE + ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2",
                                             "train.microbatches=2"]),
    "moe_fold_tp2_ep2_etp2": ("default", 8, MOE + ["parallel.tp=2", "parallel.ep=2", "parallel.expt_tp=2"]),
    "5d_tp2_cp2_pp2_dp2_ep2": ("default", 16, MOE + ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2",
                                                     "parallel.dp_shard=2", "parallel.ep=2", "model.layers=4",
                                                     "train.microbatches=2"]),
    "5d_vpp_hsdp": ("default", 32, MOE + ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.vpp=2",
                                          "parallel.dp_outer=2", "parallel.dp_shard=2", "parallel.ep=4",
                                          "model.layers=8", "train.pipeline_schedule=interleaved_1f1b",
                                          "train.microbatches=4", "train.global_batch=32"]),
}


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the ranks' processes): what the check costs whatever
    the machine's load; on an idle machine with ``--jobs`` cores the wall time is about this / jobs."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _job(config: str, overrides: list[str]):
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(os.path.join(ROOT, "configs", f"{config}.yaml"), overrides)


def _check(job, world: int, jobs: int) -> dict:
    from megashard.rehearse import rehearse_job
    from megashard.rehearse.compare import check_traces

    t0, c0 = time.perf_counter(), _cpu()
    traces = rehearse_job(job, world, jobs=jobs)
    t1 = time.perf_counter()
    result = check_traces(traces)
    cpu = _cpu() - c0
    return {"ok": result.ok, "ranks": result.ranks, "groups": result.groups, "calls": result.calls,
            "rehearse_s": round(t1 - t0, 2), "compare_s": round(time.perf_counter() - t1, 3),
            "seconds": round(time.perf_counter() - t0, 2), "cpu_s": round(cpu, 2),
            "idle_estimate_s": round(cpu / jobs, 2),
            "findings": [f.line for f in result.findings][:3]}


def baseline_rank_s(job, world: int) -> float:
    """Seconds of one rank's training step on the fake backend in a child process with plain PyTorch: the job's
    rehearsal body without recorder and mailbox (rank 0; a pipeline's rank would need its peers)."""
    import multiprocessing

    from megashard.rehearse.job import JobRank

    body = JobRank(job, world)
    if body.sizes.pp > 1:
        return float("nan")

    def run(conn):
        import torch

        torch.set_num_threads(1)

        class NoRecorder:
            def install(self):
                pass

        t0 = time.perf_counter()
        body(0, NoRecorder())
        conn.send(time.perf_counter() - t0)
        conn.close()
        os._exit(0)

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=run, args=(child,))
    p.start()
    s = parent.recv()
    p.join()
    return s


def suggested(config: str, world: int, top: int) -> list[tuple[str, list[str]]]:
    from megashard.advisor.search import suggest

    job = _job(config, [])
    result = suggest(job, world, "80GiB")
    return [(c.label(), c.overrides()) for c in result.ranked[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="4,8,16,64")
    ap.add_argument("--configs", default="default,text")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--big", type=int, default=1024, help="ranks of the default job's big check (0: skip)")
    ap.add_argument("--skip-sweep", action="store_true", help="only the timing rows (world 64, --big)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-timing", action="store_true", help="no timing rows (world 64, --big) and no baseline")
    ap.add_argument("--out", default=RESULTS, help=f"the JSON file (default {os.path.relpath(RESULTS, ROOT)})")
    args = ap.parse_args()
    rows = []
    out = {"machine": platform.node(), "cpus": os.cpu_count(), "jobs": args.jobs, "load_before": _load(), "rows": rows}
    worlds = [int(w) for w in args.worlds.split(",") if w]

    def row(kind: str, name: str, world: int, job, label: str = "") -> None:
        r = _check(job, world, args.jobs)
        r.update(kind=kind, name=name, world=world, layout=label, load=_load())
        rows.append(r)
        print(f"{kind:8} {name:24} {world:5} {label[:58]:58} {'OK' if r['ok'] else 'FINDING':8} {r['ranks']:5} "
              f"{r['calls']:7} {r['seconds']:8.1f}s {r['cpu_s']:8.1f}s {r['idle_estimate_s']:8.1f}s  load {r['load']}",
              flush=True)
        if not r["ok"]:
            print("         " + "\n         ".join(r["findings"]), flush=True)

    print(f"{'KIND':8} {'NAME':24} {'WORLD':>5} {'LAYOUT':58} {'RESULT':8} {'RANKS':>5} {'CALLS':>7} {'WALL':>9} "
          f"{'CPU':>9} {'IDLE~':>9}   (IDLE~ = CPU / jobs: the wall time on an idle machine with that many cores)")
    if not args.skip_sweep:
        for config in args.configs.split(","):
            for w in worlds:
                for label, overrides in suggested(config, w, args.top):
                    row("suggest", config, w, _job(config, overrides), label)
    if not args.skip_parity:
        for name, (config, w, overrides) in PARITY.items():
            row("parity", name, w, _job(config, overrides), " ".join(overrides)[:60])
    base = None
    if not args.skip_timing:
        job64 = _job("default", ["train.global_batch=64"])  # dp=32: two sequences per rank
        row("time", "default", 64, job64, "tp=2 dp_shard=32 global_batch=64")
        base = baseline_rank_s(job64, 64)
        out["baseline_rank_s"] = round(base, 3)
        out["time64_vs_baseline"] = round(rows[-1]["seconds"] / (64 * base), 2)
        if args.big:
            row("time", "default", args.big, _job("default", [f"train.global_batch={args.big}"]),
                f"tp=2 dp_shard={args.big // 2} global_batch={args.big}")
            out["big_vs_baseline"] = round(rows[-1]["seconds"] / (args.big * base), 2)
    out["false_positives"] = sum(1 for r in rows if not r["ok"])
    out["load_after"] = _load()
    timing = "" if base is None else (
        f"; plain PyTorch, one rank on the fake backend: {base:.2f} s; world 64: {out['time64_vs_baseline']}x the "
        "ranks' plain time one after another" + (f"; world {args.big}: {out['big_vs_baseline']}x" if args.big else ""))
    print(f"\nfalse positives: {out['false_positives']} of {len(rows)} checks{timing} (load {_load()})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0 if out["false_positives"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
