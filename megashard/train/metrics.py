"""Per-run metrics: one JSON object per step in ``<out_dir>/metrics.jsonl``, and the loss-curve PNG.

A line looks like ``{"step": 12, "loss": 4.81, "lr": 0.0018, "grad_norm": 0.93, "tokens": 12288,
"tokens_per_s": 10234.5, "step_time_s": 0.094, "time": 1730000000.1}``. A resumed run first drops the
lines of steps after the checkpoint it resumes from, so the file always describes one trajectory.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional


class MetricsWriter:
    """Append-only JSON-lines writer (rank 0 only). ``resume_step`` truncates later steps first."""

    def __init__(self, path: str, resume_step: int = 0) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step] if resume_step else []
        with open(path, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every record of a metrics file ([] if it does not exist; a torn last line is skipped)."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
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
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="training")
    valid = [r for r in records if "valid_loss" in r]
    if valid:
        ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", ms=3, lw=1.2, label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
