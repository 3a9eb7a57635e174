"""What :func:`megashard.train.loop.train` returns on every rank: the steps trained, losses, throughput, waits."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    start_step: int
    """Step the run started after (0, or the step of the checkpoint it resumed from)."""
    final_step: int
    """Last step trained."""
    losses: dict[int, float] = field(default_factory=dict)
    """step → global mean loss (identical on every rank)."""
    grad_norms: dict[int, float] = field(default_factory=dict)
    """step → global gradient norm before clipping."""
    valid_losses: dict[int, float] = field(default_factory=dict)
    """step → validation loss (mean over ``train.eval_batches`` batches and every data-parallel rank)."""
    seconds: float = 0.0
    """Wall time of the training steps (excluding set-up)."""
    tokens_per_s: float = 0.0
    """Average global throughput of this run's steps."""
    out_dir: str = ""
    """The run's output directory."""
    checkpoint_blocked_s: dict[int, float] = field(default_factory=dict)
    """step → seconds the loop waited for that step's checkpoint (``checkpoint.async``: staging only, plus waiting for
    the previous background save if it still ran)."""
    checkpoint_end_wait_s: float = 0.0
    """``checkpoint.async``: seconds the end of training waited for the last background save."""
    parameters: int = 0
    """Parameters of the whole model (every expert counted)."""
    model_flops_per_token: float = 0.0
    """Model FLOPs of one token's forward and backward (:mod:`megashard.train.usage`)."""
    usage: dict = field(default_factory=dict)
    """The end summary's numbers (what ``<out_dir>/summary.json`` holds): throughput per device, model TFLOP/s,
    MFU and its peak, and per rank (lists in rank order) the peak host RSS growth and the device memory peaks."""
