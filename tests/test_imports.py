"""The flow runs one way, and importing megashard costs nothing it does not need.

* Every import between megashard's modules — at module level, inside functions and under ``if TYPE_CHECKING:`` —
  read from the source (ast): no module imports, directly or through others, a module that imports it (no
  circles), and no module imports a module of a higher layer (config -> layout -> state -> tensors ->
  checkpoint/data -> models -> train -> launch/advisor -> cli). An import under ``if TYPE_CHECKING:`` never runs,
  but it is an arrow for the reader all the same: it makes a circle too (between the files of one folder as well
  as between folders), and it obeys the layers (a lower layer does not even name a higher one's types).
* Inside a folder the package's ``__init__`` is the top: no file imports its own package (or a package above it),
  whose ``__init__`` imports the folder's files — it imports the file that holds the name.
* ``import megashard.parallel_state`` (and ``initialize_model_parallel`` on 65,536 fake ranks) loads neither DTensor
  (``torch.distributed.tensor``), nor ``torch.distributed.device_mesh``, nor ``yaml``: checked in a fresh interpreter
  where importing them fails.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Layers, lowest first: a module may import its own layer and lower ones. The longest matching prefix wins.
LAYERS: list[tuple[str, ...]] = [
    ("megashard._version", "megashard._compat", "megashard.errors", "megashard.chunks", "megashard.progress",
     "megashard.introspect", "megashard.processes", "megashard.readers", "megashard.newfiles",
     "megashard.outputs"),
    ("megashard.config",),
    ("megashard.layout",),
    ("megashard.state", "megashard.parallel_ranks", "megashard.parallel_state", "megashard.doctor", "megashard.megatron"),
    ("megashard.tensors",),
    ("megashard.checkpoint", "megashard.data"),
    ("megashard.models",),
    ("megashard.train",),
    ("megashard.launch", "megashard.advisor", "megashard.rehearse", "megashard.live"),
    ("megashard.cli", "megashard.__main__"),
    ("megashard",),  # the package's own __init__: the facade over all of it
]

#: (importer, imported) pairs allowed to go upward, each with its reason. Keep it empty if at all possible.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for p in sorted((ROOT / "megashard").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, dict[str, tuple[int, bool]]]:
    """``{module: {imported megashard module: (line, type_only)}}`` for every module of the package.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                     for stmt in node.body for n in ast.walk(stmt)}
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges: dict[str, tuple[int, bool]] = {}
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names if a.name.split(".")[0] == "megashard"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "megashard":
                    continue
                for a in node.names:
                    sub = owner(f"{source}.{a.name}")
                    targets.append(sub if sub == f"{source}.{a.name}" else owner(source))
            for t in targets:
                if t and t != mod:
                    line, was_type_only = edges.get(t, (node.lineno, True))
                    edges[t] = (min(line, node.lineno), was_type_only and id(node) in type_only)
        graph[mod] = edges
    return graph


