"""What the hang doctor costs: the default job's train step, and one small all-reduce, with the doctor on and off;
then its straggler report on the same job, without and with one slowed rank.

Same processes, same model (configs/default.yaml: tp=2 × dp_shard=2 on 4 gloo ranks, megashard's layers, FSDP2,
AdamW, megashard's gradient clipping — :func:`megashard.train.loop.build`), the default group over a TCPStore as
under torchrun. Rounds alternate: doctor off, doctor on (``megashard.doctor.enable(state)``: every collective on a
megashard group or the default group counted and its entry written to the rank's shared-memory slot, the record
published to the store every ``--interval`` s — 0.5 s here, ten times the default job's rate — and rank 0 comparing
the ranks' waits each interval), then off again, so a burst of load on the shared machine hits both sides. Reported: the median step time
(barrier to barrier: the slowest rank counts), the ratio on / off (goal ≤ 1.02) with the quartiles of the per-round
ratios (the spread the shared machine's load gives), rank 0's main-thread and whole-process CPU time per step, the
doctor's own CPU per step on rank 0 (the main thread's extra and its background thread's, as a share of the step:
an estimate that the machine's load disturbs less than wall time), how many collectives the doctor saw per step,
and the time of one 1-element all-reduce on ``tp`` on / off (the per-call price of the interception).

The straggler report: ``--straggler-steps`` steps with the doctor on and no slow rank, then as many with rank 3
slowed by 30 % (after its own work of each step it sleeps 0.3 × that work's duration): rank 0's report after each
phase — the ranks named, after how many steps — and each rank's median lateness against its peers.

    python benchmarks/doctor_overhead.py [--quick] [--steps N] [--rounds R] [--straggler-steps N]

Prints a table and writes ``benchmarks/results/doctor_overhead.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "doctor_overhead.json")
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
WORLD = 4
CALLS = 200  # small all-reduces per timing of the per-call price


def _worker(rank: int, init: str, steps: int, rounds: int, interval: float, slow_steps: int, out_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import logging

    import torch.distributed as dist

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        _measure(rank, steps, rounds, interval, slow_steps, out_q)
    except BaseException:  # report instead of leaving the other ranks waiting
        import traceback

        out_q.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})
        os._exit(1)
    import megashard.state as ms

    ms.destroy()
    ms.end_distributed()


def _measure(rank: int, steps: int, rounds: int, interval: float, slow_steps: int, out_q) -> None:
    import torch.distributed as dist

    import megashard.doctor as doctor
    import megashard.state as ms
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches
    from megashard.train.loop import build, clip_grad_norm

    job = JobConfig.from_yaml(DEFAULT, [f"launch.nproc_per_node={WORLD}"])
    state = ms.initialize(job.parallel)
    model, opt = build(job, state)
    params = list(model.parameters())
    data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                   dp_size=state.size("dp"))
    tp = state.group("tp")
    tiny = torch.ones(1)
    counter = [0]

    def train_steps(n: int, slow: int = -1) -> float:
        dist.barrier()
        c0, p0 = time.thread_time(), time.process_time()
        t0 = time.perf_counter()
        for _ in range(n):
            counter[0] += 1
            doctor.set_step(counter[0])  # free when the doctor is off
            w0 = time.perf_counter()
            x, y = data.batch(counter[0])
            loss = model(x, y)
            loss.backward()
            if rank == slow:  # a rank 30 % slower at its own work (a slower device, a noisy neighbour)
                time.sleep(0.3 * (time.perf_counter() - w0))
            clip_grad_norm(params, job.optim.grad_clip, state)
            opt.step()
            opt.zero_grad(set_to_none=True)
        cpu.append((time.thread_time() - c0) / n)  # this thread's CPU time: less sensitive to load than wall time
        proc.append((time.process_time() - p0) / n)  # every thread of the process (the doctor's and gloo's too)
        dist.barrier()
        return (time.perf_counter() - t0) / n

    def small_calls() -> float:
        dist.barrier()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            dist.all_reduce(tiny, group=tp)
        cpu.append((time.thread_time() - c0) / CALLS)
        return (time.perf_counter() - t0) / CALLS

    cpu: list = []
    proc: list = []
    train_steps(2)  # warm-up
    times = {"off": [], "on": []}
    calls = {"off": [], "on": []}
    cpu_step = {"off": [], "on": []}
    cpu_call = {"off": [], "on": []}
    proc_step = {"off": [], "on": []}
    seen_per_step = 0.0
    thread_cpu: list = []
    for r in range(rounds):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            d = doctor.enable(state, interval=interval) if side == "on" else None
            if d is not None:
                before = sum(t.seq for t in d.ledger.by_key.values())
            times[side].append(train_steps(steps))
            cpu_step[side].append(cpu.pop())
            proc_step[side].append(proc.pop())
            if d is not None:
                seen_per_step = (sum(t.seq for t in d.ledger.by_key.values()) - before - 2) / steps  # 2 barriers
                thread_cpu.append(d.cpu_s / steps)  # its background thread (no more than the round's steps)
            calls[side].append(small_calls())
            cpu_call[side].append(cpu.pop())
            if d is not None:
                doctor.disable()
    stragglers = {}
    if slow_steps:
        for phase, slow in (("no slow rank", -1), ("rank 3 slowed by 30%", 3)):
            d = doctor.enable(state, interval=interval)
            first = counter[0] + 1
            named_at = None
            for _ in range(slow_steps):
                train_steps(1, slow)
                rep = d.straggler_report
                if named_at is None and rep and rep["named"]:
                    named_at = rep["step"] - first + 1
            doctor.set_step(counter[0] + 1)
            time.sleep(3 * interval)  # every rank published its last step; rank 0 compared them
            dist.barrier()
            if rank == 0:
                s = d.stragglers
                peers = next(iter(s.peers.values()), None)
                import statistics as st

                stragglers[phase] = {
                    "steps": s.steps, "named": s.named(), "first_named_after_steps": named_at,
                    "median_share": {r: round(st.median(peers.share[r]), 4) for r in peers.ranks} if peers else {},
                    "groups": s.group_rows()}
            doctor.disable()
    if rank == 0:
        out_q.put({"times": times, "calls": calls, "seen_per_step": seen_per_step, "cpu_step": cpu_step,
                   "cpu_call": cpu_call, "proc_step": proc_step, "stragglers": stragglers, "thread_cpu": thread_cpu})
    dist.barrier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10, quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per side (default 8, quick 2)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between publications (default 0.5)")
    ap.add_argument("--straggler-steps", type=int, default=None,
                    help="steps of each straggler phase (default 40, quick 12; 0: none)")
    args = ap.parse_args(argv)
    slow_steps = args.straggler_steps if args.straggler_steps is not None else (12 if args.quick else 40)
    steps = args.steps or (3 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 8)
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as sock:  # a TCPStore on a free port, as torchrun gives the workers
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    procs = [ctx.Process(target=_worker, args=(r, init, steps, rounds, args.interval, slow_steps, q))
             for r in range(WORLD)]
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
    load_after = os.getloadavg()[0]
    times, calls = res["times"], res["calls"]
    med = {k: statistics.median(v) for k, v in times.items()}
    per_call = {k: statistics.median(v) for k, v in calls.items()}
    cpu_step = {k: statistics.median(v) for k, v in res["cpu_step"].items()}
    cpu_call = {k: statistics.median(v) for k, v in res["cpu_call"].items()}
    proc_step = {k: statistics.median(v) for k, v in res["proc_step"].items()}
    proc_ratio = proc_step["on"] / proc_step["off"]
    ratio = med["on"] / med["off"]
    cpu_ratio = cpu_step["on"] / cpu_step["off"]
    round_ratios = sorted(a / b for a, b in zip(times["on"], times["off"]))
    quartiles = statistics.quantiles(round_ratios, n=4) if len(round_ratios) > 1 else round_ratios * 3
    thread_step = statistics.median(res["thread_cpu"]) if res["thread_cpu"] else 0.0
    # What the doctor adds on rank 0, as CPU time (less sensitive to the machine's load than wall time): the main
    # thread's extra CPU per step and the doctor thread's own, over the step time without it.
    accounted = (cpu_step["on"] - cpu_step["off"] + thread_step) / med["off"]
    print(f"hang doctor overhead: configs/default.yaml, {WORLD} gloo ranks, tp=2 × dp_shard=2, {steps} steps × "
          f"{rounds} rounds, publication every {args.interval} s; load {load_before:.1f} → {load_after:.1f} "
          f"on {os.cpu_count()} cores")
    print("| doctor | median ms/step | min | max | CPU ms/step (rank 0 main thread) | process CPU ms/step (rank 0) | "
          "µs per tp all-reduce | CPU µs per call |")
    print("|---|---|---|---|---|---|---|---|")
    for k in ("off", "on"):
        print(f"| {k} | {med[k] * 1e3:.2f} | {min(times[k]) * 1e3:.2f} | {max(times[k]) * 1e3:.2f} | "
              f"{cpu_step[k] * 1e3:.2f} | {proc_step[k] * 1e3:.2f} | {per_call[k] * 1e6:.1f} | "
              f"{cpu_call[k] * 1e6:.1f} |")
    print(f"ratio on / off: wall {ratio:.3f} (per-round ratios: median {statistics.median(round_ratios):.3f}, "
          f"quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}), CPU {cpu_ratio:.3f} (main thread), {proc_ratio:.3f} "
          f"(process); the doctor's CPU on rank 0 (main thread's extra + its thread's {thread_step * 1e3:.2f} ms) per "
          f"step: {accounted:+.1%} of the step; goal <= 1.02; "
          f"{res['seen_per_step']:.0f} collectives per step seen by the doctor; "
          f"{(cpu_call['on'] - cpu_call['off']) * 1e6:+.1f} CPU µs per collective")
    for phase, rep in res["stragglers"].items():
        named = ", ".join(f"rank {n['rank']} (+{n['lag_ms']:.1f} ms/step, {n['share']:.0%} of the step, p={n['p']:.2g})"
                          for n in rep["named"]) or "none"
        after = (f", first named after {rep['first_named_after_steps']} steps"
                 if rep["first_named_after_steps"] else "")
        shares = ", ".join(f"{r}: {v:+.1%}" for r, v in sorted(rep["median_share"].items()))
        print(f"stragglers, {phase}: {rep['steps']} steps compared; named: {named}{after}; median lateness vs "
              f"peers by rank: {shares}")
    out = {
        "benchmark": "doctor_overhead", "world_size": WORLD, "layout": "tp=2 x dp_shard=2", "steps_per_round": steps,
        "rounds": rounds, "interval_s": args.interval, "median_step_s": med, "rounds_s": times, "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "median_cpu_s_per_step": cpu_step, "median_cpu_s_per_tp_all_reduce": cpu_call,
        "median_process_cpu_s_per_step": proc_step, "process_cpu_ratio": proc_ratio, "stragglers": res["stragglers"],
        "store": "TCPStore",
        "median_round_ratio": statistics.median(round_ratios), "round_ratio_quartiles": [quartiles[0], quartiles[2]],
        "doctor_thread_cpu_s_per_step": thread_step, "accounted_cpu_share": accounted, "goal_ratio": 1.02,
        "collectives_per_step_seen": res["seen_per_step"], "median_s_per_tp_all_reduce": per_call,
        "load_before": load_before, "load_after": load_after, "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
