"""How a `ParallelState` creates its process groups: members only, one communicator per rank set, with NCCL options.

A mixin of :class:`~megashard.state.core.ParallelState` (which owns the groups; this module only holds the steps
that make them, so that the state's module reads as what it holds). Every rank first creates its groups of the
names all ranks have — the same number of new communicators on every rank of a layout — then the gloo twins of the
data-parallel groups, then the pipeline-edge groups (embedding stages only), padded so that every rank holds as
many groups as its peers (torch names a members-only group by a hash that counts them).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch.distributed as dist

from megashard.config.nccl import nccl_options, nccl_spec, options_key
from megashard.layout import EDGE_GROUPS, GROUP_ALIASES
from megashard.state.pool import pooled_group

__all__ = ["GLOO_TWIN_GROUPS", "GroupCreation", "PP_NAMES", "SHARP_GROUP_NAMES"]

#: megashard's group for Megatron's ``sharp_enabled_group`` (``dp``: the dp·cp groups; ``dp_replica``: the groups
#: across distributed-optimizer instances, Megatron's inter partial expert dp group).
SHARP_GROUP_NAMES = {"dp": "dp_cp", "dp_replica": "expt_dp_outer"}
#: Groups on ``config.pp_backend`` when it is set (the pipeline groups of the dense and the expert grid are one).
PP_NAMES = ("pp", "expt_pp")

#: Groups with a gloo twin when ``create_gloo_process_groups`` (Megatron's data-parallel gloo groups: dp, dp·cp,
#: the intra partial dp·cp, expert dp and intra partial expert dp; aliases share their twins).
GLOO_TWIN_GROUPS = ("dp", "dp_cp", "hsdp", "dp_shard_cp", "intra_dp_cp", "expt_dp", "expt_dp_shard", "intra_expt_dp")


class GroupCreation:
    """The group-creating steps of :class:`~megashard.state.core.ParallelState` (run once, from its constructor)."""

    def _create_groups(self) -> None:
        by_ranks: dict[tuple, dist.ProcessGroup] = {}
        # NCCL options per group name (Megatron's communicator config), applied on nccl only.
        spec = (nccl_spec(self.config.nccl_communicator_config_path, self.config.high_priority_stream_groups)
                if "nccl" in str(dist.get_backend()) or self.pp_backend == "nccl" else {})
        rank = self.layout_rank
        created = 0
        if self.config.sharp_group:  # NCCL SHARP goes on the first communicator made with CollNet on: this one first
            created += self._create_sharp_group(SHARP_GROUP_NAMES[self.config.sharp_group], by_ranks, spec)
        # Every rank first creates its groups of the names all ranks have (the same number of new communicators on
        # every rank of a layout), then the gloo twins, then the pipeline-edge groups (embedding stages only).
        created += self._create_named([n for n in self.layout.names() if n not in EDGE_GROUPS], by_ranks, spec)
        if self._wants_gloo_twins():
            created += self._create_gloo_twins()
        edge = self._create_named([n for n in EDGE_GROUPS if self.layout.is_member(n, rank)], by_ranks, spec)
        created += edge + self._balance_group_count(edge)
        #: communicators this rank created for this state (0 when re-using pooled ones)
        self.groups_created = created
        #: distinct communicators this state uses (gloo twins not counted)
        self.groups_used = len(by_ranks)

    def _create_named(self, names: list[str], by_ranks: dict[tuple, dist.ProcessGroup],
                      spec: Mapping[str, Any]) -> int:
        created = 0
        for name in names:
            backend = self.pp_backend if name in PP_NAMES else None  # None: the job's backend
            opts = self._options_of(name, backend, spec)
            if (opts is None and backend is None and self.layout.size(name) == dist.get_world_size()
                    and not self._sharp_spans_world):
                # The default group already spans the world (and listing W ranks would cost O(W)).
                self._groups[name] = by_ranks[("world",)] = dist.group.WORLD
                continue
            ranks = self._global(self.layout.group_of(name, self.layout_rank))
            key = (ranks, backend, options_key(opts))  # one communicator per rank set (backend, NCCL options)
            pg = by_ranks.get(key)
            if pg is None:
                # Only members call: no rank waits on groups it is not part of.
                pg, new = pooled_group(ranks, self._timeout, backend, f"megashard:{name}",
                                       pg_options=nccl_options(opts) if opts else None, options_key=key[2])
                created += new
                by_ranks[key] = pg
            self._groups[name] = pg
        return created

    def _options_of(self, name: str, backend: str | None, spec: Mapping[str, Any]) -> Any:
        """The NCCL options of group ``name`` (None off nccl). An alias such as intra_dp_cp takes the options of the
        group it names (one communicator); hierarchical cp levels take ``hcp``'s, hybrid dp·cp slices ``dp_cp``'s
        (as Megatron)."""
        if backend is not None and backend != "nccl":
            return None
        if name in self.layout.hcp_names:
            return spec.get("hcp")
        if name in self.layout.hybrid_names:
            return spec.get("dp_cp")
        return spec.get(GROUP_ALIASES.get(name, name))

    def _create_sharp_group(self, name: str, by_ranks: dict[tuple, dist.ProcessGroup], spec: Mapping[str, Any]) -> int:
        """This rank's ``name`` group with NCCL SHARP (:func:`~megashard.state.comm_env.sharp_group`); every name with
        the same ranks and options (hsdp with dp_cp …) then shares it. Returns how many communicators it created."""
        from megashard.state.comm_env import sharp_group

        opts = self._options_of(name, None, spec)
        ranks = self._global(self.layout.group_of(name, self.layout_rank))
        pg, new = sharp_group(ranks, self._timeout, f"megashard:{name}:sharp", opts,
                              note=self.config.sharp_group == "dp" and self.global_rank == 0)
        by_ranks[(ranks, None, options_key(opts))] = pg
        self._sharp_spans_world = len(ranks) == dist.get_world_size()  # then not the default group for these ranks
        return int(new)

    def _balance_group_count(self, mine: int) -> int:
        """Pad with unused one-rank groups up to the largest number of edge groups any rank created; returns how many.

        torch names a members-only group by a hash of its ranks and of the number of groups the process holds, so
        the members of every later group must hold equally many: after the embedding stages created their groups,
        the other ranks add never-used one-rank gloo groups (one collective on the default group finds the count)."""
        if dist.get_backend() == "fake" or self.world_size == 1:
            return 0
        import torch

        from megashard.state.agreement import _device
        from megashard.state.pool import placeholder_groups

        t = torch.tensor([mine], dtype=torch.int64, device=_device(None))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._layout_group)  # this layout's ranks only
        return placeholder_groups(self.global_rank, int(t.item()) - mine, self._timeout)

    def _wants_gloo_twins(self) -> bool:
        # On gloo a group is its own twin; a `fake` simulation creates no communicator at all.
        # Megatron switches them off under gtp_remat (expert ones under expt_gtp_remat: _create_gloo_twins).
        return (self.config.create_gloo_process_groups and dist.get_backend() not in ("gloo", "fake")
                and self.sizes.gtp_remat == 1)

    def _create_gloo_twins(self) -> int:
        """A gloo group with the members of every data-parallel group (:data:`GLOO_TWIN_GROUPS`), during
        initialisation (every rank makes the same calls, members only, pooled), so that ``gloo_group`` is a lookup on
        any code path."""
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        created = 0
        for name in GLOO_TWIN_GROUPS:
            if self.sizes.expt_gtp_remat > 1 and name.startswith(("expt_", "intra_expt")):
                continue
            ranks = self._global(self.layout.group_of(name, self.layout_rank))
            if ranks not in by_ranks:
                by_ranks[ranks], new = pooled_group(ranks, self._timeout, "gloo", f"megashard:{name}:gloo")
                created += new
            self._gloo_twins[name] = by_ranks[ranks]
        return created
