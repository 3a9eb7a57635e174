"""This rank's slice of a seeded parameter, drawn without holding the whole parameter.

The job initialises every parameter so that the *global* tensor depends on the seed only (:func:`megashard.models.
gpt.model.init_parameters`): the full tensor is drawn from a private generator, and each rank keeps its slice. Drawn
whole in float64, the largest parameter (the embedding: vocab × hidden) costs every rank vocab × hidden × 8 bytes
of host memory at once — 4 GiB at a 128k vocabulary and hidden 4096. :func:`local_normal` draws the same values in
row blocks of the full tensor and keeps only the slice: CPU ``normal_`` of a contiguous float64 tensor of 16 or more
elements draws one uniform per element in order, turns each aligned block of 16 into normals, and redraws the last
16 when the size is not a multiple of 16; blocks whose sizes are multiples of 16 (the last one at least 16 elements)
give the very same values (``tests/test_init_slices.py`` holds it to the whole draw, bit for bit).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["slice_ranges", "local_normal", "BLOCK_ELEMENTS"]

#: Elements of the full tensor drawn at a time (8 MiB of float64).
BLOCK_ELEMENTS = 1 << 20


def slice_ranges(shape: Sequence[int], cuts: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` per dim of ``full.chunk(n, dim)[r]`` applied for each ``(dim, n, r)`` of ``cuts`` in
    order (``torch.chunk``: pieces of ⌈len/n⌉)."""
    ranges = [(0, int(d)) for d in shape]
    for dim, n, r in cuts:
        a, b = ranges[dim]
        size = -(-(b - a) // n)
        ranges[dim] = (min(a + r * size, b), min(a + (r + 1) * size, b))
    return ranges


def local_normal(shape: Sequence[int], cuts: Sequence[tuple[int, int, int]], std: float,
                 generator: torch.Generator, block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """The slice ``cuts`` (see :func:`slice_ranges`) of ``torch.empty(shape, float64).normal_(0, std, generator)``,
    drawn in row blocks of about ``block_elements`` elements: the same values, one block in memory at a time."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    ranges = slice_ranges(shape, cuts)
    index = tuple(slice(a, b) for a, b in ranges)
    row = numel // shape[0] if shape and shape[0] else 0
    if not shape or numel <= block_elements or row == 0:
        return torch.empty(shape, dtype=torch.float64).normal_(0.0, std, generator=generator)[index].clone()
    rows = max(1, block_elements // row)
    while (rows * row) % 16:  # every block a multiple of 16 elements: the blocks of 16 stay aligned
        rows += 1
    out = torch.empty([b - a for a, b in ranges], dtype=torch.float64)
    lo0, hi0 = ranges[0]
    start = 0
    while start < shape[0]:
        stop = min(start + rows, shape[0])
        if stop < shape[0] and (shape[0] - stop) * row < 16:
            stop = shape[0]  # the last block at least 16 elements (it redraws its last 16 like the whole tensor)
        block = torch.empty((stop - start,) + shape[1:], dtype=torch.float64).normal_(0.0, std, generator=generator)
        a, b = max(start, lo0), min(stop, hi0)
        if a < b:
            out[a - lo0:b - lo0] = block[(slice(a - start, b - start),) + index[1:]]
        del block  # before the next block is allocated: one block in memory, not two
        start = stop
    return out
