"""The scratch-memory buffer class: one allocation per (name, dtype) reused instead of allocated per step.

Apart from :mod:`megashard.state.memory` (the current state's buffer, which needs the current state) so that the
per-layout state (:mod:`megashard.state.layout_locals`) can own one without importing the current state.
See :mod:`megashard.state.memory` for use."""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Callable, Optional, Sequence, Union

import torch

from megashard.chunks import contiguous_strides
from megashard.errors import ConfigError
from megashard.state.devices import current_device

__all__ = ["GlobalMemoryBuffer"]


def _checked_shape(tensor_shape: object, name: str) -> tuple[int, ...]:
    """Accept any integer-like dims (e.g. NumPy ints) as ints; refuse bools, negatives and non-ints."""
    try:
        dims = (tensor_shape,) if not hasattr(tensor_shape, "__iter__") else tuple(tensor_shape)  # type: ignore[arg-type]
        if any(isinstance(d, bool) for d in dims):
            raise TypeError
        shape = tuple(operator.index(d) for d in dims)
    except TypeError:
        shape = (-1,)
    if min(shape, default=0) < 0:
        raise ConfigError(f"get_tensor({name!r}): tensor_shape must be non-negative ints, got {tensor_shape!r}")
    return shape


class GlobalMemoryBuffer:
    """One flat buffer per ``(name, dtype)``, grown when a request does not fit.

    ``device`` defaults to the CUDA current device when CUDA is available, else the CPU; a CUDA ``device``
    without a usable CUDA device raises :class:`~megashard.errors.ConfigError` here, not at the first request.
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None) -> None:
        self.device = torch.device(device) if device is not None else current_device()
        if self.device.type == "cuda":
            from megashard.state.devices import cuda_unavailable_reason

            why = cuda_unavailable_reason()
            if why:
                raise ConfigError(f"GlobalMemoryBuffer(device={str(self.device)!r}): {why}; use device='cpu' "
                                  "(or leave it unset: the CUDA current device when there is one, else the CPU)")
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._shapes: dict[tuple, tuple[tuple[int, ...], int, tuple[int, ...]]] = {}  # shape -> (shape, numel, strides)

    def get_tensor(
        self,
        tensor_shape: Union[int, Sequence[int], torch.Size],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    ) -> torch.Tensor:
        """Return a tensor of shape ``tensor_shape`` and ``dtype`` backed by buffer ``(name, dtype)``.

        No allocation happens when the buffer already holds at least ``prod(tensor_shape)`` elements;
        otherwise the buffer is replaced by a new one of exactly that many elements, allocated inside
        ``mem_alloc_context()`` when given (e.g. a CUDA memory pool). Tensors handed out earlier keep
        the old storage alive until they are dropped. Contents are uninitialised.
        """
        if type(tensor_shape) is torch.Size:
            shape = tuple(tensor_shape)
        else:
            shape = (tensor_shape,) if isinstance(tensor_shape, int) else tuple(tensor_shape)
            if not all(type(d) is int for d in shape):  # bools, floats, NumPy ints: slow path
                shape = _checked_shape(tensor_shape, name)
        info = self._shapes.get(shape)
        if info is None:  # first request of this shape: validate once, remember numel and strides
            shape = _checked_shape(shape, name)
            info = (shape, math.prod(shape), contiguous_strides(shape))
            if len(self._shapes) >= 4096:
                self._shapes.clear()  # bound the memo for callers with ever-changing shapes
            self._shapes[shape] = info
        shape, required, strides = info
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < required:
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"get_tensor({name!r}): dtype must be a torch.dtype, got {dtype!r}")
            ctx = _allocation_context(mem_alloc_context, name)
            with ctx:
                buf = torch.empty(required, dtype=dtype, device=self.device, requires_grad=False)
            self.buffer[key] = buf
        # One as_strided call: half the cost of buf[:required].view(shape) (two views) per request.
        return buf.as_strided(shape, strides)

    def clear(self) -> None:
        """Drop every buffer (memory is freed once no handed-out view references it)."""
        self.buffer.clear()

    def nbytes(self) -> int:
        """Total bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffer.values())


def _allocation_context(mem_alloc_context: Optional[Callable[[], contextlib.AbstractContextManager]],
                        name: str) -> contextlib.AbstractContextManager:
    """``mem_alloc_context()``, checked: a callable that returns a context manager (e.g.
    ``lambda: torch.cuda.use_mem_pool(pool)``), not the context manager itself (a ``with`` block can be entered
    only once, and the buffer allocates again whenever a request outgrows it)."""
    if mem_alloc_context is None:
        return contextlib.nullcontext()
    fix = "pass a callable that returns one, e.g. mem_alloc_context=lambda: torch.cuda.use_mem_pool(pool)"
    if not callable(mem_alloc_context):
        raise ConfigError(f"get_tensor({name!r}): mem_alloc_context must be a callable returning a context manager, "
                          f"got {type(mem_alloc_context).__name__} {mem_alloc_context!r}; {fix}")
    ctx = mem_alloc_context()
    if not (hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__")):
        raise ConfigError(f"get_tensor({name!r}): mem_alloc_context() returned {type(ctx).__name__} {ctx!r}, not a "
                          f"context manager; {fix}")
    return ctx
