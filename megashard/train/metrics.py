"""Per-run metrics: one JSON object per step in ``<out_dir>/metrics.jsonl``, the loss-curve PNG, and rank 0's
summary at the end (:func:`print_summary`).

A line looks like ``{"step": 12, "loss": 4.81, "lr": 0.0018, "grad_norm": 0.93, "tokens": 12288,
"tokens_per_s": 10234.5, "step_time_s": 0.094, "time": 1730000000.1, "world_size": 4}``. A resumed run first drops
the lines of steps after the checkpoint it resumes from, so the file always describes one trajectory. The first step
after a restart or a change of the world (an elastic job) carries ``world_change``: the world before, the nodes
that left and joined, the step resumed from, the steps redone and the seconds lost (:mod:`megashard.train.world`);
the loss plot marks those steps.
"""
from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from megashard.train.config import JobConfig
    from megashard.train.result import TrainResult


class MetricsWriter:
    """Append-only JSON-lines writer (rank 0 only). ``resume_step`` truncates later steps first.

    :meth:`write` is the one function through which a step record goes out: to ``metrics.jsonl`` and to the run's
    experiment loggers (``loggers``: a :class:`megashard.train.loggers.Loggers`, TensorBoard and W&B), so every path
    that records a step (the loop, a world change) reaches all of them alike."""

    def __init__(self, path: str, resume_step: int = 0, loggers: Any = None) -> None:
        self.path = path
        self.loggers = loggers
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step] if resume_step else []
        with open(path, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self.loggers is not None:
            self.loggers.log(record)

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every record of a metrics file ([] if it does not exist; a torn last line is skipped)."""
    if not os.path.isfile(path):
        return []
    from megashard.errors import MegashardError
    from megashard.readers import check_regular

    try:
        check_regular(path, "metrics file")  # not a FIFO (it would block): isfile above follows no race
    except MegashardError:
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def world_changes(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """``[(step, "world 4→2"), ...]``: the first step after each restart or change of the world size, with a label."""
    out = []
    for i, r in enumerate(records):
        change = r.get("world_change")
        before = records[i - 1].get("world_size") if i else None
        if isinstance(change, dict):
            before = change.get("world_size_before", before)
        elif not (i and before is not None and r.get("world_size") not in (None, before)):
            continue
        now = r.get("world_size")
        label = f"world {before}→{now}" if before not in (None, now) else "restart"
        out.append((int(r["step"]), label))
    return out


def plot_loss(records: Iterable[dict[str, Any]], path: str, title: str = "") -> Optional[str]:
    """Write the loss curve to ``path`` (PNG). Returns None on success, else a note why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss plot skipped: matplotlib is not installed (pip install 'megashard[plot]')"
    records = list(records)
    if not records:
        return "loss plot skipped: no metrics recorded"
    if os.path.lexists(path) and not _plot_of_ours(path):  # a picture of the user's in the run directory: kept
        return (f"loss plot skipped: {path} exists and is not a plot megashard drew (megashard never overwrites a "
                "file it did not make; move it away to get the plot)")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="training")
    valid = [r for r in records if "valid_loss" in r]
    if valid:
        ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", ms=3, lw=1.2, label="validation")
    marks = world_changes(records)
    for step, text in marks:  # a restart or a new world size: a dashed line at the first step trained after it
        ax.axvline(step - 0.5, color="tab:red", ls="--", lw=0.9, alpha=0.7)
        ax.annotate(text, xy=(step - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=7, color="tab:red", rotation=90, va="top")
    if valid or marks:
        if marks:
            ax.plot([], [], color="tab:red", ls="--", lw=0.9, label="restart / world change")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": _PLOT_SIGNATURE})  # a PNG text chunk: how the next run knows it
    plt.close(fig)
    return None


def write_summary(job: JobConfig, result: TrainResult) -> str:
    """``<out_dir>/summary.json``: the run's end summary (``result.usage``: throughput, model TFLOP/s, MFU and its
    peak, per-rank memory peaks) with its steps and final loss. Returns its path."""
    from megashard.outputs import temp_path

    path = os.path.join(result.out_dir, "summary.json")
    doc = {"job": job.name, "start_step": result.start_step, "final_step": result.final_step,
           "loss": result.losses.get(result.final_step), "valid_loss": result.valid_losses.get(result.final_step),
           "seconds": result.seconds, **result.usage}
    tmp = temp_path(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def usage_lines(usage: dict[str, Any]) -> list[str]:
    """The summary's lines of throughput, model size and memory per rank (from ``TrainResult.usage``)."""
    if not usage:
        return []
    out = []
    mfu = usage.get("mfu")
    peak = (f", MFU {mfu:.1%} of {usage['peak_tflops_per_device']:.3g} TFLOP/s ({usage['peak_source']})"
            if mfu is not None else f", MFU unknown ({usage.get('peak_source')})" if usage.get("peak_source") else "")
    out.append(f"  per device: {usage['tokens_per_s_per_device']:,.0f} tokens/s, model "
               f"{usage['model_tflops_per_device']:.3g} TFLOP/s{peak}")
    out.append(f"  model: {usage['parameters']:,} parameters, {usage['model_flops_per_token'] / 1e6:,.2f} MFLOP per "
               "token (forward and backward)")
    growth = usage.get("host_peak_rss_growth_bytes") or []
    if growth:
        top = max(range(len(growth)), key=lambda r: growth[r])
        each = ", ".join(_mib(g) for g in growth) if len(growth) <= 8 else f"{_mib(min(growth))} to {_mib(growth[top])}"
        line = (f"  peak memory per rank: host RSS +{_mib(growth[top])} (rank {top}; ranks 0..{len(growth) - 1}: "
                f"{each})")
        dev = usage.get("device_peak_allocated_bytes")
        if dev:
            d = max(range(len(dev)), key=lambda r: dev[r])
            line += (f"; device {_mib(dev[d])} allocated, {_mib(usage['device_peak_reserved_bytes'][d])} reserved "
                     f"(rank {d})")
        out.append(line)
    return out


#: The PNG "Software" text of the loss plot megashard draws (older plots: matplotlib's own, also accepted).
_PLOT_SIGNATURE = "megashard loss plot"


def _plot_of_ours(path: str) -> bool:
    """``path`` is a loss plot megashard drew: a regular PNG whose head carries megashard's signature (or, drawn by a
    megashard before signatures, matplotlib's)."""
    from megashard.errors import MegashardError
    from megashard.readers import check_regular

    try:
        check_regular(path, "loss plot")
        with open(path, "rb") as f:
            head = f.read(4096)
    except (OSError, MegashardError):
        return False
    return head.startswith(b"\x89PNG") and (_PLOT_SIGNATURE.encode() in head or b"matplotlib" in head)


def print_summary(job: JobConfig, result: TrainResult, records: list[dict[str, Any]]) -> None:
    """Rank 0's summary at the end: final loss, throughput per device and MFU, model size, memory per rank,
    outputs, the loss plot."""
    out = result.out_dir
    msg = [f"megashard run: {job.name}: "]
    if result.final_step == result.start_step:
        msg.append(f"nothing to do, already at step {result.final_step} of {job.train.steps} "
                   f"(checkpoint in {job.checkpoint_dir}); raise train.steps to train on")
    else:
        valid = result.valid_losses.get(result.final_step)
        msg.append(f"step {result.final_step}, loss {result.losses[result.final_step]:.4f}, "
                   + (f"validation loss {valid:.4f}, " if valid is not None else "") +
                   f"{result.tokens_per_s:,.0f} tokens/s over {result.seconds:.1f} s")
    lines = ["".join(msg)] + (usage_lines(result.usage) if result.final_step != result.start_step else [])
    lines.append(f"  metrics: {os.path.join(out, 'metrics.jsonl')} (summary: {os.path.join(out, 'summary.json')})")
    changes = [r["world_change"] for r in records if isinstance(r.get("world_change"), dict)]
    if changes:  # restarts and world changes of this run: the work they cost (details per change in metrics.jsonl)
        down = sum(c.get("seconds_down") or 0.0 for c in changes) + sum(c.get("seconds_redone") or 0.0 for c in changes)
        sizes = " → ".join(str(r["world_size"]) for i, r in enumerate(records) if "world_size" in r
                           and (i == 0 or records[i - 1].get("world_size") != r["world_size"]))
        lines.append(f"  {len(changes)} restart{'s' if len(changes) != 1 else ''} or world change"
                     f"{'s' if len(changes) != 1 else ''} (world {sizes}): {sum(c.get('steps_redone') or 0 for c in changes)} "
                     f"steps redone, {down:.1f} s lost")
    if job.train.plot:
        png = os.path.join(out, "loss.png")
        note = plot_loss(records, png, title=f"{job.name}: loss")
        lines.append(f"  {note}" if note else f"  loss curve: {png}")
    lines.append(f"  checkpoints: {job.checkpoint_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)
