"""`ParallelState`: the process groups and device meshes of one job, built from a `ParallelConfig`.

A rank creates only the groups it belongs to (``new_group(..., use_local_synchronization=True)``),
each rank set once (``hsdp`` and ``dp_cp`` share a communicator), every one with the configured
timeout. DeviceMeshes are assembled over those groups with ``DeviceMesh.from_group`` — never by
``_flatten`` (which would make every rank create every group again, without the timeout).

Meshes (every axis present, size 1 included):

- ``dense_mesh``  — axes ``(pp, dp_outer, dp_shard, cp, tp)``
- ``expert_mesh`` — axes ``(pp, expt_dp, ep, expt_tp)``
- ``fsdp_mesh``   — axes ``(pp, dp_outer, dp_shard_cp, tp)``: the root to slice for FSDP/HSDP + TP,
  so that FSDP2 and TP DTensors share one root mesh.
- ``mesh(name)``  — a 1-D mesh for any group name (``dp``, ``dp_cp``, ``tp_ep`` …).

The module-level functions (`initialize`, `get_parallel_state`, `destroy`) keep one *current* state;
several states can coexist (e.g. for multi-module models) — pass them around explicitly.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError
from megashard.layout import DENSE_GROUPS, DENSE_MESH_AXES, EXPERT_GROUPS, EXPERT_MESH_AXES, GROUP_NAMES, RankLayout

#: Root views built by from_group: name -> group names of their axes (outermost first).
VIEW_AXES: dict[str, tuple[str, ...]] = {
    "dense": DENSE_MESH_AXES,
    "expert": EXPERT_MESH_AXES,
    "fsdp": ("pp", "dp_outer", "dp_shard_cp", "tp"),
    # The expert view that FSDPDistributedIndex expects: FSDP over expt_dp, TP over expt_tp.
    "expert_fsdp": ("pp", "ep", "expt_dp", "expt_tp"),
}
# Axis names of each view: the group names, except that the expert FSDP view uses the dense names
# FSDPDistributedIndex looks up (expt_dp plays dp_shard_cp, expt_tp plays tp).
_VIEW_DIM_NAMES: dict[str, tuple[str, ...]] = {
    **VIEW_AXES, "expert_fsdp": ("pp", "ep", "dp_shard_cp", "tp"),
}


def resolve_backend(config: ParallelConfig) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if _device_type(config) == "cuda" else "gloo"


def _device_type(config: ParallelConfig) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_devices(config: ParallelConfig, processes_per_node: int | None = None, prefix: str = "") -> None:
    """ConfigError when this machine cannot run ``config``'s device and backend: ``device=cuda`` or
    ``backend=nccl`` without a usable CUDA device or NCCL, or fewer CUDA devices than ``processes_per_node``.
    ``prefix`` names the fields (``"parallel."`` for a job YAML)."""
    cpu_fix = f"use {prefix}device=cpu (or auto) and {prefix}backend=gloo (or auto) on this machine"
    no_cuda = (f"this machine has no usable CUDA device (torch {torch.__version__}"
               f"{', a CPU-only build' if torch.version.cuda is None else ''})")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{prefix}device=cuda, but {no_cuda}; {cpu_fix}")
    backend = resolve_backend(config)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(f"{prefix}backend=nccl needs CUDA devices, but {no_cuda}; {cpu_fix}")
        if not dist.is_nccl_available():
            raise ConfigError(f"{prefix}backend=nccl, but this torch build has no NCCL; use {prefix}backend=gloo")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError(f"{prefix}backend=gloo, but this torch build has no gloo; use {prefix}backend=nccl on CUDA")
    if processes_per_node and _device_type(config) == "cuda" and torch.cuda.device_count() < processes_per_node:
        raise ConfigError(
            f"launch.nproc_per_node={processes_per_node} processes on this node need one CUDA device each, but "
            f"this machine has {torch.cuda.device_count()}; use launch.nproc_per_node={torch.cuda.device_count()}"
        )


#: What torch.distributed's env:// initialisation reads (torchrun and `megashard run` set all of them).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(config: ParallelConfig) -> None:
    """Initialise the default process group from torchrun's environment if it is not up yet."""
    if dist.is_initialized():
        return
    missing = [v for v in LAUNCHER_ENV if v not in os.environ]
    if missing:
        raise StateError(
            f"megashard.initialize() found no torch.distributed launcher: the environment variable(s) "
            f"{', '.join(missing)} are not set. Start the script with torchrun (e.g. torchrun --nproc-per-node=4 "
            "train.py) or megashard run, or call torch.distributed.init_process_group(...) before initialize()"
        )
    check_devices(config)
    backend = resolve_backend(config)
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.timeout))


