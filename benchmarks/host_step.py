"""Host time of one training step of a launch-bound model: megashard before/after the issue-20 changes, and plain PyTorch.

One process (a world of one, gloo on CPU or nccl on CUDA), the default GPT shrunk until the arithmetic is negligible
(2 layers, hidden 32, 2 heads, seq 16, vocab 64, batch 4: the time is dispatch, hooks and Python), three sides
stepped alternately, each from the same initial weights on the same batches:

* **before**: megashard as it was: clipping one parameter at a time with a host sync
  (:func:`megashard.train.clip.clip_grad_norm_reference`), stock ``torch.optim.AdamW(foreach=True)`` on the
  DTensors, the data order computed per batch (``Split.train_direct``), every FSDP module resharded after forward;
* **after**: :func:`megashard.train.loop.build` as the job runs it (grouped foreach norms, :class:`LocalShardAdamW`,
  cached data order, torchtitan's reshard choice);
* **pytorch**: the same GPT from stock modules with ``torch.nn.utils`` clipping and ``AdamW(foreach=True)``, no FSDP
  (what ``benchmarks/gpu.py`` compares with on a GPU).

Per side the median of every phase (data, forward, backward, clip, optimizer) and of the whole step (phases timed
back to back; on CUDA each phase ends with a synchronize, so the sum is host + device time of that phase). The
before/after ratios per phase are the per-change numbers; after/pytorch is issue 20's goal (≤ 1.3 on the GPU).

    python benchmarks/host_step.py [--quick] [--device cpu|cuda] [--size tiny|default] [--out PATH]

Prints a table and writes ``benchmarks/results/host_step.json``. Note the load (printed) beside any number.
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
RESULTS = os.path.join(HERE, "results", "host_step.json")
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
SIZES = {
    "tiny": ["model.hidden=32", "model.heads=2", "model.seq_len=16", "model.vocab_size=64", "train.global_batch=4"],
    "default": [],
}
PHASES = ("data", "forward", "backward", "clip", "optimizer")


def _sides(job, device: torch.device):
    """{side: (step_fn(step) -> dict of phase seconds)}."""
    import megashard.state as ms
    from megashard.train.clip import clip_grad_norm, clip_grad_norm_reference
    from megashard.train.data import Batches
    from megashard.train.loop import build
    from megashard.train.optim import build_optimizer
    from train_step import clip_plain, init_like_megashard, plain_gpt

    state = ms.initialize(job.parallel)
    o = job.optim
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(model, opt, clip, data, autocast: bool = False):
        params = list(model.parameters())

        def step(i: int) -> dict:
            t = [time.perf_counter()]

            def mark() -> None:
                sync()
                t.append(time.perf_counter())

            x, y = data.batch(i)
            mark()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            mark()
            loss.backward()
            mark()
            clip(params)
            mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark()
            return dict(zip(PHASES, (b - a for a, b in zip(t, t[1:]))))

        return step

    def batches(direct: bool = False) -> Batches:
        b = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, device=device)
        if direct:
            for split in b.samples.splits:
                split.train = split.train_direct
        return b

    after_model, after_opt = build(job, state)
    before_model, _ = build(job, state)
    for m in before_model.modules():  # the old choice: every FSDP module frees its parameters after forward
        if hasattr(m, "set_reshard_after_forward"):
            m.set_reshard_after_forward(True, recurse=False)
    before_opt = build_optimizer(before_model, o, local_shards=False)
    plain = plain_gpt(job.model, torch.float32).to(device)
    init_like_megashard(plain, job.model, job.parallel.seed)
    plain_opt = torch.optim.AdamW([{"params": [p for p in plain.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
                                   {"params": [p for p in plain.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    bf16 = job.train.dtype == "bfloat16"
    return {
        "before": timed(before_model, before_opt, lambda ps: clip_grad_norm_reference(ps, o.grad_clip, state),
                        batches(direct=True)),
        "after": timed(after_model, after_opt, lambda ps: clip_grad_norm(ps, o.grad_clip, state), batches()),
        "pytorch": timed(plain, plain_opt, lambda ps: clip_plain(ps, o.grad_clip), batches(), autocast=bf16),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", default="tiny", choices=tuple(SIZES), help="tiny: launch-bound; default: configs/default.yaml")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    import torch.distributed as dist

    from megashard.train.config import JobConfig

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    steps, rounds, warmup = (5, 3, 3) if args.quick else (20, 10, 5)
    load = os.getloadavg()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = JobConfig.from_yaml(DEFAULT, ["launch.nproc_per_node=1", "parallel.tp=1", "parallel.dp_shard=1",
                                            f"parallel.device={args.device}", f"train.dtype={args.dtype}"]
                                  + SIZES[args.size])
        sides = _sides(job, device)
        times: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES + ("step",)} for s in sides}
        nxt = {s: 0 for s in sides}
        for s in sides:
            for _ in range(warmup):
                sides[s](nxt[s])
                nxt[s] += 1
        for r in range(rounds):  # alternating: a burst of load hits every side
            order = list(sides) if r % 2 == 0 else list(reversed(list(sides)))
            for s in order:
                for _ in range(steps):
                    ph = sides[s](nxt[s])
                    nxt[s] += 1
                    for k, v in ph.items():
                        times[s][k].append(v)
                    times[s]["step"].append(sum(ph.values()))
    finally:
        from megashard.state import end_distributed

        end_distributed()
    med = {s: {k: statistics.median(v) * 1e3 for k, v in t.items()} for s, t in times.items()}
    load_end = os.getloadavg()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"host step time ({args.size} model, {args.dtype}, {device.type}: {name}), torch {torch.__version__}, "
          f"load {load[0]:.2f} -> {load_end[0]:.2f}, {steps} steps x {rounds} rounds per side; median ms")
    print(f"| {'phase':<10} | {'before':>8} | {'after':>8} | {'pytorch':>8} | {'after/before':>12} | {'after/pytorch':>13} |")
    print(f"|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 15}|")
    for k in PHASES + ("step",):
        b, a, p = med["before"][k], med["after"][k], med["pytorch"][k]
        print(f"| {k:<10} | {b:>8.3f} | {a:>8.3f} | {p:>8.3f} | {a / b:>12.2f} | {a / p if p else float('nan'):>13.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"benchmark": "host_step", "device": name, "size": args.size, "dtype": args.dtype,
                   "torch": torch.__version__, "python": platform.python_version(), "loadavg_start": load,
                   "loadavg_end": load_end, "quick": args.quick, "steps_per_round": steps, "rounds": rounds,
                   "median_ms": med, "ratio_after_before": med["after"]["step"] / med["before"]["step"],
                   "ratio_after_pytorch": med["after"]["step"] / med["pytorch"]["step"]}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
