"""Measured step times: ``megashard plan --suggest --calibrate`` runs the top layouts on this machine and ranks by them.

    timings = time_layouts(doc, "job", result.ranked[:4], world_size=4)    # real `megashard run`s, interleaved
    apply_timings(result, timings)          # measured layouts first, fastest measured first; the rest as modelled
    save_calibration(path, timings, ...); load_calibration(path, shape, world_size)

The roofline of :mod:`megashard.advisor.cost` only ranks; it is not calibrated. Here each candidate runs as the job
runs — ``megashard run`` (torchrun, this machine, ``world_size`` processes on one node) of the job's config with the
candidate's overrides, a few steps, no checkpoints — and its ``metrics.jsonl`` gives the seconds of every step.
The first ``warmup`` steps are dropped (start-up, the optimizer's lazy state). Runs are interleaved over
``rounds`` rounds (round r starts at candidate r), so that a load that comes and goes on a shared machine falls on
every candidate alike, and each candidate's time is the median of its steps over all rounds.

A calibration file (JSON, ``kind: megashard-advisor-calibration``) keeps the timings with what they were measured
for (the job's numbers, the world size, the machine), so that a later ``--calibration FILE`` ranks without running
anything; a file measured for another job or world is refused, naming what differs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megashard.errors import ConfigError

KIND = "megashard-advisor-calibration"
VERSION = 1


@dataclass
class Timing:
    """Measured seconds per step of one layout (``layout``: :meth:`Candidate.label`)."""

    layout: str
    overrides: list[str]
    step_s: Optional[float] = None
    """Median seconds per step after the warm-up, over every round (None when no run finished)."""
    samples: list[float] = field(default_factory=list)
    error: Optional[str] = None
    """The last line of a failed run's error output."""
    rounds: list[float] = field(default_factory=list)
    """The median step of each round that finished (their spread is the noise of this layout's time)."""

    @property
    def noise(self) -> float:
        """Relative spread of this layout's time: (slowest - fastest round) / median over its rounds; with one round
        the spread of its steps' middle half (0 when unknown)."""
        if self.step_s is None:
            return 0.0
        vals = self.rounds if len(self.rounds) > 1 else self.samples
        if len(vals) < 2:
            return 0.0
        if len(self.rounds) > 1:
            return (max(vals) - min(vals)) / self.step_s
        q = statistics.quantiles(vals, n=4)
        return (q[2] - q[0]) / self.step_s


