"""Checkpoint benchmarks.

Section ``distribution``: ``distribute_shards_to_ranks`` on 100,000 shards x 64 ranks in three holder
regimes (1-8 random holders per shard, all 64, 1-64), against two baselines run in the same process:

* ``reference`` — the plain O(shards · holders) statement of the rule (sort with a tuple key, then
  ``min`` over each shard's holders); megashard's own ``distribute_shards_reference``.
* ``megatron-shape`` — the loop shape of Megatron-LM's implementation: for every shard, scan all
  ranks and test membership in the holder tuple, O(shards · ranks · holders). Written here from the
  documented rule, not copied.

All three must return the same assignment (checked). Reported: best-of-N wall and CPU time (CPU time is
steadier on a shared machine), the speed-up ratios, the ratio to Megatron-LM's own timings from
ANCHORS.md, and max/mean bytes per rank of the assignment.

Section ``save_load`` (``--part io``): save and load MB/s of megashard.checkpoint (DCP, uneven FSDP shards,
completion marker, checksums computed while writing and verified while reading — the defaults) over 4 gloo
ranks, against plain DCP and against torch.save / torch.load of the same bytes from one process; 1 GB
(``--quick``: 64 MB). Goals: load with default verification >= 1x torch.load, save >= 0.9x torch.save; the
table says whether they were met, and the machine's load average before and after. Both sections merge their
results into ``benchmarks/results/checkpoint.json``.

Section ``async_save`` (``--part async``): the time the training loop (``megashard.train.loop.train``) is blocked
per checkpoint with ``checkpoint.async: true`` against the synchronous save, on the default job's GPT scaled up
(hidden 768, 6 layers: ~0.5 GB per checkpoint with the AdamW moments), 4 gloo ranks (tp2 x dp_shard2); also the
training time with no checkpoints, sync and async ones. Goal: blocked <= 10% of the synchronous save
(``--quick``: hidden 256, 2 layers).

Usage: ``python benchmarks/checkpoint.py [--quick] [--only distribution] [--part io] [--part async]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from megashard.checkpoint.distribution import distribute_shards_reference, distribute_shards_to_ranks

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
    """Best wall time and best CPU time of ``repeat`` runs (CPU time is steadier on a shared machine)."""
    best, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu, result


def _max_over_mean(assign, sizes, num_ranks) -> float:
    loads = [0] * num_ranks
    for k, r in assign.items():
        loads[r] += sizes[k]
    return max(loads) / (sum(loads) / num_ranks)


def bench_distribution(args) -> Dict:
    rows: List[Dict] = []
    for regime in REGIMES:
        s2r, s2s = make_case(regime, args.shards, args.ranks)
        t_ms, c_ms, got = _best_time(lambda: distribute_shards_to_ranks(s2r, s2s, args.ranks, set()), args.repeat)
        t_ref, c_ref, ref = _best_time(lambda: distribute_shards_reference(s2r, s2s, args.ranks, set()), args.ref_repeat)
        row = {
            "regime": regime, "shards": args.shards, "ranks": args.ranks,
            "megashard_s": t_ms, "reference_s": t_ref, "speedup_vs_reference": t_ref / t_ms,
            "megashard_cpu_s": c_ms, "reference_cpu_s": c_ref,
            "max_over_mean_load": _max_over_mean(got, s2s, args.ranks), "equal_to_reference": got == ref,
        }
        if not args.skip_megatron_shape:
            t_meg, c_meg, meg = _best_time(lambda: megatron_shape(s2r, s2s, args.ranks, set()), args.megatron_repeat)
            row.update(megatron_shape_s=t_meg, megatron_shape_cpu_s=c_meg, speedup_vs_megatron_shape=t_meg / t_ms,
                       speedup_vs_megatron_shape_cpu=c_meg / c_ms, equal_to_megatron_shape=got == meg)
        if args.shards == 100_000 and args.ranks == 64:
            row["speedup_vs_megatron_anchor"] = MEGATRON_ANCHOR_S[regime] / t_ms
        rows.append(row)

    print(f"\ndistribute_shards_to_ranks: {args.shards:,} shards x {args.ranks} ranks (best of {args.repeat} / "
          f"{args.ref_repeat} / {args.megatron_repeat}; load average {os.getloadavg()[0]:.1f})")
    head = f"{'holders':>8} {'megashard':>10} {'cpu':>7} {'reference':>10} {'x ref':>6}"
    if not args.skip_megatron_shape:
        head += f" {'megatron-shape':>15} {'x meg':>6} {'x meg cpu':>9}"
    head += f" {'max/mean':>9} {'equal':>6}"
    print(head)
    for r in rows:
        line = (f"{r['regime']:>8} {r['megashard_s']:>9.3f}s {r['megashard_cpu_s']:>6.3f}s"
                f" {r['reference_s']:>9.3f}s {r['speedup_vs_reference']:>5.1f}x")
        equal = r["equal_to_reference"]
        if "megatron_shape_s" in r:
            line += (f" {r['megatron_shape_s']:>14.3f}s {r['speedup_vs_megatron_shape']:>5.1f}x"
                     f" {r['speedup_vs_megatron_shape_cpu']:>8.1f}x")
            equal = equal and r["equal_to_megatron_shape"]
        line += f" {r['max_over_mean_load']:>9.6f} {str(equal):>6}"
        print(line)
    if all("speedup_vs_megatron_anchor" in r for r in rows):
        print("vs Megatron-LM anchor timings (0.70 / 2.75 / 2.29 s): "
              + ", ".join(f"{r['regime']} {r['speedup_vs_megatron_anchor']:.1f}x" for r in rows))
    if not all(r["equal_to_reference"] and r.get("equal_to_megatron_shape", True) for r in rows):
        raise SystemExit("megashard's assignment differs from a baseline")
    return {"rows": rows, "repeat": [args.repeat, args.ref_repeat, args.megatron_repeat],
            "megatron_anchor_s": MEGATRON_ANCHOR_S}


# ---------------------------------------------------------------------------------------------- save_load
# Save/load throughput of megashard.checkpoint (DCP + marker + checksums + uneven FSDP shards) on gloo ranks,
# against plain DCP and torch.save / torch.load of the same bytes from one process (selected by --part io).
_IO_TENSORS = 16  # tensors in the state; rows chosen so that FSDP's chunks are uneven
_IO_COLS = 1024
IO_GOALS = {"load_speed_vs_torch_load": 1.0, "save_speed_vs_torch_save": 0.9}  # megashard with default verification


def _io_rows(total_bytes: int, world: int) -> int:
    rows = max(total_bytes // (4 * _IO_COLS * _IO_TENSORS), world)
    return rows + 1 if rows % world == 0 else rows  # torch.chunk shards of unequal length


def _io_state(rank: int, world: int, total_bytes: int, mesh, empty: bool = False) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    rows = _io_rows(total_bytes, world)
    q = -(-rows // world)
    local_rows = max(0, min(q, rows - q * rank))
    g = torch.Generator().manual_seed(rank)
    out = {}
    for i in range(_IO_TENSORS):
        local = torch.empty(local_rows, _IO_COLS)
        if not empty:
            local.uniform_(generator=g)
        out[f"w{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([rows, _IO_COLS]),
                                          stride=(_IO_COLS, 1))
    return out


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _io_worker(rank: int, world: int, init_file: str, total_bytes: int, tmp: str, repeat: int, checksums, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import shutil
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import megashard
    from megashard import checkpoint
    from megashard.config import ParallelConfig

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        st = megashard.initialize(ParallelConfig())  # dp = world: FSDP-style Shard(0) over every rank
        mesh = st.fully_shard_mesh
        sd = _io_state(rank, world, total_bytes, mesh)
        target = _io_state(rank, world, total_bytes, mesh, empty=True)
        nbytes = sum(int(t.numel()) * 4 for t in sd.values())  # global bytes
        times: Dict[str, List[float]] = {}

        def check_equal() -> None:
            for k in sd:
                if not torch.equal(sd[k].to_local(), target[k].to_local()):
                    raise SystemExit(f"rank {rank}: {k} loaded wrong")
                target[k].to_local().zero_()

        variants = [(f"megashard ({a})", a, True) for a in checksums] + [("megashard (crc32, no verify)", "crc32", False)]
        for i in range(repeat):
            for name, algo, verify in variants:
                root = os.path.join(tmp, "megashard")
                times.setdefault(f"{name} save", []).append(
                    _timed(lambda: checkpoint.save(root, i, state_dict=sd, checksum=algo)))
                times.setdefault(f"{name} load", []).append(
                    _timed(lambda: checkpoint.load(root, state_dict=target, verify=verify)))
                check_equal()
                if rank == 0:  # outside the timed region
                    shutil.rmtree(root, ignore_errors=True)
            plain = os.path.join(tmp, "dcp", str(i))
            times.setdefault("plain DCP save", []).append(_timed(lambda: dcp.save(sd, checkpoint_id=plain)))
            times.setdefault("plain DCP load", []).append(_timed(lambda: dcp.load(target, checkpoint_id=plain)))
            check_equal()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(plain, ignore_errors=True)
                # Baseline: the same bytes as full tensors, torch.save / torch.load from one process.
                full = {k: torch.empty(t.shape) for k, t in sd.items()}
                for t in full.values():
                    t.uniform_()
                path = os.path.join(tmp, "full.pt")

                def save_full() -> None:
                    with open(path, "wb") as f:
                        torch.save(full, f)
                        f.flush()
                        os.fsync(f.fileno())

                t0 = time.perf_counter()
                save_full()
                times.setdefault("torch.save save", []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                loaded = torch.load(path, weights_only=True)
                times.setdefault("torch.save load", []).append(time.perf_counter() - t0)
                del loaded, full
                os.remove(path)
            dist.barrier()
        if rank == 0:
            q.put({"bytes": nbytes, "times": times})
        megashard.destroy()
    except BaseException as e:  # noqa: BLE001 - report instead of hanging the parent
        q.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def bench_save_load(args) -> Dict:
    import multiprocessing as mp
    import shutil
    import tempfile

    total = (args.io_mb if args.io_mb else (64 if args.quick else 1024)) << 20
    world, repeat = args.io_ranks, (1 if args.quick else args.io_repeat)
    checksums = ["crc32"] if args.quick else ["crc32", "sha256"]
    tmp = tempfile.mkdtemp(prefix="megashard-bench-io-", dir=args.io_dir)
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_io_worker, args=(r, world, os.path.join(tmp, "rdv"), total, tmp, repeat, checksums, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if "error" in res:
        raise SystemExit(res["error"])
    load_after = os.getloadavg()
    nbytes = res["bytes"]
    best = {k: min(v) for k, v in res["times"].items()}
    methods = sorted({k.rsplit(" ", 1)[0] for k in best}, key=lambda m: (m.startswith("torch"), m.startswith("plain"), m))
    base_save, base_load = best["torch.save save"], best["torch.save load"]
    rows = []
    for m in methods:
        s, l = best[f"{m} save"], best[f"{m} load"]
        rows.append({"method": m, "save_s": s, "load_s": l, "save_MBps": nbytes / s / 1e6, "load_MBps": nbytes / l / 1e6,
                     "save_speed_vs_torch_save": base_save / s, "load_speed_vs_torch_load": base_load / l})
    print(f"\ncheckpoint save/load: {nbytes / 1e6:.0f} MB of float32 ({_IO_TENSORS} uneven FSDP-sharded tensors) over "
          f"{world} gloo ranks vs torch.save/torch.load from one process (best of {repeat}; files fsynced; loads from "
          f"page cache; {os.cpu_count()} cpus, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    print(f"{'method':<29} {'save s':>8} {'save MB/s':>10} {'x torch':>8} {'load s':>8} {'load MB/s':>10} {'x torch':>8}")
    for r in rows:
        print(f"{r['method']:<29} {r['save_s']:>8.2f} {r['save_MBps']:>10.0f} {r['save_speed_vs_torch_save']:>7.2f}x "
              f"{r['load_s']:>8.2f} {r['load_MBps']:>10.0f} {r['load_speed_vs_torch_load']:>7.2f}x")
    default = next(r for r in rows if r["method"] == "megashard (crc32)")
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    medians = {"load_speed_vs_torch_load": med["torch.save load"] / med["megashard (crc32) load"],
               "save_speed_vs_torch_save": med["torch.save save"] / med["megashard (crc32) save"]}
    goals = {k: {"goal": g, "got": default[k], "median_ratio": medians[k], "met": default[k] >= g}
             for k, g in IO_GOALS.items()}
    for k, g in goals.items():
        print(f"goal {k.replace('_', ' ')} >= {g['goal']}x (megashard, default verification): best {g['got']:.2f}x, "
              f"median {g['median_ratio']:.2f}x: {'met' if g['met'] else 'NOT met'}"
              + (" (the goals are for 1 GB; this run is smaller, so fixed costs weigh more)" if total < (1 << 30) else ""))
    return {"bytes": nbytes, "ranks": world, "repeat": repeat, "rows": rows, "goals": goals,
            "loadavg_before": load_before, "loadavg_after": load_after, "all_times_s": res["times"]}


# ---------------------------------------------------------------------------------------------- async_save
ASYNC_GOAL = 0.10  # blocked time of an async checkpoint <= 10% of the synchronous save's


def _async_job(out_dir: str, mode: str, args) -> list:
    """Overrides of configs/default.yaml: the default job's model scaled up (hidden, layers), 4 ranks tp2 x dp_shard2."""
    ckpt = {"none": ["checkpoint.interval=0", "checkpoint.save_final=false"],
            "sync": [f"checkpoint.interval={args.async_interval}", "checkpoint.async=false"],
            "async": [f"checkpoint.interval={args.async_interval}", "checkpoint.async=true"]}[mode]
    return [f"model.hidden={args.async_hidden}", f"model.heads={args.async_hidden // 64}",
            f"model.layers={args.async_layers}", "model.seq_len=64", "train.global_batch=8",
            f"train.steps={args.async_steps}", "train.progress=false", "train.plot=false", "train.resume=false",
            "checkpoint.keep=1", f"train.out_dir={out_dir}/{mode}", "optim.warmup_steps=1", "parallel.tp=2",
            "parallel.dp_shard=2", f"launch.nproc_per_node={args.async_ranks}"] + ckpt