# Communicators are pooled per process: PyTorch names a locally-synchronised group by a hash of its ranks
# and of the number of live groups, so destroying and re-creating the same rank set would reuse the old
# group's store keys and connect to dead sockets. Re-initialising megashard therefore reuses the pooled
# communicator (also the fast path: creating NCCL communicators is the slow part of start-up).
_POOL: dict[tuple, dist.ProcessGroup] = {}
_POOL_WORLD: list = [None]  # the default group the pool belongs to


def _pooled_group(ranks: tuple[int, ...], timeout: timedelta, backend: str | None, desc: str) -> tuple[dist.ProcessGroup, bool]:
    """The pooled group for ``ranks`` (created by its members only on first use); (group, created_now)."""
    world = dist.group.WORLD
    if _POOL_WORLD[0] is not world:  # a new default group: the old communicators died with the old one
        _POOL.clear()
        _POOL_WORLD[0] = world
    key = (ranks, timeout.total_seconds(), backend)
    pg = _POOL.get(key)
    if pg is not None:
        return pg, False
    pg = dist.new_group(list(ranks), timeout=timeout, backend=backend, use_local_synchronization=True, group_desc=desc)
    _POOL[key] = pg
    return pg, True


def pooled_group_count() -> int:
    """How many communicators megashard holds in this process (for tests and benchmarks)."""
    return len(_POOL)


def release_process_groups() -> None:
    """Destroy every pooled communicator (at shutdown, before ``destroy_process_group()``).

    Do not initialise megashard again in the same default group afterwards: re-created groups would get
    the released groups' names (see the pool note above). Destroying the default group releases them too.
    """
    for pg in _POOL.values():
        try:
            dist.destroy_process_group(pg)
        except (ValueError, RuntimeError):
            pass
    _POOL.clear()


