"""`FSDPDistributedIndex`: the FSDP/HSDP view of the meshes (Megatron-FSDP's class, same constructor).

Get one for the current layout with ``megashard.get_parallel_state().fsdp_index()``: it is built over
``fsdp_mesh`` (axes ``pp, dp_outer, dp_shard_cp, tp``) and the expert view (axes ``pp, dp_outer, ep, dp_shard_cp,
tp`` where dp_outer = expt_dp_outer, dp_shard_cp = expt_dp_shard and tp = expt_tp: experts shard inside an HSDP
replica and replicate across replicas).

The constructor takes Megatron-FSDP 0.6.1's parameters in its positional order, and misuse raises ``ValueError``
as Megatron-FSDP does (:class:`FSDPIndexError` is both a ``ValueError`` and a megashard error).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch.distributed import DeviceMesh, ProcessGroup

from megashard._compat import mesh_flattened_names
from megashard.errors import MegashardError


class FSDPIndexError(MegashardError, ValueError):
    """Misuse of :class:`FSDPDistributedIndex` (Megatron-FSDP raises ``ValueError`` for the same cases)."""

logger = logging.getLogger(__name__)


def get_mesh_names(device_mesh: Optional[DeviceMesh] = None, only_submesh_dims: bool = False) -> list[str]:
    """Axis names of ``device_mesh`` plus, unless ``only_submesh_dims``, names flattened from its root."""
    if device_mesh is None:
        return []
    names = list(device_mesh.mesh_dim_names or ())
    if not only_submesh_dims:
        names += [n for n in mesh_flattened_names(device_mesh) if n not in names]
    return names


def contains_submesh(device_mesh: Optional[DeviceMesh], submesh_names: Optional[str | Sequence[str]]) -> bool:
    """True if every name in ``submesh_names`` is an axis (or flattened name) of ``device_mesh``."""
    if device_mesh is None or submesh_names is None:
        return False
    if isinstance(submesh_names, str):
        submesh_names = (submesh_names,)
    names = get_mesh_names(device_mesh)
    return all(n is not None and n in names for n in submesh_names)


class FSDPDistributedIndex:
    """References to the meshes and process groups FSDP/HSDP needs.

    Args (Megatron-FSDP 0.6.1's order):
        device_mesh: the root (dense) mesh; the named axes below must be axes of it.
        dp_shard_dim: axis FSDP shards over (data and context parallel), e.g. ``"dp_shard_cp"``.
        dp_outer_dim: axis of HSDP replicas; ``None`` = plain FSDP.
        tp_dim: tensor-parallel axis.
        hybrid_fsdp_group: the flattened (dp_outer, dp_shard) group; required with ``dp_outer_dim``.
        hybrid_fsdp_expt_group: the expert counterpart of ``hybrid_fsdp_group`` (the whole expert dp group).
        hsdp_outer_dp_shard: shard across dp_outer too (logical rank order (dp_shard, dp_outer)).
        expt_device_mesh: the expert mesh (same axis names); ``None`` = no expert groups.
        fsdp_group_ag: an independent all-gather group with the FSDP group's ranks (all-gather / reduce-scatter
            overlap), returned by ``get_fsdp_group(independent_all_gather=True)``; ``None`` = none.
        expt_fsdp_group_ag: the expert counterpart of ``fsdp_group_ag``.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: Optional[str] = None,
        dp_outer_dim: Optional[str] = None,
        tp_dim: Optional[str] = None,
        hybrid_fsdp_group: Optional[ProcessGroup] = None,
        hybrid_fsdp_expt_group: Optional[ProcessGroup] = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: Optional[DeviceMesh] = None,
        fsdp_group_ag: Optional[ProcessGroup] = None,
        expt_fsdp_group_ag: Optional[ProcessGroup] = None,
    ):
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group
        self.fsdp_group_ag = fsdp_group_ag
        self.expt_fsdp_group_ag = expt_fsdp_group_ag

        def group_of(mesh: Optional[DeviceMesh], dim: Optional[str]) -> Optional[ProcessGroup]:
            return mesh[dim].get_group() if mesh is not None and dim is not None and contains_submesh(mesh, dim) else None

        self.fsdp_group = group_of(device_mesh, dp_shard_dim)
        self.outer_fsdp_group = group_of(device_mesh, dp_outer_dim)
        self.expt_fsdp_group = group_of(expt_device_mesh, dp_shard_dim)
        self.expt_outer_fsdp_group = group_of(expt_device_mesh, dp_outer_dim)

        # Registry (*names, is_expert) -> submesh; flattened names are never sliced from a root.
        self.mesh_library: dict[tuple, DeviceMesh] = {}
        tp, hsdp_tp, fsdp_tp = (tp_dim,), (dp_outer_dim, dp_shard_dim, tp_dim), (dp_shard_dim, tp_dim)
        hsdp, fsdp = (dp_outer_dim, dp_shard_dim), (dp_shard_dim,)
        for pat in (tp, hsdp_tp, fsdp_tp, hsdp, fsdp):
            self._register(device_mesh, pat, False)
        # Expert HSDP patterns start from the dense mesh and are overridden by the expert mesh when it has them.
        if expt_device_mesh is not None:
            for pat in (hsdp, hsdp_tp):
                self._register(device_mesh, pat, True)
            for pat in (tp, fsdp_tp, fsdp, hsdp, hsdp_tp):
                self._register(expt_device_mesh, pat, True)

        if self.fsdp_group is None:
            raise FSDPIndexError(
                f"FSDPDistributedIndex needs the FSDP axis: dp_shard_dim={dp_shard_dim!r} is not an axis of the mesh "
                f"(axes: {get_mesh_names(device_mesh)})"
            )
        if self.use_hybrid_fsdp:
            if self.outer_fsdp_group is None:
                raise FSDPIndexError(
                    f"hybrid FSDP needs the outer axis: dp_outer_dim={dp_outer_dim!r} is not an axis of the mesh "
                    f"(axes: {get_mesh_names(device_mesh)})"
                )
            if self.hybrid_fsdp_group is None:
                raise FSDPIndexError(
                    "hybrid FSDP (dp_outer_dim given) needs hybrid_fsdp_group, the flattened (dp_outer, dp_shard) "
                    "group; ParallelState.fsdp_index() passes it for you"
                )

    def _register(self, mesh: DeviceMesh, names: tuple, is_expert: bool) -> bool:
        if any(n is None for n in names) or not contains_submesh(mesh, names):
            return False
        key = tuple(names) + (is_expert,)
        self.mesh_library[key] = mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]
        return True

    def get_submesh(self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False) -> DeviceMesh:
        """A registered submesh by axis name(s)."""
        if isinstance(mesh_dim_names, str):
            mesh_dim_names = (mesh_dim_names,)
        key = tuple(mesh_dim_names) + (is_expert_parallel,)
        mesh = self.mesh_library.get(key)
        if mesh is None:
            known = sorted({k[:-1] for k in self.mesh_library if k[-1] == is_expert_parallel})
            raise FSDPIndexError(
                f"no submesh {tuple(mesh_dim_names)} (is_expert_parallel={is_expert_parallel}) is registered; "
                f"registered: {known}"
            )
        return mesh

    def get_dp_group(self, is_expert_parallel: bool = False) -> ProcessGroup:
        """The whole data-parallel group: hybrid (outer × shard) under HSDP, else the FSDP group."""
        if is_expert_parallel:
            return self.hybrid_fsdp_expt_group if self.use_hybrid_fsdp else self.expt_fsdp_group
        return self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False, independent_all_gather: bool = False) -> ProcessGroup:
        """The group parameters are sharded over; with ``independent_all_gather`` its all-gather twin
        (``fsdp_group_ag`` / ``expt_fsdp_group_ag``, None when not given), as Megatron-FSDP."""
        if is_expert_parallel:
            return self.expt_fsdp_group_ag if independent_all_gather else self.expt_fsdp_group
        return self.fsdp_group_ag if independent_all_gather else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> Optional[ProcessGroup]:
        """The HSDP replica group (None without HSDP)."""
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        """The mesh this index was built over (dense or expert)."""
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """This rank's index when sharding over (dp_shard, dp_outer) with dp_shard varying slowest.

        The hybrid group lists ranks as (outer, inner) with inner fastest; full-shard HSDP reorders them to
        (inner, outer), so logical rank = inner_rank · outer_size + outer_rank.
        """
        if not self.hsdp_outer_dp_shard:
            raise FSDPIndexError(
                "get_logical_hybrid_fsdp_rank needs full-shard hybrid FSDP: build the index with hsdp_outer_dp_shard=True"
            )
        outer = self.get_outer_fsdp_group(is_expert_parallel)
        inner = self.get_fsdp_group(is_expert_parallel)
        if outer is None or inner is None:
            raise FSDPIndexError("get_logical_hybrid_fsdp_rank needs both the outer and the FSDP group (HSDP layout)")
        dp_rank = self.get_dp_group(is_expert_parallel).rank()
        outer_size, inner_size = outer.size(), inner.size()
        o, i = divmod(dp_rank, inner_size)
        return i * outer_size + o
