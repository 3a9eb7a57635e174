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

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from megashard.config import ParallelConfig, ResolvedSizes
from megashard.errors import ConfigError, did_you_mean
from megashard.layout.grid import GroupMembers, RankGrid
from megashard.layout.groups import (DENSE_GROUPS, DENSE_MESH_AXES, EDGE_GROUPS, EXPERT_GROUPS, EXPERT_HSDP_MESH_AXES,
                                     EXPERT_MESH_AXES, GROUP_ALIASES, GROUP_NAMES)
from megashard.layout.hybrid import hybrid_group_sizes, hybrid_name, hybrid_slice, slice_index

#: Megatron's ``get_embedding_ranks`` / ``get_position_embedding_ranks``: a pipeline group's ranks -> the ranks
#: that hold the (position) embedding.
EdgeRanks = Callable[[list[int]], Sequence[int]]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first and the last pipeline stage (one rank without pipeline parallelism), as Megatron-LM."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first pipeline stage, as Megatron-LM."""
    return [pp_ranks[0]]
from megashard.layout.node_locality import LocalityReport, locality_report

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

    def __init__(self, sizes: ResolvedSizes | ParallelConfig, world_size: int | None = None, *,
                 embedding_ranks: EdgeRanks | None = None, position_embedding_ranks: EdgeRanks | None = None):
        if isinstance(sizes, ParallelConfig):
            if world_size is None:
                raise ConfigError("RankLayout(config) needs world_size; or pass config.resolve(world_size)")
            sizes = sizes.resolve(world_size)
        elif world_size is not None and world_size != sizes.world_size:
            raise ConfigError(f"RankLayout(sizes, world_size={world_size}): the sizes were resolved for "
                              f"{sizes.world_size} ranks")
        self.sizes = sizes
        self.world_size = sizes.world_size
        #: Megatron's get_embedding_ranks / get_position_embedding_ranks (the ``embd`` / ``pos_embd`` groups)
        self.edge_ranks: dict[str, EdgeRanks] = {
            "embd": embedding_ranks or default_embedding_ranks,
            "pos_embd": position_embedding_ranks or default_position_embedding_ranks,
        }
        #: hierarchical context-parallel level names (hcp0, hcp1, …; empty when cp is not hierarchical)
        self.hcp_names: tuple[str, ...] = tuple(f"hcp{k}" for k in range(len(sizes.hierarchical_cp or ())))
        #: hybrid dp·cp group sizes -> names (hybrid_dp_cp_2, …; empty unless hybrid context parallelism is on)
        self.hybrid_names: dict[str, int] = ({hybrid_name(k): k for k in hybrid_group_sizes(sizes.dp * sizes.cp)}
                                             if getattr(sizes, "hybrid_cp", False) else {})
        dense, expert = [], []
        for tok in sizes.order:
            if tok == "tp":
                dense.append(("tp", sizes.tp)); expert.append(("expt_tp", sizes.expt_tp))
                if sizes.gtp_remat > 1:  # Megatron injects gtp_remat right after tp (dense grid only)
                    dense.append(("gtp_remat", sizes.gtp_remat))
            elif tok == "cp":
                dense.append(("cp", sizes.cp))
            elif tok == "ep":
                expert.append(("ep", sizes.ep))
                if sizes.expt_gtp_remat > 1:  # … and the expert one right after ep (expert grid only)
                    expert.append(("expt_gtp_remat", sizes.expt_gtp_remat))
            elif tok == "dp":
                dense += [("dp_shard", sizes.dp_shard), ("dp_outer", sizes.dp_outer)]
                # The expert replica axis: expt_dp = expt_dp_shard (faster) · expt_dp_outer (= dp_outer). (Sizes that
                # do not split — refused by resolve(), but possible in a layout record saved before — keep one.)
                outer = sizes.dp_outer if sizes.expt_dp % sizes.dp_outer == 0 else 1
                expert += [("expt_dp_shard", sizes.expt_dp // outer), ("expt_dp_outer", outer)]
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
        grid, axes = self._named_axes(name)
        # a size-1 gtp_remat axis is absent from its grid (it would add nothing): drop it
        return grid, tuple(a for a in axes if a in grid.index)

    def _named_axes(self, name: str) -> tuple[RankGrid, tuple[str, ...]]:
        name = GROUP_ALIASES.get(name, name)
        if name in DENSE_GROUPS:
            return self._dense, DENSE_GROUPS[name]
        if name in EXPERT_GROUPS:
            return self._expert, EXPERT_GROUPS[name]
        # Megatron token strings such as "tp-pp" or "tp-ep-pp" (expert when it names ep). "gtp_remat" is the axis of
        # the grid the other tokens name (an axis of size 1 is absent from a grid: it adds nothing).
        toks = name.split("-")
        if set(toks) <= {"tp", "cp", "dp", "pp", "ep", "gtp_remat"} and len(toks) == len(set(toks)):
            if "ep" in toks:
                if "cp" in toks:
                    raise ConfigError(f"group '{name}': cp and ep live in different layouts")
                m = {"tp": ("expt_tp",), "ep": ("ep",), "dp": ("expt_dp_shard", "expt_dp_outer"), "pp": ("pp",),
                     "gtp_remat": ("expt_gtp_remat",)}
                return self._expert, tuple(a for t in toks for a in m[t])
            m = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp_shard", "dp_outer"), "pp": ("pp",), "gtp_remat": ("gtp_remat",)}
            return self._dense, tuple(a for t in toks for a in m[t])
        if name in EDGE_GROUPS or name in self.hcp_names or name in self.hybrid_names:
            raise ConfigError(f"group '{name}' is not an axis combination: ask group_of/members/size/is_member for it")
        valid = self.names()
        raise ConfigError(f"unknown group '{name}'{did_you_mean(name, valid)}; valid: {', '.join(valid)} "
                          "or Megatron tokens like 'tp-pp'")

    def names(self) -> tuple[str, ...]:
        """Every group name this layout answers for: the axis groups, Megatron's aliases, the pipeline-edge groups
        (embd, pos_embd), the hierarchical cp levels (hcp0, … when configured) and the hybrid dp·cp slices
        (hybrid_dp_cp_2, … with hybrid context parallelism)."""
        return GROUP_NAMES + tuple(GROUP_ALIASES) + EDGE_GROUPS + self.hcp_names + tuple(self.hybrid_names)

    def extra_names(self) -> tuple[str, ...]:
        """The names configured beyond the axis groups: hierarchical cp levels and hybrid dp·cp slices."""
        return self.hcp_names + tuple(self.hybrid_names)

    # ------------------------------------------------------------------ groups that are not axis combinations
    def _edge_group(self, name: str, pp_ranks: list[int]) -> list[int]:
        """Megatron's ``get_embedding_ranks(pp_ranks)`` (or the position one), checked: a non-empty list of distinct
        ranks of that pipeline group."""
        ranks = self.edge_ranks[name](list(pp_ranks))
        try:
            ranks = [int(r) for r in ranks]
        except (TypeError, ValueError):
            ranks = None  # type: ignore[assignment]
        if not ranks or len(set(ranks)) != len(ranks) or any(r not in pp_ranks for r in ranks):
            what = "get_embedding_ranks" if name == "embd" else "get_position_embedding_ranks"
            raise ConfigError(f"{what}({pp_ranks}) returned {ranks!r}: it must return distinct ranks of the pipeline "
                              f"group it is given (e.g. [{pp_ranks[0]}, {pp_ranks[-1]}])")
        return ranks

    def _hcp_dims(self, name: str, rank: int) -> tuple[int, list[tuple[int, int]]]:
        """``(base, [(size, stride)])`` of ``rank``'s group of hierarchical cp level ``name`` (``hcpK``): level K is
        the K-th sub-axis of cp (sizes fastest first), as Megatron's ``create_hierarchical_groups``."""
        level = self.hcp_names.index(name)
        hcp = self.sizes.hierarchical_cp or ()
        inner = 1
        for s in hcp[:level]:
            inner *= s
        stride = self._dense.strides[self._dense.index["cp"]] * inner
        size = hcp[level]
        return rank - ((rank // stride) % size) * stride, [(size, stride)]

    def is_member(self, name: str, rank: int) -> bool:
        """Whether ``rank`` is in a ``name`` group: always for axis groups, for ``embd``/``pos_embd`` only on the
        stages that hold the embedding."""
        self._check_rank(rank)
        if name in EDGE_GROUPS:
            return rank in self.group_of(name, rank)
        if name not in self.hcp_names and name not in self.hybrid_names:
            self._grid_axes(name)  # validates the name
        return True

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks (valid: 0..{self.world_size - 1})")

    def size(self, name: str) -> int:
        """Size of the ``name`` groups (for ``embd``/``pos_embd``: of the first pipeline's, which all share with
        the default rank selections)."""
        if name in EDGE_GROUPS:
            return len(self.group_of(name, 0))
        if name in self.hcp_names:
            return (self.sizes.hierarchical_cp or ())[self.hcp_names.index(name)]
        if name in self.hybrid_names:
            return self.hybrid_names[name]
        grid, axes = self._grid_axes(name)
        n = 1
        for a in axes:
            n *= grid.sizes[grid.index[a]]
        return n

    def groups(self, name: str) -> list[list[int]]:
        """All groups of ``name``, in Megatron's group order and in-group order."""
        if name in EDGE_GROUPS:
            return [self._edge_group(name, g) for g in self.groups("pp")]
        if name in self.hcp_names:
            seen, out = set(), []
            for cp_group in self.groups("cp"):  # Megatron: level groups of each cp group, in cp-group order
                for r in cp_group:
                    g = self.group_of(name, r)
                    if g[0] not in seen:
                        seen.add(g[0])
                        out.append(g)
            return out
        if name in self.hybrid_names:  # Megatron: the slices of each dp·cp group, in dp·cp group order
            k = self.hybrid_names[name]
            return [g[i:i + k] for g in self.groups("dp_cp") for i in range(0, len(g), k)]
        grid, axes = self._grid_axes(name)
        return grid.groups(axes)

    def group_of(self, name: str, rank: int) -> list[int]:
        """The members of ``rank``'s group of ``name`` (in-group order as Megatron). For ``embd``/``pos_embd``: the
        embedding ranks of ``rank``'s pipeline, which hold ``rank`` only on the embedding stages (:meth:`is_member`)."""
        self._check_rank(rank)
        if name in EDGE_GROUPS:
            return self._edge_group(name, self.group_of("pp", rank))
        if name in self.hcp_names or name in self.hybrid_names:
            return list(self.members(name, rank))
        grid, axes = self._grid_axes(name)
        return grid.group_of(axes, rank)

    def members(self, name: str, rank: int) -> GroupMembers:
        """``group_of(name, rank)`` without listing it: O(axes) whatever the group size (for huge worlds)."""
        self._check_rank(rank)
        if name in EDGE_GROUPS:  # a selection of a pipeline group: a short list
            return self.group_of(name, rank)  # type: ignore[return-value]
        if name in self.hcp_names:
            base, dims = self._hcp_dims(name, rank)
            return GroupMembers(base, dims)
        if name in self.hybrid_names:  # a slice of the rank's dp·cp group (hybrid_slice: list when not a block)
            return hybrid_slice(self.members("dp_cp", rank), self.rank_in("dp_cp", rank),  # type: ignore[return-value]
                                self.hybrid_names[name])
        masked, _ = self.group_dims(name)
        return GroupMembers(rank - sum(((rank // d) % s) * d for s, d in masked), masked)

    def group_dims(self, name: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(size, rank stride)`` of the axes a ``name`` group spans, and of the other axes of its layout
        (dense or expert), fastest first: a group is ``base + Σ i·stride`` over the first list."""
        grid, axes = self._grid_axes(name)
        return grid.split(axes)

    def rank_in(self, name: str, rank: int) -> int:
        """Index of ``rank`` inside its ``name`` group (ConfigError for an ``embd``/``pos_embd`` non-member)."""
        self._check_rank(rank)
        if name in self.hybrid_names:
            i = self.rank_in("dp_cp", rank)
            return i - slice_index(i, self.hybrid_names[name], self.size("dp_cp"))[0]
        if name in EDGE_GROUPS or name in self.hcp_names:
            members = self.group_of(name, rank)
            if rank not in members:
                raise ConfigError(f"rank {rank} is not in a '{name}' group (its pipeline's is {members})")
            return members.index(rank)
        grid, axes = self._grid_axes(name)
        return grid.rank_in(axes, rank)

    def group_index(self, name: str, rank: int) -> int:
        """Which of ``groups(name)`` holds ``rank``."""
        self._check_rank(rank)
        if name in EDGE_GROUPS:
            return self.group_index("pp", rank)
        if name in self.hcp_names:
            return [g[0] for g in self.groups(name)].index(self.group_of(name, rank)[0])
        if name in self.hybrid_names:
            k, n = self.hybrid_names[name], self.size("dp_cp")
            return self.group_index("dp_cp", rank) * (-(-n // k)) + self.rank_in("dp_cp", rank) // k
        grid, axes = self._grid_axes(name)
        return grid.group_index(axes, rank)

    def num_groups(self, name: str) -> int:
        """How many ``name`` groups there are (a hybrid dp·cp slice size that does not divide dp·cp counts Megatron's
        short last slices too)."""
        if name in self.hybrid_names:
            n = self.size("dp_cp")
            return (self.world_size // n) * -(-n // self.hybrid_names[name])
        if name in EDGE_GROUPS:
            return self.world_size // self.size("pp")
        return self.world_size // self.size(name)

    def rank_groups(self, rank: int, names: Iterable[str] = GROUP_NAMES) -> dict[str, list[int]]:
        """Every named group of one rank."""
        return {n: self.group_of(n, rank) for n in names}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis, dense and expert (pp appears once; ``expt_dp`` is the coordinate in
        the whole expert dp group, ``expt_dp_shard``/``expt_dp_outer`` those on the expert replica split)."""
        self._check_rank(rank)
        c = self._dense.coords(rank)
        e = self._expert.coords(rank)
        c.update(expt_tp=e["expt_tp"], ep=e["ep"], expt_dp=self._expert.rank_in(EXPERT_GROUPS["expt_dp"], rank),
                 expt_dp_shard=e["expt_dp_shard"], expt_dp_outer=e["expt_dp_outer"])  # (the expert replica axis)
        return c

    def rank_generator(self, expert: bool = False, rank_offset: int = 0) -> "RankGenerator":
        """Megatron's :class:`~megashard.layout.rank_generator.RankGenerator` for these sizes: the dense one
        (``tp, cp, dp, pp``; ``ep=1``) or the expert one (``expt_tp, ep, expt_dp, pp``; ``cp=1``), whose
        ``get_ranks(token)`` equals :meth:`groups` for the same token."""
        from megashard.layout.rank_generator import RankGenerator

        s, order = self.sizes, "-".join(self.sizes.order)
        if expert:
            if s.expt_gtp_remat > 1:
                order = order.replace("ep", "ep-gtp_remat", 1)
            return RankGenerator(tp=s.expt_tp, ep=s.ep, dp=s.expt_dp, pp=s.pp, cp=1, order=order, rank_offset=rank_offset,
                                 gtp_remat=s.expt_gtp_remat)
        if s.gtp_remat > 1:
            order = order.replace("tp", "tp-gtp_remat", 1)
        return RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=s.cp, order=order, rank_offset=rank_offset,
                             gtp_remat=s.gtp_remat)

    # ------------------------------------------------------------------ meshes
    def _mesh_axes(self, expert: bool | str) -> tuple[str, ...]:
        if expert == "hsdp":
            return EXPERT_HSDP_MESH_AXES
        return EXPERT_MESH_AXES if expert else DENSE_MESH_AXES

    def mesh_ranks(self, expert: bool | str = False) -> list:
        """Nested lists: ``[pp][dp_outer][dp_shard][cp][tp]`` (``expert=True``: ``[pp][expt_dp][ep][expt_tp]``;
        ``expert="hsdp"``: ``[pp][expt_dp_outer][expt_dp_shard][ep][expt_tp]``) -> rank."""
        axes = self._mesh_axes(expert)
        members = [self.members(a, 0) for a in axes]  # a mesh axis = the group of that name through rank 0

        def build(i: int, base: int):
            m = members[i]
            if i == len(axes) - 1:
                return [base + o for o in m]
            return [build(i + 1, base + o) for o in m]

        return build(0, 0)

    def mesh_shape(self, expert: bool | str = False) -> tuple[int, ...]:
        return tuple(self.size(a) for a in self._mesh_axes(expert))

    # ------------------------------------------------------------------ pipeline
    def pipeline_ranks(self, rank: int) -> list[int]:
        return self.group_of("pp", rank)

    # ------------------------------------------------------------------ locality
    def locality(self, ranks_per_node: int, names: Iterable[str] = GROUP_NAMES) -> LocalityReport:
        """Count, per group name, the groups whose members sit on more than one node (node = rank // G), without
        listing any group (:func:`megashard.layout.node_locality.locality_report`)."""
        # group_dims also checks each name (after locality_report has checked ranks_per_node: the generator is lazy)
        dims = ((name, *self.group_dims(name)) for name in names if name != "world")
        return locality_report(ranks_per_node, self.world_size, dims)

    def describe(self) -> dict[str, int]:
        """The world size and every resolved axis size."""
        s = self.sizes
        out = {k: getattr(s, k) for k in ("world_size", "tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp")}
        out.update({k: getattr(s, k) for k in ("gtp_remat", "expt_gtp_remat") if getattr(s, k) > 1})
        return out


def locality(layout: RankLayout, ranks_per_node: int, names: Iterable[str] = GROUP_NAMES) -> LocalityReport:
    """``layout.locality(ranks_per_node, names)``: which groups cross node boundaries, without listing any."""
    return layout.locality(ranks_per_node, names)
