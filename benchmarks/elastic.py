"""Elastic training: kill a node at random steps, several times, and measure what each change costs.

Two launchers on localhost (``launch.nnodes=1:2``, 2 gloo processes each, c10d rendezvous; :mod:`tests._elastic`):
node A (it hosts the rendezvous store) and node B train the default job (tp=2, ``dp_shard: auto``) at world 4. At a
random step B is killed with SIGKILL; A goes on at world 2; as soon as it trains again a new launcher joins and the
job grows back to world 4 — ``--kills`` times. Reported per change (from the ``world_change`` records of
metrics.jsonl): the steps redone (trained past the checkpoint by the world that ended), the seconds from the last
step of the old world to training again (detection, rendezvous, start-up, resharded load) and the seconds the
redone steps had taken. The baseline, in the same run: the same job uninterrupted at world 4 — the wall time ratio,
and the largest relative difference of the loss at any step and of the final parameters.

float32 by default (what users train in). The losses agree to rounding; the parameters too, except the attention
key bias, whose gradient is zero up to rounding (softmax ignores a constant added to every score) so that Adam
amplifies rounding noise there: shown on its own line. ``--dtype float64`` removes it.

Usage: ``python benchmarks/elastic.py [--kills 3] [--steps 300] [--seed 0] [--dtype float32]``; prints a table and
writes ``benchmarks/results/elastic.json``. The machine's load before and after is printed: other jobs on a shared
machine slow the restarts.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "elastic.json")


def main(argv=None) -> int:
    from tests._elastic import ElasticRun, loss_differences, reference, top

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="nodes killed (each followed by a node joining)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval in steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--node-timeout", type=int, default=3, help="launch.rdzv_node_timeout (s)")
    ap.add_argument("--last-call", type=int, default=3, help="launch.rdzv_last_call (s)")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="megashard-bench-elastic-")
    config = "configs/default.yaml"
    common = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}", "checkpoint.keep=0",
              f"train.dtype={args.dtype}", "train.plot=false", "train.micro_batch_size=4", "parallel.dp_shard=auto"]
    try:
        t0 = time.perf_counter()
        ref = reference(os.path.join(tmp, "ref"), config, common, timeout=3600)
        t_ref = time.perf_counter() - t0
        if ref.returncode != 0:
            print(ref.stderr[-3000:], file=sys.stderr)
            return 1
        run = ElasticRun(os.path.join(tmp, "el"), config, common, last_call=args.last_call,
                         node_timeout=args.node_timeout, timeout=1800)
        # kill points: random steps, spread over the run, each a while after the previous change settled
        span = args.steps // (args.kills + 1)
        kills = [i * span + rng.randrange(span // 3, max(span // 3 + 1, span // 2)) for i in range(1, args.kills + 1)]
        t0 = time.perf_counter()
        killed_at = []
        try:
            a = run.node("A")
            run.wait_store()
            run.node("B")
            for i, step in enumerate(kills):
                run.wait_for(lambda m: top(m, world=4) >= step or not run.nodes[-1].alive(), f"step {step} at world 4")
                if top(run.metrics()) >= args.steps:
                    break
                killed_at.append(top(run.metrics(), world=4))
                t_kill = run.nodes[-1].kill()
                run.wait_for(lambda m: run.world().get("world_size") == 2 and run.world().get("time", 0) > t_kill,
                             "world 2", metrics=False)
                run.node(f"B{i + 2}")  # a new node joins at once: world 2 trains while it starts
            codes = [n.wait(run.timeout) for n in (a, run.nodes[-1])]
        finally:
            run.stop_all()
        t_el = time.perf_counter() - t0
        from megashard.train.checkpointing import read_full_model
        from megashard.train.metrics import read_metrics

        want, got = read_metrics(os.path.join(tmp, "ref", "metrics.jsonl")), run.metrics()
        diffs = loss_differences(want, got)
        pa, pb = (read_full_model(os.path.join(d, "checkpoints")) for d in (os.path.join(tmp, "ref"), run.out))
        pdiff = {k: float((pa[k].double() - pb[k].double()).abs().max()) / (float(pa[k].abs().max()) or 1.0) for k in pa}
        key_bias = {k: v for k, v in pdiff.items() if k.endswith("attn.qkv.bias")}
        others = {k: v for k, v in pdiff.items() if k not in key_bias}
        changes = [(r["step"], r["world_size"], r["world_change"]) for r in got if "world_change" in r]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    rows = []
    for step, world, c in changes:
        what = "node left" if c["nodes_left"] else "node joined" if c["nodes_joined"] else "restart"
        rows.append({"event": what, "world": f"{c['world_size_before']}→{world}", "resumed_from": c["resumed_from"],
                     "last_step_before": c["last_step_before"], "steps_redone": c["steps_redone"],
                     "seconds_down": c["seconds_down"], "seconds_redone": c["seconds_redone"]})
    print(f"elastic training: {args.kills} node(s) killed at random steps ({killed_at}), each followed by a node "
          f"joining; {args.steps} steps, checkpoint every {args.interval}, {args.dtype}, "
          f"rdzv_node_timeout={args.node_timeout} s, rdzv_last_call={args.last_call} s")
    print(f"{'#':>2}  {'event':<11} {'world':<6} {'resumed':>7} {'last':>5} {'redone':>6} {'s to training':>13} "
          f"{'s redone':>8}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>2}  {r['event']:<11} {r['world']:<6} {r['resumed_from']:>7} {r['last_step_before']:>5} "
              f"{r['steps_redone']:>6} {r['seconds_down']:>13.1f} {r['seconds_redone']:>8.2f}")
    lost = sum(r["seconds_down"] + r["seconds_redone"] for r in rows)
    worst = max(diffs, key=diffs.get)
    print(f"total: {sum(r['steps_redone'] for r in rows)} steps redone, {lost:.1f} s lost; elastic run {t_el:.1f} s vs "
          f"uninterrupted world-4 run {t_ref:.1f} s (ratio {t_el / t_ref:.2f}); exit codes {codes}")
    print(f"largest relative loss difference vs the uninterrupted run: {diffs[worst]:.2e} (step {worst}); final "
          f"parameters: {max(others.values()):.2e} ({max(others, key=others.get)}), attention key bias "
          f"{max(key_bias.values()):.2e} (zero gradient up to rounding)")
    print(f"machine load before {load0[0]:.1f}, after {load1[0]:.1f} (1-min average; {os.cpu_count()} cores)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "killed_at": killed_at, "changes": rows, "seconds_lost": lost,
                   "elastic_s": t_el, "uninterrupted_s": t_ref, "ratio": t_el / t_ref,
                   "max_loss_rel_diff": diffs[worst], "max_param_rel_diff": max(others.values()),
                   "max_key_bias_rel_diff": max(key_bias.values()), "exit_codes": codes,
                   "load_before": load0, "load_after": load1}, f, indent=1)
    print(f"wrote {RESULTS}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
