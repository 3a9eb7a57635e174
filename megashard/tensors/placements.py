"""Resolve a parameter's TP layout plus the FSDP/HSDP layout into DTensor placements on a named mesh.

megashard's FSDP mesh has axes ``("pp", "dp_outer", "dp_shard_cp", "tp")``. A parameter is placed as

* ``tp``: ``Shard(partition_dim)`` if TP splits it (``_StridedShard(partition_dim, split_factor=stride)``
  for a Megatron ``partition_stride`` > 1), else ``Replicate()``;
* ``dp_shard_cp``: ``Shard(fsdp_dim)`` (FSDP shards dim 0 by default) — or, when a later axis (TP)
  already splits ``fsdp_dim``, ``_StridedShard(fsdp_dim, split_factor=<product of those axis sizes>)``,
  exactly what FSDP2's ``fully_shard`` records for a TP-sharded parameter;
* ``dp_outer``: ``Replicate()`` (HSDP replicas);
* any other axis (``pp``): ``Replicate()`` — a pipeline stage's parameters live on its own pp
  coordinate only, so the DTensor of a parameter is normally built on the mesh *without* pp
  (:func:`param_mesh_axes` names the axes to slice).

Uneven sizes: FSDP chunks the local TP shard like ``torch.chunk`` (trailing ranks smaller or empty).
The strided placements describe that exactly whenever the TP split of ``fsdp_dim`` divides evenly
(Megatron and DTensor's ``ColwiseParallel`` both require it); when a global shape is known and it does
not, :func:`resolve_placements` checks every mesh coordinate and raises
:class:`~megashard.errors.ShardingError` if DTensor would misread the data.
"""
from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from megashard._compat import _StridedShard
from megashard.errors import ShardingError
from megashard.tensors.shape import explicit_order_placements, global_index_runs_at, ordered_index_runs_at
from megashard.tensors.tp_attrs import (
    get_mcore_tensor_parallel_partition_dim,
    get_tensor_model_parallel_partition_stride,
)

__all__ = [
    "FSDP_MESH_AXES",
    "tp_placement",
    "resolve_placements",
    "param_mesh_axes",
    "ordered_index_runs_at",
]

FSDP_MESH_AXES = ("pp", "dp_outer", "dp_shard_cp", "tp")
"""Axis names of megashard's FSDP(+TP) mesh, outermost first."""

NamedMesh = Union[DeviceMesh, Mapping[str, int]]


def tp_placement(param: torch.Tensor) -> Placement:
    """The placement of ``param`` on the TP axis.

    ``param`` is either a DTensor on a 1-D TP mesh (e.g. after ``parallelize_module``; its placement
    is returned) or a tensor carrying Megatron TP attributes (see :mod:`megashard.tensors.tp_attrs`).
    """
    if isinstance(param, DTensor):
        if param.device_mesh.ndim != 1:
            raise ShardingError(
                f"parameter DTensor lives on a {param.device_mesh.ndim}-axis mesh {param.device_mesh.mesh_dim_names} with "
                f"placements {param.placements}; pass the TP-only DTensor (before fully_shard) or a plain tensor with TP attributes"
            )
        return param.placements[0]
    dim = get_mcore_tensor_parallel_partition_dim(param)
    if dim is None:
        return Replicate()
    stride = get_tensor_model_parallel_partition_stride(param)
    return _StridedShard(dim, split_factor=stride) if stride > 1 else Shard(dim)


