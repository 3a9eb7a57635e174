"""Checkpoints: save and load training state with ``torch.distributed.checkpoint``, in any layout.

    from megashard import checkpoint
    path = checkpoint.save("ckpt", step, model, optimizer, consumed_samples=n, keep_last=3)
    report = checkpoint.load(checkpoint.latest_checkpoint("ckpt"), model, optimizer)

The package holds one concept per module:

* save / load: :mod:`~megashard.checkpoint.saving`, :mod:`~megashard.checkpoint.loading`, built on
  :mod:`~megashard.checkpoint.state_dict` (what is saved), :mod:`~megashard.checkpoint.rank_state`
  (per-rank RNG and data-loader state), :mod:`~megashard.checkpoint.planners` (who writes which shard,
  weights-only objects) and :mod:`~megashard.checkpoint.collective` (every rank ends a step alike);
* files: :mod:`~megashard.checkpoint.safety` (crash-safe directories, completion marker, retention),
  :mod:`~megashard.checkpoint.checksums`, :mod:`~megashard.checkpoint.storage` (DCP storage that
  hashes as it writes and verifies as it reads), :mod:`~megashard.checkpoint.consolidate` (offline
  inspect / consolidate);
* Megatron-LM's building blocks, with its names: :mod:`~megashard.checkpoint.mapping` (``ShardedTensor``),
  :mod:`~megashard.checkpoint.distribution` (``distribute_shards_to_ranks``) and
  :mod:`~megashard.checkpoint.exchange` (``exchange_loaded_tensors_*``).

The package's names are imported on first use, so the pure file handling (``safety``, ``checksums``) loads
without torch: ``megashard run`` reads a checkpoint's records before it starts any process.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LoadReport", "latest_checkpoint", "list_checkpoints", "load", "save"]

_HOME = {"LoadReport": "loading", "load": "loading", "latest_checkpoint": "safety", "list_checkpoints": "safety",
         "save": "saving"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        import importlib

        value = getattr(importlib.import_module(f"megashard.checkpoint.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megashard.checkpoint' has no attribute {name!r}")
