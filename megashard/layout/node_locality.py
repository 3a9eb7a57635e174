"""Node locality: which groups of a layout cross node boundaries, counted without listing any group.

With ``G`` ranks per node (node = rank // G) a group crosses a boundary when its members sit on more than one
node. :func:`locality_report` counts that per group name by arithmetic on the group bases (a 16,777,216-rank report
takes milliseconds) and warns about the names whose collectives should stay inside a node (``NODE_LOCAL_GROUPS``).
It reads a group name's axes as ``(size, rank stride)`` pairs — what :meth:`RankLayout.group_dims
<megashard.layout.RankLayout.group_dims>` gives, and :meth:`RankLayout.locality <megashard.layout.RankLayout.locality>`
hands in — so this arithmetic knows no layout class.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from megashard.errors import ConfigError
from megashard.layout.groups import NODE_LOCAL_GROUPS

#: ``(size, rank stride)`` of each axis, fastest first
Dims = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class LocalityReport:
    """Which groups cross node boundaries for ``ranks_per_node`` ranks per node."""

    ranks_per_node: int
    crossing: dict[str, tuple[int, int]]  # name -> (groups crossing nodes, total groups)
    warnings: tuple[str, ...]


def locality_warning(name: str, size: int, n_cross: int, n_groups: int, ranks_per_node: int) -> str:
    """The warning for a node-local group name (NODE_LOCAL_GROUPS) whose groups cross node boundaries."""
    return (
        f"{name} groups (size {size}) cross node boundaries in {n_cross} of {n_groups} groups with "
        f"{ranks_per_node} ranks per node: its collectives will run over the network; make {name} divide "
        f"{ranks_per_node} and put it first in order"
    )


def _base_residues(dims: Iterable[tuple[int, int]], G: int) -> dict[int, int]:
    """How many group bases (all sums of ``i·stride``, ``0 <= i < size`` per dim) have each residue mod G.

    ``i·stride mod G`` repeats with period ``G / gcd(stride, G)``, so each dim costs O(G²) at most, not
    O(size): a 131,072-rank world takes well under a millisecond per group name.
    """
    counts = {0: 1}
    for size, stride in dims:
        if size > 1:
            period = G // math.gcd(stride, G)
            # multiplicity of each step i < period among 0..size-1
            steps = {(i * stride) % G: (size - i + period - 1) // period for i in range(min(size, period))}
            nxt: dict[int, int] = {}
            for r, c in counts.items():
                for k, m in steps.items():
                    key = (r + k) % G
                    nxt[key] = nxt.get(key, 0) + c * m
            counts = nxt
    return counts


def _residue_cost(dims: Iterable[tuple[int, int]], G: int) -> int:
    """An upper bound of the dictionary updates :func:`_base_residues` makes."""
    cost, n = 0, 1
    for size, stride in dims:
        if size > 1:
            steps = min(size, G // math.gcd(stride, G))
            cost += n * steps
            n = min(G, n * steps)
    return cost


def _bases_below(x: int, masked: Sequence[tuple[int, int]], rest: Sequence[tuple[int, int]]) -> int:
    """How many group bases (ranks whose coordinates on the ``masked`` dims are 0) are < ``x``; O(dims)."""
    dims = sorted([(s, d, True) for s, d in masked if s > 1] + [(s, d, False) for s, d in rest if s > 1],
                  key=lambda t: t[1])
    free_below = [1]  # bases per value of the lower digits
    for size, _, is_masked in dims:
        free_below.append(free_below[-1] * (1 if is_masked else size))
    count = 0
    for k in range(len(dims) - 1, -1, -1):  # most significant digit first
        size, stride, is_masked = dims[k]
        digit = (x // stride) % size
        count += (min(digit, 1) if is_masked else digit) * free_below[k]
        if is_masked and digit:
            return count
    return count


def locality_report(ranks_per_node: int, world_size: int, dims: Iterable[tuple[str, Dims, Dims]]) -> LocalityReport:
    """Count, per group name, the groups whose members sit on more than one node (node = rank // G), and warn
    about node-local names (NODE_LOCAL_GROUPS) that cross; :meth:`RankLayout.locality` calls this.

    ``dims``: ``(name, masked, rest)`` per group name — the axes a group of that name spans and the other axes of
    its grid, as :meth:`RankLayout.group_dims` gives them (read after ``ranks_per_node`` is checked).

    Computed without listing any group: a group is ``base + offsets`` with the smallest offset 0 and the largest ``span``, so (when
    ``span < G``) it crosses a node boundary iff ``base % G + span >= G``. Either the residues of the
    group bases mod G are counted (cost independent of the world size, at most ~G² per axis) or, when
    fewer, the bases in the ``span`` ranks before every node boundary (O(world / G)) — whichever is
    cheaper: a 16,777,216-rank report takes milliseconds.
    """
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node={ranks_per_node!r} must be a positive integer")
    G, W = ranks_per_node, world_size
    crossing: dict[str, tuple[int, int]] = {}
    warnings = []
    for name, masked, rest in dims:
        size = math.prod(s for s, _ in masked)
        n_groups = W // size
        span = sum((s - 1) * d for s, d in masked)
        if size == 1 or G >= W:
            n_cross = 0
        elif span >= G:
            n_cross = n_groups
        elif _residue_cost(rest, G) <= 4 * (W // G):
            residues = _base_residues(rest, G)
            n_cross = sum(c for r, c in residues.items() if r >= G - span)
        else:  # bases in [p - span, p) for every node boundary p (disjoint ranges since span < G)
            n_cross = sum(_bases_below(p, masked, rest) - _bases_below(p - span, masked, rest)
                          for p in range(G, W, G))
        crossing[name] = (n_cross, n_groups)
        if n_cross and name in NODE_LOCAL_GROUPS:
            warnings.append(locality_warning(name, size, n_cross, n_groups, G))
    return LocalityReport(G, crossing, tuple(warnings))
