"""Pipeline step time and bubble, and MoE folding throughput, on this machine (gloo, CPU processes).

Pipeline: an 8-block GPT (hidden 128, seq 64, vocab 256), global batch 32, 4 processes in every layout —
``pp=1`` (dp_shard=4, the baseline), ``pp=2`` (× dp_shard=2) and ``pp=4`` with ``1f1b`` and ``interleaved_1f1b``
(vpp=2), 8 microbatches. Reported: the median step time (forward, backward, AdamW; barrier to barrier), its
ratio to pp=1, and the measured bubble next to the theoretical ``(pp-1)/(m+pp-1)`` (interleaved:
``(pp-1)/(vpp·m+pp-1)``). The measured bubble is ``1 - busy/step``, where ``busy`` is the time this rank's stage
modules take for all microbatches' forward and backward run back to back without the schedule (the slowest
rank's value).

MoE: ``configs/moe-folding.yaml`` (8 processes: tp=2 · dp_shard=4 for attention, ep=4 · expt_dp=2 for the
experts, all-to-all dispatch) against the same model with its experts replicated (ep=1, expt_dp=8): tokens/s.

    python benchmarks/pipeline.py [--quick]

Prints tables and writes ``benchmarks/results/pipeline.json``. Four helpers share two cores here: the load is
printed with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "pipeline.json")
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
MB = 8
MODEL = ["model.layers=8", "model.hidden=128", "model.heads=4", "train.global_batch=32", "model.dropout=0.0",
         "train.dtype=float32", "parallel.tp=1", "parallel.dp_shard=-1", "optim.warmup_steps=0"]
LAYOUTS = {
    "pp=1": [],
    "pp=2 1f1b": ["parallel.pp=2", f"train.microbatches={MB}"],
    "pp=2 interleaved": ["parallel.pp=2", "parallel.vpp=2", "train.pipeline_schedule=interleaved_1f1b",
                         f"train.microbatches={MB}"],
    "pp=4 1f1b": ["parallel.pp=4", f"train.microbatches={MB}"],
    "pp=4 interleaved": ["parallel.pp=4", "parallel.vpp=2", "train.pipeline_schedule=interleaved_1f1b",
                         f"train.microbatches={MB}"],
}


def _pipeline_worker(rank: int, world: int, overrides: list[str], steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import megashard.state as ms
    from megashard.state.devices import current_device
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches
    from megashard.train.loop import _forward_backward, build

    job = JobConfig.from_yaml(DEFAULT, MODEL + overrides + [f"launch.nproc_per_node={world}"])
    state = ms.initialize(job.parallel)
    job.validate(sizes=state.sizes)
    model, opt = build(job, state)
    data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                   dp_size=state.size("dp"), device=current_device(state.device_type))
    pipe = None
    if state.size("pp") > 1:
        from megashard.models.pipeline import Pipeline

        pipe = Pipeline(job, state, model)
    times = []
    for step in range(steps):
        x, y = data.batch(step)
        dist.barrier()
        t0 = time.perf_counter()
        if pipe is not None:
            pipe.step(x, y, step)
        else:
            _forward_backward(model, x, y, 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    busy = 0.0
    if pipe is not None:  # this rank's stages, every microbatch, back to back, no schedule, no p2p
        mb = job.microbatches(state.size("pp"))
        x, y = data.batch(0)
        xs, ys = x.chunk(mb), y.chunk(mb)
        for _ in range(2):  # the second round is timed
            t0 = time.perf_counter()
            for part in model.parts:
                for i in range(mb):
                    if part.stage.is_first:
                        inp = xs[i]
                    else:
                        inp = torch.randn(xs[i].shape + (job.model.hidden,), requires_grad=True)
                    o = part(inp, ys[i]) if part.stage.is_last else part(inp)
                    (o if o.dim() == 0 else o.sum()).backward()
            busy = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
    b = torch.tensor([busy])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "busy": float(b)}, f)
    ms.destroy()


def _moe_worker(rank: int, world: int, overrides: list[str], steps: int, out: str) -> None:
    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "moe-folding.yaml"),
                              overrides + [f"train.steps={steps}", "checkpoint.interval=0", "train.progress=false",
                                           "checkpoint.save_final=false", "train.plot=false", "train.resume=false",
                                           f"train.out_dir={os.path.dirname(out)}/moe-run"])
    r = train(job)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens_per_s": r.tokens_per_s, "seconds": r.seconds}, f)


def _spawn(fn, world: int, overrides: list[str], steps: int) -> dict:
    from tests._dist import spawn_checks

    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)

    res = spawn_checks([_Bound(fn, overrides, steps, out)], world_size=world, timeout=1200)
    if res.errors or res.hung:
        raise SystemExit(f"benchmark run {overrides} failed: {res.errors or res.hung}")
    with open(out) as f:
        return json.load(f)


class _Bound:
    """A picklable check: ``fn(rank, world, overrides, steps, out)``."""

    def __init__(self, fn, overrides, steps, out):  # noqa: ANN001
        self.fn, self.overrides, self.steps, self.out = fn, overrides, steps, out
        self.__name__ = fn.__name__

    def __call__(self, rank: int, world: int) -> None:
        self.fn(rank, world, self.overrides, self.steps, self.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    args = ap.parse_args()
    steps = 4 if args.quick else 12
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load0 = os.getloadavg()
    rows = []
    base = None
    for name, ov in LAYOUTS.items():
        r = _spawn(_pipeline_worker, 4, ov, steps)
        t = statistics.median(r["times"][2:])  # the first steps warm up (allocations, p2p set-up)
        pp = 4 if "pp=4" in name else 2 if "pp=2" in name else 1
        vpp = 2 if "interleaved" in name else 1
        theory = (pp - 1) / (vpp * MB + pp - 1) if pp > 1 else 0.0
        measured = max(0.0, 1 - r["busy"] / t) if pp > 1 else 0.0
        base = t if base is None else base
        rows.append({"layout": name, "step_s": t, "vs_pp1": t / base, "bubble_measured": measured,
                     "bubble_theory": theory})
        print(f"  {name:<18} {t * 1e3:8.1f} ms", file=sys.stderr, flush=True)
    moe = {}
    for name, ov in (("folding ep=4", []), ("replicated ep=1", ["parallel.ep=1"])):
        moe[name] = _spawn(_moe_worker, 8, ov, 6 if args.quick else 12)["tokens_per_s"]
    load1 = os.getloadavg()
    print(f"\npipeline step time, 4 gloo processes, global batch 32, {MB} microbatches "
          f"(load {load0[0]:.1f} → {load1[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'layout':<18} {'step ms':>8} {'vs pp=1':>8} {'bubble':>8} {'theory':>8}")
    for r in rows:
        print(f"{r['layout']:<18} {r['step_s'] * 1e3:8.1f} {r['vs_pp1']:8.2f} {r['bubble_measured']:8.2f} "
              f"{r['bubble_theory']:8.2f}")
    ratio = moe["folding ep=4"] / moe["replicated ep=1"]
    print(f"\nMoE tokens/s, configs/moe-folding.yaml, 8 gloo processes")
    for k, v in moe.items():
        print(f"{k:<18} {v:10,.0f}")
    print(f"{'folding/replicated':<18} {ratio:10.2f}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"pipeline": rows, "moe_tokens_per_s": moe, "moe_ratio": ratio, "steps": steps,
                   "load_before": load0, "load_after": load1, "cpus": os.cpu_count(),
                   "machine": platform.machine(), "python": platform.python_version()}, f, indent=1)
    print(f"\nwrote {os.path.relpath(RESULTS, ROOT)}")


if __name__ == "__main__":
    main()
