"""What one parallel layout holds per rank besides its groups: the RNG tracker, the memory buffer, the
virtual-pipeline rank.

A :class:`~megashard.state.ParallelState` owns one :class:`LayoutLocals` (``state.locals``), so two states keep
two trackers and two buffers. The Megatron-style module functions (``get_cuda_rng_tracker``,
``get_global_memory_buffer``, ``set_virtual_pipeline_model_parallel_rank`` ...) act on the current state's, or —
before ``initialize()``, after ``destroy()``, or with no current state — on a *detached* one of the process
(:func:`megashard.state.current.current_locals`), which ``initialize()`` hands over to the state it creates.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megashard.state.buffer import GlobalMemoryBuffer

__all__ = ["LayoutLocals"]


class LayoutLocals:
    """Per-layout mutable state of one rank.

    Attributes:
        rng_tracker: the RNG tracker (:mod:`megashard.state.rng`), or None until first use.
        rng_tracker_flags: ``(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)`` it was made with.
        virtual_pipeline_rank: the virtual-pipeline stage being run (Megatron's ``_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK``),
            or None.
    """

    def __init__(self, device: "str | torch.device | None" = None) -> None:
        self.device = device
        self.rng_tracker: Any = None
        self.rng_tracker_flags: Optional[tuple[bool, bool, bool]] = None
        self.virtual_pipeline_rank: Optional[int] = None
        self._memory_buffer: Optional[GlobalMemoryBuffer] = None

    @property
    def memory_buffer(self) -> GlobalMemoryBuffer:
        """The scratch-memory buffer, created on first use on ``device`` (default: the current device)."""
        if self._memory_buffer is None:
            self._memory_buffer = GlobalMemoryBuffer(self.device)
        return self._memory_buffer

    def take_over(self, other: "LayoutLocals") -> None:
        """Move what ``other`` holds (set up before a state existed) into this one, where this one holds nothing;
        ``other`` is left empty."""
        if self.rng_tracker is None and other.rng_tracker is not None:
            self.rng_tracker, self.rng_tracker_flags = other.rng_tracker, other.rng_tracker_flags
            other.rng_tracker, other.rng_tracker_flags = None, None
        if self._memory_buffer is None and other._memory_buffer is not None:
            self._memory_buffer, other._memory_buffer = other._memory_buffer, None
        if self.virtual_pipeline_rank is None:
            self.virtual_pipeline_rank = other.virtual_pipeline_rank
        other.reset()

    def reset(self) -> None:
        """Drop the tracker (the next use creates a fresh one), free the buffer, forget the virtual-pipeline rank."""
        self.rng_tracker, self.rng_tracker_flags = None, None
        if self._memory_buffer is not None:
            self._memory_buffer.clear()
        self._memory_buffer = None
        self.virtual_pipeline_rank = None
