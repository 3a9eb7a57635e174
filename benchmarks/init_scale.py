"""Parallel-state initialisation at scale: megashard against ``init_device_mesh`` on the ``fake`` backend.

One process simulates one rank (rank 0 by default) of a 1,024 … 65,536-rank world
(``init_process_group("fake", ...)``: no communication, but every group a rank creates is really
constructed). Every measurement runs in a FRESH subprocess, so process-group state and memory never
leak from one measurement into the next.

* megashard: ``megashard.state.initialize(ParallelConfig(..., backend="fake", device="cpu"))``, then
  ``st.dense_mesh``, ``st.fsdp_mesh``, ``st.expert_mesh`` (all 20 named groups + 3 root meshes).
* baseline: ``init_device_mesh("cpu", (pp, dp, cp, tp))`` + ``_flatten`` of ``dp_cp``, ``dp_shard_cp``
  (same axes as dp_cp without HSDP) and ``tp_cp`` — fewer meshes than megashard builds (no expert mesh).

Layouts: ``tp8 cp2 pp4 ep8``, ``all sizes 1`` (everything data-parallel) and ``megatron groups``: tp8 cp4 pp4 ep8
with two distributed-optimizer instances (dp_outer 2) and hierarchical cp [2, 2] — every group of Megatron-LM 0.19's
``initialize_model_parallel`` enabled (embedding, position embedding, amax, hierarchical cp, intra/inter instance
groups, expert replica axis, gtp_remat).

Communicators per rank against Megatron-LM: counted from the plain re-statement of its ``initialize_model_parallel``
(tests/_megatron_ref.py; every ``create_group`` call whose ranks hold the rank is one communicator, gloo groups
included as Megatron creates them by default) next to megashard's on a GPU job (one communicator per distinct
non-world rank set, plus gloo twins of the data-parallel groups).

Per measurement: wall and CPU time of the initialisation only (imports and ``init_process_group`` are
excluded; best of ``--repeats`` fresh processes), peak Python heap (tracemalloc, in a separate fresh process
because tracing slows the run), ``ru_maxrss`` growth, ``new_group``/``split_group`` calls and backend
constructions (counted by wrapping them) — against the floor: the distinct non-world rank sets the
rank belongs to. Prints a markdown table and writes ``benchmarks/results/init_scale.json``.

    python benchmarks/init_scale.py [--quick] [--repeats N] [--rank R] [--profile] [--import-init-only]

``--quick`` runs 1,024 and 4,096 ranks only; ``--profile`` adds a cProfile of megashard at the largest world.
Then (unless ``--quick`` or ``--no-import-init``) import and initialisation apart, ``import megashard.parallel_state``
+ ``initialize_model_parallel`` against Megatron-LM's and ``init_device_mesh`` at 65,536 and 1,048,576 ranks
(:mod:`benchmarks.init_import`, ``benchmarks/results/init_import.json``); ``--import-init-only`` runs just that.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "init_scale.json")
WORLDS = (1024, 4096, 16384, 65536)
QUICK_WORLDS = (1024, 4096)
LAYOUTS: dict[str, dict[str, int]] = {
    "tp8 cp2 pp4 ep8": {"tp": 8, "cp": 2, "pp": 4, "ep": 8},
    "all sizes 1": {},
    "megatron groups": {"tp": 8, "cp": 4, "pp": 4, "ep": 8, "dp_outer": 2, "hierarchical_context_parallel_sizes": [2, 2]},
}
IMPLS = ("megashard", "init_device_mesh")
#: ANCHORS.md, rank 0 on this kind of machine: world -> layout -> (Megatron-LM s, init_device_mesh s).
ANCHOR_SECONDS = {
    1024: {"tp8 cp2 pp4 ep8": (0.10, 0.035), "all sizes 1": (0.20, 0.040)},
    4096: {"tp8 cp2 pp4 ep8": (0.57, 0.040), "all sizes 1": (0.80, 0.27)},
    16384: {"tp8 cp2 pp4 ep8": (1.48, 0.22), "all sizes 1": (3.56, 0.61)},
    65536: {"tp8 cp2 pp4 ep8": (5.75, 0.60), "all sizes 1": (14.1, 2.37)},
}
GOAL_WORLD = 65536
GOAL_SPEEDUP = 10.0


# ---------------------------------------------------------------------------------------------- worker
def _install_counters() -> dict[str, int]:
    """Count ``new_group``/``split_group`` calls (every module that bound the name) and fake-backend constructions."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as dm
    import torch.distributed.distributed_c10d as c10d

    from megashard._compat import wrap_backend_creator

    counts = {"new_group": 0, "split_group": 0, "backend": 0}

    def counted(key: str, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in ("new_group", "split_group"):
        orig = getattr(c10d, name)
        w = counted(name, orig)
        for mod in (c10d, dist, dm):
            if getattr(mod, name, None) is orig:
                setattr(mod, name, w)
    wrap_backend_creator("fake", lambda creator: counted("backend", creator))
    return counts


def _sizes(layout: str, world: int) -> dict[str, int]:
    s = dict(LAYOUTS[layout])
    tp, cp, pp = s.get("tp", 1), s.get("cp", 1), s.get("pp", 1)
    return {"tp": tp, "cp": cp, "pp": pp, "dp": world // (tp * cp * pp), "ep": s.get("ep", 1)}


def _run_megashard(layout: str, world: int) -> dict[str, Any]:
    import megashard.state as ms
    from megashard.config import ParallelConfig

    st = ms.initialize(ParallelConfig(**LAYOUTS[layout], backend="fake", device="cpu"))
    st.dense_mesh, st.fsdp_mesh, st.expert_mesh  # noqa: B018 - build the root meshes
    return {"groups_created_reported": st.groups_created, "groups_used": st.groups_used}


def _run_device_mesh(layout: str, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from megashard._compat import mesh_flatten

    s = _sizes(layout, world)
    mesh = init_device_mesh("cpu", (s["pp"], s["dp"], s["cp"], s["tp"]), mesh_dim_names=("pp", "dp", "cp", "tp"))
    mesh_flatten(mesh["dp", "cp"], "dp_cp")
    mesh_flatten(mesh["dp", "cp"], "dp_shard_cp")  # FSDP's axis; same ranks as dp_cp without HSDP
    mesh_flatten(mesh["cp", "tp"], "tp_cp")
    return {}


def worker(impl: str, layout: str, world: int, rank: int, trace: bool, profile: bool) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns a JSON-able dict."""
    import gc
    import resource
    import tracemalloc

    import torch.distributed as dist
    import torch.distributed.device_mesh  # noqa: F401 - import cost is not initialisation cost

    import megashard.state  # noqa: F401
    from megashard._compat import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    counts = _install_counters()
    run = _run_megashard if impl == "megashard" else _run_device_mesh
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    prof = None
    if trace:
        tracemalloc.start()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    extra = run(layout, world)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu, **counts, **extra}
    if prof is not None:
        prof.disable()
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        out["profile"] = buf.getvalue()
    if trace:
        out["tracemalloc_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    out["rss_delta_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return out


# ---------------------------------------------------------------------------------------------- parent
def _spawn(impl: str, layout: str, world: int, rank: int, *, trace: bool = False, profile: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--layout", layout,
           "--world", str(world), "--rank", str(rank)]
    cmd += ["--trace"] if trace else []
    cmd += ["--profile"] if profile else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{impl} {layout!r} world={world} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def floor_groups(layout: str, world: int, rank: int) -> int:
    """Distinct non-world rank sets among the named groups of ``rank`` (every name of the layout it is a member
    of): what it must create at least."""
    from megashard.config import ParallelConfig
    from megashard.layout import RankLayout

    lay = RankLayout(ParallelConfig(**LAYOUTS[layout]), world)
    sets = {}
    for name in lay.names():
        if lay.size(name) < world and lay.is_member(name, rank):  # a world-sized group is the default group
            sets[tuple(lay.group_of(name, rank))] = name
    return len(sets)


def communicators(layout: str, world: int, rank: int) -> dict[str, Any]:
    """Communicators ``rank`` holds on a GPU job with gloo twins (the default): megashard (one per distinct non-world
    rank set + the gloo twins of the data-parallel groups, one per distinct set) against Megatron-LM 0.19 (every
    ``create_group`` call holding the rank, from the re-statement in tests/_megatron_ref.py)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megashard.config import ParallelConfig
    from megashard.layout import RankLayout
    from megashard.state.core import GLOO_TWIN_GROUPS
    from tests._megatron_ref import communicators_of_rank

    cfg = ParallelConfig(**LAYOUTS[layout])
    lay = RankLayout(cfg, world)
    twins = len({tuple(lay.group_of(n, rank)) for n in GLOO_TWIN_GROUPS})
    s = lay.sizes
    t0 = time.perf_counter()
    meg = communicators_of_rank(world, rank, tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, etp=s.expt_tp, n_inst=s.dp_outer,
                                hcp=list(s.hierarchical_cp) if s.hierarchical_cp else None, order="-".join(s.order))
    return {"megashard_nccl": floor_groups(layout, world, rank), "megashard_gloo": twins,
            "megatron_nccl": meg["default"], "megatron_gloo": meg["gloo"], "megatron_distinct_sets": meg["sets"],
            "megatron_count_s": time.perf_counter() - t0}


def measure(world: int, layout: str, rank: int, repeats: int) -> dict[str, Any]:
    row: dict[str, Any] = {"world": world, "layout": layout, "rank": rank, "floor_groups": floor_groups(layout, world, rank),
                           "communicators": communicators(layout, world, rank)}
    runs: dict[str, list[dict]] = {i: [] for i in IMPLS}
    for _ in range(repeats):  # interleaved, so a burst of load on the shared machine hits both
        for impl in IMPLS:
            runs[impl].append(_spawn(impl, layout, world, rank))
    for impl in IMPLS:
        traced = _spawn(impl, layout, world, rank, trace=True)
        walls = [r["wall_s"] for r in runs[impl]]
        last = runs[impl][-1]
        row[impl] = {
            "wall_s": min(walls),
            "wall_s_median": statistics.median(walls),
            "cpu_s": min(r["cpu_s"] for r in runs[impl]),
            "walls_s": walls,
            "tracemalloc_peak_mb": traced["tracemalloc_peak_mb"],
            "rss_delta_mb": max(r["rss_delta_mb"] for r in runs[impl]),
            "new_group_calls": last["new_group"],
            "split_group_calls": last["split_group"],
            "backend_constructions": last["backend"],
            **{k: last[k] for k in ("groups_created_reported", "groups_used") if k in last},
        }
    ms, dm = row["megashard"], row["init_device_mesh"]
    row["speedup"] = dm["wall_s"] / ms["wall_s"]
    row["speedup_cpu"] = dm["cpu_s"] / ms["cpu_s"]
    row["anchor_s"] = dict(zip(("megatron", "init_device_mesh"), ANCHOR_SECONDS.get(world, {}).get(layout, ())))
    return row


def _groups(d: dict) -> int:
    return d["new_group_calls"] + d["split_group_calls"]


def table(rows: list[dict]) -> str:
    head = (
        "| world | layout | megashard s | init_device_mesh s | speed-up (wall / CPU) | megashard peak MB "
        "(tracemalloc / RSS Δ) | init_device_mesh peak MB (tracemalloc / RSS Δ) | groups created megashard | "
        "groups created init_device_mesh | rank's groups (floor) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ms, dm = r["megashard"], r["init_device_mesh"]
        lines.append(
            f"| {r['world']:,} | {r['layout']} | {ms['wall_s']:.3f} | {dm['wall_s']:.3f} | "
            f"{r['speedup']:.1f}× / {r['speedup_cpu']:.1f}× | {ms['tracemalloc_peak_mb']:.1f} / {ms['rss_delta_mb']:.1f} | "
            f"{dm['tracemalloc_peak_mb']:.1f} / {dm['rss_delta_mb']:.1f} | {_groups(ms):,} | {_groups(dm):,} | "
            f"{r['floor_groups']} |"
        )
    lines += ["", "| world | layout | communicators on the rank: megashard (nccl + gloo twins) | Megatron-LM 0.19 "
              "(nccl + gloo) | Megatron-LM distinct rank sets |", "|" + "---|" * 5]
    for r in rows:
        c = r["communicators"]
        lines.append(f"| {r['world']:,} | {r['layout']} | {c['megashard_nccl']} + {c['megashard_gloo']} | "
                     f"{c['megatron_nccl']} + {c['megatron_gloo']} | {c['megatron_distinct_sets']} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> dict[str, Any]:
    """The issue's two goals: groups created ≤ the rank's groups everywhere; ≥10× faster at 65,536 ranks."""
    over = [f"{r['world']} {r['layout']}: {_groups(r['megashard'])} > {r['floor_groups']}"
            for r in rows if _groups(r["megashard"]) > r["floor_groups"]]
    at_goal = [r for r in rows if r["world"] == GOAL_WORLD]
    slow = [f"{r['layout']}: {r['speedup']:.1f}×" for r in at_goal if r["speedup"] < GOAL_SPEEDUP]
    return {
        "groups_within_floor": not over,
        "groups_over_floor": over,
        "speedup_goal_measured": bool(at_goal),
        "speedup_goal_met": bool(at_goal) and not slow,
        "speedup_below_goal": slow,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,024 and 4,096 ranks only, one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="fresh timing processes per case (default 3, quick 1)")
    ap.add_argument("--rank", type=int, default=0, help="simulated rank (default 0, as in ANCHORS.md)")
    ap.add_argument("--worlds", type=int, nargs="*", default=None, help="override the world sizes")
    ap.add_argument("--profile", action="store_true", help="cProfile megashard at the largest world")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--no-import-init", action="store_true", help="skip the import / init table (init_import.py)")
    ap.add_argument("--import-init-only", action="store_true", help="only the import / init table (init_import.py)")
    ap.add_argument("--megatron-python", default=None, help="an interpreter with megatron-core for the import / init "
                    "table (default: this one if it has it, else $MEGATRON_PYTHON)")
    # worker mode (internal)
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.layout, args.world, args.rank, args.trace, args.profile)))
        return 0

    if args.import_init_only:
        return _import_init(args)
    worlds = tuple(args.worlds) if args.worlds else (QUICK_WORLDS if args.quick else WORLDS)
    repeats = args.repeats or (1 if args.quick else 3)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    rows = []
    for world in worlds:
        for layout in LAYOUTS:
            row = measure(world, layout, args.rank, repeats)
            rows.append(row)
            print(f"  {world:>6} {layout:<16} megashard {row['megashard']['wall_s']:.3f} s  "
                  f"init_device_mesh {row['init_device_mesh']['wall_s']:.3f} s  ({row['speedup']:.1f}×)", flush=True)
    profiles = {}
    if args.profile:
        for layout in LAYOUTS:
            profiles[layout] = _spawn("megashard", layout, max(worlds), args.rank, profile=True)["profile"]
    print()
    print(table(rows))
    g = goals(rows)
    print()
    print(f"groups created ≤ the rank's groups (floor) everywhere: {'yes' if g['groups_within_floor'] else 'NO ' + str(g['groups_over_floor'])}")
    if g["speedup_goal_measured"]:
        print(f"≥{GOAL_SPEEDUP:.0f}× faster than init_device_mesh at {GOAL_WORLD:,} ranks: "
              f"{'yes' if g['speedup_goal_met'] else 'NO ' + str(g['speedup_below_goal'])}")
    for layout, text in profiles.items():
        print(f"\ncProfile, megashard, {layout}, {max(worlds):,} ranks:\n{text}")
    import torch

    doc = {
        "benchmark": "init_scale",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "quick": args.quick,
        "repeats": repeats,
        "rank": args.rank,
        "elapsed_s": time.perf_counter() - t_start,
        "baseline": "init_device_mesh (pp, dp, cp, tp) + _flatten dp_cp, dp_shard_cp, tp_cp",
        "rows": rows,
        "goals": g,
        "profiles": profiles,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwrote {args.out}")
    if not (args.quick or args.no_import_init):
        _import_init(args)
    return 0


def _import_init(args: argparse.Namespace) -> int:
    """The import / init table of init_import.py (a file of its own: it runs under Megatron's interpreter too)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import init_import

    print("\nimport and initialisation apart (seconds beyond import torch.distributed; fresh process each):")
    init_import.run(megatron_python=args.megatron_python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
