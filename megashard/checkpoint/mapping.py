"""Shard metadata for checkpoints: which piece of which global tensor a rank holds.

A :class:`ShardedTensor` says "my local tensor ``data`` (shape ``local_shape``) is the block of the
global tensor ``key`` (shape ``global_shape``) that starts at ``global_offset``", plus whether this
copy is the *main* replica (``replica_id`` 0) or one of several identical copies. Field names follow
Megatron-LM's ``dist_checkpointing.mapping.ShardedTensor`` so code written against Megatron reads the
same. Two shards are the same data iff their shard ids are equal::

    sharded_tensor_shard_id(sh) == (key, global_offset, flattened_range as (start, stop) or None)

:func:`sharded_state_dict_from_dtensors` describes a DTensor state dict in these terms, with the local
shape and offset taken from DTensor itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megashard._compat import torch_compute_local_shape_and_global_offset
from megashard.errors import CheckpointError

__all__ = [
    "ReplicaId",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardId",
    "_ShardId",
    "_sharded_tensor_shard_id",
    "is_main_replica",
    "nested_values",
    "sharded_tensor_shard_id",
    "sharded_tensor_from_dtensor",
    "sharded_state_dict_from_dtensors",
]

ReplicaId = Union[int, Tuple[int, ...]]
"""0 (or all zeros) marks the main replica, the one copy that is saved."""
ShardedStateDict = Dict[str, Any]
"""A (nested) state dict whose tensors are replaced by :class:`ShardedTensor` records."""
ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]
"""``(key, global_offset, (flat_start, flat_stop) or None)``: equal ids mean the same data."""
_ShardId = ShardId  # Megatron's (private) name


@dataclass
class ShardedTensor:
    """One rank's block of a global tensor.

    Args:
        key: name of the global tensor (unique in the checkpoint).
        data: the local tensor, or None for pure metadata (e.g. after :meth:`without_data`).
        dtype: element type of ``data``.
        local_shape: shape of the local block (before ``flattened_range`` is applied).
        global_shape: shape of the whole tensor.
        global_offset: index of the block's first element in the global tensor, one entry per global dim.
        axis_fragmentations: number of equal blocks along every global dim when the sharding is a
            regular grid (each offset a multiple of the local size), else None (e.g. uneven shards).
        replica_id: 0 or a tuple of zeros for the main replica; anything else is a redundant copy.
        prepend_axis_num: leading global dims of size 1 that the local tensor does not have.
        allow_shape_mismatch: the stored global shape may differ on load (e.g. padded vocabularies).
        flattened_range: if set, ``data`` is ``local_block.flatten()[flattened_range]`` (1-D, step 1).
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]] = None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(s) for s in self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Raise :class:`CheckpointError` unless shapes, offsets, dtype and flat range agree."""
        where = f"ShardedTensor {self.key!r}"
        ndim = len(self.global_shape)
        if len(self.global_offset) != ndim:
            raise CheckpointError(
                f"{where}: global_offset {self.global_offset} has {len(self.global_offset)} entries but "
                f"global_shape {self.global_shape} has {ndim}; give one offset per global dim."
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise CheckpointError(
                f"{where}: local_shape {self.local_shape} plus prepend_axis_num={self.prepend_axis_num} "
                f"must have as many dims as global_shape {self.global_shape}."
            )
        block = (1,) * self.prepend_axis_num + self.local_shape
        for d, (off, loc, glob) in enumerate(zip(self.global_offset, block, self.global_shape)):
            if off < 0 or loc < 0 or (off + loc > glob and not self.allow_shape_mismatch):
                raise CheckpointError(
                    f"{where}: dim {d} block [{off}, {off + loc}) lies outside global size {glob}; "
                    "offsets and sizes must satisfy 0 <= offset and offset + local size <= global size "
                    "(or pass allow_shape_mismatch=True)."
                )
        if self.axis_fragmentations is not None:
            if len(self.axis_fragmentations) != ndim:
                raise CheckpointError(
                    f"{where}: axis_fragmentations {self.axis_fragmentations} needs {ndim} entries."
                )
            for d, (off, loc) in enumerate(zip(self.global_offset[self.prepend_axis_num:], self.local_shape)):
                if loc != 0 and off % loc != 0:
                    raise CheckpointError(
                        f"{where}: dim {d + self.prepend_axis_num} offset {off} is not a multiple of the "
                        f"local size {loc}, so the shards are not a regular grid; set axis_fragmentations=None."
                    )
        numel = 1
        for s in self.local_shape:
            numel *= s
        fr = self.flattened_range
        if fr is not None:
            if not isinstance(fr, slice) or fr.step not in (None, 1) or fr.start is None or fr.stop is None \
                    or not 0 <= fr.start <= fr.stop <= numel:
                raise CheckpointError(
                    f"{where}: flattened_range {fr!r} must be slice(start, stop) with "
                    f"0 <= start <= stop <= {numel} (the local block's numel) and step 1."
                )
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointError(f"{where}: data dtype {self.data.dtype} differs from dtype {self.dtype}.")
            expected = (fr.stop - fr.start,) if fr is not None else self.local_shape
            if tuple(self.data.shape) != tuple(expected):
                raise CheckpointError(
                    f"{where}: data shape {tuple(self.data.shape)} differs from the expected {tuple(expected)} "
                    f"({'flattened_range length' if fr is not None else 'local_shape'})."
                )

    @property
    def has_regular_grid(self) -> bool:
        """True when ``axis_fragmentations`` describes the sharding as an even grid."""
        return self.axis_fragmentations is not None

    @property
    def numel(self) -> int:
        """Number of elements this shard stores (the flat range if set, else the local block)."""
        if self.flattened_range is not None:
            return self.flattened_range.stop - self.flattened_range.start
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local block in the global tensor (ints for prepended dims, slices otherwise)."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(off, off + sh) for off, sh in zip(self.global_offset[p:], self.local_shape)
        )

    def without_data(self) -> "ShardedTensor":
        """A copy with ``data=None`` (cheap to pickle for metadata exchange)."""
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Allocate ``data`` (only if it is None) with the stored (flat) shape and dtype on ``device``."""
        if self.data is not None:
            return
        shape = (self.numel,) if self.flattened_range is not None else self.local_shape
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Describe an evenly sharded tensor by ``(global_dim, chunk_index, num_chunks)`` triples.

        ``ShardedTensor.from_rank_offsets("w", local, (0, tp_rank, tp))`` says ``local`` is chunk
        ``tp_rank`` of ``tp`` equal chunks of the global tensor along dim 0.
        """
        ndim = data.ndim + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragments = [1] * ndim
        seen = set()
        for axis, index, count in rank_offsets:
            if not 0 <= axis < ndim or axis in seen or count < 1 or not 0 <= index < count:
                raise CheckpointError(
                    f"ShardedTensor {key!r}: bad rank offset (dim={axis}, index={index}, count={count}); "
                    f"need 0 <= dim < {ndim}, each dim once, count >= 1 and 0 <= index < count."
                )
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = count * local
            global_offset[axis] = index * local
            fragments[axis] = count
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset),
                   tuple(fragments), replica_id, prepend_axis_num, **init_kwargs)


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for replica id 0 or a tuple of zeros (the copy that gets saved)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> ShardId:
    """Identity of a shard's data: ``(key, global_offset, (start, stop) or None)``.

    Equal on every rank that holds a replica of the same data, so it can key cross-rank maps.
    """
    fr = sharded_tensor.flattened_range
    return (sharded_tensor.key, sharded_tensor.global_offset, None if fr is None else (fr.start, fr.stop))


_sharded_tensor_shard_id = sharded_tensor_shard_id  # Megatron's (private) name


def nested_values(x: Any) -> Iterator[Any]:
    """Leaves of nested dicts / lists / tuples, depth first, in insertion order."""
    if isinstance(x, dict):
        for v in x.values():
            yield from nested_values(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from nested_values(v)
    else:
        yield x


def _regular_grid(local_shape, global_shape, global_offset) -> Optional[Tuple[int, ...]]:
    frags = []
    for loc, glob, off in zip(local_shape, global_shape, global_offset):
        if loc == 0 or glob % loc or off % loc:
            return None
        frags.append(glob // loc)
    return tuple(frags)


def sharded_tensor_from_dtensor(key: str, tensor: torch.Tensor) -> Optional[ShardedTensor]:
    """Describe this rank's piece of a DTensor (or a plain, replicated tensor) as a ShardedTensor.

    * Local shape and global offset come from DTensor's own ``compute_local_shape_and_global_offset``.
    * ``replica_id`` is the row-major index of this rank's coordinates on the mesh axes whose placement
      is ``Replicate`` (0 on the main replica; 0 if no axis replicates).
    * A plain ``torch.Tensor`` is taken as replicated on every rank of the default group: the global
      tensor is the tensor itself and ``replica_id`` is the global rank (rank 0 holds the main replica).

    Returns None when the calling rank is not part of the DTensor's mesh (it holds nothing).
    Raises :class:`CheckpointError` for ``Partial`` placements (reduce before saving).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        shape = tuple(tensor.shape)
        return ShardedTensor(key, tensor, tensor.dtype, shape, shape, (0,) * len(shape),
                             (1,) * len(shape), replica_id=rank)
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    replica_id = 0
    for axis, p in enumerate(tensor.placements):
        if p.is_partial():
            raise CheckpointError(
                f"DTensor {key!r} has placement {p} on mesh axis {axis}; a Partial value is not the "
                "tensor yet. Call .redistribute(placements=[Replicate() or Shard(d) ...]) before saving."
            )
        if p.is_replicate():
            replica_id = replica_id * mesh.size(axis) + coord[axis]
    local_shape, global_offset = torch_compute_local_shape_and_global_offset(
        tensor.shape, mesh, tensor.placements
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise CheckpointError(
            f"DTensor {key!r}: local tensor shape {tuple(local.shape)} differs from the shape "
            f"{tuple(local_shape)} DTensor computes for placements {tensor.placements}; padded local "
            "tensors must be unpadded before they are described for a checkpoint."
        )
    global_shape = tuple(tensor.shape)
    return ShardedTensor(key, local, local.dtype, tuple(local_shape), global_shape, tuple(global_offset),
                         _regular_grid(local_shape, global_shape, global_offset), replica_id=replica_id)


def sharded_state_dict_from_dtensors(state_dict: Dict[str, Any], prefix: str = "") -> ShardedStateDict:
    """Replace every tensor of a (nested) state dict by its :class:`ShardedTensor` description.

    Keys of nested dicts are joined with ``"."`` (``{"layer": {"w": t}}`` -> key ``"layer.w"``);
    non-tensor values are kept as they are; DTensors on meshes this rank is not part of are dropped.
    """
    out: ShardedStateDict = {}
    for k, v in state_dict.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = sharded_state_dict_from_dtensors(v, prefix=f"{name}.")
        elif isinstance(v, torch.Tensor):
            sh = sharded_tensor_from_dtensor(name, v)
            if sh is not None:
                out[k] = sh
        else:
            out[k] = v
    return out
