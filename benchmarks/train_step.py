"""Training-step time of the default job: megashard's Megatron-style layers against plain PyTorch TP.

Both sides train the same GPT (configs/default.yaml: 2 layers, hidden 64, 4 heads, vocab 256, seq 64,
global batch 16) on the same layout (tp=2 × dp_shard=2, 4 gloo processes) with FSDP2 and AdamW:

* **megashard**: :func:`megashard.train.loop.build` — Column/RowParallelLinear and VocabParallelEmbedding
  over megashard's ``tp`` group, vocabulary-parallel cross entropy, ``fully_shard`` on
  ``state.fully_shard_mesh``, megashard's gradient clipping;
* **PyTorch**: the same model written with ``nn.Linear``/``nn.Embedding``, parallelised with
  ``torch.distributed.tensor.parallel`` (``ColwiseParallel``/``RowwiseParallel``, ``loss_parallel``),
  ``fully_shard`` on the ``dp`` axis of ``init_device_mesh``, ``clip_grad_norm_`` on DTensors.

Both start from the same initial weights, so their first losses agree (reported). Timing alternates
the two sides round by round (a burst of load on the shared machine hits both) and reports the median
step time (barrier-to-barrier, so the slowest rank counts) and the ratio megashard / PyTorch.

    python benchmarks/train_step.py [--quick] [--steps N] [--rounds R]

Prints a table and writes ``benchmarks/results/train_step.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "train_step.json")
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
WORLD = 4


# ---------------------------------------------------------------------------------------------- plain PyTorch model
def plain_gpt(cfg, dtype):
    """The same GPT as megashard.models.gpt.model, from stock modules (parameter names identical)."""
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim = cfg.hidden // cfg.heads
            self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, dtype=dtype)
            self.proj = nn.Linear(cfg.hidden, cfg.hidden, dtype=dtype)

        def forward(self, x):
            b, s, _ = x.shape
            qkv = self.qkv(x)  # local tensor [b, s, 3·hidden/tp] under ColwiseParallel
            q, k, v = qkv.view(b, s, -1, 3, self.head_dim).unbind(dim=3)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(cfg.hidden, 4 * cfg.hidden, dtype=dtype)
            self.fc2 = nn.Linear(4 * cfg.hidden, cfg.hidden, dtype=dtype)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(cfg.hidden, dtype=dtype), Attention()
            self.ln2, self.mlp = nn.LayerNorm(cfg.hidden, dtype=dtype), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=dtype)
            self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, dtype=dtype))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden, dtype=dtype)
            self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, dtype=dtype)

        def forward(self, ids, targets):
            x = self.embed(ids) + self.pos[: ids.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))  # DTensor sharded on the vocabulary
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return GPT()


@torch.no_grad()
def init_like_megashard(model, cfg, seed: int) -> None:
    """The initial values megashard's init_parameters gives the same names (full tensors, before sharding)."""
    from megashard.models.layers import scaled_std
    from megashard.models.gpt.model import param_init_seed

    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("ln_f"):
            p.fill_(1.0)
        else:
            std = scaled_std(cfg.init_std, cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else cfg.init_std
            g = torch.Generator().manual_seed(param_init_seed(seed, name))
            p.copy_(torch.empty(p.shape, dtype=torch.float64).normal_(0.0, std, generator=g).to(p.dtype))


def clip_plain(params, max_norm: float) -> torch.Tensor:
    """Gradient clipping the stock way. ``clip_grad_norm_`` refuses DTensors on different meshes (here TP+FSDP
    weights on (dp, tp) and FSDP-only norms on dp), so the norm is taken per mesh and combined (as torchtitan)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total = torch.zeros(())
    for gs in by_mesh.values():
        n = torch.nn.utils.get_total_norm(gs, foreach=True)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        total = total + n.float() ** 2
    total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=True)
    return total


def build_plain(job):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    s = job.validate(WORLD)
    mesh = init_device_mesh("cpu", (s.dp, s.tp), mesh_dim_names=("dp", "tp"))
    model = plain_gpt(job.model, torch.float32)
    init_like_megashard(model, job.model, job.parallel.seed)
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    o = job.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    dp_rank = mesh["dp"].get_local_rank()

    def step(x, y):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = model(x, y)
            loss.backward()
        clip_plain(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()

    return step, dp_rank, s.dp


def build_megashard(job):
    import megashard.state as ms
    from megashard.train.loop import build, clip_grad_norm

    state = ms.initialize(job.parallel)
    model, opt = build(job, state)
    params = list(model.parameters())

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        clip_grad_norm(params, job.optim.grad_clip, state)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, state.rank_in("dp"), state.size("dp")


# ---------------------------------------------------------------------------------------------- worker
def _worker(rank: int, init_file: str, steps: int, rounds: int, warmup: int, out_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import logging

    import torch.distributed as dist

    # DTensor warns at every clip that two all-reduces run for a 2-D partial norm: expected here, not news.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _measure(rank, steps, rounds, warmup, out_q)
    except BaseException:  # report instead of leaving the other ranks waiting
        import traceback

        out_q.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})
        os._exit(1)
    dist.destroy_process_group()


def _measure(rank: int, steps: int, rounds: int, warmup: int, out_q) -> None:
    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.data import Batches

    job = JobConfig.from_yaml(DEFAULT, [f"launch.nproc_per_node={WORLD}"])
    sides = {"megashard": build_megashard(job), "pytorch": build_plain(job)}
    data = {k: Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=r, dp_size=n)
            for k, (_, r, n) in sides.items()}
    first = {}
    next_step = {k: 0 for k in sides}

    def run(side: str, n: int) -> float:
        fn = sides[side][0]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            loss = fn(*data[side].batch(next_step[side]))
            if next_step[side] == 0:
                lt = loss.clone()
                dist.all_reduce(lt)
                first[side] = float(lt) / WORLD  # every rank holds its dp slice's loss (tp ranks equal)
            next_step[side] += 1
        dist.barrier()
        return (time.perf_counter() - t0) / n

    for side in sides:
        run(side, warmup)
    times = {k: [] for k in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            times[side].append(run(side, steps))
    if rank == 0:
        out_q.put({"times": times, "first_loss": first})
    dist.barrier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10, quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per side (default 8, quick 2)")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 8)
    warmup = 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "rdzv"), steps, rounds, warmup, q)) for r in range(WORLD)]
        for p in procs:
            p.start()
        res = None
        deadline = time.monotonic() + 3600
        while res is None and time.monotonic() < deadline:
            try:
                res = q.get(timeout=2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    res = {"error": "a benchmark process died without a report"}
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if res is None or "error" in res:
        print(f"benchmark failed: {res['error'] if res else 'timed out'}", file=sys.stderr)
        return 1
    times, first = res["times"], res["first_loss"]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["megashard"] / med["pytorch"]
    ratios = [a / b for a, b in zip(times["megashard"], times["pytorch"])]
    print(f"train step of configs/default.yaml: {WORLD} gloo ranks, tp=2 × dp_shard=2, {steps} steps × {rounds} rounds")
    print(f"{'side':<12}{'median ms/step':>16}{'min':>10}{'max':>10}{'first loss':>14}")
    for k in ("megashard", "pytorch"):
        print(f"{k:<12}{med[k] * 1e3:>16.1f}{min(times[k]) * 1e3:>10.1f}{max(times[k]) * 1e3:>10.1f}{first[k]:>14.6f}")
    print(f"ratio megashard / pytorch: {ratio:.3f} (median of per-round ratios {statistics.median(ratios):.3f}; goal <= 1.05)")
    out = {
        "benchmark": "train_step", "world_size": WORLD, "layout": "tp=2 x dp_shard=2", "steps_per_round": steps,
        "rounds": rounds, "median_s": med, "rounds_s": times, "ratio": ratio, "median_round_ratio": statistics.median(ratios),
        "first_loss": first, "goal_ratio": 1.05, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
