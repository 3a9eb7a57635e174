"""Import and initialisation apart: what ``import megashard.parallel_state`` + ``initialize_model_parallel`` cost beyond
``import torch.distributed``, against Megatron-LM's and ``init_device_mesh``, at 65,536 and 1,048,576 fake ranks.

Every measurement is a FRESH process simulating one rank (rank 0) on the ``fake`` backend; the three phases are
timed apart: ``import torch.distributed`` (the common floor, reported for reference), the import the
implementation adds (``megashard.parallel_state`` / ``megatron.core.parallel_state`` /
``torch.distributed.device_mesh``) and the initialisation:

* megashard: ``initialize_model_parallel(tp, pp, cp, ep)`` — Megatron's signature, megashard's state underneath
  (groups created lazily by members only; no mesh is built);
* Megatron-LM: ``megatron.core.parallel_state.initialize_model_parallel`` with the same sizes
  (``create_gloo_process_groups=False``: a fake world has no gloo), run by the interpreter that has megatron-core
  (this one, or ``--megatron-python`` / ``$MEGATRON_PYTHON``); left out where none has it;
* ``init_device_mesh("cpu", (pp, dp, cp, tp))`` + ``_flatten`` of ``dp_cp``, ``dp_shard_cp``, ``tp_cp`` (as
  init_scale.py's baseline).

    python benchmarks/init_import.py [--worlds 65536 1048576] [--repeats 3] [--megatron-python PATH]

Prints a markdown table and writes ``benchmarks/results/init_import.json``; ``benchmarks/init_scale.py`` runs it too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "init_import.json")
WORLDS = (65536, 1048576)
LAYOUTS: dict[str, dict[str, int]] = {"tp8 cp2 pp4 ep8": {"tp": 8, "cp": 2, "pp": 4, "ep": 8}, "all sizes 1": {}}
IMPLS = ("megashard", "megatron", "init_device_mesh")
HEAVY = ("torch.distributed.tensor", "yaml", "megatron.core.transformer")
#: the goal of issue 21: megashard's import + init at 65,536 ranks, beyond import torch.distributed
GOAL_S, GOAL_WORLD = 0.1, 65536


def worker(impl: str, layout: str, world: int) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    s = LAYOUTS[layout]
    tp, cp, pp, ep = s.get("tp", 1), s.get("cp", 1), s.get("pp", 1), s.get("ep", 1)
    t0 = time.perf_counter()
    import torch.distributed as dist

    t1 = time.perf_counter()
    before = set(sys.modules)
    if impl == "megashard":
        import megashard.parallel_state as ps
    elif impl == "megatron":
        from megatron.core import parallel_state as ps
    else:
        from torch.distributed.device_mesh import init_device_mesh
    t2 = time.perf_counter()
    loaded = sorted(m for m in HEAVY if m in set(sys.modules) - before)
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the fake backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t3 = time.perf_counter()
    if impl == "megashard":
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep)
    elif impl == "megatron":
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep,
                                     create_gloo_process_groups=False)
    else:
        mesh = init_device_mesh("cpu", (pp, world // (tp * cp * pp), cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        mesh["dp", "cp"]._flatten("dp_cp")
        mesh["dp", "cp"]._flatten("dp_shard_cp")
        mesh["cp", "tp"]._flatten("tp_cp")
    t4 = time.perf_counter()
    return {"torch_distributed_import_s": t1 - t0, "import_s": t2 - t1, "init_s": t4 - t3,
            "heavy_modules_loaded_by_import": loaded}


def _python_for(impl: str, megatron_python: Optional[str]) -> Optional[str]:
    if impl != "megatron":
        return sys.executable
    for py in (sys.executable, megatron_python or os.environ.get("MEGATRON_PYTHON")):
        if py and subprocess.run([py, "-c", "import megatron.core.parallel_state"], capture_output=True,
                                 timeout=600).returncode == 0:
            return py
    return None


def _spawn(py: str, impl: str, layout: str, world: int, timeout: float) -> dict[str, Any]:
    root = os.path.dirname(HERE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [py, os.path.abspath(__file__), "--worker", impl, "--layout", layout, "--world", str(world)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(worlds, repeats: int, megatron_python: Optional[str], timeout: float, log=print) -> list[dict]:
    pys = {impl: _python_for(impl, megatron_python) for impl in IMPLS}
    rows = []
    for world in worlds:
        for layout in LAYOUTS:
            row: dict[str, Any] = {"world": world, "layout": layout}
            for impl in IMPLS:
                if pys[impl] is None:
                    row[impl] = {"error": "megatron-core not installed"}
                    continue
                reps = 1 if impl == "megatron" else repeats  # seconds to minutes each: one run says enough
                runs = [_spawn(pys[impl], impl, layout, world, timeout) for _ in range(reps)]
                ok = [r for r in runs if "error" not in r]
                if not ok:
                    row[impl] = runs[0]
                    continue
                best = {k: min(r[k] for r in ok) for k in ("torch_distributed_import_s", "import_s", "init_s")}
                row[impl] = {**best, "total_s": best["import_s"] + best["init_s"], "runs": runs,
                             "heavy_modules_loaded_by_import": ok[0]["heavy_modules_loaded_by_import"],
                             "python": pys[impl]}
                if len(ok) < len(runs):  # a slow repeat ran past the limit: say so, keep the ones that finished
                    row[impl]["errors"] = [r["error"] for r in runs if "error" in r]
            rows.append(row)
            log(f"  {world:>8,} {layout:<16} " + "  ".join(
                f"{i} {row[i]['import_s']:.3f}+{row[i]['init_s']:.3f} s" if "init_s" in row[i] else f"{i} -"
                for i in IMPLS), flush=True)
    return rows


def _cell(d: dict, key: str) -> str:
    return f"{d[key]:.3f}" if key in d else d.get("error", "-")


def table(rows: list[dict]) -> str:
    lines = ["| world | layout | megashard import / init / total s | Megatron-LM import / init / total s | "
             "init_device_mesh import / init / total s | megashard vs Megatron (total) | megashard vs "
             "init_device_mesh (total) | import torch.distributed s |", "|" + "---|" * 8]
    for r in rows:
        ms, mg, dm = r["megashard"], r["megatron"], r["init_device_mesh"]

        def trio(d: dict) -> str:
            return " / ".join(_cell(d, k) for k in ("import_s", "init_s", "total_s")) if "init_s" in d else d["error"]

        def ratio(d: dict) -> str:
            return f"{d['total_s'] / ms['total_s']:.1f}×" if "total_s" in d and "total_s" in ms else "-"

        lines.append(f"| {r['world']:,} | {r['layout']} | {trio(ms)} | {trio(mg)} | {trio(dm)} | {ratio(mg)} | "
                     f"{ratio(dm)} | {_cell(ms, 'torch_distributed_import_s')} |")
    return "\n".join(lines)


def goal(rows: list[dict]) -> dict[str, Any]:
    at = [r["megashard"] for r in rows if r["world"] == GOAL_WORLD and "total_s" in r["megashard"]]
    worst = max((d["total_s"] for d in at), default=None)
    heavy = sorted({m for r in rows for m in r["megashard"].get("heavy_modules_loaded_by_import", [])})
    return {"world": GOAL_WORLD, "limit_s": GOAL_S, "megashard_total_s_worst": worst,
            "met": worst is not None and worst <= GOAL_S, "heavy_modules_loaded_by_megashard_import": heavy}


def run(worlds=WORLDS, repeats: int = 3, megatron_python: Optional[str] = None, timeout: float = 900,
        out: Optional[str] = RESULTS) -> dict[str, Any]:
    load0 = os.getloadavg()
    rows = measure(worlds, repeats, megatron_python, timeout)
    g = goal(rows)
    print()
    print(table(rows))
    print(f"\nmegashard import + init at {GOAL_WORLD:,} ranks ≤ {GOAL_S} s beyond import torch.distributed: "
          f"{'yes' if g['met'] else 'NO'} (worst {g['megashard_total_s_worst']}); DTensor / yaml loaded by the "
          f"import: {', '.join(g['heavy_modules_loaded_by_megashard_import']) or 'none'}")
    import torch

    doc = {"benchmark": "init_import", "torch": torch.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(), "repeats": repeats,
           "rank": 0, "rows": rows, "goal": g}
    if out:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {out} (load average {load0[0]:.1f} at start, {doc['loadavg_end'][0]:.1f} at end)")
    return doc


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=list(WORLDS))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per case, best reported (Megatron: one)")
    ap.add_argument("--megatron-python", default=None, help="an interpreter with megatron-core (default: this one "
                    "if it has it, else $MEGATRON_PYTHON)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per measurement before it counts as timed out")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.layout, args.world)))
        return 0
    run(tuple(args.worlds), args.repeats, args.megatron_python, args.timeout, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