def _async_worker(rank: int, world: int, init_file: str, tmp: str, args, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import contextlib
    import io
    import warnings

    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        for mode in ("none", "sync", "async", "none2"):
            job = JobConfig.from_yaml(os.path.join(os.path.dirname(os.path.dirname(RESULTS)), "..", "configs", "default.yaml"),
                                      _async_job(tmp, mode.rstrip("2"), args))
            dist.barrier()
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):
                r = train(job)
            out[mode] = {"wall_s": time.perf_counter() - t0, "train_s": r.seconds,
                         "blocked_s": {str(k): v for k, v in r.checkpoint_blocked_s.items()},
                         "end_wait_s": r.checkpoint_end_wait_s}
        if rank == 0:
            ckpt = os.path.join(tmp, "sync", "checkpoints")
            nbytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ckpt) for f in fs)
            q.put({"runs": out, "checkpoint_bytes": nbytes})
    except BaseException as e:  # noqa: BLE001 - report instead of hanging the parent
        q.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def bench_async_save(args) -> Dict:
    """Time the training loop is blocked per checkpoint: checkpoint.async against the synchronous save."""
    import multiprocessing as mp
    import shutil
    import tempfile

    world = args.async_ranks
    tmp = tempfile.mkdtemp(prefix="megashard-bench-async-", dir=args.io_dir)
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_async_worker, args=(r, world, os.path.join(tmp, "rdv"), tmp, args, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if "error" in res:
        raise SystemExit(res["error"])
    load_after = os.getloadavg()
    runs = res["runs"]
    steps = sorted(runs["sync"]["blocked_s"], key=int)
    sync = [runs["sync"]["blocked_s"][k] for k in steps]
    asyn = [runs["async"]["blocked_s"][k] for k in steps]
    mid = steps[:-1] or steps  # checkpoints during training (the last one is followed by the end's wait)
    ratio = statistics.median(runs["async"]["blocked_s"][k] for k in mid) / statistics.median(
        runs["sync"]["blocked_s"][k] for k in mid)
    none_s = min(runs["none"]["train_s"], runs["none2"]["train_s"])
    print(f"\ncheckpoint blocking: the default job's GPT scaled to hidden={args.async_hidden}, layers={args.async_layers} "
          f"({res['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint with AdamW moments), {world} gloo ranks (tp2 x dp_shard2), "
          f"{args.async_steps} steps, a checkpoint every {args.async_interval} (files fsynced; {os.cpu_count()} cpus, "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    print(f"{'step':>6} {'sync save s':>12} {'async blocked s':>16} {'async / sync':>13}")
    for k, a, b in zip(steps, sync, asyn):
        print(f"{k:>6} {a:>12.3f} {b:>16.3f} {b / a:>12.1%}")
    print(f"end of training waits for the last background save: {runs['async']['end_wait_s']:.2f} s")
    print(f"training time (steps only): no checkpoints {none_s:.1f} s, sync {runs['sync']['train_s']:.1f} s, "
          f"async {runs['async']['train_s']:.1f} s (+ end wait {runs['async']['end_wait_s']:.1f} s)")
    met = ratio <= ASYNC_GOAL
    print(f"goal: async blocked time <= {ASYNC_GOAL:.0%} of the sync save (median over the checkpoints during "
          f"training): {ratio:.1%}: {'met' if met else 'NOT met'}")
    return {"ranks": world, "hidden": args.async_hidden, "layers": args.async_layers, "steps": args.async_steps,
            "interval": args.async_interval, "checkpoint_bytes": res["checkpoint_bytes"], "runs": runs,
            "sync_save_s": dict(zip(steps, sync)), "async_blocked_s": dict(zip(steps, asyn)),
            "goal": {"async_blocked_over_sync_save": ASYNC_GOAL, "got": ratio, "met": met},
            "loadavg_before": load_before, "loadavg_after": load_after}


# name -> function(args) -> JSON-able dict. The save/load-throughput section goes here as "save_load".
SECTIONS: Dict[str, Callable] = {"distribution": bench_distribution, "save_load": bench_save_load,
                                 "async_save": bench_async_save}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10,000 shards, one repeat (a smoke run)")
    p.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    p.add_argument("--shards", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5, help="best-of repeats for megashard")
    p.add_argument("--ref-repeat", type=int, default=2, help="best-of repeats for the reference")
    p.add_argument("--megatron-repeat", type=int, default=1, help="repeats of the slow megatron-shape baseline")
    p.add_argument("--skip-megatron-shape", action="store_true")
    p.add_argument("--json", default=RESULTS)
    p.add_argument("--part", choices=("io", "distribution", "async"), action="append",
                   help="io = the save_load section, distribution = the distribution section, async = async_save")
    p.add_argument("--io-mb", type=int, default=None, help="save_load: state size in MB (default 1024; --quick 64)")
    p.add_argument("--io-ranks", type=int, default=4, help="save_load: gloo ranks")
    p.add_argument("--io-repeat", type=int, default=3, help="save_load: best-of repeats")
    p.add_argument("--io-dir", default=None, help="save_load: where to write (default: the system temp dir)")
    p.add_argument("--async-hidden", type=int, default=768, help="async_save: model.hidden (heads = hidden / 64)")
    p.add_argument("--async-layers", type=int, default=6, help="async_save: model.layers")
    p.add_argument("--async-steps", type=int, default=9, help="async_save: training steps per run")
    p.add_argument("--async-interval", type=int, default=3, help="async_save: steps between checkpoints")
    p.add_argument("--async-ranks", type=int, default=4, help="async_save: gloo ranks (tp2 x dp_shard)")
    args = p.parse_args(argv)
    if args.part:
        args.only = (args.only or []) + [{"io": "save_load", "async": "async_save"}.get(x, x) for x in args.part]
    if args.quick:
        args.shards, args.repeat, args.ref_repeat = 10_000, 1, 1
        args.async_hidden, args.async_layers = 256, 2
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
