"""Flat sharded tensors (OLMo-core style): every rank holds slices of the *flattened* full tensor.

A :class:`ShardingSpec` says which ``[start, end)`` ranges of the flattened unsharded tensor each rank
of a process group holds (in element units); a :class:`ShardedFlatTensor` is the 1-D local data plus
that spec, and can gather the full tensor, unshard/reshard itself in place, and cut other tensors of
the same shape the same way. :class:`ShardedFlatParameter` is the ``nn.Parameter`` version.

Example::

    p = ShardedFlatParameter.shard(torch.randn(5, 3))    # 15 elements over 4 ranks: 4, 4, 4, 3
    p.sharded_shape                                       # (4,) on ranks 0-2, (3,) on rank 3
    full = p.gather()                                     # (5, 3) on every rank, differentiable
    p.unshard_(); y = x @ p; p.reshard_()                 # FSDP-style use in place

Uneven sizes are fine (trailing ranks may hold fewer or zero elements); collectives pad to the
largest shard so they also run on gloo. Without an initialised process group, everything works as a
world of one rank.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megashard.chunks import chunk_bounds
from megashard.errors import ShardingError, StateError

__all__ = ["ShardingSpec", "ShardedFlatTensor", "ShardedFlatParameter"]

T = TypeVar("T", bound="ShardedFlatTensor")


def _group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class ShardingSpec:
    """Which flat ranges of the unsharded tensor every rank holds.

    Attributes:
        unsharded_shape: shape of the full tensor.
        unsharded_flattened_offsets: indexed by rank in the process group; each entry is a tuple of
            ``(start_idx, end_idx)`` ranges (elements, half-open) into the flattened full tensor, in the
            order they are stored locally. Together they must cover every element exactly once.
    """

    unsharded_shape: tuple[int, ...]
    unsharded_flattened_offsets: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(s) for s in self.unsharded_shape)
            offsets = tuple(tuple((int(a), int(b)) for a, b in rank_offsets) for rank_offsets in self.unsharded_flattened_offsets)
        except (TypeError, ValueError) as e:
            raise ShardingError(
                f"ShardingSpec needs a shape of ints and, per rank, a tuple of (start, end) int pairs; got "
                f"unsharded_shape={self.unsharded_shape!r}, unsharded_flattened_offsets={self.unsharded_flattened_offsets!r} ({e})"
            ) from None
        object.__setattr__(self, "unsharded_shape", shape)
        object.__setattr__(self, "unsharded_flattened_offsets", offsets)
        if any(s < 0 for s in shape):
            raise ShardingError(f"unsharded_shape {shape} has a negative size")
        if not offsets:
            raise ShardingError("ShardingSpec needs offsets for at least one rank")
        numel = math.prod(shape)
        ranges = []
        for rank, rank_offsets in enumerate(offsets):
            for a, b in rank_offsets:
                if not 0 <= a <= b <= numel:
                    raise ShardingError(
                        f"rank {rank} has range ({a}, {b}) for a tensor of shape {shape} ({numel} elements); "
                        f"ranges need 0 <= start <= end <= {numel}"
                    )
                if a < b:
                    ranges.append((a, b, rank))
        ranges.sort()
        covered = 0
        for a, b, rank in ranges:
            if a > covered:
                raise ShardingError(
                    f"ShardingSpec for shape {shape}: flat elements [{covered}, {a}) belong to no rank; "
                    "the ranges of all ranks must cover every element exactly once"
                )
            if a < covered:
                raise ShardingError(
                    f"ShardingSpec for shape {shape}: rank {rank}'s range ({a}, {b}) overlaps elements before {covered} "
                    "already held by another range; every element must be held exactly once"
                )
            covered = b
        if covered != numel:
            raise ShardingError(
                f"ShardingSpec for shape {shape}: flat elements [{covered}, {numel}) belong to no rank; "
                "the ranges of all ranks must cover every element exactly once"
            )

    @property
    def sharded_numels(self) -> tuple[int, ...]:
        """Number of local elements on each rank."""
        return tuple(sum(b - a for a, b in r) for r in self.unsharded_flattened_offsets)

    @property
    def unsharded_flattened_shape(self) -> tuple[int]:
        """``(numel,)`` of the full tensor."""
        return (math.prod(self.unsharded_shape),)

    @property
    def world_size(self) -> int:
        return len(self.unsharded_flattened_offsets)

    @classmethod
    def even(cls, unsharded_shape: Sequence[int], world_size: int) -> "ShardingSpec":
        """Contiguous chunks of ``ceil(numel / world_size)`` elements; trailing ranks smaller or empty."""
        if world_size < 1:
            raise ShardingError(f"world_size {world_size} must be >= 1")
        numel = math.prod(int(s) for s in unsharded_shape)
        return cls(tuple(unsharded_shape), tuple((chunk_bounds(numel, world_size, r),) for r in range(world_size)))


class _GatherFlat(torch.autograd.Function):
    """All-gather of flat shards; the backward sums the gradient over ranks and keeps this rank's slices."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: ShardingSpec, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.spec, ctx.group, ctx.dtype = spec, group, local.dtype
        return _all_gather_flat(local.detach(), spec, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        if _group_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        flat = grad.reshape(-1)
        local = _take(flat, ctx.spec.unsharded_flattened_offsets[_group_rank(ctx.group)])
        return local.to(ctx.dtype), None, None


def _take(flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    if len(ranges) == 1:
        a, b = ranges[0]
        return flat[a:b]
    if not ranges:
        return flat[:0]
    return torch.cat([flat[a:b] for a, b in ranges])


def _place(out_flat: torch.Tensor, data: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    pos = 0
    for a, b in ranges:
        out_flat[a:b].copy_(data[pos : pos + b - a])
        pos += b - a


def _all_gather_flat(
    local: torch.Tensor, spec: ShardingSpec, group: Optional[dist.ProcessGroup], rank0_only: bool = False
) -> torch.Tensor:
    world, rank = _group_size(group), _group_rank(group)
    out = torch.empty(spec.unsharded_shape, dtype=local.dtype, device=local.device)
    if world == 1:
        _place(out.view(-1), local.reshape(-1), spec.unsharded_flattened_offsets[0])
        return out
    numels = spec.sharded_numels
    padded = F.pad(local.reshape(-1), (0, max(numels) - local.numel())).contiguous()  # gloo needs equal sizes
    if rank0_only:
        bufs = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
        dist.gather(padded, bufs, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if rank != 0:
            return torch.empty(0, dtype=local.dtype, device=local.device)
    else:
        bufs = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(bufs, padded, group=group)
    flat = out.view(-1)
    for r, buf in enumerate(bufs):
        _place(flat, buf[: numels[r]], spec.unsharded_flattened_offsets[r])
    return out


class ShardedFlatTensor(torch.Tensor):
    """A 1-D local shard of a flattened tensor, with the :class:`ShardingSpec` and group it belongs to.

    Torch ops on it return plain tensors (the sharding metadata is not propagated).
    """

    _META = "__sharded_metadata__"

    def __new__(cls, data: torch.Tensor, requires_grad: bool = False) -> "ShardedFlatTensor":
        if data.ndim != 1:
            raise ShardingError(f"{cls.__name__} data must be 1-D (a flat shard); got shape {tuple(data.shape)}")
        if isinstance(data, ShardedFlatTensor):
            data.requires_grad_(requires_grad)
            return data
        tensor = torch.Tensor._make_subclass(cls, data, requires_grad)
        setattr(tensor, cls._META, {})
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    # --- metadata ---------------------------------------------------------------------------------
    def _meta(self) -> dict:
        meta = getattr(self, self._META, None)
        if meta is None:
            meta = {}
            setattr(self, self._META, meta)
        return meta

    def mark_as_sharded(self, sharding_spec: ShardingSpec, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Attach ``sharding_spec`` and ``process_group``; the local size must match this rank's ranges."""
        world, rank = _group_size(process_group), _group_rank(process_group)
        if sharding_spec.world_size != world:
            raise ShardingError(
                f"ShardingSpec lists {sharding_spec.world_size} ranks but the process group has {world}; "
                "give one entry of unsharded_flattened_offsets per rank of the group"
            )
        want = sharding_spec.sharded_numels[rank]
        if self.numel() != want:
            raise ShardingError(
                f"rank {rank} holds {self.numel()} elements but its ShardingSpec ranges "
                f"{sharding_spec.unsharded_flattened_offsets[rank]} need {want}"
            )
        meta = self._meta()
        meta["sharding_spec"], meta["process_group"] = sharding_spec, process_group

    @property
    def sharding_spec(self) -> ShardingSpec:
        spec = self._meta().get("sharding_spec")
        if spec is None:
            raise StateError(f"this {type(self).__name__} has no ShardingSpec yet; create it with .shard(...) or call mark_as_sharded")
        return spec

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._meta().get("process_group")

    @property
    def is_sharded(self) -> bool:
        """False between :meth:`unshard_` and :meth:`reshard_`."""
        return "sharded_data" not in self._meta()

    @property
    def unsharded_shape(self) -> tuple[int, ...]:
        return self.sharding_spec.unsharded_shape

    @property
    def sharded_shape(self) -> tuple[int]:
        """``(local numel,)`` on this rank."""
        return (self.sharding_spec.sharded_numels[_group_rank(self.process_group)],)

    @property
    def sharded_data(self) -> torch.Tensor:
        """The local flat shard (also while unsharded)."""
        return self._meta().get("sharded_data", self.data)

    @sharded_data.setter
    def sharded_data(self, data: torch.Tensor) -> None:
        if "sharded_data" in self._meta():
            self._meta()["sharded_data"] = data
        else:
            self.data = data

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def shard(
        cls: type[T],
        tensor: torch.Tensor,
        sharding_spec: Optional[ShardingSpec] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        synchronize: bool = True,
        device: Optional[torch.device] = None,
        requires_grad: Optional[bool] = None,
    ) -> T:
        """Shard the full ``tensor`` over ``process_group`` (default: the world).

        ``sharding_spec`` defaults to :meth:`ShardingSpec.even`. With ``synchronize`` the tensor is
        first broadcast from the group's rank 0, so every rank shards the same values. ``requires_grad``
        defaults to True for :class:`ShardedFlatParameter`, else to ``tensor.requires_grad``.
        """
        world, rank = _group_size(process_group), _group_rank(process_group)
        if sharding_spec is None:
            sharding_spec = ShardingSpec.even(tuple(tensor.shape), world)
        if tuple(tensor.shape) != sharding_spec.unsharded_shape:
            raise ShardingError(f"tensor of shape {tuple(tensor.shape)} does not match ShardingSpec.unsharded_shape {sharding_spec.unsharded_shape}")
        if sharding_spec.world_size != world:
            raise ShardingError(
                f"ShardingSpec lists {sharding_spec.world_size} ranks but the process group has {world}; "
                "give one entry of unsharded_flattened_offsets per rank of the group"
            )
        if synchronize and world > 1:
            tensor = tensor.detach().contiguous().clone()
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            dist.broadcast(tensor, src, group=process_group)
        local = _take(tensor.detach().reshape(-1), sharding_spec.unsharded_flattened_offsets[rank])
        local = local.to(device=device if device is not None else tensor.device).clone()
        if requires_grad is None:  # parameters require grad like nn.Parameter; plain tensors follow the input
            requires_grad = True if issubclass(cls, torch.nn.Parameter) else tensor.requires_grad
        out = cls(local, requires_grad=requires_grad)
        out.mark_as_sharded(sharding_spec, process_group)
        return out

    def wrap(self, tensor: torch.Tensor, requires_grad: Optional[bool] = None) -> "ShardedFlatTensor":
        """Mark ``tensor`` (same local shape) as sharded like ``self``; returns a :class:`ShardedFlatTensor`."""
        if tuple(tensor.shape) != tuple(self.sharded_data.shape):
            raise ShardingError(f"can only wrap a tensor of the local shard shape {tuple(self.sharded_data.shape)}; got {tuple(tensor.shape)}")
        wrapped = ShardedFlatTensor(tensor.data, requires_grad=tensor.requires_grad if requires_grad is None else requires_grad)
        wrapped.mark_as_sharded(self.sharding_spec, self.process_group)
        return wrapped

    # --- cutting full tensors the same way -------------------------------------------------------
    def _check_unsharded(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.unsharded_shape:
            raise ShardingError(f"expected a tensor of the unsharded shape {self.unsharded_shape}; got {tuple(tensor.shape)}")
        return tensor.reshape(-1)

    def chunk_unsharded(self, tensor: torch.Tensor, pad: bool = False) -> list[torch.Tensor]:
        """Cut a full-shape tensor into every rank's flat shard (padded with zeros to the largest if ``pad``)."""
        flat = self._check_unsharded(tensor)
        chunks = [_take(flat, r) for r in self.sharding_spec.unsharded_flattened_offsets]
        if pad:
            n = max(self.sharding_spec.sharded_numels)
            chunks = [F.pad(c, (0, n - c.numel())) for c in chunks]
        return chunks

    def sharded_chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard of a full-shape tensor (a view when the rank holds one range)."""
        flat = self._check_unsharded(tensor)
        return _take(flat, self.sharding_spec.unsharded_flattened_offsets[_group_rank(self.process_group)])

    # --- collectives ------------------------------------------------------------------------------
    def gather(self, dtype: Optional[torch.dtype] = None, rank0_only: bool = False) -> torch.Tensor:
        """The full tensor (``unsharded_shape``) on every rank, or only on group rank 0 if ``rank0_only``.

        Differentiable (unless ``rank0_only``): the gradient of the local shard is the sum over ranks of
        the gradient of its elements, so every rank of the group must run the backward.
        """
        if not self.is_sharded:
            raise StateError("gather() needs the sharded data; call reshard_() first (or use the unsharded data directly)")
        local = self if dtype is None else self.to(dtype)  # plain tensor, still on the autograd graph
        if rank0_only or not (torch.is_grad_enabled() and local.requires_grad):
            return _all_gather_flat(local.detach(), self.sharding_spec, self.process_group, rank0_only)
        return _GatherFlat.apply(local, self.sharding_spec, self.process_group)

    def unshard_(self, unsharded_data: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None, rank0_only: bool = False) -> None:
        """Replace the data in place by the full tensor (gathered unless ``unsharded_data`` is given).

        With ``rank0_only``, ranks other than 0 hold an empty tensor. Call :meth:`reshard_` afterwards.

        Autograd: PyTorch caches a parameter's gradient accumulator with the shape it had when a graph
        used it, so do not keep a graph built on the sharded data (e.g. an old ``loss``) alive across
        ``unshard_``/``reshard_``; a backward through it would fail with a shape mismatch.
        """
        if not self.is_sharded:
            raise StateError("unshard_() called twice; call reshard_() first")
        if unsharded_data is None:
            with torch.no_grad():
                unsharded_data = _all_gather_flat(self.data if dtype is None else self.data.to(dtype), self.sharding_spec, self.process_group, rank0_only)
        elif tuple(unsharded_data.shape) != self.unsharded_shape:
            raise ShardingError(f"unsharded_data has shape {tuple(unsharded_data.shape)}; expected {self.unsharded_shape}")
        elif dtype is not None:
            unsharded_data = unsharded_data.to(dtype)
        self._meta()["sharded_data"] = self.data
        self.data = unsharded_data

    def reshard_(self, writeback: bool = False) -> None:
        """Go back to the local shard after :meth:`unshard_`; with ``writeback``, copy this rank's slices
        of the (possibly modified) full data into it first. Gradients are left to the caller."""
        meta = self._meta()
        if "sharded_data" not in meta:
            raise StateError("reshard_() without a preceding unshard_()")
        sharded = meta["sharded_data"]
        if writeback:
            if tuple(self.data.shape) != self.unsharded_shape:
                raise StateError(
                    f"reshard_(writeback=True) needs the full data on this rank, but it holds shape {tuple(self.data.shape)} "
                    "(unshard_(rank0_only=True) leaves other ranks empty)"
                )
            with torch.no_grad():
                sharded.copy_(self.sharded_chunk(self.data.as_subclass(torch.Tensor)).to(sharded.dtype))
        del meta["sharded_data"]
        self.data = sharded

    def __deepcopy__(self, memo: dict) -> "ShardedFlatTensor":
        # nn.Parameter's deepcopy would drop the metadata; the process group is shared, not copied.
        out = torch.Tensor._make_subclass(type(self), self.data.clone(), self.requires_grad)
        memo[id(self)] = out
        meta = {k: (v if k == "process_group" else copy.deepcopy(v, memo)) for k, v in self._meta().items()}
        setattr(out, self._META, meta)
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        spec = self._meta().get("sharding_spec")
        shape = spec.unsharded_shape if spec is not None else None
        return f"{type(self).__name__}(local_tensor={self.data.as_subclass(torch.Tensor)!r}, unsharded_shape={shape}, requires_grad={self.requires_grad})"


class ShardedFlatParameter(ShardedFlatTensor, torch.nn.Parameter):
    """An ``nn.Parameter`` that is a :class:`ShardedFlatTensor` (requires grad by default)."""

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = True) -> "ShardedFlatParameter":
        if data is None:
            data = torch.empty(0)
        if data.ndim != 1:
            raise ShardingError(f"{cls.__name__} data must be 1-D (a flat shard); got shape {tuple(data.shape)}")
        param = torch.Tensor._make_subclass(cls, data.detach() if isinstance(data, torch.Tensor) else data, requires_grad)
        meta = dict(getattr(data, ShardedFlatTensor._META, {}) or {})
        setattr(param, ShardedFlatTensor._META, meta)
        return param

    def __reduce_ex__(self, proto: int) -> Any:
        # nn.Parameter pickles via torch._utils._rebuild_parameter, which would drop the spec.
        return (_rebuild_sharded_flat_parameter, (self.data.as_subclass(torch.Tensor), self.requires_grad, self._meta().get("sharding_spec")))


def _rebuild_sharded_flat_parameter(data: torch.Tensor, requires_grad: bool, spec: Optional[ShardingSpec]) -> ShardedFlatParameter:
    p = ShardedFlatParameter(data, requires_grad=requires_grad)
    if spec is not None:
        p._meta()["sharding_spec"] = spec
    return p
