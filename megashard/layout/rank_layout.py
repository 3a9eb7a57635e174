"""`RankLayout`: which ranks form each parallel group — pure arithmetic, no processes.

Ranks are laid out as Megatron-LM's ``RankGenerator`` lays them out: the axes of the ``order`` string
form a mixed-radix number, leftmost axis fastest. A group of an axis combination holds the ranks that
differ only along those axes; its members are listed with the leftmost (fastest) axis varying fastest,
and groups are listed in the same mixed-radix order of the remaining axes. Megatron's ``dp`` is split
here into ``dp_shard`` (faster) and ``dp_outer``, so ``dp`` groups are unchanged and HSDP's groups are
contiguous slices of them.

Two layouts share the ranks: the *dense* one over ``(tp, cp, dp_shard, dp_outer, pp)`` and the *expert*
one over ``(expt_tp, ep, expt_dp, pp)`` ("MoE parallel folding"); the group names are in
:mod:`megashard.layout.groups`, the grid arithmetic in :mod:`megashard.layout.grid`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from megashard.config import ParallelConfig, ResolvedSizes
from megashard.errors import ConfigError, did_you_mean
from megashard.layout.grid import GroupMembers, RankGrid
from megashard.layout.groups import (
    DENSE_GROUPS,
    DENSE_MESH_AXES,
    EXPERT_GROUPS,
    EXPERT_MESH_AXES,
    GROUP_NAMES,
)
from megashard.layout.node_locality import LocalityReport, locality

if TYPE_CHECKING:
    from megashard.layout.rank_generator import RankGenerator


class RankLayout:
    """Every group of every axis and axis combination for resolved sizes, without processes.

    The flow is ``ParallelConfig.resolve(world)`` → :class:`~megashard.config.ResolvedSizes` → ``RankLayout(sizes)``;
    ``RankLayout(config, world_size)`` is a shorthand for ``RankLayout(config.resolve(world_size))``.

    >>> lay = RankLayout(ParallelConfig(tp=2, pp=4).resolve(16))
    >>> lay.groups("pp")[:2]
    [[0, 4, 8, 12], [1, 5, 9, 13]]
    """

    def __init__(self, sizes: ResolvedSizes | ParallelConfig, world_size: int | None = None):
        if isinstance(sizes, ParallelConfig):
            if world_size is None:
                raise ConfigError("RankLayout(config) needs world_size; or pass config.resolve(world_size)")
            sizes = sizes.resolve(world_size)
        elif world_size is not None and world_size != sizes.world_size:
            raise ConfigError(f"RankLayout(sizes, world_size={world_size}): the sizes were resolved for "
                              f"{sizes.world_size} ranks")
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
        self._dense = RankGrid(dense)
        self._expert = RankGrid(expert)
        # Equal pp size and stride on both grids <=> identical pp groups (members, order, group order): O(1).
        if sizes.pp > 1 and self._dense.strides[self._dense.index["pp"]] != self._expert.strides[self._expert.index["pp"]]:
            # Unreachable after ParallelConfig.resolve's order rule; kept as a guard for hand-made ResolvedSizes.
            raise ConfigError(
                f"the dense and expert pipeline groups differ for order={'-'.join(sizes.order)}; put pp last in order"
            )

    # ------------------------------------------------------------------ lookup
    def grid(self, expert: bool = False) -> RankGrid:
        """The dense grid (axes of ``order`` as tp, cp, dp_shard, dp_outer, pp) or the expert one (expt_tp, ep,
        expt_dp, pp), fastest axis first."""
        return self._expert if expert else self._dense

    def axes_of(self, name: str) -> tuple[bool, tuple[str, ...]]:
        """``(expert, axes)``: which grid a group name (or Megatron token string such as ``tp-pp``) lives on and
        the grid axes its groups span; ConfigError for an unknown name."""
        grid, axes = self._grid_axes(name)
        return grid is self._expert, axes

    def _grid_axes(self, name: str) -> tuple[RankGrid, tuple[str, ...]]:
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
        raise ConfigError(f"unknown group '{name}'{did_you_mean(name, GROUP_NAMES)}; valid: {', '.join(GROUP_NAMES)} "
                          "or Megatron tokens like 'tp-pp'")

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
        return grid.split(axes)

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

    def rank_generator(self, expert: bool = False, rank_offset: int = 0) -> "RankGenerator":
        """Megatron's :class:`~megashard.layout.rank_generator.RankGenerator` for these sizes: the dense one
        (``tp, cp, dp, pp``; ``ep=1``) or the expert one (``expt_tp, ep, expt_dp, pp``; ``cp=1``), whose
        ``get_ranks(token)`` equals :meth:`groups` for the same token."""
        from megashard.layout.rank_generator import RankGenerator

        s, order = self.sizes, "-".join(self.sizes.order)
        if expert:
            return RankGenerator(tp=s.expt_tp, ep=s.ep, dp=s.expt_dp, pp=s.pp, cp=1, order=order, rank_offset=rank_offset)
        return RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=s.cp, order=order, rank_offset=rank_offset)

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
        """Count, per group name, the groups whose members sit on more than one node (node = rank // G), without
        listing any group (:func:`megashard.layout.node_locality.locality`)."""
        return locality(self, ranks_per_node, names)

    def describe(self) -> dict[str, int]:
        """The world size and every resolved axis size."""
        s = self.sizes
        return {k: getattr(s, k) for k in ("world_size", "tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp")}
