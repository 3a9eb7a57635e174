"""Multi-module layouts: several rank layouts on disjoint rank ranges of one job, and the pairing across a seam.

A vision encoder on ranks 0-3 (tp=1, dp=4) feeding a language model on ranks 4-11 (tp=2, pp=2, dp=2): each module is
an ordinary :class:`~megashard.layout.RankLayout` shifted by its first rank (``rank_offset``); where one module's
last pipeline stage feeds another's first, :func:`pair_modules` says which rank sends what to which rank.

**The pairing rule** (Megatron-LM's ``BridgeCommunicator``: one leader per data-parallel replica, fan-in/fan-out
by contiguous blocks):

1. Each data-parallel replica of a module has a *leader*: its tp = cp = 0 rank at the boundary stage (the last
   pipeline stage of the sender, the first of the receiver). Leaders are listed in data-parallel index order.
2. With ``S`` sender and ``D`` receiver replicas, one must divide the other. Replica ``i`` of a module holds the
   ``i``-th contiguous block of the global batch (``dp`` blocks), so
   - *fan-in* (``S = k·D``): receiver leader ``j`` gets the whole outputs of sender leaders ``j·k … j·k+k-1`` and
     concatenates them in that order along the batch dim;
   - *fan-out* (``D = k·S``): sender leader ``i`` splits its output into ``k`` equal batch parts and sends part
     ``p`` to receiver leader ``i·k + p``.
3. Inside a replica the leader shares what it received with its tp·cp group (broadcast): every tp/cp rank of the
   boundary stage needs the activations (forward) or the output gradient (backward). Gradients flow back over the
   same links, sliced the same way.

Pure arithmetic: :func:`pair_modules` is a function of the two layouts only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from megashard.config.modules import ModulesConfig
from megashard.config.parallel import ParallelConfig
from megashard.config.sizes import check_world_size
from megashard.errors import ConfigError, unknown_names
from megashard.layout.rank_layout import RankLayout

__all__ = ["Link", "ModuleLayout", "MultiModuleLayout", "pair_modules"]


@dataclass(frozen=True)
class ModuleLayout:
    """One module: its name, first global rank, layout (over its own ranks 0..n-1) and config."""

    name: str
    rank_offset: int
    layout: RankLayout
    config: Optional[ParallelConfig] = None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ranks(self) -> range:
        """The module's global ranks."""
        return range(self.rank_offset, self.rank_offset + self.layout.world_size)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.rank_offset <= rank < self.rank_offset + self.layout.world_size

    def group_of(self, name: str, rank: int) -> list[int]:
        """Global ranks of global ``rank``'s ``name`` group (any group name of :class:`RankLayout`)."""
        if rank not in self:
            raise ConfigError(f"rank {rank} is not in module '{self.name}' (ranks {self.ranks.start}-{self.ranks.stop - 1})")
        return [r + self.rank_offset for r in self.layout.group_of(name, rank - self.rank_offset)]

    def groups(self, name: str) -> list[list[int]]:
        """Every ``name`` group of the module, global ranks."""
        off = self.rank_offset
        return [[r + off for r in g] for g in self.layout.groups(name)]

    def leaders(self, stage: int) -> list[int]:
        """The tp = cp = 0 rank of every data-parallel replica at pipeline ``stage``, in data-parallel order."""
        first = self.layout.grid().rank_at({"pp": stage})
        return [r + self.rank_offset for r in self.layout.group_of("dp", first)]


@dataclass(frozen=True)
class Link:
    """One point-to-point transfer across a seam: ``src`` sends batch part ``src_part`` of ``src_parts`` of its
    boundary output; ``dst`` places it as part ``dst_part`` of ``dst_parts`` of its input (parts are equal, contiguous
    blocks along the batch dim). Gradients go back the same way."""

    src: int
    dst: int
    src_part: int = 0
    src_parts: int = 1
    dst_part: int = 0
    dst_parts: int = 1


def pair_modules(src: ModuleLayout, dst: ModuleLayout) -> list[Link]:
    """The links from ``src``'s last pipeline stage to ``dst``'s first (the rule in the module docstring).

    Raises ConfigError when neither data-parallel size divides the other."""
    s_lead = src.leaders(src.layout.sizes.pp - 1)
    d_lead = dst.leaders(0)
    ns, nd = len(s_lead), len(d_lead)
    if ns % nd and nd % ns:
        raise ConfigError(f"cannot connect module '{src.name}' (dp={ns}) to '{dst.name}' (dp={nd}): one data-parallel "
                          "size must divide the other (each receiver replica takes whole sender outputs, or each "
                          "sender splits its batch evenly)")
    if ns >= nd:
        k = ns // nd
        return [Link(s, d_lead[i // k], 0, 1, i % k, k) for i, s in enumerate(s_lead)]
    k = nd // ns
    return [Link(s_lead[j // k], d, j % k, k, 0, 1) for j, d in enumerate(d_lead)]


@dataclass(frozen=True)
class MultiModuleLayout:
    """Every module of a job, the connections ``(src, dst)`` between them, and the world size."""

    modules: tuple[ModuleLayout, ...]
    connections: tuple[tuple[str, str], ...]
    world_size: int

    @classmethod
    def from_config(cls, config: ModulesConfig, world_size: int) -> "MultiModuleLayout":
        """Every module's layout of ``config`` for a job of ``world_size`` ranks (ConfigError when a module does not
        fit it, or its sizes do not fit its rank count — the message names the module)."""
        check_world_size(world_size)
        if config.min_world_size > world_size:
            last = max(config.modules, key=lambda m: m.last_rank)
            raise ConfigError(f"module '{last.name}' uses ranks up to {last.last_rank}, but the world has {world_size} "
                              f"ranks; give at least {config.min_world_size}")
        layouts = []
        for m in config.modules:
            try:
                layout = RankLayout(m.parallel.resolve(m.num_ranks))
            except ConfigError as e:
                raise ConfigError(f"module '{m.name}' (ranks {m.first_rank}-{m.last_rank}, {m.num_ranks} ranks): {e}") from None
            layouts.append(ModuleLayout(m.name, m.first_rank, layout, m.parallel))
        multi = cls(tuple(layouts), config.connections, world_size)
        for src, dst in config.connections:
            multi.links(src, dst)  # a seam whose data-parallel sizes do not pair fails here, before any process
        return multi

    def __iter__(self) -> Iterator[ModuleLayout]:
        return iter(self.modules)

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.name == name:
                return m
        raise ConfigError(f"unknown module {unknown_names([name], [m.name for m in self.modules])}; modules: "
                          f"{', '.join(m.name for m in self.modules)}")

    def module_of(self, rank: int) -> Optional[ModuleLayout]:
        """The module holding global ``rank`` (None for a rank outside every module)."""
        for m in self.modules:
            if rank in m:
                return m
        return None

    def links(self, src: str, dst: str) -> list[Link]:
        """:func:`pair_modules` of two modules by name."""
        return pair_modules(self.module(src), self.module(dst))

    @property
    def idle_ranks(self) -> int:
        """Ranks of the world that belong to no module."""
        return self.world_size - sum(m.world_size for m in self.modules)
