"""megashard's CUDA paths on one GPU against plain PyTorch, in the same run:

* RNG ``fork()`` enter+exit on the CUDA generator (state tensors, and graph-safe generator states with
  ``use_cudagraphable_rng=True``) vs the raw generator get/set calls one fork makes;
* ``GlobalMemoryBuffer.get_tensor`` on reuse vs ``torch.empty`` through the CUDA caching allocator;
* train step of the default model (configs/default.yaml, tp=1, dp=1 on one GPU, NCCL world of one) in float32
  and bfloat16: megashard's layers + FSDP2 + clipping (:func:`megashard.train.loop.build`) vs the same GPT from
  stock modules with AdamW (bf16: autocast), same initial weights and batches; median ms/step, CUDA-synchronised.

Without CUDA it prints why it cannot run and exits 0 without writing results (tools/gpu-check.sh reports the skip).

    python benchmarks/gpu.py [--quick] [--out benchmarks/results/gpu.json]
    python benchmarks/gpu.py --model llama-1b [--steps 10] [--smoke]     # benchmarks/llama_1b.py

Prints a table and writes ``benchmarks/results/gpu.json`` (``llama_1b.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the sibling benchmarks, also when run as `python -m`
sys.path.insert(1, os.path.dirname(HERE))  # megashard from this checkout when it is not installed
RESULTS = os.path.join(HERE, "results", "gpu.json")
DEFAULT = os.path.join(os.path.dirname(HERE), "configs", "default.yaml")


def bench_graph_safe_fork(iters: int, repeats: int) -> list[dict]:
    """fork() of a use_cudagraphable_rng tracker vs the raw graph-safe get/set pairs it performs."""
    from per_rank_state import paired_ns

    from megashard.state.rng import RNGStatesTracker, _device_generator

    tracker = RNGStatesTracker(use_cudagraphable_rng=True)
    tracker.add("a", 1)
    gen = _device_generator(-1)
    stream = {"a": gen.clone_state()}

    def fork_loop(n: int) -> None:
        for _ in range(n):
            with tracker.fork("a"):
                pass

    def raw_loop(n: int) -> None:
        for _ in range(n):
            orig = gen.graphsafe_get_state()
            gen.graphsafe_set_state(stream["a"])
            stream["a"] = gen.graphsafe_get_state()
            gen.graphsafe_set_state(orig)

    ours, raw = paired_ns(fork_loop, raw_loop, iters, repeats)
    return [{"case": "graph-safe fork() enter+exit", "megashard_ns": ours, "baseline": "raw graphsafe get/set x2",
             "baseline_ns": raw}]


def _train_sides(dtype: str):
    """(megashard step, plain step, batches) for the default job on this GPU in ``dtype``."""
    from train_step import build_megashard, clip_plain, init_like_megashard, plain_gpt

    from megashard.train.config import JobConfig
    from megashard.train.data import Batches

    job = JobConfig.from_yaml(DEFAULT, ["launch.nproc_per_node=1", "parallel.tp=1", "parallel.dp_shard=1",
                                        "parallel.device=cuda", f"train.dtype={dtype}"])
    ours, _, _ = build_megashard(job)
    model = plain_gpt(job.model, torch.float32).cuda()
    init_like_megashard(model, job.model, job.parallel.seed)
    o = job.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)

    def plain(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(x, y)
        loss.backward()
        clip_plain(list(model.parameters()), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, device=torch.device("cuda"))
    return ours, plain, data


def bench_train(steps: int, rounds: int, warmup: int) -> list[dict]:
    import torch.distributed as dist

    import megashard

    rows = []
    for dtype in ("float32", "bfloat16"):
        ours, plain, data = _train_sides(dtype)
        sides = {"megashard": ours, "pytorch": plain}
        next_step = {k: 0 for k in sides}
        first: dict[str, float] = {}

        def run(side: str, n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                loss = sides[side](*data.batch(next_step[side]))
                if next_step[side] == 0:
                    first[side] = float(loss)
                next_step[side] += 1
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n

        for side in sides:
            run(side, warmup)
        times: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(rounds):  # alternating: a burst of load hits both sides
            for side in (sides if r % 2 == 0 else reversed(list(sides))):
                times[side].append(run(side, steps))
        med = {k: statistics.median(v) * 1e9 for k, v in times.items()}
        rows.append({"case": f"train step {dtype}", "megashard_ns": med["megashard"], "baseline": "plain PyTorch",
                     "baseline_ns": med["pytorch"], "first_loss": first})
        megashard.destroy()
        dist.barrier()
    return rows


def main(argv=None) -> int:
    from megashard.state.devices import cuda_unavailable_reason

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--out", default=None, help="JSON output path (default benchmarks/results/gpu.json, llama_1b.json)")
    ap.add_argument("--model", default="default", choices=("default", "llama-1b"),
                    help="default: the launch-bound tiny job and the state micro-benchmarks; llama-1b: throughput of a "
                         "0.95 B Llama, megashard compiled vs a compiled Hugging Face loop (benchmarks/llama_1b.py)")
    ap.add_argument("--smoke", action="store_true", help="llama-1b: a scaled-down model (runs on the CPU too)")
    ap.add_argument("--steps", type=int, default=10, help="llama-1b: timed steps per side")
    ap.add_argument("--warmup", type=int, default=3, help="llama-1b: untimed steps first (compilation)")
    ap.add_argument("--backend", default=None, help="llama-1b: torch.compile backend (default inductor; aot_eager on CPU)")
    ap.add_argument("--device", default=None, choices=(None, "cuda", "cpu"), help="llama-1b: default cuda if usable")
    args = ap.parse_args(argv)
    if args.model == "llama-1b":
        import llama_1b

        if not args.smoke and cuda_unavailable_reason():
            print(f"benchmarks/gpu.py: skipped: the full llama-1b size needs CUDA: {cuda_unavailable_reason()} "
                  "(--smoke runs a scaled-down model on the CPU)")
            return 0
        return llama_1b.main(args)
    args.out = args.out or RESULTS
    reason = cuda_unavailable_reason()
    if reason:
        print(f"benchmarks/gpu.py: skipped: needs CUDA: {reason}")
        return 0
    import torch.distributed as dist

    from per_rank_state import bench_buffer, bench_fork

    torch.cuda.set_device(0)
    iters, repeats = (500, 3) if args.quick else (5000, 15)
    steps, rounds = (3, 2) if args.quick else (10, 6)
    load = os.getloadavg()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = bench_fork(iters, repeats) + bench_graph_safe_fork(iters, repeats)
        rows += bench_buffer([4096, 1 << 22] if args.quick else [4096, 1 << 20, 1 << 24], iters // 4, repeats)
        rows += bench_train(steps, rounds, warmup=3)
    finally:
        from megashard.state import end_distributed

        end_distributed()
    for r in rows:
        r["ratio"] = r["megashard_ns"] / r["baseline_ns"]
    name = torch.cuda.get_device_name(0)
    print(f"GPU benchmarks on {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"load {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, {'quick' if args.quick else 'full'} run")
    print(f"| {'case':<30} | {'megashard':>12} | {'baseline':<24} | {'baseline':>12} | {'ratio':>6} |")
    print(f"|{'-' * 32}|{'-' * 14}|{'-' * 26}|{'-' * 14}|{'-' * 8}|")
    for r in rows:
        unit, div = ("ms", 1e6) if r["case"].startswith("train") else ("us", 1e3)
        print(f"| {r['case']:<30} | {r['megashard_ns'] / div:>9.3f} {unit} | {r['baseline']:<24} | "
              f"{r['baseline_ns'] / div:>9.3f} {unit} | {r['ratio']:>6.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"benchmark": "gpu", "device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                   "python": platform.python_version(), "loadavg": load, "quick": args.quick, "iters": iters,
                   "repeats": repeats, "train_steps_per_round": steps, "train_rounds": rounds, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
