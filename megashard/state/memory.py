"""A scratch-memory buffer: reuse one allocation per (name, dtype) instead of allocating per step.

Typical use is a communication or workspace buffer needed every step with the same shape::

    buf = get_global_memory_buffer().get_tensor((seq, hidden), torch.bfloat16, "mpu")

The returned tensor is a *view* of the buffer: its contents are garbage (like ``torch.empty``) and
it is overwritten by the next ``get_tensor`` with the same name and dtype. Callers must not use two
tensors of the same name at the same time.

The "global" buffer (Megatron's name) belongs to the current :class:`~megashard.state.ParallelState`
(``state.locals.memory_buffer``, on the state's device); before ``initialize()`` it is the process's detached one
(:mod:`megashard.state.layout_locals`). ``megashard.destroy()`` frees it.
"""
from __future__ import annotations

from megashard.state.buffer import GlobalMemoryBuffer
from megashard.state.current import current_locals

__all__ = ["GlobalMemoryBuffer", "get_global_memory_buffer"]


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The current state's :class:`GlobalMemoryBuffer` (before ``initialize()``: the process's), created on first use."""
    return current_locals().memory_buffer
