"""`RankLayout`: which ranks form each parallel group — pure arithmetic, no processes.

Ranks are laid out as Megatron-LM's ``RankGenerator`` lays them out: the axes of the ``order`` string
form a mixed-radix number, leftmost axis fastest. A group of an axis combination holds the ranks that
differ only along those axes; its members are listed with the leftmost (fastest) axis varying fastest,
and groups are listed in the same mixed-radix order of the remaining axes. Megatron's ``dp`` is split
here into ``dp_shard`` (faster) and ``dp_outer``, so ``dp`` groups are unchanged and HSDP's groups are
contiguous slices of them.

Two layouts share the ranks: the *dense* one over ``(tp, cp, dp_shard, dp_outer, pp)`` and the *expert*
one over ``(expt_tp, ep, expt_dp, pp)`` ("MoE parallel folding").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence, overload

from megashard.config import ParallelConfig, ResolvedSizes
from megashard.errors import ConfigError

#: Named groups: name -> (layout, axes). Axes are listed for documentation; membership order comes from `order`.
DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp_shard", "dp_outer"),
    "dp_shard": ("dp_shard",),
    "dp_outer": ("dp_outer",),
    "dp_cp": ("cp", "dp_shard", "dp_outer"),
    "dp_shard_cp": ("cp", "dp_shard"),
    "hsdp": ("cp", "dp_shard", "dp_outer"),
    "tp_cp": ("tp", "cp"),
    "tp_dp": ("tp", "dp_shard", "dp_outer"),
    "tp_dp_cp": ("tp", "cp", "dp_shard", "dp_outer"),
    "mp": ("tp", "pp"),
    "world": ("tp", "cp", "dp_shard", "dp_outer", "pp"),
}
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
    "expt_pp": ("pp",),
}
GROUP_NAMES: tuple[str, ...] = tuple(DENSE_GROUPS) + tuple(EXPERT_GROUPS)
DENSE_MESH_AXES = ("pp", "dp_outer", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "expt_dp", "ep", "expt_tp")
#: Groups that should stay inside a node (their collectives sit on the critical path).
NODE_LOCAL_GROUPS = ("tp", "ep", "expt_tp")


class _Grid:
    """A mixed-radix rank grid: axes listed fastest first."""

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
        return {n: (rank // d) % s for n, s, d in zip(self.names, self.sizes, self.strides)}

    @staticmethod
    def _span(dims: Iterable[tuple[int, int]]) -> list[int]:
        # All offsets over (size, stride) dims, first dim fastest.
        offs = [0]
        for size, stride in dims:
            if size > 1:
                offs = [o + i * stride for i in range(size) for o in offs]
        return offs

    def _split(self, axes: Iterable[str]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        mask = set(axes)
        masked = [(s, d) for n, s, d in zip(self.names, self.sizes, self.strides) if n in mask]
        rest = [(s, d) for n, s, d in zip(self.names, self.sizes, self.strides) if n not in mask]
        return masked, rest

    def groups(self, axes: Iterable[str]) -> list[list[int]]:
        masked, rest = self._split(axes)
        offs = self._span(masked)
        return [[b + o for o in offs] for b in self._span(rest)]

    def group_of(self, axes: Iterable[str], rank: int) -> list[int]:
        masked, _ = self._split(axes)
        base = rank - sum(((rank // d) % s) * d for s, d in masked)
        return [base + o for o in self._span(masked)]

    def rank_in(self, axes: Iterable[str], rank: int) -> int:
        masked, _ = self._split(axes)
        idx, mult = 0, 1
        for s, d in masked:
            idx += ((rank // d) % s) * mult
            mult *= s
        return idx

    def group_index(self, axes: Iterable[str], rank: int) -> int:
        _, rest = self._split(axes)
        idx, mult = 0, 1
        for s, d in rest:
            idx += ((rank // d) % s) * mult
            mult *= s
        return idx

    def rank_at(self, coords: dict[str, int]) -> int:
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
        return iter(_Grid._span(self.dims) if not self.base else [self.base + o for o in _Grid._span(self.dims)])

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


class RankLayout:
    """Every group of every axis and axis combination for a resolved config, without processes.

    >>> lay = RankLayout(ParallelConfig(tp=2, pp=4), world_size=16)
    >>> lay.groups("pp")[:2]
    [[0, 4, 8, 12], [1, 5, 9, 13]]
    """

    def __init__(self, config: ParallelConfig | ResolvedSizes, world_size: int | None = None):
        if isinstance(config, ResolvedSizes):
            sizes = config
        else:
            if world_size is None:
                raise ConfigError("RankLayout(config) needs world_size")
            sizes = config.resolve(world_size)
        self.sizes = sizes
        self.world_size = sizes.world_size
        dense, expert = [], []
        for tok in sizes.order:
            if tok == "tp":
                dense.append(("tp", sizes.tp)); expert.append(("expt_tp", sizes.expt_tp))
            elif tok == "cp":
                dense.append(("cp", sizes.cp))
            elif tok == "ep":
                expert.append(("ep", sizes.ep))
            elif tok == "dp":
                dense += [("dp_shard", sizes.dp_shard), ("dp_outer", sizes.dp_outer)]
                expert.append(("expt_dp", sizes.expt_dp))
            elif tok == "pp":
                dense.append(("pp", sizes.pp)); expert.append(("pp", sizes.pp))
        self._dense = _Grid(dense)
        self._expert = _Grid(expert)
        # Equal pp size and stride on both grids <=> identical pp groups (members, order, group order): O(1).
        if sizes.pp > 1 and self._dense.strides[self._dense.index["pp"]] != self._expert.strides[self._expert.index["pp"]]:
            # Unreachable after ParallelConfig.resolve's order rule; kept as a guard for hand-made ResolvedSizes.
            raise ConfigError(
                f"the dense and expert pipeline groups differ for order={'-'.join(sizes.order)}; put pp last in order"
            )

    # ------------------------------------------------------------------ lookup
    def _grid_axes(self, name: str) -> tuple[_Grid, tuple[str, ...]]:
        if name in DENSE_GROUPS:
            return self._dense, DENSE_GROUPS[name]
        if name in EXPERT_GROUPS:
            return self._expert, EXPERT_GROUPS[name]
        # Megatron token strings such as "tp-pp" or "tp-ep-pp" (expert when it names ep).
        toks = name.split("-")
        if set(toks) <= {"tp", "cp", "dp", "pp", "ep"} and len(toks) == len(set(toks)):
            if "ep" in toks:
                if "cp" in toks:
                    raise ConfigError(f"group '{name}': cp and ep live in different layouts")
                m = {"tp": ("expt_tp",), "ep": ("ep",), "dp": ("expt_dp",), "pp": ("pp",)}
                return self._expert, tuple(a for t in toks for a in m[t])
            m = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp_shard", "dp_outer"), "pp": ("pp",)}
            return self._dense, tuple(a for t in toks for a in m[t])
        import difflib

        close = difflib.get_close_matches(name, GROUP_NAMES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown group '{name}'{hint}; valid: {', '.join(GROUP_NAMES)} or Megatron tokens like 'tp-pp'")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks (valid: 0..{self.world_size - 1})")

    def size(self, name: str) -> int:
        grid, axes = self._grid_axes(name)
        n = 1
        for a in axes:
            n *= grid.sizes[grid.index[a]]
        return n

    def groups(self, name: str) -> list[list[int]]:
        """All groups of ``name``, in Megatron's group order and in-group order."""
        grid, axes = self._grid_axes(name)
        return grid.groups(axes)

    def group_of(self, name: str, rank: int) -> list[int]:
        """The members of ``rank``'s group of ``name`` (in-group order as Megatron)."""
        self._check_rank(rank)
        grid, axes = self._grid_axes(name)
        return grid.group_of(axes, rank)

    def members(self, name: str, rank: int) -> GroupMembers:
        """``group_of(name, rank)`` without listing it: O(axes) whatever the group size (for huge worlds)."""
        self._check_rank(rank)
        masked, _ = self.group_dims(name)
        return GroupMembers(rank - sum(((rank // d) % s) * d for s, d in masked), masked)

    def group_dims(self, name: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(size, rank stride)`` of the axes a ``name`` group spans, and of the other axes of its layout
        (dense or expert), fastest first: a group is ``base + Σ i·stride`` over the first list."""
        grid, axes = self._grid_axes(name)
        return grid._split(axes)

    def rank_in(self, name: str, rank: int) -> int:
        """Index of ``rank`` inside its ``name`` group."""
        self._check_rank(rank)
        grid, axes = self._grid_axes(name)
        return grid.rank_in(axes, rank)

    def group_index(self, name: str, rank: int) -> int:
        """Which of ``groups(name)`` holds ``rank``."""
        self._check_rank(rank)
        grid, axes = self._grid_axes(name)
        return grid.group_index(axes, rank)

    def rank_groups(self, rank: int, names: Iterable[str] = GROUP_NAMES) -> dict[str, list[int]]:
        """Every named group of one rank."""
        return {n: self.group_of(n, rank) for n in names}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis, dense and expert (pp appears once)."""
        self._check_rank(rank)
        c = self._dense.coords(rank)
        c.update(self._expert.coords(rank))
        return c

    # ------------------------------------------------------------------ meshes
    def mesh_ranks(self, expert: bool = False) -> list:
        """Nested lists: ``[pp][dp_outer][dp_shard][cp][tp]`` (or ``[pp][expt_dp][ep][expt_tp]``) -> rank."""
        grid = self._expert if expert else self._dense
        axes = EXPERT_MESH_AXES if expert else DENSE_MESH_AXES

        def build(i: int, base: int):
            a = axes[i]
            j = grid.index[a]
            step = grid.strides[j]
            if i == len(axes) - 1:
                return [base + k * step for k in range(grid.sizes[j])]
            return [build(i + 1, base + k * step) for k in range(grid.sizes[j])]

        return build(0, 0)

    def mesh_shape(self, expert: bool = False) -> tuple[int, ...]:
        grid = self._expert if expert else self._dense
        axes = EXPERT_MESH_AXES if expert else DENSE_MESH_AXES
        return tuple(grid.sizes[grid.index[a]] for a in axes)

    # ------------------------------------------------------------------ pipeline
    def pipeline_ranks(self, rank: int) -> list[int]:
        return self.group_of("pp", rank)

    # ------------------------------------------------------------------ locality
    def locality(self, ranks_per_node: int, names: Iterable[str] = GROUP_NAMES) -> LocalityReport:
        """Count, per group name, the groups whose members sit on more than one node (node = rank // G)."""
        if ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node={ranks_per_node} must be a positive integer")
        G = ranks_per_node
        crossing: dict[str, tuple[int, int]] = {}
        warnings = []
        for name in names:
            if name == "world":
                continue
            size = self.size(name)
            n_groups = self.world_size // size
            if size == 1:
                crossing[name] = (0, n_groups)
                continue
            grid, axes = self._grid_axes(name)
            n_cross = sum(1 for g in grid.groups(axes) if min(g) // G != max(g) // G)
            crossing[name] = (n_cross, n_groups)
            if n_cross and name in NODE_LOCAL_GROUPS:
                warnings.append(locality_warning(name, size, n_cross, n_groups, G))
        return LocalityReport(G, crossing, tuple(warnings))

    def describe(self) -> dict[str, int]:
        s = self.sizes
        return {k: getattr(s, k) for k in ("world_size", "tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp")}