class ParallelState:
    """Process groups, device meshes and per-rank state of one parallel layout.

    Args:
        config: the parallel config; sizes are resolved against the default group's world size.
        device_type: device of the meshes (``"cpu"``/``"cuda"``); default from ``config.device``.
        agree_on: more fields every rank must agree on (e.g. the rest of a job config, as dotted keys),
            compared together with ``config`` and the megashard and torch versions.

    Creation is collective: first every rank checks, in one small collective on the default group with
    ``config.timeout``, that its config and versions equal rank 0's (:mod:`megashard.agreement`; a
    difference raises :class:`~megashard.errors.RankMismatchError` on every rank, naming ranks and fields),
    then it creates the groups it belongs to.
    """

    def __init__(self, config: ParallelConfig, *, device_type: str | None = None,
                 agree_on: Mapping[str, Any] | None = None):
        if not dist.is_initialized():
            raise StateError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group (or "
                "megashard.state.init_distributed(config)) before creating a ParallelState"
            )
        from megashard.agreement import check_ranks_agree, fingerprint

        config.validate()  # world-independent checks; the sizes are resolved after the ranks agree
        check_ranks_agree(fingerprint(config, agree_on), timeout=config.timeout)
        self.config = config
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.layout = RankLayout(config, self.world_size)
        self.sizes = self.layout.sizes
        self.device_type = device_type or _device_type(config)
        self._timeout = timedelta(seconds=config.timeout)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        self._views: dict[str, DeviceMesh] = {}
        self._destroyed = False
        self._gloo_twins: dict[str, dist.ProcessGroup] = {}
        self._create_groups()

    # ------------------------------------------------------------------ construction
    def _create_groups(self) -> None:
        by_ranks: dict[tuple[int, ...] | str, dist.ProcessGroup] = {}
        created = 0
        for name in GROUP_NAMES:
            if self.layout.size(name) == self.world_size:
                # The default group already spans the world (and listing W ranks would cost O(W)).
                self._groups[name] = by_ranks["world"] = dist.group.WORLD
                continue
            ranks = tuple(self.layout.group_of(name, self.global_rank))
            pg = by_ranks.get(ranks)
            if pg is None:
                # Only members call: no rank waits on groups it is not part of.
                pg, new = _pooled_group(ranks, self._timeout, None, f"megashard:{name}")
                created += new
                by_ranks[ranks] = pg
            self._groups[name] = pg
        #: communicators this rank created for this state (0 when re-using pooled ones)
        self.groups_created = created
        #: distinct communicators this state uses
        self.groups_used = len(by_ranks)

    def _rank_tensor(self, view: str) -> torch.Tensor:
        """The rank at every coordinate of a view, computed with one permute (no per-rank Python loop)."""
        expert = view.startswith("expert")
        grid = self.layout._expert if expert else self.layout._dense
        groups = EXPERT_GROUPS if expert else DENSE_GROUPS
        n = len(grid.sizes)
        # Tensor dim k holds grid axis n-1-k (slowest first). A view axis merges its grid axes slowest-first,
        # which reproduces the in-group (sorted) order of the group it stands for.
        t = torch.arange(self.world_size).reshape(list(reversed(grid.sizes)))
        perm: list[int] = []
        shape: list[int] = []
        for name in VIEW_AXES[view]:
            idx = sorted((grid.index[a] for a in groups.get(name, (name,))), reverse=True)
            perm += [n - 1 - i for i in idx]
            size = 1
            for i in idx:
                size *= grid.sizes[i]
            shape.append(size)
        return t.permute(perm).reshape(shape)

    def _view(self, view: str) -> DeviceMesh:
        mesh = self._views.get(view)
        if mesh is None:
            self._check_alive()
            names = VIEW_AXES[view]
            mesh = DeviceMesh.from_group(
                [self._groups[n] for n in names], self.device_type,
                mesh=self._rank_tensor(view), mesh_dim_names=_VIEW_DIM_NAMES[view],
            )
            self._views[view] = mesh
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
            else:
                m = DeviceMesh.from_group(self._groups[name], self.device_type, mesh_dim_names=(name,))
            self._meshes[name] = m
        return m

    # ------------------------------------------------------------------ groups
    def _check_name(self, name: str) -> None:
        if name not in self._groups:
            import difflib

            close = difflib.get_close_matches(name, GROUP_NAMES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown group '{name}'{hint}; valid: {', '.join(GROUP_NAMES)}")

    def _check_alive(self) -> None:
        if self._destroyed:
            raise StateError("this ParallelState has been destroyed; create a new one with megashard.initialize()")

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of ``name`` that this rank belongs to."""
        self._check_alive()
        self._check_name(name)
        return self._groups[name]

    def gloo_group(self, name: str) -> dist.ProcessGroup:
        """A gloo group with the members of ``name`` for CPU-side work.

        On a gloo job this is the group itself. Otherwise the first call creates gloo twins of every
        group at once, in a fixed order, so it must be made by every rank (like initialisation).
        """
        pg = self.group(name)
        if dist.get_backend(pg) == "gloo":
            return pg
        if not self._gloo_twins:
            by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
            for n in GROUP_NAMES:
                ranks = tuple(self.layout.group_of(n, self.global_rank))
                if ranks not in by_ranks:
                    by_ranks[ranks], _ = _pooled_group(ranks, self._timeout, "gloo", f"megashard:{n}:gloo")
                self._gloo_twins[n] = by_ranks[ranks]
        return self._gloo_twins[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, in group-rank order."""
        self._check_name(name)
        return self.layout.group_of(name, self.global_rank)

    def rank_in(self, name: str) -> int:
        """This rank's index inside its ``name`` group."""
        self._check_name(name)
        return self.layout.rank_in(name, self.global_rank)

    def size(self, name: str) -> int:
        """Size of the ``name`` groups."""
        self._check_name(name)
        return self.layout.size(name)

    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.global_rank)

    # ------------------------------------------------------------------ FSDP view
    def fsdp_index(self, hsdp_outer_dp_shard: bool = False):
        """An :class:`~megashard.index.FSDPDistributedIndex` over ``fsdp_mesh`` (and the expert view)."""
        from megashard.index import FSDPDistributedIndex

        hybrid = self.sizes.dp_outer > 1
        return FSDPDistributedIndex(
            self.fsdp_mesh,
            dp_shard_dim="dp_shard_cp",
            dp_outer_dim="dp_outer" if hybrid else None,
            tp_dim="tp",
            hybrid_fsdp_group=self._groups["hsdp"] if hybrid else None,
            hsdp_outer_dp_shard=hsdp_outer_dp_shard,
            expt_device_mesh=self._view("expert_fsdp"),
            hybrid_fsdp_expt_group=self._groups["expt_dp"] if hybrid else None,
        )

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Forget every group and mesh of this state (communicators stay pooled for re-use). Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        self._meshes.clear()
        self._views.clear()
        self._groups.clear()
        self._gloo_twins.clear()

    def __repr__(self) -> str:
        s = self.sizes
        return (
            f"ParallelState(rank={self.global_rank}/{self.world_size}, tp={s.tp}, cp={s.cp}, pp={s.pp}, "
            f"dp={s.dp} (outer {s.dp_outer} x shard {s.dp_shard}), ep={s.ep}, expt_tp={s.expt_tp}, expt_dp={s.expt_dp})"
        )


