"""The arithmetic under every rank layout: a mixed-radix rank grid, and a group's members without a list.

:class:`RankGrid` numbers ranks over named axes (leftmost fastest, as Megatron-LM's ``RankGenerator``);
:class:`GroupMembers` is one group of it as ``base + Σ i·stride``, so a group of millions of ranks costs nothing
until it is listed. Pure Python, no processes.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence, overload


def _span(dims: Iterable[tuple[int, int]]) -> list[int]:
    """All offsets ``Σ i·stride`` over ``(size, stride)`` dims, first dim fastest."""
    offs = [0]
    for size, stride in dims:
        if size > 1:
            offs = [o + i * stride for i in range(size) for o in offs]
    return offs


def _index(rank: int, dims: Iterable[tuple[int, int]]) -> int:
    """``rank``'s coordinates on ``(size, stride)`` dims read as one mixed-radix number, first dim fastest."""
    idx, mult = 0, 1
    for size, stride in dims:
        idx += ((rank // stride) % size) * mult
        mult *= size
    return idx


class RankGrid:
    """A mixed-radix rank grid: named axes listed fastest first; a rank is ``Σ coord_k · stride_k``.

    ``names``, ``sizes``, ``strides`` (per axis, fastest first), ``index`` (axis name -> position) and
    ``world_size`` are public: :class:`~megashard.state.ParallelState` builds its mesh tensors from them."""

    def __init__(self, axes: Sequence[tuple[str, int]]):
        self.names = [a for a, _ in axes]
        self.sizes = [s for _, s in axes]
        self.strides = []
        acc = 1
        for s in self.sizes:
            self.strides.append(acc)
            acc *= s
        self.world_size = acc
        self.index = {n: i for i, n in enumerate(self.names)}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on every axis."""
        return {n: (rank // d) % s for n, s, d in zip(self.names, self.sizes, self.strides)}

    def split(self, axes: Iterable[str]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(size, stride)`` of the ``axes`` and of the other axes, fastest first."""
        mask = set(axes)
        masked = [(s, d) for n, s, d in zip(self.names, self.sizes, self.strides) if n in mask]
        rest = [(s, d) for n, s, d in zip(self.names, self.sizes, self.strides) if n not in mask]
        return masked, rest

    def groups(self, axes: Iterable[str]) -> list[list[int]]:
        """Every group spanning ``axes`` (members fastest axis first; groups in the order of the other axes)."""
        masked, rest = self.split(axes)
        offs = _span(masked)
        return [[b + o for o in offs] for b in _span(rest)]

    def group_of(self, axes: Iterable[str], rank: int) -> list[int]:
        """The group spanning ``axes`` that holds ``rank``."""
        masked, _ = self.split(axes)
        base = rank - sum(((rank // d) % s) * d for s, d in masked)
        return [base + o for o in _span(masked)]

    def rank_in(self, axes: Iterable[str], rank: int) -> int:
        """Index of ``rank`` inside its group spanning ``axes``."""
        return _index(rank, self.split(axes)[0])

    def group_index(self, axes: Iterable[str], rank: int) -> int:
        """Which of :meth:`groups` (``axes``) holds ``rank``."""
        return _index(rank, self.split(axes)[1])

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (missing axes: 0)."""
        return sum(coords.get(n, 0) * d for n, d in zip(self.names, self.strides))


class GroupMembers(Sequence[int]):
    """The ranks of one group without listing them: ``base + Σ i_k·stride_k`` over ``(size_k, stride_k)``
    dims, first dim fastest (the order of :meth:`RankLayout.group_of`). Indexing and ``len`` are O(dims),
    so a group of 16 million ranks costs nothing until it is iterated; ``list(m)`` lists it.
    Equal to a list or tuple of the same ranks."""

    __slots__ = ("base", "dims", "_len")

    def __init__(self, base: int, dims: Iterable[tuple[int, int]]):
        merged: list[tuple[int, int]] = []
        for size, stride in dims:  # canonical form: size-1 dims dropped, contiguous dims merged
            if size == 1:
                continue
            if merged and merged[-1][0] * merged[-1][1] == stride:
                merged[-1] = (merged[-1][0] * size, merged[-1][1])
            else:
                merged.append((size, stride))
        self.base, self.dims = base, tuple(merged)
        n = 1
        for size, _ in self.dims:
            n *= size
        self._len = n

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"group index {i} out of range for a group of {self._len} ranks")
        r = self.base
        for size, stride in self.dims:
            i, c = divmod(i, size)
            r += c * stride
        return r

    def __iter__(self) -> Iterator[int]:
        return iter(_span(self.dims) if not self.base else [self.base + o for o in _span(self.dims)])

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        off = rank - self.base
        for size, stride in sorted(self.dims, key=lambda d: -d[1]):  # largest stride first: greedy digits
            c = min(off // stride, size - 1) if off >= 0 else -1
            off -= max(c, 0) * stride
        return off == 0 and rank >= self.base

    @property
    def stride(self) -> int | None:
        """The step when the ranks form an arithmetic progression (one dim; 1 for a single rank), else None."""
        if not self.dims:
            return 1
        return self.dims[0][1] if len(self.dims) == 1 else None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GroupMembers):
            return (self.base, self.dims) == (other.base, other.dims)
        if isinstance(other, (list, tuple)):
            return len(other) == self._len and list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.base, self.dims))

    def __repr__(self) -> str:
        if self._len <= 64:
            return repr(list(self))
        return f"GroupMembers(base={self.base}, dims={list(self.dims)})  # {self._len} ranks"
