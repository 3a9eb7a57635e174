"""Save and resume the training job through :mod:`megashard.checkpoint.dcp`.

Every checkpoint is a directory ``<checkpoint dir>/step_<N>`` published atomically (temporary
directory, completion marker, rename; see :mod:`megashard.checkpoint.safety`), so a run killed while
saving resumes from the previous complete one.

What is stored is layout-independent: every parameter and AdamW moment as a DTensor of the *global*
tensor (see :func:`megashard.train.parallelize.global_dtensor`: this rank's FSDP shard of its TP slice,
placed on ``state.fsdp_mesh``), plus AdamW's step count, under the checkpoint's ``extra`` section.
Loading builds the same keys for the current layout and DCP reads each rank's part, so a run saved at
tp=2 · dp=2 resumes at dp=4 (or any other layout of the same model). The data position is a pure
function of the step (:mod:`megashard.train.data`) and the RNG is re-seeded from the step, so no
per-rank loader or generator state is needed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from megashard.train.parallelize import global_dtensor, local_tensor

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_full_model"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, *, fresh: bool) -> dict[str, Any]:
    """The global-DTensor state dict; ``fresh=True`` gives new empty local tensors (load targets)."""
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    opt_state = optimizer.state
    for name, p in model.named_parameters():
        loc = local_tensor(p.detach())
        sd["model"][name] = global_dtensor(torch.empty_like(loc) if fresh else loc, p, state)
        st = opt_state.get(p)
        if st is None and not fresh:
            continue  # no optimizer step yet
        for key in _MOMENTS:
            t = local_tensor(st[key]) if (st is not None and not fresh) else torch.empty_like(loc)
            sd["optim"][f"{name}.{key}"] = global_dtensor(t, p, state)
        step = st["step"] if (st is not None and not fresh) else torch.zeros((), dtype=torch.float32)
        sd["optim"][f"{name}.step"] = step.detach().clone() if fresh else step
    return sd


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any,
                    *, consumed_samples: Optional[int] = None, keep: int = 0) -> str:
    """Write the checkpoint of ``step`` under ``root`` (all ranks call); keep the newest ``keep`` (0 = all).

    Uses :func:`megashard.checkpoint.dcp.save`: written to a temporary directory, published by an
    atomic rename with a completion marker, so a run killed mid-save leaves the previous checkpoint
    as the newest complete one. Returns the checkpoint directory.
    """
    from megashard.checkpoint import dcp

    return dcp.save(root, step, state_dict=_state_dict(model, optimizer, state, fresh=False),
                    consumed_samples=consumed_samples, keep_last=keep or None, checksum="crc32",
                    overwrite=True, parallel_state=state)


def latest_checkpoint(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint under ``root``, or None."""
    from megashard.checkpoint import safety

    return safety.latest_checkpoint(root)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> int:
    """Load ``path`` (a checkpoint, or a root: its newest complete one) into the parallelized model and
    optimizer of the current layout, whatever layout it was saved with; returns its step.

    A checkpoint of another model raises :class:`~megashard.errors.CheckpointError` naming the first
    tensor whose shape differs.
    """
    from megashard.checkpoint import dcp

    sd = _state_dict(model, optimizer, state, fresh=True)
    report = dcp.load(path, state_dict=sd, parallel_state=state, restore_rng=False, verify=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local_tensor(p.detach()).copy_(sd["model"][name].to_local())
            st = optimizer.state.get(p)
            if st is None:
                st = optimizer.state[p] = {}
            for key in _MOMENTS:
                if key not in st:
                    st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                local_tensor(st[key]).copy_(sd["optim"][f"{name}.{key}"].to_local())
            st["step"] = sd["optim"][f"{name}.step"].to(torch.float32).clone()
    return int(report.step)


def read_full_model(path: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters saved in checkpoint ``path``, by name, read in this process alone.

    No process group needed: for inspection, exports and tests. Reads the whole checkpoint into memory.
    """
    from megashard.checkpoint.consolidate import load_full_state_dict

    # Verified files, tensors only, non-tensor items with weights_only=True: nothing unpickled blindly.
    nested = load_full_state_dict(path, keys={"extra.model"})
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            flat[key] = node

    walk(nested, "")
    prefix = "extra.model."
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
