"""Elastic training: kill a node at random steps, several times, and measure what each change costs — with live
recovery (``launch.recovery: live``: the survivors re-form the world in place, state from memory) and with the
restart path (``restart``: torchrun restarts every worker, which resumes from the newest checkpoint), in one run, on
the same kill steps.

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

Per change: ``s to a step`` is, for a node killed, the time from the kill to the next completed step, and for a
node joining, the time the running world did not train (``seconds_down`` of its ``world_change`` record); ``state from``
whether the new world read a checkpoint (``state_from``); ``s launch→join``, for a node joining, the time from its
``megashard run`` to the first step of the world it is in (its own start-up, while the running world trains). Kill
points lie between 1/30 and 2/3 of the run, so that the last newcomer has time to join (each newcomer's start-up,
~20 s on 2 cores, is ~70 steps of this job); a kill waits for world 4, and the run
fails if a planned kill or join did not happen within the steps. Summary per path: the median of ``s to a step``, the
steps redone, the checkpoint reads, and the whole run against the uninterrupted one.

Usage: ``python benchmarks/elastic.py [--kills 3] [--steps 300] [--seed 0] [--dtype float32] [--paths live,restart]``;
prints a table and writes ``benchmarks/results/elastic.json``. The machine's load before and after is printed: other jobs on a shared
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

from megashard.train.metrics import read_metrics  # noqa: E402


def _run_path(tmp: str, path: str, config: str, common: list, kills: list, args) -> dict:
    """One elastic run with ``launch.recovery=<path>``: node B killed at each step of ``kills`` (world 4), a new node
    joining as soon as the survivor trains alone."""
    from tests._elastic import ElasticRun, top

    node_timeout = args.live_node_timeout if path == "live" else args.node_timeout
    run = ElasticRun(os.path.join(tmp, path), config, common + [f"launch.recovery={path}"], last_call=args.last_call,
                     node_timeout=node_timeout, timeout=1800)
    t0 = time.perf_counter()
    killed_at, t_kills, t_launches = [], [], []
    try:
        run.pause()  # both nodes in the first world (a node that starts late would join first: another change)
        a = run.node("A")
        run.wait_store()
        run.node("B")
        run.wait_for(lambda m: run.world().get("world_size") == 4, "world 4", metrics=False)
        run.go_on()
        joined_at = 0  # a kill comes at its planned step, and at least 5 steps after the world of 4 formed again
        for i, step in enumerate(kills):
            due = max(step, joined_at + 5)
            run.wait_for(lambda m: top(m, world=4) >= due or not run.nodes[-1].alive(), f"step {due} at world 4")
            if top(run.metrics()) >= args.steps:
                break
            killed_at.append(top(run.metrics(), world=4))
            t_kill = run.nodes[-1].kill()
            t_kills.append(t_kill)
            run.wait_for(lambda m: run.world().get("world_size") == 2 and run.world().get("time", 0) > t_kill,
                         "world 2", metrics=False)
            t_launches.append(run.node(f"B{i + 2}").started)  # a new node joins at once: world 2 trains meanwhile
            run.wait_for(lambda m: run.world().get("world_size") == 4 or top(m) >= args.steps, "world 4 again",
                         metrics=True)
            joined_at = run.world().get("start_step", 0) if run.world().get("world_size") == 4 else args.steps
        codes = [n.wait(run.timeout) for n in (a, run.nodes[-1])]
    finally:
        run.stop_all()
    seconds = time.perf_counter() - t0
    got = run.metrics()
    rows = []
    for r in got:
        c = r.get("world_change")
        if c is None:
            continue
        what = "node left" if c["nodes_left"] else "node joined" if c["nodes_joined"] else "restart"
        row = {"event": what, "world": f"{c['world_size_before']}→{r['world_size']}", "step": r["step"],
               "resumed_from": c["resumed_from"], "steps_redone": c["steps_redone"],
               "seconds_down": c["seconds_down"], "state_from": c.get("state_from", "checkpoint")}
        row["launch_to_join"] = None
        if what == "node left":  # from the kill (the benchmark's clock) to the next completed step
            t_kill = max((t for t in t_kills if t < r["time"]), default=None)
            row["to_step"] = None if t_kill is None else round(r["time"] - t_kill, 3)
        else:
            row["to_step"] = c["seconds_down"]
            # from the newcomer's `megashard run` to the first step of the world it is in (its start-up: the running
            # world trains meanwhile, except for `to_step`)
            t_launch = max((t for t in t_launches if t < r["time"]), default=None)
            row["launch_to_join"] = None if t_launch is None else round(r["time"] - t_launch, 3)
        rows.append(row)
    return {"path": path, "rows": rows, "seconds": seconds, "killed_at": killed_at, "codes": codes,
            "metrics": got, "out": run.out}


def by_hand(steps: int = 200, kill_at: int = 25) -> int:
    """Issue 36's case as a user runs it: two launchers on localhost (``launch.nnodes=1:2``, 2 processes each, the
    second started after the first, torchrun's default rendezvous timeouts), the default job with ``parallel.tp=2
    parallel.dp_outer=auto parallel.dp_shard=1`` (each node a full replica), ``checkpoint.interval=10``; the second
    launcher SIGKILLed at step ``kill_at`` or later, a new one started once the survivor trains alone. Prints both
    ``world_change`` records."""
    from tests._elastic import ElasticRun, top

    tmp = tempfile.mkdtemp(prefix="megashard-bench-byhand-")
    load0 = os.getloadavg()
    run = ElasticRun(os.path.join(tmp, "run"), "configs/default.yaml",
                     ["parallel.tp=2", "parallel.dp_outer=auto", "parallel.dp_shard=1", "checkpoint.interval=10",
                      f"train.steps={steps}", "train.plot=false"], last_call=30, node_timeout=15, timeout=1800)
    try:
        a = run.node("A")
        run.wait_store()
        run.node("B")
        run.wait_for(lambda m: top(m, world=4) >= kill_at, f"step {kill_at} at world 4")
        t_kill = run.nodes[1].kill()
        run.wait_for(lambda m: any(r.get("world_size") == 2 and r["time"] > t_kill for r in m), "training alone")
        b2 = run.node("B2")
        codes = [a.wait(run.timeout), b2.wait(run.timeout)]
        changes = [(r["step"], r["world_size"], r["world_change"]) for r in run.metrics()
                   if "world_change" in r and r["step"] > 1]
    finally:
        run.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"by hand: {steps} steps, tp=2 dp_outer=auto dp_shard=1, checkpoint every 10, second launcher SIGKILLed at "
          f"step >= {kill_at}, a new one started once the survivor trained alone; exit codes {codes}")
    for step, world, c in changes:
        print(f"  step {step}: world {c['world_size_before']} → {world}: steps_redone {c['steps_redone']}, seconds_down "
              f"{c['seconds_down']}, state from {c.get('state_from')}")
    print(f"machine load before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f} (1-min average; {os.cpu_count()} cores)")
    return 0 if codes == [0, 0] else 1


def main(argv=None) -> int:
    from statistics import median

    from tests._elastic import loss_differences, reference

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="nodes killed (each followed by a node joining)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval in steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--node-timeout", type=int, default=3, help="launch.rdzv_node_timeout (s)")
    ap.add_argument("--live-node-timeout", type=int, default=10,
                    help="launch.rdzv_node_timeout (s) of the live path: a survivor does not wait for it (only a join "
                         "does), and on a loaded machine a short one drops nodes whose heartbeats come late")
    ap.add_argument("--last-call", type=int, default=3, help="launch.rdzv_last_call (s)")
    ap.add_argument("--paths", default="live,restart", help="launch.recovery values to run, comma-separated")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    ap.add_argument("--by-hand", action="store_true", help="only issue 36's two-launcher case (live recovery, HSDP)")
    args = ap.parse_args(argv)
    if args.by_hand:
        return by_hand()
    rng = random.Random(args.seed)
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="megashard-bench-elastic-")
    config = "configs/default.yaml"
    common = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}", "checkpoint.keep=0",
              f"train.dtype={args.dtype}", "train.plot=false", "train.micro_batch_size=4", "parallel.dp_shard=auto"]
    # kill points: random steps spread over 1/30 to 2/3 of the run — the last third leaves the last newcomer time to
    # start and join (its start-up, ~20 s on 2 cores, ~70 steps, runs beside the training world); a kill waits for
    # world 4 and comes at least 5 steps after it formed, so the kills after the first usually come later than planned
    span = (args.steps * 2 // 3 - args.steps // 30) // args.kills
    kills = [args.steps // 30 + i * span + rng.randrange(0, max(1, span // 3)) for i in range(args.kills)]
    results = {}
    try:
        t0 = time.perf_counter()
        ref = reference(os.path.join(tmp, "ref"), config, common, timeout=3600)
        t_ref = time.perf_counter() - t0
        if ref.returncode != 0:
            print(ref.stderr[-3000:], file=sys.stderr)
            return 1
        want = read_metrics(os.path.join(tmp, "ref", "metrics.jsonl"))
        for path in args.paths.split(","):
            res = _run_path(tmp, path, config, common, kills, args)
            got = res.pop("metrics")
            if [r["step"] for r in got] != [r["step"] for r in want]:
                args.keep = True
                print(f"{path}: the run's metrics end at step {max((r['step'] for r in got), default=0)} of "
                      f"{args.steps} (exit codes {res['codes']}); its files are kept in {tmp}", file=sys.stderr)
                return 1
            diffs = loss_differences(want, got)
            res["max_loss_rel_diff"] = max(diffs.values())
            res["ratio"] = res["seconds"] / t_ref
            results[path] = res
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    print(f"elastic training: {args.kills} node(s) killed at steps {kills} (world 4), each followed by a node joining; "
          f"{args.steps} steps, checkpoint every {args.interval}, {args.dtype}, rdzv_node_timeout={args.node_timeout} s "
          f"(live: {args.live_node_timeout} s), rdzv_last_call={args.last_call} s")
    print(f"{'path':<8} {'#':>2}  {'event':<11} {'world':<6} {'step':>5} {'resumed':>7} {'redone':>6} {'s to a step':>11} "
          f"{'state from':<10} {'s launch→join':>13}")
    for path, res in results.items():
        for i, r in enumerate(res["rows"], 1):
            to = "?" if r["to_step"] is None else f"{r['to_step']:.1f}"
            lj = "" if r["launch_to_join"] is None else f"{r['launch_to_join']:.1f}"
            print(f"{path:<8} {i:>2}  {r['event']:<11} {r['world']:<6} {r['step']:>5} {r['resumed_from']:>7} "
                  f"{r['steps_redone']:>6} {to:>11} {r['state_from']:<10} {lj:>13}")
    print(f"uninterrupted world-4 run: {t_ref:.1f} s")
    for path, res in results.items():
        rows = res["rows"]
        to = [r["to_step"] for r in rows if r["to_step"] is not None and r["event"] == "node left"]
        res["median_to_step"] = median(to) if to else None
        joins = [r["to_step"] for r in rows if r["to_step"] is not None and r["event"] == "node joined"]
        res["median_join_down"] = median(joins) if joins else None
        res["steps_redone"] = sum(r["steps_redone"] for r in rows)
        res["max_steps_redone"] = max((r["steps_redone"] for r in rows), default=0)
        res["checkpoint_reads"] = sum(r["state_from"] == "checkpoint" for r in rows)
        res["kills_done"] = len(res["killed_at"])
        res["joins_done"] = sum(r["event"] == "node joined" and r["launch_to_join"] is not None for r in rows)
        lj = [r["launch_to_join"] for r in rows if r["launch_to_join"] is not None]
        res["median_launch_to_join"] = median(lj) if lj else None
        med = "?" if res["median_to_step"] is None else f"{res['median_to_step']:.1f} s"
        jmed = "?" if res["median_join_down"] is None else f"{res['median_join_down']:.1f} s"
        ljmed = "?" if res["median_launch_to_join"] is None else f"{res['median_launch_to_join']:.1f} s"
        print(f"{path}: {res['kills_done']} of {args.kills} kills and {res['joins_done']} joins done; a new node's "
              f"launch to its world's first step, median {ljmed}")
        print(f"{path}: {len(rows)} changes, median {med} from a kill to the next step, {jmed} down per join, "
              f"{res['steps_redone']} steps redone (at most "
              f"{res['max_steps_redone']} per change), {res['checkpoint_reads']} checkpoint reads; run {res['seconds']:.1f} s "
              f"(ratio {res['ratio']:.2f} to uninterrupted); largest relative loss difference "
              f"{res['max_loss_rel_diff']:.1e}; exit codes {res['codes']}")
    if {"live", "restart"} <= set(results) and results["live"]["median_to_step"] and results["restart"]["median_to_step"]:
        print(f"live / restart, median time from a kill to the next step: "
              f"{results['live']['median_to_step'] / results['restart']['median_to_step']:.2f}")
    print(f"machine load before {load0[0]:.1f}, after {load1[0]:.1f} (1-min average; {os.cpu_count()} cores)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "kills": kills, "uninterrupted_s": t_ref, "paths": results,
                   "load_before": load0, "load_after": load1}, f, indent=1)
    print(f"wrote {RESULTS}")
    short = [p for p, res in results.items() if res["kills_done"] < args.kills or res["joins_done"] < args.kills]
    for p in short:
        print(f"{p}: not every planned change happened within {args.steps} steps (see the table)")
    return 0 if not short and all(c == 0 for res in results.values() for c in res["codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
