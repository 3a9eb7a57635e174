"""`ParallelState`: the process groups, device meshes and per-layout state of one job, built from a layout.

The flow ends here: ``ParallelConfig.resolve(world)`` → ``ResolvedSizes`` → ``RankLayout(sizes)`` →
``ParallelState(config, layout)`` (without a layout the state resolves the config itself, once).

A rank creates only the groups it belongs to (``new_group(..., use_local_synchronization=True)``, through the
communicator pool of :mod:`megashard.state.pool`), each rank set once (``hsdp`` and ``dp_cp`` share a
communicator), every one with the configured timeout and, on nccl, the NCCL options of its name
(:mod:`megashard.config.nccl`); on a non-gloo backend also gloo twins of the data-parallel groups (Megatron's set),
when the config asks for them (the steps that make them: :mod:`megashard.state.groups_build`). The names are
every name of the layout (:meth:`RankLayout.names`): the axis groups, Megatron's aliases, the pipeline-edge groups
``embd``/``pos_embd`` (created by the embedding stages only) and the hierarchical cp levels. DeviceMeshes are
assembled over those groups (:mod:`megashard.state.meshes`) — never by ``_flatten``.

Meshes (every axis present, size 1 included):

- ``dense_mesh``  — axes ``(pp, dp_outer, dp_shard, cp, tp)``
- ``expert_mesh`` — axes ``(pp, expt_dp, ep, expt_tp)``
- ``expert_hsdp_mesh`` — axes ``(pp, expt_dp_outer, expt_dp_shard, ep, expt_tp)``: the expert replica axis
- ``fsdp_mesh``   — axes ``(pp, dp_outer, dp_shard_cp, tp)``: the root to slice for FSDP/HSDP + TP,
  so that FSDP2 and TP DTensors share one root mesh.
- ``mesh(name)``  — a 1-D mesh for any group name (``dp``, ``dp_cp``, ``tp_ep`` …).

Per-layout state — the RNG tracker, the memory buffer, the virtual-pipeline rank — lives in ``state.locals``
(:mod:`megashard.state.layout_locals`), so several states can coexist (e.g. for multi-module models); the current
one, which the Megatron-style functions use, is kept by :mod:`megashard.state.current`.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch.distributed as dist

from megashard._compat import mesh_release_groups
from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError, did_you_mean
from megashard.layout import EDGE_GROUPS, RankLayout
from megashard.state.devices import check_devices, current_device
from megashard.state.groups_build import GLOO_TWIN_GROUPS, PP_NAMES, SHARP_GROUP_NAMES, GroupCreation
from megashard.state.layout_locals import LayoutLocals
from megashard.state.meshes import VIEW_AXES, build_view
from megashard.state.pool import pooled_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh  # imported where a mesh is built: ~0.1 s

    from megashard.state.index import FSDPDistributedIndex

__all__ = ["GLOO_TWIN_GROUPS", "PP_NAMES", "ParallelState", "SHARP_GROUP_NAMES"]


class ParallelState(GroupCreation):
    """Process groups, device meshes and per-rank state of one parallel layout.

    Args:
        config: the parallel config (timeout, backend, device, gloo twins; validated when it was built).
        layout: its :class:`~megashard.layout.RankLayout` for the default group's world size, when the caller has
            resolved it already (e.g. from :meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>`);
            ``None`` = resolve ``config`` here, once.
        device_type: device of the meshes (``"cpu"``/``"cuda"``); default from ``config.device``.
        agree_on: more fields every rank must agree on (e.g. the rest of a job config, as dotted keys),
            compared together with ``config`` and the megashard and torch versions.
        rank_offset: first global rank of this layout when it covers only part of the job (one module of a
            multi-module job, :mod:`megashard.state.modules`): the layout's ranks are ``rank_offset ..
            rank_offset + layout.world_size - 1``; only they construct the state (needs ``layout``), and every group
            holds global ranks (0 for a module that starts at rank 0). None (default): the layout spans the default
            group.

    Creation is collective: first every rank checks, in one small collective on the default group with
    ``config.timeout``, that its config and versions equal rank 0's (:mod:`megashard.state.agreement`; a
    difference raises :class:`~megashard.errors.RankMismatchError` on every rank, naming ranks and fields),
    then it creates the groups it belongs to. With ``rank_offset`` the check runs on the layout's own ranks (a
    group its members create first), so other modules' ranks are neither waited for nor touched.
    """

    def __init__(self, config: ParallelConfig, layout: RankLayout | None = None, *, device_type: str | None = None,
                 agree_on: Mapping[str, Any] | None = None, rank_offset: int | None = None):
        if not dist.is_initialized():
            raise StateError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group (or "
                "megashard.state.init_distributed(config)) before creating a ParallelState"
            )
        from megashard.state.agreement import check_ranks_agree, fingerprint

        if dist.get_backend() != "fake":  # a simulation needs no devices
            # device=cuda / backend=nccl on a machine without them: one line here, not an error from inside torch at
            # the first mesh or collective (init_distributed checks the same when it starts the default group).
            check_devices(config if device_type is None else dataclasses.replace(config, device=device_type))

        self.global_rank = dist.get_rank()
        self._timeout = timedelta(seconds=config.timeout)
        agree_group = None
        if rank_offset is not None:
            agree_group = self._module_group(layout, rank_offset)
        self._layout_group = agree_group  # None: the default group
        #: first global rank of this layout (0 unless it is one module of a multi-module job)
        self.rank_offset = rank_offset or 0
        # The config was checked when it was built (it is frozen); the sizes are resolved after the ranks agree.
        check_ranks_agree(fingerprint(config, agree_on), timeout=config.timeout, group=agree_group)
        self.config = config
        #: ranks of this layout (the default group's size unless it is one module of a multi-module job)
        self.world_size = dist.get_world_size() if layout is None else layout.world_size
        if layout is None:
            layout = RankLayout(config.resolve(self.world_size))
        elif rank_offset is None and layout.world_size != dist.get_world_size():
            raise ConfigError(f"ParallelState: the layout was resolved for {layout.world_size} ranks, but the default "
                              f"process group has {dist.get_world_size()}; pass rank_offset= for a layout on part of "
                              "the ranks")
        #: this rank's index in the layout (its global rank minus ``rank_offset``)
        self.layout_rank = self.global_rank - self.rank_offset
        self.layout = layout
        self.sizes = layout.sizes
        self.device_type = device_type or current_device(config.device).type
        #: the RNG tracker, memory buffer and virtual-pipeline rank of this layout
        self.locals = LayoutLocals(self.device_type)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._gloo_twins: dict[str, dist.ProcessGroup] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        self._views: dict[str, DeviceMesh] = {}
        self._destroyed = False
        self._sharp_spans_world = False
        from megashard.state.comm_env import prepare_comm_options

        #: backend of the pp groups (None: the job's); SHARP and the backend checked before any group exists
        self.pp_backend = prepare_comm_options(config.pp_backend, config.sharp_group)
        from megashard.state.pool import register_user

        register_user(self)  # release_idle_groups keeps the groups of live states
        self._create_groups()

    # ------------------------------------------------------------------ construction
    def _module_group(self, layout: RankLayout | None, rank_offset: int) -> dist.ProcessGroup:
        """The group of all this layout's ranks (created by them only), for the agreement check."""
        if layout is None:
            raise ConfigError("ParallelState(rank_offset=...) needs the layout of its ranks: pass layout=RankLayout(...)")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ConfigError(f"ParallelState: rank_offset={rank_offset!r} must be a non-negative integer")
        end = rank_offset + layout.world_size
        if end > dist.get_world_size():
            raise ConfigError(f"ParallelState: ranks {rank_offset}..{end - 1} do not fit the {dist.get_world_size()} "
                              "ranks of the default group")
        if not rank_offset <= self.global_rank < end:
            raise StateError(f"rank {self.global_rank} is not one of this layout's ranks {rank_offset}..{end - 1}: "
                             "only they create its ParallelState")
        if layout.world_size == dist.get_world_size():
            return dist.group.WORLD
        pg, _ = pooled_group(tuple(range(rank_offset, end)), self._timeout, None, "megashard:module")
        return pg

    def _global(self, ranks: Iterable[int]) -> tuple[int, ...]:
        off = self.rank_offset
        return tuple(r + off for r in ranks) if off else tuple(ranks)

    def _view(self, view: str) -> DeviceMesh:
        mesh = self._views.get(view)
        if mesh is None:
            self._check_alive()
            mesh = self._views[view] = build_view(self.layout, view, self._groups, self.device_type, self.rank_offset)
        return mesh

    # ------------------------------------------------------------------ meshes
    @property
    def dense_mesh(self) -> DeviceMesh:
        """Axes ``(pp, dp_outer, dp_shard, cp, tp)``."""
        return self._view("dense")

    @property
    def expert_mesh(self) -> DeviceMesh:
        """Axes ``(pp, expt_dp, ep, expt_tp)``."""
        return self._view("expert")

    @property
    def expert_hsdp_mesh(self) -> DeviceMesh:
        """Axes ``(pp, expt_dp_outer, expt_dp_shard, ep, expt_tp)``: the expert mesh with its replica axis
        (``expt_dp_outer = dp_outer``)."""
        return self._view("expert_hsdp")

    @property
    def expert_fully_shard_mesh(self) -> DeviceMesh:
        """The mesh to hand to ``fully_shard`` for expert parameters: 1-D ``expt_dp_shard`` (FSDP inside a
        replica), or 2-D ``(expt_dp_outer, expt_dp_shard)`` (HSDP) when ``dp_outer > 1`` — experts shard inside
        a replica and replicate across replicas, as dense parameters."""
        if self.sizes.dp_outer > 1:
            return self.expert_hsdp_mesh["expt_dp_outer", "expt_dp_shard"]
        return self.expert_hsdp_mesh["expt_dp_shard"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Axes ``(pp, dp_outer, dp_shard_cp, tp)``: slice it for FSDP2 + TP so both share one root."""
        return self._view("fsdp")

    @property
    def fully_shard_mesh(self) -> DeviceMesh:
        """The mesh to hand to ``fully_shard``: 1-D ``dp_shard_cp`` (FSDP), or 2-D ``(dp_outer, dp_shard_cp)``
        (HSDP) when ``dp_outer > 1``. Never a 2-D ``(dp_shard, cp)`` slice, which FSDP would read as HSDP."""
        if self.sizes.dp_outer > 1:
            return self.fsdp_mesh["dp_outer", "dp_shard_cp"]
        return self.fsdp_mesh["dp_shard_cp"]

    def mesh(self, name: str) -> DeviceMesh:
        """A 1-D DeviceMesh of the group ``name`` (any of :data:`GROUP_NAMES`)."""
        self._check_name(name)
        m = self._meshes.get(name)
        if m is None:
            self._check_alive()
            if name in VIEW_AXES["fsdp"]:
                m = self.fsdp_mesh[name]
            elif name in ("dp_shard", "cp"):
                m = self.dense_mesh[name]
            elif name in ("ep", "expt_dp", "expt_tp"):
                m = self.expert_mesh[name]
            elif name in ("expt_dp_shard", "expt_dp_outer"):
                m = self.expert_hsdp_mesh[name]
            else:
                from torch.distributed.device_mesh import DeviceMesh

                m = DeviceMesh.from_group(self._groups[name], self.device_type, mesh_dim_names=(name,))
            self._meshes[name] = m
        return m

    # ------------------------------------------------------------------ groups
    def _check_name(self, name: str) -> None:
        if name not in self._groups:
            if name in EDGE_GROUPS:
                return  # a known name this rank is not a member of (group() says so)
            names = self.layout.names()
            raise ConfigError(f"unknown group '{name}'{did_you_mean(name, names)}; valid: {', '.join(names)}")

    def _check_alive(self) -> None:
        if self._destroyed:
            raise StateError("this ParallelState has been destroyed; create a new one with megashard.initialize()")

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of ``name`` that this rank belongs to (StateError for ``embd``/``pos_embd`` on a stage
        without the embedding: test with :meth:`in_group`)."""
        self._check_alive()
        self._check_name(name)
        pg = self._groups.get(name)
        if pg is None:
            stage = self.layout.rank_in("pp", self.layout_rank)
            raise StateError(f"rank {self.global_rank} (pipeline stage {stage} of {self.sizes.pp}) is not in the '{name}' "
                             f"group: its pipeline's is {self.ranks(name)}; test state.in_group('{name}') first")
        return pg

    def named_groups(self) -> dict[str, dist.ProcessGroup]:
        """Every group this rank belongs to, by megashard's name (aliases of one communicator map to the same object;
        gloo twins not included). A copy: for tools that watch the groups, e.g. :mod:`megashard.doctor`."""
        self._check_alive()
        return dict(self._groups)

    def in_group(self, name: str) -> bool:
        """Whether this rank is in a ``name`` group (False only for ``embd``/``pos_embd`` off the embedding stages)."""
        self._check_name(name)
        return name in self._groups

    def hcp_groups(self) -> list[dist.ProcessGroup]:
        """The hierarchical context-parallel groups of this rank, level 0 (fastest) first (Megatron's
        ``get_hierarchical_context_parallel_groups``); empty when cp is not hierarchical."""
        return [self.group(n) for n in self.layout.hcp_names]

    def hybrid_dp_cp_groups(self) -> dict[int, dist.ProcessGroup]:
        """This rank's hybrid dp·cp groups by size (Megatron's ``_HYBRID_DP_CP_GROUPS``): the power-of-two slices of its
        dp·cp group; empty without hybrid context parallelism."""
        return {k: self.group(n) for n, k in self.layout.hybrid_names.items()}

    def gloo_group(self, name: str) -> dist.ProcessGroup:
        """A gloo group with the members of ``name`` for CPU-side work (a lookup: no collective).

        On a gloo job this is the group itself. On other backends the twins are created during initialisation
        when ``config.create_gloo_process_groups`` is true (the default); otherwise this raises StateError.
        """
        pg = self.group(name)
        if dist.get_backend(pg) == "gloo":
            return pg
        twin = self._gloo_twins.get(name)
        if twin is None:
            backend = dist.get_backend(pg)
            why = ("a 'fake' simulation creates no communicators" if backend == "fake" else
                   f"gloo twins exist for the data-parallel groups {', '.join(GLOO_TWIN_GROUPS)} only (as in "
                   "Megatron-LM)" if name not in GLOO_TWIN_GROUPS else
                   "parallel.create_gloo_process_groups is false; set it to true (ParallelConfig("
                   "create_gloo_process_groups=True)) to create them at initialisation")
            raise StateError(f"no gloo twin of group '{name}' on this {backend} job: {why}")
        return twin

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, in group-rank order."""
        self._check_name(name)
        return list(self._global(self.layout.group_of(name, self.layout_rank)))

    def rank_in(self, name: str) -> int:
        """This rank's index inside its ``name`` group."""
        self._check_name(name)
        return self.layout.rank_in(name, self.layout_rank)

    def size(self, name: str) -> int:
        """Size of the ``name`` groups (for ``embd``/``pos_embd``: of this rank's pipeline's)."""
        self._check_name(name)
        if name in EDGE_GROUPS:
            return len(self.ranks(name))
        return self.layout.size(name)

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis (dense and expert)."""
        return self.layout.coords(self.layout_rank)

    # ------------------------------------------------------------------ FSDP view
    def fsdp_index(self, hsdp_outer_dp_shard: bool = False) -> "FSDPDistributedIndex":
        """An :class:`~megashard.state.index.FSDPDistributedIndex` over ``fsdp_mesh`` (and the expert view)."""
        from megashard.state.index import FSDPDistributedIndex

        hybrid = self.sizes.dp_outer > 1
        return FSDPDistributedIndex(
            self.fsdp_mesh,
            dp_shard_dim="dp_shard_cp",
            dp_outer_dim="dp_outer" if hybrid else None,
            tp_dim="tp",
            hybrid_fsdp_group=self._groups["hsdp"] if hybrid else None,
            hybrid_fsdp_expt_group=self._groups["expt_dp"] if hybrid else None,
            hsdp_outer_dp_shard=hsdp_outer_dp_shard,
            expt_device_mesh=self._view("expert_fsdp"),
        )

    def pg_collection(self, megatron: bool | None = None) -> Any:
        """Megatron's ``ProcessGroupCollection`` of this rank's groups: a real
        ``megatron.core.process_groups_config.ProcessGroupCollection`` when megatron-core is importable (``megatron``
        None) or required (True: MissingExtraError without it), megashard's stand-in with the same field names
        otherwise or with ``megatron=False`` (:mod:`megashard.state.pg_collection`)."""
        from megashard.state.pg_collection import pg_collection

        return pg_collection(self, megatron)

    def pooled_groups_in_use(self) -> list[dist.ProcessGroup]:
        """The communicators this (live) state uses: none once destroyed."""
        if self._destroyed:
            return []
        ag = [g for g in getattr(self, "all_gather_groups", {}).values() if g is not None]
        return [*self._groups.values(), *self._gloo_twins.values(), *ag]

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Forget every group and mesh of this state and drop its RNG tracker, memory buffer and virtual-pipeline
        rank (communicators stay pooled for re-use). Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        for mesh in (*self._views.values(), *self._meshes.values()):
            mesh_release_groups(mesh)  # DTensor caches may keep a mesh alive: not its groups
        self._meshes.clear()
        self._views.clear()
        self._groups.clear()
        self._gloo_twins.clear()
        self.locals.reset()

    def __repr__(self) -> str:
        s = self.sizes
        return (
            f"ParallelState(rank={self.global_rank}/{self.world_size}"
            f"{f' from rank {self.rank_offset}' if self.rank_offset else ''}, tp={s.tp}, cp={s.cp}, pp={s.pp}, "
            f"dp={s.dp} (outer {s.dp_outer} x shard {s.dp_shard}), ep={s.ep}, expt_tp={s.expt_tp}, expt_dp={s.expt_dp})"
        )