def _axes(mesh: NamedMesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if isinstance(mesh, DeviceMesh):
        if mesh.mesh_dim_names is None:
            raise ShardingError(f"mesh {mesh} has no axis names; build it with mesh_dim_names such as {FSDP_MESH_AXES}")
        return tuple(mesh.mesh_dim_names), tuple(int(s) for s in mesh.shape)
    return tuple(mesh.keys()), tuple(int(v) for v in mesh.values())


def param_mesh_axes(mesh: NamedMesh, *, pp_axis: str = "pp") -> tuple[str, ...]:
    """Axes of ``mesh`` a parameter's DTensor is distributed over: all but ``pp_axis``."""
    return tuple(a for a in _axes(mesh)[0] if a != pp_axis)


def _check_representable(size: int, mesh_shape: Sequence[int], placements: Sequence[Placement], what: str) -> None:
    """Compare, for one dim of ``size`` elements, the layout FSDP makes with the one DTensor reads."""
    ordered = explicit_order_placements(mesh_shape, placements)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        want = ordered_index_runs_at([size], mesh_shape, ordered, coord)[0]
        got = global_index_runs_at([size], mesh_shape, placements, coord)[0]
        if want != got:
            raise ShardingError(
                f"{what}: FSDP would give coordinate {coord} of those axes the indices {list(want)} but DTensor reads "
                f"them as {list(got)}. The TP-sharded dim must divide by the product of the TP axis sizes "
                "(pad it, e.g. the vocabulary, as Megatron does)"
            )


def resolve_placements(
    param: torch.Tensor,
    mesh: NamedMesh,
    *,
    fsdp: bool = True,
    fsdp_dim: int = 0,
    global_shape: Optional[Sequence[int]] = None,
    tp_axis: str = "tp",
    dp_shard_axis: str = "dp_shard_cp",
    dp_outer_axis: str = "dp_outer",
) -> tuple[Placement, ...]:
    """DTensor placements of ``param`` on ``mesh``, one per mesh axis, in mesh axis order.

    Args:
        param: a TP DTensor (1-D TP mesh) or a tensor with Megatron TP attributes.
        mesh: a DeviceMesh with axis names, or an ordered mapping axis name -> size, e.g.
            ``{"dp_shard_cp": 2, "tp": 2}``. Axes may be any subset of :data:`FSDP_MESH_AXES`
            plus others (placed Replicate); a missing ``tp`` axis means no TP.
        fsdp: shard over ``dp_shard_axis`` (False: replicate there, i.e. DDP).
        fsdp_dim: the dim FSDP shards (FSDP2 default 0).
        global_shape: full shape of the parameter; default ``param.shape`` for a DTensor. When known,
            checked to be representable (see module docstring).

    Returns:
        e.g. ``(Replicate(), Replicate(), _StridedShard(0, sf=2), Shard(0))`` for a column-parallel
        weight on ``("pp", "dp_outer", "dp_shard_cp", "tp")`` with tp=2.
    """
    names, sizes = _axes(mesh)
    if len(set(names)) != len(names):
        raise ShardingError(f"mesh axis names {names} repeat a name; each axis needs its own name")
    if fsdp and dp_shard_axis not in names:
        raise ShardingError(
            f"mesh axes {names} have no FSDP axis {dp_shard_axis!r}; pass dp_shard_axis=<one of {names}> or fsdp=False"
        )
    tp_p = tp_placement(param) if tp_axis in names else Replicate()
    ndim = len(global_shape) if global_shape is not None else param.dim()
    if not -ndim <= fsdp_dim < max(ndim, 1):
        raise ShardingError(f"fsdp_dim {fsdp_dim} is not a dim of a {ndim}-d parameter; use 0..{ndim - 1}")
    fsdp_dim %= max(ndim, 1)

    placements: list[Placement] = [Replicate() for _ in names]
    if tp_axis in names:
        placements[names.index(tp_axis)] = tp_p
    if fsdp:
        i = names.index(dp_shard_axis)
        later = [(j, p) for j, p in enumerate(placements) if j > i and isinstance(p, (Shard, _StridedShard)) and p.dim == fsdp_dim]
        if any(isinstance(p, _StridedShard) for _, p in later):
            raise ShardingError(
                f"TP placement {tp_p} (Megatron partition_stride > 1) splits dim {fsdp_dim}, which FSDP also shards; "
                "FSDP2 cannot express that. Use partition_stride=1 or shard FSDP on another dim (fsdp_dim)"
            )
        split_factor = 1
        for j, _ in later:
            split_factor *= sizes[j]
        placements[i] = _StridedShard(fsdp_dim, split_factor=split_factor) if split_factor > 1 else Shard(fsdp_dim)
    # dp_outer (HSDP replicas), pp and unknown axes stay Replicate().

    if global_shape is None and isinstance(param, DTensor):
        global_shape = tuple(param.shape)
    if fsdp and global_shape is not None:
        fsdp_p = placements[names.index(dp_shard_axis)]
        # Exact when the TP split of fsdp_dim divides evenly; otherwise compare all coordinates of the
        # axes that split fsdp_dim (other axes do not change that dim).
        if isinstance(fsdp_p, _StridedShard) and int(global_shape[fsdp_dim]) % int(fsdp_p.split_factor) != 0:
            keep = [j for j, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == fsdp_dim]
            _check_representable(
                int(global_shape[fsdp_dim]), [sizes[j] for j in keep], [_with_dim(placements[j], 0) for j in keep],
                f"parameter of shape {tuple(global_shape)}, dim {fsdp_dim} split over axes "
                f"{tuple(names[j] for j in keep)} of sizes {tuple(sizes[j] for j in keep)} with {[placements[j] for j in keep]}",
            )
    return tuple(placements)


def _with_dim(p: Placement, dim: int) -> Placement:
    return _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(dim)
