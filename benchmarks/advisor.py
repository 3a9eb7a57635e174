"""`megashard plan --suggest`: how right its memory is, how well calibration ranks, and how long it takes.

Three parts (``--part memory,calibration,speed``; all by default):

**memory** — modelled, traced (:mod:`megashard.advisor.trace`) and measured peak memory for every layout of
:data:`LAYOUTS` (and, with ``--layouts test:new``, the new jobs of tests/test_advisor_memory.py) (15 jobs on 4 gloo ranks
that the tests never tuned: dense HSDP, tp, cp (gpt and llama), FSDP, pipelines 1F1B first/last stage, GPipe,
interleaved 1F1B with recompute, zbv, recompute with distributed saved inputs, MoE ep / ep+expt_tp / tp+ep, llama
bf16). Measured as the tests measure (tests/_live_bytes.py): live tensor-storage bytes of the steps after the first,
frees by gloo's thread placed after the program's last use — the same bytes on every run, at any load. Goal: never
more than 3% under, at most 5% over.

**calibration** — every layout that fits a small case (configs/default.yaml, 4 ranks, ``--calib-memory``) is timed
with real `megashard run`s (the calibration's own :func:`megashard.advisor.calibrate.time_layouts`: interleaved
rounds, median of the steps after warm-up); the calibrated #1 (the fastest measured among the model's top
``--calibrate K``) against the fastest of all, and where the model's own #1 lands.

For a few jobs and world sizes the advisor (``megashard.advisor.search.suggest``: enumerate, validate with the job's
own rules, estimate memory and step time) runs in this process; reported are the layouts considered, the wall time
(median of ``--repeat``), the time per layout, and the time for 1,024 layouts. The baseline is what a user would do
without it: ``megashard plan CONFIG --world-size N parallel.tp=…`` (in-process ``main``) for each layout, which
validates and lays out one layout and says nothing of memory or time; it runs for the first ``--baseline`` layouts
and is reported per layout, with the ratio. Also: whether torch was imported (it must not be).

**speed** (below) — the advisor's time per layout against planning each layout one by one.

**host** — the default job's peak RSS growth per rank (``VmHWM`` at the end minus ``VmRSS`` after the imports,
4 ranks under torchrun) against the advisor's host memory per rank.

Usage: ``python benchmarks/advisor.py [--part memory,calibration,host,speed] [--repeat 3] [--baseline 40] [--quick]``;
writes ``benchmarks/results/advisor.json``. Every part prints the load average (the machine is shared).
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


# ---------------------------------------------------------------------------------------------- memory
WORLD = 4
RUN = ["train.steps=2", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
       "train.plot=false", "train.resume=false", "model.dropout=0.0", "data.num_sequences=32",
       f"launch.nproc_per_node={WORLD}"]
#: The model of the memory layouts (not the tests' hidden 128 / 512 vocabulary / seq 64).
MODEL = ["model.vocab_size=1024", "model.hidden=256", "model.layers=4", "model.heads=8", "model.seq_len=128",
         "train.global_batch=8"]
#: name -> overrides of the untuned memory layouts (4 ranks each).
LAYOUTS = {
    "hsdp dp_outer=2 dp_shard=2": ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2"],
    "tp=2 fsdp=2 tied": ["parallel.tp=2", "parallel.dp_shard=2", "model.tie_embeddings=true"],
    "gpt tp=2 cp=2": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1"],
    "llama cp=4": ["parallel.tp=1", "parallel.cp=4", "parallel.dp_shard=1", "model.arch=llama"],
    "fsdp=4 hidden 512 vocab 256": ["parallel.tp=1", "parallel.dp_shard=4", "model.hidden=512",
                                    "model.vocab_size=256"],
    "pp=2 1f1b tp=2 mb=4": ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "train.microbatches=4"],
    "pp=4 gpipe mb=8": ["parallel.tp=1", "parallel.pp=4", "parallel.dp_shard=1", "train.microbatches=8",
                        "train.pipeline_schedule=gpipe"],
    "pp=2 vpp=2 interleaved recompute": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=2",
                                         "train.microbatches=4", "train.pipeline_schedule=interleaved_1f1b",
                                         "model.recompute=true"],
    "pp=2 zbv mb=4": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=2",
                      "train.microbatches=4", "train.pipeline_schedule=zbv"],
    "tp=2 recompute distributed": ["parallel.tp=2", "parallel.dp_shard=2", "model.recompute=true",
                                   "model.distribute_saved_activations=true"],
    "moe 8 experts top-2 ep=2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "model.num_experts=8",
                                 "model.moe_top_k=2"],
    "moe ep=2 expt_tp=2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "parallel.expt_tp=2",
                           "model.num_experts=8", "model.moe_top_k=2"],
    "moe llama tp=2 ep=2": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2", "model.num_experts=4",
                            "model.moe_top_k=2", "model.arch=llama"],
    "llama bf16 tp=2 recompute distributed": ["parallel.tp=2", "parallel.dp_shard=2", "model.arch=llama",
                                              "train.dtype=bfloat16", "model.recompute=true",
                                              "model.distribute_saved_activations=true"],
    "llama bf16 fsdp=4 mb=2": ["parallel.tp=1", "parallel.dp_shard=4", "model.arch=llama", "train.dtype=bfloat16",
                               "train.microbatches=2"],
}
_ENV = "MEGASHARD_ADVISOR_BENCH_DIR"


def layout_job(name: str, out: str = "/tmp") -> object:
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(os.path.join(ROOT, "configs", "default.yaml"),
                               RUN + MODEL + [f"train.out_dir={out}/{name.replace(' ', '_')}"] + LAYOUTS[name])


def check_measure(rank: int, world_size: int) -> None:
    """In each spawned rank: every layout's steady-state peak (tests/_live_bytes.py's definition)."""
    from megashard.train.loop import train
    from tests._live_bytes import LiveBytes

    out = os.environ[_ENV]
    names = json.load(open(os.path.join(out, "names.json")))
    peaks = {}
    for name in names:
        if name.startswith("test:"):
            import tests.test_advisor_memory as T

            os.environ[T.ENV] = out
            job = T._job(name[5:])
        else:
            job = layout_job(name, out)
        with LiveBytes(warmup_steps=1) as live:
            train(job)
        peaks[name] = live.peak
    with open(os.path.join(out, f"peaks{rank}.json"), "w") as f:
        json.dump(peaks, f)


def _jobs(names: list[str]) -> list[tuple[str, object]]:
    """(name, JobConfig) of every job measured: this file's LAYOUTS by name, tests/test_advisor_memory.py's jobs as
    ``test:NAME``."""
    out = []
    for name in names:
        if name.startswith("test:"):
            import tests.test_advisor_memory as T

            out.append((name, T._job(name[5:])))
        else:
            out.append((name, layout_job(name)))
    return out


def memory_part(names: list[str], trace: bool = True) -> list[dict]:
    """Modelled, traced and measured peak (largest rank) of each job."""
    import tempfile

    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape
    from tests._dist import spawn_checks

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megashard-advisor-bench-") as tmp:
        json.dump(names, open(os.path.join(tmp, "names.json"), "w"))
        os.environ[_ENV] = tmp
        try:
            spawn_checks([check_measure], WORLD, timeout=3600).assert_ok("check_measure")
        finally:
            os.environ.pop(_ENV, None)
        per_rank = [json.load(open(os.path.join(tmp, f"peaks{r}.json"))) for r in range(WORLD)]
    measure_s = time.perf_counter() - t0
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS.replace(".json", "-measured.json"), "w") as f:  # kept before any estimate runs
        json.dump({"per_rank": per_rank, "loadavg": os.getloadavg()}, f)
    rows = []
    t1 = time.perf_counter()
    for name, job in _jobs(names):
        est = estimate_memory(JobShape.from_job(job), job.parallel.resolve(WORLD), job.model.recompute,
                              job.model.distribute_saved_activations)
        ranks = [p[name] for p in per_rank]
        real = max(ranks)
        traced, exact, why = None, False, None
        if trace:
            from megashard.advisor.trace import trace_memory

            every = trace_memory(job, WORLD)
            peaks = [p for p in every if p.peak is not None]
            traced = max(p.peak for p in peaks) if peaks else None
            exact = any(p.exact for p in peaks)
            why = next((p.error for p in every if p.error), None)
        rows.append({"layout": name, "predicted": est.peak, "traced": traced, "measured": real,
                     "error": est.peak / real - 1, "traced_error": traced / real - 1 if traced else None,
                     "traced_exact": exact, "trace_error": why,
                     "phase": est.phase, "pp_rank": est.rank, "ranks": ranks})
    trace_s = time.perf_counter() - t1
    print(f"\n## memory: modelled, traced and measured peak per rank (largest rank; 4 gloo ranks measured in "
          f"{measure_s:.0f} s, every pipeline rank traced in {trace_s:.0f} s; load average {os.getloadavg()})\n")
    print("| job | modelled MiB | traced MiB | measured MiB | modelled error | traced error | modelled peak at |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tr = (f"{r['traced'] / 2**20:.3f}" + (" (every rank, values)" if r["traced_exact"] else "")) if r["traced"] \
            else "-"
        te = f"{r['traced_error']:+.1%}" if r["traced_error"] is not None else "-"
        print(f"| {r['layout']} | {r['predicted'] / 2**20:.3f} | {tr} | {r['measured'] / 2**20:.3f} | "
              f"{r['error']:+.1%} | {te} | pp rank {r['pp_rank']}, {r['phase']} |")
    for r in rows:
        if r["trace_error"]:
            print(f"trace of {r['layout']} failed: {r['trace_error']}")
    errs = [r["error"] for r in rows]
    inside = sum(-0.03 <= e <= 0.05 for e in errs)
    print(f"\nmodelled: {inside} of {len(rows)} within the goal (-3% .. +5%); errors {min(errs):+.1%} .. {max(errs):+.1%}")
    terrs = [r["traced_error"] for r in rows if r["traced_error"] is not None]
    if terrs:
        print(f"traced: {sum(abs(e) <= 0.01 for e in terrs)} of {len(terrs)} within 1%; errors {min(terrs):+.1%} .. "
              f"{max(terrs):+.1%}")
    return rows


# ---------------------------------------------------------------------------------------------- calibration
def calibration_part(memory: str, top: int, steps: int, rounds: int, limit: int) -> dict:
    """``--calibrate top``'s choice (layouts that differ) and the model's first ``limit`` layouts, timed together in
    interleaved rounds: the calibrated #1 (the fastest of the chosen) against the fastest of all timed, and Kendall's
    τ between the model's and the measured order of the chosen."""
    from megashard.advisor.calibrate import kendall_tau, pick_layouts, time_layouts
    from megashard.advisor.search import suggest
    from megashard.cli.suggest import job_machine
    from megashard.advisor.units import parse_bytes
    from megashard.config import yamlfile
    from megashard.train.config import JobConfig

    config = os.path.join(ROOT, "configs", "default.yaml")
    job = JobConfig.from_yaml(config)
    world, rpn, mem, hw, notes = job_machine(job, WORLD, None, parse_bytes(memory), {})
    result = suggest(job, world, mem, rpn, hw)
    chosen = pick_layouts(result.ranked, top)
    layouts = chosen + [c for c in result.ranked[:limit] if c not in chosen]
    t0 = time.perf_counter()
    timings = time_layouts(yamlfile.load_yaml(config), job.name, layouts, WORLD, steps=steps, rounds=rounds,
                           log=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    measured = [(t.step_s, i) for i, t in enumerate(timings) if t.step_s is not None]
    fastest_s, fastest_i = min(measured)
    calibrated_s, calibrated_i = min((s, i) for s, i in measured if i < len(chosen))
    order = sorted(measured)
    model_rank = {id(c): k for k, c in enumerate(result.ranked, 1)}
    tau = kendall_tau([layouts[i].cost.seconds for _, i in measured if i < len(chosen)],
                      [sec for sec, i in measured if i < len(chosen)])
    print(f"\n## calibration: configs/default.yaml on {WORLD} ranks ({hw.describe(job.train.dtype)}); --calibrate "
          f"{top} chose {len(chosen)} layouts that differ, timed with the model's first {limit} ({len(layouts)} in all), "
          f"{rounds} interleaved rounds × {steps} steps, medians after 2 warm-up steps; "
          f"{time.perf_counter() - t0:.0f} s, load average {os.getloadavg()})\n")
    print("| measured # | model # | chosen by --calibrate | layout | modelled ms | ms/step (median) | rounds' medians ms |")
    print("|---|---|---|---|---|---|---|")
    for k, (sec, i) in enumerate(order, 1):
        t = timings[i]
        c = layouts[i]
        print(f"| {k} | {model_rank[id(c)]} | {'yes' if i < len(chosen) else ''} | {t.layout} | "
              f"{c.cost.seconds * 1e3:.1f} | {sec * 1e3:.1f} | {', '.join(f'{x * 1e3:.1f}' for x in t.rounds)} |")
    gap = calibrated_s / fastest_s - 1
    print(f"\ncalibrated #1 (the fastest of the {len(chosen)} chosen): {timings[calibrated_i].layout}, "
          f"{calibrated_s * 1e3:.1f} ms; fastest of all {len(measured)}: {timings[fastest_i].layout}, "
          f"{fastest_s * 1e3:.1f} ms: {gap:+.1%} (goal: within 5%). Kendall's τ (model vs measured, chosen): "
          f"{tau if tau is None else round(tau, 2)}")
    return {"memory": memory, "top": top, "timed": len(layouts), "fit": len(result.ranked),
            "chosen": [c.label() for c in chosen],
            "timings": [{"model_rank": model_rank[id(layouts[i])], "layout": t.layout, "modelled_s": layouts[i].cost.seconds,
                         "step_s": t.step_s, "rounds": t.rounds, "samples": t.samples, "error": t.error}
                        for i, t in enumerate(timings)],
            "calibrated": timings[calibrated_i].layout, "calibrated_s": calibrated_s,
            "fastest": timings[fastest_i].layout, "fastest_s": fastest_s, "gap": gap, "kendall_tau": tau,
            "hardware": hw.describe(job.train.dtype)}


# ---------------------------------------------------------------------------------------------- host memory
_RSS_WORKER = """
import json, os, sys
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
import torch
import megashard.train.loop as loop
from megashard.train.config import JobConfig
start = status("VmRSS")  # after the imports: the baseline
loop.train(JobConfig.from_yaml(sys.argv[2], sys.argv[3:]))
with open(sys.argv[1] + "." + os.environ["RANK"] + ".json", "w") as f:
    json.dump({"growth": status("VmHWM") - start}, f)
"""


def host_part(runs: int = 1) -> dict:
    """The default job's peak RSS growth per rank (VmHWM at the end - VmRSS after the imports; torchrun, 4 ranks, 200
    steps, checkpoints as configured) against the advisor's host memory per rank for its layout."""
    import subprocess
    import tempfile

    from megashard.advisor.host import estimate_host
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape
    from megashard.train.config import JobConfig

    config = os.path.join(ROOT, "configs", "default.yaml")
    job = JobConfig.from_yaml(config)
    shape = JobShape.from_job(job)
    sizes = job.parallel.resolve(WORLD)
    device_peak = estimate_memory(shape, sizes).peak
    model = estimate_host(shape, "cpu", device_peak)
    growth = []
    with tempfile.TemporaryDirectory(prefix="megashard-advisor-host-") as tmp:
        worker = os.path.join(tmp, "worker.py")
        with open(worker, "w") as f:
            f.write(_RSS_WORKER)
        for k in range(runs):
            out = os.path.join(tmp, f"run{k}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", worker,
                   out, config, f"train.out_dir={out}-dir", "train.progress=false", "train.plot=false"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
            subprocess.run(cmd, check=True, env=env, capture_output=True)
            growth.append([json.load(open(f"{out}.{r}.json"))["growth"] for r in range(WORLD)])
    largest = [max(g) for g in growth]
    err = [model.peak / x - 1 for x in largest]
    print(f"\n## host memory: configs/default.yaml, {WORLD} ranks, {runs} run(s) (load average {os.getloadavg()})\n")
    print("| run | peak RSS growth per rank MiB | largest | advisor's host memory per rank MiB | error |")
    print("|---|---|---|---|---|")
    for k, g in enumerate(growth):
        print(f"| {k + 1} | {', '.join(f'{x / 2**20:.0f}' for x in g)} | {largest[k] / 2**20:.0f} | "
              f"{model.peak / 2**20:.1f} | {err[k]:+.1%} |")
    print(f"\nparts: {', '.join(f'{k} {v / 2**20:.2f}' for k, v in model.parts.items())} MiB (goal: within 20% of the "
          "largest rank's)")
    return {"growth": growth, "model": model.peak, "parts": model.parts, "errors": err}


# ---------------------------------------------------------------------------------------------- speed
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
                *c.overrides()]  # the layout's sizes and the schedule its vpp needs
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
    return (time.perf_counter() - t) / max(1, len(layouts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="memory,calibration,host,speed", help="comma-separated parts to run")
    ap.add_argument("--layouts", default=None, help="memory: comma-separated layout names (default: all; test:NAME for "
                    "a job of tests/test_advisor_memory.py, test:new for its new ones)")
    ap.add_argument("--no-trace", action="store_true", help="memory: measure and model only")
    ap.add_argument("--host-runs", type=int, default=2, help="host: runs of the default job")
    ap.add_argument("--calib-memory", default="4GiB", help="calibration: memory per rank of the small case")
    ap.add_argument("--calibrate", type=int, default=5, help="calibration: --calibrate K")
    ap.add_argument("--calib-steps", type=int, default=5)
    ap.add_argument("--calib-rounds", type=int, default=2)
    ap.add_argument("--calib-limit", type=int, default=8, help="calibration: the model's first N layouts timed too")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=int, default=40, help="layouts planned one by one for the baseline")
    ap.add_argument("--quick", action="store_true", help="one repeat, 10 baseline layouts")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.baseline = 1, 10
    parts = set(args.part.split(","))
    report: dict = {"parts": sorted(parts), "loadavg_start": os.getloadavg()}
    if "memory" in parts:
        names = args.layouts.split(",") if args.layouts else list(LAYOUTS)
        if "test:new" in names:
            import tests.test_advisor_memory as T

            names = [n for n in names if n != "test:new"] + [f"test:{n}" for n in T.NEW_JOBS]
        report["memory"] = memory_part(names, trace=not args.no_trace)
    if "calibration" in parts:
        report["calibration"] = calibration_part(args.calib_memory, args.calibrate, args.calib_steps,
                                                 args.calib_rounds, args.calib_limit)
    if "host" in parts:
        report["host"] = host_part(args.host_runs)
    if "speed" in parts:
        report.update(speed_part(args))
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    report["loadavg_end"] = os.getloadavg()
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {RESULTS}")


def speed_part(args: argparse.Namespace) -> dict:
    rows = []
    for name, config, overrides, world in CASES:
        sec, result = run_case(config, overrides, world, args.repeat)
        per = sec / result.considered
        base = baseline(config, overrides, world, result, args.baseline)
        rows.append({"case": name, "world_size": world, "considered": result.considered, "fit": len(result.ranked),
                     "refused": len(result.rejected), "seconds": sec, "us_per_layout": per * 1e6,
                     "seconds_per_1024": per * 1024, "baseline_us_per_layout": base * 1e6,
                     "speedup": base / per if per else None})
    torch_loaded = "torch" in sys.modules and "memory" not in args.part and "calibration" not in args.part
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print("\n## speed: the advisor per layout against `megashard plan` per layout\n")
    print(f"| case | world | layouts | fit | refused | advisor s | µs/layout | s per 1,024 | `plan` µs/layout | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['world_size']} | {r['considered']:,} | {r['fit']:,} | {r['refused']:,} | "
              f"{r['seconds']:.3f} | {r['us_per_layout']:.0f} | {r['seconds_per_1024']:.3f} | "
              f"{r['baseline_us_per_layout']:.0f} | {r['speedup']:.1f}× |")
    print(f"\ntorch imported: {torch_loaded}; load average {load}; python {platform.python_version()}")
    return {"speed": rows, "torch_imported": torch_loaded, "loadavg": load, "repeat": args.repeat,
            "python": platform.python_version(), "machine": platform.machine()}


if __name__ == "__main__":
    main()
