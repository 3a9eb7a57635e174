"""Megatron's hybrid dp·cp groups as a view over the rank grid: consecutive slices of each dp·cp group.

With ``hybrid_context_parallel`` Megatron-LM 0.19 creates, for every power of two ``k`` from 2 up to (not including)
the size ``n`` of a dp·cp group — ``[2**i for i in range(int(log2(n)))][1:]`` — the groups of ``k`` consecutive
members of each dp·cp group (``ranks[i:i + k]`` for ``i`` in ``range(0, n, k)``; the last one shorter when ``k``
does not divide ``n``). Nothing here knows which ranks form a dp·cp group: the slices are taken from the
:class:`~megashard.layout.GroupMembers` the layout gives for ``dp_cp`` (DESIGN §6: one rank arithmetic).
"""
from __future__ import annotations

from math import log2
from megashard.layout.grid import GroupMembers

__all__ = ["HYBRID_PREFIX", "hybrid_group_sizes", "hybrid_name", "hybrid_slice", "slice_index"]

#: Group-name prefix of the hybrid dp·cp groups: ``hybrid_dp_cp_<k>``.
HYBRID_PREFIX = "hybrid_dp_cp_"


def hybrid_group_sizes(dp_cp: int) -> list[int]:
    """Megatron's sizes for a dp·cp group of ``dp_cp`` ranks: 2, 4, … below ``dp_cp`` (``[]`` for 1, 2 or 3)."""
    return [2 ** i for i in range(int(log2(dp_cp)))][1:] if dp_cp >= 1 else []


def hybrid_name(size: int) -> str:
    """The group name of the size-``size`` hybrid groups (``hybrid_dp_cp_4``)."""
    return f"{HYBRID_PREFIX}{size}"


def slice_index(index: int, size: int, n: int) -> tuple[int, int]:
    """``(start, stop)`` of the size-``size`` slice holding position ``index`` of a group of ``n`` members."""
    start = (index // size) * size
    return start, min(start + size, n)


def hybrid_slice(members: GroupMembers, index: int, size: int) -> "GroupMembers | list[int]":
    """The size-``size`` slice of ``members`` (one dp·cp group) holding its ``index``-th member.

    A :class:`GroupMembers` (O(dims), whatever the size) when the slice is a block of the group's dims — its first
    dims whole and the next one in runs of equal length, which holds for every power of two that divides ``n``
    when the dims' sizes are powers of two — otherwise the listed ranks (e.g. a dim of size 3 cut in twos, or the
    short last slice Megatron makes when ``size`` does not divide ``n``)."""
    n = len(members)
    start, stop = slice_index(index, size, n)
    if stop - start == size:
        dims: list[tuple[int, int]] = []
        left = size
        for s, d in members.dims:
            if left == 1:
                break
            if left % s == 0:
                dims.append((s, d))
                left //= s
            elif s % left == 0:
                dims.append((left, d))
                left = 1
            else:
                break
        if left == 1:
            return GroupMembers(members[start], dims)
    return members[start:stop]
