"""Index arithmetic every layer shares: ``torch.chunk`` bounds and row-major (contiguous) strides.

Plain integer arithmetic, no torch import, so any module may use it without importing upward
(the memory buffer, recompute, sharding, DTensor splits, flat shards).

``torch.chunk`` splits a length ``L`` into ``n`` chunks of ``ceil(L / n)`` elements each; the last
non-empty chunk may be shorter and the chunks after it are empty (``torch.chunk`` drops them,
a sharding keeps them as zero-length shards)::

    chunk_sizes(10, 4) == (3, 3, 3, 1)      chunk_sizes(5, 4) == (2, 2, 1, 0)
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["chunk_bounds", "chunk_size", "chunk_sizes", "contiguous_strides"]


def chunk_size(length: int, num_chunks: int) -> int:
    """Elements of a full chunk when ``torch.chunk`` splits ``length`` into ``num_chunks``: ``ceil(length / num_chunks)``."""
    return -(-int(length) // int(num_chunks))


def chunk_bounds(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` (0-based) when ``torch.chunk`` splits ``length`` into ``num_chunks``.

    Trailing chunks are empty (``start == stop == length``) when the chunks overshoot ``length``.
    """
    size = chunk_size(length, num_chunks)
    return min(size * index, length), min(size * (index + 1), length)


def chunk_sizes(length: int, num_chunks: int) -> tuple[int, ...]:
    """The length of every chunk, empty trailing chunks included (``len() == num_chunks``)."""
    return tuple(b - a for a, b in (chunk_bounds(length, num_chunks, i) for i in range(num_chunks)))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides (in elements) of a contiguous row-major tensor of ``shape``, as ``torch.empty(shape).stride()``.

    A zero-size dim counts as 1 for the strides of the dims before it, as in PyTorch.
    """
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))