# ---------------------------------------------------------------------- current instance
_CURRENT: ParallelState | None = None


def initialize(config: ParallelConfig | None = None, *, agree_on: Mapping[str, Any] | None = None,
               **sizes: Any) -> ParallelState:
    """Create the current :class:`ParallelState` (initialising torch.distributed from the environment if needed).

    ``initialize(ParallelConfig(tp=2))`` or ``initialize(tp=2, pp=2)``. ``agree_on``: more fields every
    rank must agree on (see :class:`ParallelState`).
    """
    global _CURRENT
    if config is None:
        config = ParallelConfig.from_dict(sizes)
    elif sizes:
        raise ConfigError(f"pass either a ParallelConfig or sizes, not both (got extra {sorted(sizes)})")
    if _CURRENT is not None:
        raise StateError(
            "megashard is already initialised; call megashard.destroy() first (or keep the returned "
            "ParallelState and create another one directly with ParallelState(config))"
        )
    init_distributed(config)
    state = ParallelState(config, agree_on=agree_on)
    _CURRENT = state
    return state


def is_initialized() -> bool:
    return _CURRENT is not None


def get_parallel_state() -> ParallelState:
    """The current state; raises StateError before `initialize` or after `destroy`."""
    if _CURRENT is None:
        raise StateError("megashard parallel state is not initialised: call megashard.initialize(config) first")
    return _CURRENT


def set_parallel_state(state: ParallelState | None) -> ParallelState | None:
    """Make ``state`` current (e.g. while running one module of a multi-module model); returns the previous one."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, state
    return prev


def destroy() -> None:
    """Tear down the current state: its groups, meshes, RNG tracker and memory buffer. Safe to call twice."""
    global _CURRENT
    state, _CURRENT = _CURRENT, None
    if state is not None:
        state.destroy()
    # Per-rank state lives in modules that may never have been imported: nothing to reset there.
    import sys

    for mod in ("megashard.random", "megashard.memory"):
        if mod in sys.modules:
            sys.modules[mod]._reset_for_destroy()
