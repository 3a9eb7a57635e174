"""Uneven-DTensor benchmark: gather throughput and state-dict metadata time, 4 gloo ranks (CPU).

Section ``gather`` (per full-tensor size, 1 MB .. 256 MB; ``--quick``: .. 16 MB), float32 rows of
1024 elements, bytes/s = full-tensor bytes / wall time, barrier to barrier; variants interleaved
round-robin, median of ``max(repeat, 16 * repeat / size_mb)`` runs:

* ``cold``         ``gather_uneven_dtensor_to_full_tensor`` on a fresh uneven Shard(0) DTensor
                     (per-rank rows 31/19/27/23 %), layout unknown: up to ~12 MB one round that
                     carries metadata and data together, above that a metadata all-gather first;
* ``warm``           the same DTensor gathered again: its layout was attached by the first gather
                     (or by ``update_uneven_dtensor_chunk_metadata``), so only data moves;
* ``full_tensor``    ``DTensor.full_tensor()`` on an even DTensor of the same size (the baseline);
* ``raw``            one raw ``all_gather_into_tensor`` (``all_gather_single`` where it exists) of
                     the even shards into a fresh output (the floor of any gather).

Ratios are throughput over ``full_tensor``'s (goal >= 0.8): ``warm`` is the steady state, ``cold``
pays for learning the layout (a metadata round of a few ms on gloo where the tensor is too big to
send eagerly).

Section ``metadata``: ``preprocess_state_dict_for_uneven_dtensor`` on a state dict of 1,000 uneven
DTensors (random per-rank lengths, zeros included) on a 1-D (4) and a 2-D (2, 2) mesh, against the
per-tensor way (``gather_and_compute_chunk_metadata`` per tensor: one exchange per tensor).

Usage: ``python benchmarks/uneven_gather.py [--quick] [--repeat N]``; writes
``benchmarks/results/uneven_gather.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "uneven_gather.json")
WORLD = 4
COLS = 1024  # float32 elements per row: 4 KiB rows
FRACTIONS = (0.31, 0.19, 0.27, 0.23)


def _timed(fns: dict, repeat: int) -> dict:
    """Median wall time (s) of every callable in ``fns``, barrier to barrier, interleaved round-robin
    so that load from other processes on the machine hits all variants alike."""
    import torch.distributed as dist

    for fn in fns.values():  # warm-up
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _raw_all_gather(out, inp):
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.all_gather_into_tensor(out, inp)


def _gather_section(rank, sizes_mb, repeat):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor, update_uneven_dtensor_chunk_metadata

    mesh = init_device_mesh("cpu", (WORLD,))
    rows_out = []
    for mb in sizes_mb:
        rows = mb * 2**20 // (4 * COLS)
        parts = [int(rows * f) for f in FRACTIONS]
        parts[-1] = rows - sum(parts[:-1])
        local = torch.full((parts[rank], COLS), float(rank))

        def fresh():
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, COLS), stride=(COLS, 1))

        warm = fresh()
        update_uneven_dtensor_chunk_metadata(warm)
        even_local = torch.full((rows // WORLD, COLS), float(rank))
        even = DTensor.from_local(even_local, mesh, [Shard(0)], run_check=False,
                                  shape=(rows // WORLD * WORLD, COLS), stride=(COLS, 1))
        nbytes = rows * COLS * 4
        reps = max(repeat, int(repeat * 16 / mb))  # small sizes are noisier and cheap: more repetitions
        t = _timed({
            "cold": lambda: gather_uneven_dtensor_to_full_tensor(fresh()),
            "warm": lambda: gather_uneven_dtensor_to_full_tensor(warm),
            "full_tensor": lambda: even.full_tensor(),
            "raw": lambda: _raw_all_gather(torch.empty(rows // WORLD * WORLD, COLS), even_local),
        }, reps)
        full = gather_uneven_dtensor_to_full_tensor(fresh()).to_local()  # check what was timed: rows in place
        bounds = [0] + [sum(parts[: i + 1]) for i in range(WORLD)]
        assert all(bool((full[bounds[r]:bounds[r + 1]] == r).all()) for r in range(WORLD))
        del full
        rows_out.append({"size_mb": mb, "bytes": nbytes, "parts": parts,
                         **{f"{k}_s": v for k, v in t.items()},
                         **{f"{k}_GBps": nbytes / v / 1e9 for k, v in t.items()},
                         "ratio_warm_vs_full_tensor": t["full_tensor"] / t["warm"],
                         "ratio_cold_vs_full_tensor": t["full_tensor"] / t["cold"],
                         "ratio_warm_vs_raw": t["raw"] / t["warm"]})
    return rows_out


def _metadata_section(rank, n_tensors, repeat):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megashard.tensors.uneven import gather_and_compute_chunk_metadata, preprocess_state_dict_for_uneven_dtensor

    out = []
    for mesh_shape, placements in (((WORLD,), [Shard(0)]), ((2, 2), [Shard(0), Shard(1)])):
        mesh = init_device_mesh("cpu", mesh_shape)
        coord = mesh.get_coordinate()
        sd = {}
        for k in range(n_tensors):
            rng = random.Random(k)
            shape = [rng.randint(0, 40), rng.randint(1, 40)]
            local = []
            for d in range(2):  # dim d is cut by mesh axis d (if any) into random pieces
                if d < len(mesh_shape):
                    n = mesh_shape[d]
                    cuts = sorted(rng.randint(0, shape[d]) for _ in range(n - 1))
                    b = [0] + cuts + [shape[d]]
                    local.append(b[coord[d] + 1] - b[coord[d]])
                else:
                    local.append(shape[d])
            sd[f"layer{k}.weight"] = DTensor.from_local(torch.zeros(local), mesh, placements[: len(mesh_shape)],
                                                        run_check=False, shape=tuple(shape), stride=(shape[1], 1))
        t = _timed({"batched": lambda: preprocess_state_dict_for_uneven_dtensor(sd),
                    "per_tensor": lambda: [gather_and_compute_chunk_metadata(v) for v in sd.values()]}, repeat)
        t_batched, t_per_tensor = t["batched"], t["per_tensor"]
        out.append({"mesh": list(mesh_shape), "tensors": n_tensors, "batched_s": t_batched,
                    "per_tensor_s": t_per_tensor, "speedup": t_per_tensor / t_batched})
    return out


def _worker(rank, init_file, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        res = {"gather": _gather_section(rank, args["sizes_mb"], args["repeat"]),
               "metadata": _metadata_section(rank, 1000, args["repeat"])}
        if rank == 0:
            queue.put(res)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 16 MB and fewer repeats")
    ap.add_argument("--repeat", type=int, default=None, help="timed repetitions per case (median reported)")
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args(argv)
    sizes = [1, 4, 16] if a.quick else [1, 4, 16, 64, 256]
    repeat = a.repeat or (3 if a.quick else 5)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=_worker, args=(r, init_file, {"sizes_mb": sizes, "repeat": repeat}, queue))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        res = None
        while res is None:  # fail fast if a rank dies instead of waiting for the deadline
            try:
                res = queue.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    raise SystemExit("a benchmark rank failed; see its traceback above")
        for p in procs:
            p.join()
    res["config"] = {"world": WORLD, "backend": "gloo", "torch": torch.__version__, "python": platform.python_version(),
                     "cpus": os.cpu_count(), "repeat": repeat, "repeat_rule": "max(repeat, 16 * repeat / size_mb) per size", "quick": a.quick}
    print(f"gather, {WORLD} gloo ranks, GB/s (median, >= {repeat} interleaved runs); ratios = megashard / even full_tensor()")
    print(f"{'size':>7} {'warm':>8} {'cold':>8} {'full_tensor':>11} {'raw':>8} {'warm/ft':>8} {'cold/ft':>8}")
    for r in res["gather"]:
        print(f"{r['size_mb']:>5}MB {r['warm_GBps']:8.3f} {r['cold_GBps']:8.3f} {r['full_tensor_GBps']:11.3f} "
              f"{r['raw_GBps']:8.3f} {r['ratio_warm_vs_full_tensor']:8.2f} {r['ratio_cold_vs_full_tensor']:8.2f}")
    print("\nmetadata for a state dict of 1,000 uneven DTensors")
    print(f"{'mesh':>8} {'batched':>9} {'per-tensor':>11} {'speed-up':>9}")
    for r in res["metadata"]:
        print(f"{str(tuple(r['mesh'])):>8} {r['batched_s'] * 1e3:7.1f}ms {r['per_tensor_s'] * 1e3:9.1f}ms {r['speedup']:8.1f}x")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\nwrote {a.out}")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