def _layer(mod: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:  # the top package's own __init__ is itself only: a new top-level module needs a layer
            if (mod == p or (mod.startswith(p + ".") and p != "megashard")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{mod} is in no layer: add it to LAYERS"
    return layer


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_graph_sees_function_level_and_type_checking_imports():
    g = import_graph()
    assert g["megashard.train.loop"]["megashard.train.ckptlock"][1] is False  # inside _hold_checkpoint_dir
    assert g["megashard.state.megatron_multi"]["megashard.state.core"][1] is True  # under TYPE_CHECKING only
    assert "megashard.state.current" in g["megashard.state.memory"]
    assert "megashard.config.parallel" in g["megashard.config"]  # a package's __init__ is a module too
    # a made-up circle is found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _circles(g: dict[str, dict[str, tuple[int, bool]]], with_type_only: bool) -> list[str]:
    """The circles of ``g`` (runtime imports only, or with the TYPE_CHECKING ones), one line per arrow in them."""
    # A file's import of its own package is test_no_import_of_own_package's (the package imports the file: a circle)
    edges = {m: {t for t, (_, type_only) in e.items() if (with_type_only or not type_only) and not _is_ancestor(t, m)}
             for m, e in g.items()}
    lines = []
    for comp in _cycles(edges):
        lines += [f"  {a} -> {b} (line {g[a][b][0]}{', TYPE_CHECKING' if g[a][b][1] else ''})"
                  for a in comp for b in sorted(edges[a]) if b in comp]
    return lines


def _is_ancestor(package: str, mod: str) -> bool:
    return mod.startswith(package + ".")


def test_no_import_circles():
    lines = _circles(import_graph(), with_type_only=False)
    assert not lines, "import circles:\n" + "\n".join(lines)


def test_no_import_circles_counting_type_checking_imports():
    """Inside one folder too: ``config/nccl.py`` naming ``ParallelConfig`` under TYPE_CHECKING while
    ``config/parallel.py`` calls ``nccl_spec`` was a circle (issue 28); the thing both need moves down, or the
    check moves to the caller."""
    lines = _circles(import_graph(), with_type_only=True)
    assert not lines, "import circles (TYPE_CHECKING imports included):\n" + "\n".join(lines)


def test_the_circle_checks_see_a_circle_inside_one_folder():
    g = {"megashard.x.a": {"megashard.x.b": (3, False)}, "megashard.x.b": {"megashard.x.a": (7, True)},
         "megashard.x": {"megashard.x.a": (1, False)}, "megashard.x.c": {"megashard.x": (2, False)}}
    assert _circles(g, with_type_only=False) == []
    assert _circles(g, with_type_only=True) == ["  megashard.x.a -> megashard.x.b (line 3)",
                                                "  megashard.x.b -> megashard.x.a (line 7, TYPE_CHECKING)"]
    assert _own_package_imports(g) == ["  megashard.x.c -> megashard.x, line 2"]


def _own_package_imports(g: dict[str, dict[str, tuple[int, bool]]]) -> list[str]:
    return [f"  {m} -> {t}, line {line}{' (TYPE_CHECKING)' if type_only else ''}"
            for m, edges in sorted(g.items()) for t, (line, type_only) in sorted(edges.items()) if _is_ancestor(t, m)]


def test_no_import_of_own_package():
    """A file imports the file that holds the name, not its folder's ``__init__`` (the facade over the folder):
    ``state/recompute.py`` took ``get_parallel_state`` from ``megashard.state`` (issue 28)."""
    up = _own_package_imports(import_graph())
    assert not up, "imports of a module's own package (import the module that holds the name):\n" + "\n".join(up)


def test_no_upward_imports():
    g = import_graph()
    up = [f"  {m} ({_layer(m)}) -> {t} ({_layer(t)}), line {line}{' (TYPE_CHECKING)' if type_only else ''}"
          for m, edges in sorted(g.items()) for t, (line, type_only) in sorted(edges.items())
          if _layer(t) > _layer(m) and (m, t) not in ALLOWED_UPWARD]
    assert not up, "imports of a higher layer (config -> layout -> state -> tensors -> checkpoint -> models -> " \
                   "train -> launch/advisor -> cli):\n" + "\n".join(up)


_LIGHT = r"""
import sys, time
import torch.distributed as dist
HEAVY = ("torch.distributed.tensor", "torch.distributed.device_mesh", "yaml")
for name in HEAVY:  # torch.distributed itself may have loaded device_mesh: make any further import of them fail
    sys.modules[name] = None
t0 = time.perf_counter()
import megashard.parallel_state as ps
t1 = time.perf_counter()
from megashard._compat import fake_store
dist.init_process_group("fake", store=fake_store(), rank=12345, world_size=65536)
t2 = time.perf_counter()
ps.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                             context_parallel_size=2)
t3 = time.perf_counter()
print(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_world_size(),
      ps.get_context_parallel_rank())
ps.destroy_model_parallel()
print(f"import {t1 - t0:.3f} s, init {t3 - t2:.3f} s", file=sys.stderr)
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_parallel_state_loads_no_dtensor_device_mesh_or_yaml():
    r = _run(_LIGHT)
    assert r.returncode == 0, r.stderr[-3000:]
    # rank 12345 of tp8·cp2·pp4 (order tp-cp-dp-pp): tp rank 1, cp rank 1, pp rank 12345 // 16384 = 0, dp 1024
    assert r.stdout.split() == ["1", "0", "1024", "1"], r.stdout


def test_parallel_state_import_adds_none_of_them():
    """Without blocking: what ``import megashard.parallel_state`` adds to what ``import torch.distributed`` loaded."""
    r = _run("import sys, torch.distributed\nbefore = set(sys.modules)\nimport megashard.parallel_state\n"
             "print(sorted(m for m in set(sys.modules) - before if m in ('yaml', 'torch.distributed.device_mesh') "
             "or m.startswith(('torch.distributed.tensor', 'yaml.'))))")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_the_old_paths_of_moved_modules_still_work():
    """``megashard.train.<old name>`` (README and docs named them before issue 21 moved them) is the moved module."""
    import importlib

    from megashard.train import _MOVED

    for old, new in _MOVED.items():
        moved = importlib.import_module(new)
        assert importlib.import_module(f"megashard.train.{old}") is moved, old
        assert moved.__spec__.name == new, old  # the alias does not rename the module
    from megashard.models.gpt.model import GPT
    from megashard.train.model import GPT as OldGPT

    assert OldGPT is GPT
    # ... and as a command line: the worker without a config prints its usage and exits 2
    r = _run("import runpy, sys; sys.argv = ['x']; runpy.run_module('megashard.train.worker', run_name='__main__')")
    assert r.returncode == 2 and "usage: python -m megashard.launch.worker CONFIG.yaml" in r.stderr, r.stderr[-2000:]