def _run_once(yaml_path: str, overrides: list[str], world_size: int, steps: int, out_dir: str,
              timeout: float) -> tuple[list[float], Optional[str]]:
    """One ``megashard run`` of the job with ``overrides``: the seconds of each step (metrics.jsonl), or an error."""
    cmd = [sys.executable, "-m", "megashard", "run", yaml_path, *overrides, f"train.steps={steps}",
           f"train.out_dir={out_dir}", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
           "train.plot=false", "train.resume=false", "train.eval_interval=0", f"launch.nproc_per_node={world_size}",
           "launch.nnodes=1", "launch.max_restarts=0"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"did not finish within {timeout:g} s"
    path = os.path.join(out_dir, "metrics.jsonl")
    if p.returncode != 0 or not os.path.exists(path):
        lines = [ln for ln in (p.stderr or p.stdout or "").strip().splitlines() if ln.strip()]
        return [], (lines[-1] if lines else f"exit code {p.returncode}")
    times = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "step_time_s" in rec:
                times.append(float(rec["step_time_s"]))
    return times, None


def time_layouts(doc: dict[str, Any], name: str, candidates: list[Any], world_size: int, *, steps: int = 5,
                 warmup: int = 2, rounds: int = 2, timeout: float = 600.0,
                 log: Optional[Callable[[str], None]] = None) -> list[Timing]:
    """Run every candidate ``rounds`` times (interleaved) for ``steps`` steps; the median step time after ``warmup``.

    ``doc``: the job as a YAML mapping (its config with the user's overrides applied); ``name``: the job's name (the
    file the runs read is ``<name>.yaml`` in a temporary directory that is removed afterwards).
    """
    import yaml

    from megashard.advisor.units import check_count

    check_count("world_size", world_size, 1)
    check_count("steps", steps, 1)
    check_count("warmup", warmup, 0)
    check_count("rounds", rounds, 1)
    if steps <= warmup:
        raise ConfigError(f"--calibrate-steps {steps}: must be more than the {warmup} warm-up steps it drops")
    timings = [Timing(c.label(), c.overrides()) for c in candidates]
    tmp = tempfile.mkdtemp(prefix="megashard-calibrate-")
    try:
        yaml_path = os.path.join(tmp, f"{name}.yaml")
        with open(yaml_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        n = len(timings)
        for r in range(rounds):
            for k in range(n):
                i = (r + k) % n  # round r starts at candidate r: drift of the machine's load spreads over all
                t = timings[i]
                if t.error and not t.samples:
                    continue  # it failed before: do not wait for it again
                out = os.path.join(tmp, f"run{i}-{r}")
                times, err = _run_once(yaml_path, t.overrides, world_size, steps, out, timeout)
                shutil.rmtree(out, ignore_errors=True)
                if err:
                    t.error = err
                else:
                    t.samples += times[warmup:]
                    if times[warmup:]:
                        t.rounds.append(statistics.median(times[warmup:]))
                if log is not None:
                    what = f"{statistics.median(times[warmup:]) * 1e3:.1f} ms/step" if not err else f"failed: {err}"
                    log(f"calibrate: round {r + 1}/{rounds}, {t.layout}: {what}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for t in timings:
        t.step_s = statistics.median(t.samples) if t.samples else None
    return timings


def pick_layouts(ranked: list[Any], k: int, margin: float = 0.1) -> list[Any]:
    """The ``k`` layouts ``--calibrate`` times: layouts that differ, in the model's order. First the model's best
    variant of each distinct set of sizes (tp, cp, pp, vpp, dp_outer, dp_shard, ep, expt_tp); when there are fewer than
    ``k`` of those, the variants (recompute, microbatches) whose modelled time differs by more than ``margin`` from
    every picked variant of the same sizes; then the rest in the model's order. Timing three variants of one layout
    that differ by less than the noise of the rounds tells nothing (issue 40)."""
    picked: list[Any] = []
    seen: dict[tuple, list[float]] = {}

    def key(c: Any) -> tuple:
        return tuple(c.sizes.get(a) for a in ("tp", "cp", "pp", "vpp", "dp_outer", "dp_shard", "ep", "expt_tp"))

    for c in ranked:
        if len(picked) == k:
            return picked
        if key(c) not in seen:
            seen[key(c)] = [c.cost.seconds]
            picked.append(c)
    for c in ranked:
        if len(picked) == k:
            return picked
        times = seen[key(c)]
        if c not in picked and all(abs(c.cost.seconds / t - 1) > margin for t in times):
            times.append(c.cost.seconds)
            picked.append(c)
    picked += [c for c in ranked if c not in picked][:k - len(picked)]
    return picked


def kendall_tau(xs: list[float], ys: list[float]) -> Optional[float]:
    """Kendall's τ-b between two orders (``xs[i]``, ``ys[i]``: one item's two values); None with fewer than 2 items
    or no pair ordered in both."""
    n = len(xs)
    conc = disc = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif (a > 0) == (b > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else None


def noise_notes(timed: list[Any], timings: list[Timing]) -> list[str]:
    """One line per neighbouring pair of measured layouts (fastest first) whose times differ by less than the noise
    of their own rounds: their order is not measured, only guessed."""
    by = {t.layout: t for t in timings}
    out = []
    for a, b in zip(timed, timed[1:]):
        ta, tb = by.get(a.label()), by.get(b.label())
        if ta is None or tb is None or ta.step_s is None or tb.step_s is None:
            continue
        gap = tb.step_s / ta.step_s - 1
        noise = max(ta.noise, tb.noise)
        if gap <= noise:
            out.append(f"{a.label()} and {b.label()}: {gap:+.1%} apart, within the noise of their rounds "
                       f"(up to {noise:.1%}): their order is not measured")
    return out


def apply_timings(result: Any, timings: list[Timing]) -> int:
    """Put measured step times on ``result``'s candidates (``measured_s``) and rank: measured layouts first, fastest
    measured first; then the others in the model's order. Returns how many candidates got a measured time."""
    by_label = {t.layout: t for t in timings}
    hit = 0
    for c in result.ranked + result.too_big:
        t = by_label.get(c.label())
        c.measured_s = t.step_s if t is not None else None
        c.measure_error = t.error if t is not None and t.step_s is None else None
        hit += c.measured_s is not None
    order = {id(c): i for i, c in enumerate(result.ranked)}
    timed = [c for c in result.ranked if c.measured_s is not None]
    result.kendall_tau = kendall_tau([c.cost.seconds for c in timed], [c.measured_s for c in timed])
    result.ranked.sort(key=lambda c: (c.measured_s is None, c.measured_s if c.measured_s is not None else 0.0,
                                      order[id(c)]))
    timed = [c for c in result.ranked if c.measured_s is not None]
    result.noise_notes = noise_notes(timed, timings)
    return hit


# ---------------------------------------------------------------------------------------------- the file
def fingerprint(shape: Any) -> dict[str, Any]:
    """What a calibration is valid for: every number of the job's :class:`JobShape` except those a layout sets."""
    d = dataclasses.asdict(shape)
    d.pop("microbatches", None)
    d.pop("micro_batch_size", None)
    d.pop("branching", None)  # the synthetic data's: no bearing on the step time
    d.pop("schedule", None)
    return d


def save_calibration(path: str, timings: list[Timing], shape: Any, world_size: int, source: str, steps: int,
                     rounds: int, device: str) -> None:
    """Write the timings as a calibration file; an existing file is replaced only when it is a calibration file (one
    megashard wrote), never a file of the user's."""
    if os.path.exists(path):
        _read(path, "--calibration")  # refuses a file that is not one of ours
    doc = {"kind": KIND, "version": VERSION, "source": source, "world_size": world_size, "shape": fingerprint(shape),
           "machine": {"node": platform.node(), "cpus": os.cpu_count(), "device": device,
                       "python": platform.python_version()},
           "steps": steps, "rounds": rounds, "timings": [dataclasses.asdict(t) for t in timings]}
    from megashard.outputs import temp_path

    tmp = temp_path(path)  # a new name of its own (path.tmp<pid> could be a file of the user's)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _read(path: str, option: str) -> dict[str, Any]:
    from megashard.readers import SMALL, read_json

    if not os.path.lexists(path):
        raise ConfigError(f"{option} {path}: no such file (write one with --calibrate --calibration {path})")
    # a FIFO, device or huge file is named, never read (it would block or fill memory)
    doc = read_json(path, option, limit=SMALL, hint="give a calibration file megashard wrote (--calibrate)")
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ConfigError(f"{option} {path}: not a calibration file megashard wrote (no kind: {KIND}); megashard does "
                          "not overwrite or read it")
    if doc.get("version") != VERSION or not isinstance(doc.get("timings"), list):
        raise ConfigError(f"{option} {path}: calibration file version {doc.get('version')!r} (this megashard reads "
                          f"version {VERSION}); calibrate again")
    return doc


def load_calibration(path: str, shape: Any, world_size: int) -> list[Timing]:
    """The timings of a calibration file measured for this job (``shape``) and ``world_size``; ConfigError naming
    what differs otherwise."""
    from megashard.advisor.units import check_count

    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load_calibration: path={path!r:.60} must be a file path (str)")
    check_count("world_size", world_size, 1)
    doc = _read(os.fspath(path), "--calibration")
    got_world = doc.get("world_size")
    if isinstance(got_world, bool) or not isinstance(got_world, int) or got_world < 1:
        raise ConfigError(f"--calibration {path}: its world_size is {got_world!r} ({type(got_world).__name__}), not a "
                          "positive integer: the file is damaged or not megashard's; calibrate again (--calibrate)")
    if got_world != world_size:
        raise ConfigError(f"--calibration {path}: measured for {doc.get('world_size')} ranks, not --world-size "
                          f"{world_size}; calibrate this world (--calibrate)")
    want, got = fingerprint(shape), doc.get("shape") or {}
    diff = [f"{k}={got.get(k)!r} (this job: {v!r})" for k, v in want.items() if got.get(k) != v]
    if diff:
        raise ConfigError(f"--calibration {path}: measured for another job: {', '.join(diff[:4])}; calibrate this "
                          "job (--calibrate)")
    out = []
    for i, t in enumerate(doc["timings"]):
        if not isinstance(t, dict) or not isinstance(t.get("layout"), str):
            raise ConfigError(f"--calibration {path}: timings[{i}] has no layout; calibrate again")
        step = t.get("step_s")
        if step is not None and (not isinstance(step, (int, float)) or not step > 0):
            raise ConfigError(f"--calibration {path}: timings[{i}].step_s={step!r} is not a positive number")
        out.append(Timing(t["layout"], list(t.get("overrides") or []), step, list(t.get("samples") or []),
                          t.get("error"), [float(x) for x in t.get("rounds") or [] if isinstance(x, (int, float))]))
    return out
