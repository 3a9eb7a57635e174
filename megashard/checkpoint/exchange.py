"""How checkpoint shard metadata and loaded shards travel between ranks (the collectives).

Same names and signatures as Megatron-LM's ``dist_checkpointing.exchange_utils``:

* :func:`determine_main_replica_uniform_distribution` — one ``all_gather_object`` of shard metadata,
  then the pure rule :func:`~megashard.checkpoint.distribution.distribute_shards_to_ranks`.
* ``exchange_loaded_tensors_*`` / :func:`exchange_by_distribution` — after every rank loaded its part,
  send each shard to the ranks that need it. Tensors travel as raw bytes, so every dtype works on
  gloo (CPU) and NCCL; the communication device follows the group's backend.

The distribution names (:class:`ShardDistribution`, :func:`distribute_shards_to_ranks`, ``_shard_size``)
live in :mod:`megashard.checkpoint.distribution` and are importable from here too, as in Megatron.
Ranks in a :class:`ShardDistribution` are ranks *within* the parallelization group.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from itertools import zip_longest
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from megashard.checkpoint.distribution import ShardDistribution, _shard_size, distribute_shards_to_ranks, shard_size
from megashard.checkpoint.mapping import (
    ShardedStateDict,
    ShardedTensor,
    ShardId,
    is_main_replica,
    nested_values,
    sharded_tensor_shard_id,
)
from megashard.errors import CheckpointError

__all__ = [
    "ShardDistribution",
    "is_float8tensor",
    "_shard_size",
    "_get_empty_tensor_for_exchange",
    "distribute_shards_to_ranks",
    "determine_main_replica_uniform_distribution",
    "exchange_loaded_tensors_gather_rounds",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_by_distribution",
    "EXCHANGE_ALGORITHMS",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

EXCHANGE_ALGORITHMS = ("broadcast", "gather_rounds", "gather_object")


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a TransformerEngine ``Float8Tensor``.

    Looks at the class hierarchy only, so it never imports TransformerEngine (a TE tensor can only
    exist if TE is already imported) and is simply False without it.
    """
    for cls in type(tensor).__mro__:
        if cls.__name__ == "Float8Tensor" and cls.__module__.startswith("transformer_engine"):
            return True
    return False



# --------------------------------------------------------------------------------------------------
# metadata exchange
# --------------------------------------------------------------------------------------------------
def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Optional[dist.ProcessGroup],
    ignore_groups: bool = False,
) -> Optional[ShardDistribution]:
    """Decide which rank of ``parallelization_group`` saves (or loads) every shard.

    One ``all_gather_object`` of every rank's shard metadata, then :func:`distribute_shards_to_ranks`
    on every rank (same answer everywhere, no further communication). Collective over the group.

    Args:
        sharded_state_dict: nested dict/list whose ShardedTensor leaves describe this rank's shards.
        parallelization_group: the group to spread the work over (None = the default group).
        ignore_groups: also distribute shards whose main replica is in another group (used for
            loading: this group then loads every shard its ranks need); those are assigned last.

    Returns:
        The distribution, or None if the group has a single rank.
    """
    group = parallelization_group if parallelization_group is not None else dist.group.WORLD
    group_size = dist.get_world_size(group=group)
    if group_size <= 1:
        return None
    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    all_shards: List[Optional[List[ShardedTensor]]] = [None] * group_size
    dist.all_gather_object(all_shards, local, group=group)

    shard_to_ranks: Dict[ShardId, List[int]] = defaultdict(list)
    shard_to_size: Dict[ShardId, int] = {}
    shard_to_metadata: Dict[ShardId, ShardedTensor] = {}
    has_main: Set[ShardId] = set()
    has_other: Set[ShardId] = set()
    for rank, rank_shards in enumerate(all_shards):
        for sh in rank_shards:
            sid = sharded_tensor_shard_id(sh)
            shard_to_ranks[sid].append(rank)
            if sid not in shard_to_size:
                shard_to_size[sid] = shard_size(sh)
                shard_to_metadata[sid] = sh
            (has_main if is_main_replica(sh.replica_id) else has_other).add(sid)
    # Main replicas always; other replicas only when loading (ignore_groups), and those go last.
    in_group = has_main | has_other if ignore_groups else has_main
    cross = in_group - has_main
    shard_to_ranks = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    main_rank = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, group_size, cross)
    return ShardDistribution(main_rank, in_group, shard_to_metadata, shard_to_ranks)


# --------------------------------------------------------------------------------------------------
# tensor exchange
# --------------------------------------------------------------------------------------------------
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}


def _comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Device collectives on ``group`` run on: the accelerator for NCCL-like backends, else CPU.

    Decided from the backend only, so every rank of the group agrees (a mixed ``cpu:gloo,cuda:nccl``
    group uses the accelerator).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    for name, dev_type in _ACCELERATOR_BACKENDS.items():
        if name in backend:
            mod = getattr(torch, dev_type, None)
            if mod is not None and mod.is_available():
                return torch.device(dev_type, mod.current_device())
    return torch.device("cpu")


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor (any dtype, 0-dim included)."""
    return t.reshape(-1).view(torch.uint8)


def _dequantized(shard_id: ShardId, tensor: torch.Tensor, loaded: Dict[ShardId, torch.Tensor]) -> torch.Tensor:
    # TransformerEngine FP8 tensors travel in their nominal dtype (what the metadata says).
    if not is_float8tensor(tensor):
        return tensor
    try:
        out = tensor.from_float8()
    except Exception:  # noqa: BLE001 - TE renamed it
        out = tensor.dequantize()
    loaded[shard_id] = out
    return out


def _get_empty_tensor_for_exchange(
    shard_id: ShardId,
    needed_shards: Dict[ShardId, ShardedTensor],
    unneeded_shards: Dict[ShardId, ShardedTensor],
    loaded_tensors: Dict[ShardId, torch.Tensor],
    device: Optional[torch.device] = None,
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """Receive buffer for ``shard_id`` on the communication device.

    If this rank needs the shard (it is in ``needed_shards``), the buffer is that ShardedTensor's
    ``data`` (allocated if None), or a same-shaped buffer on ``device`` when ``data`` lives elsewhere;
    it is recorded in ``loaded_tensors`` and the original device is returned so the caller can move it
    back. Otherwise a fresh throw-away buffer is built from the ``unneeded_shards`` metadata (whose
    ``data`` is never overwritten) and the device is None.

    Args:
        device: communication device (default: from the default group's backend).

    Returns:
        (buffer on ``device``, original device of the needed tensor or None).
    """
    device = torch.device(device) if device is not None else _comm_device()
    needed = needed_shards.get(shard_id)
    if needed is None:
        sh = unneeded_shards[shard_id]  # metadata only: a fresh buffer, never someone's data
        shape = (sh.numel,) if sh.flattened_range is not None else sh.local_shape
        return torch.empty(shape, dtype=sh.dtype, device=device), None
    needed.init_data(device=device)
    orig_device = needed.data.device
    tensor = needed.data
    if tensor.device != device or not tensor.is_contiguous():
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    loaded_tensors[shard_id] = tensor
    return tensor, orig_device


def _finish(shard_id: ShardId, buf: torch.Tensor, needed_shards: Dict[ShardId, ShardedTensor],
            loaded: Dict[ShardId, torch.Tensor]) -> None:
    """Put a received buffer where the caller wants it: into the needed shard's own ``data`` if any."""
    sh = needed_shards.get(shard_id)
    if sh is None:
        return
    target = sh.data
    if target is not None and target is not buf:
        target.copy_(buf)
        loaded[shard_id] = target
    else:
        loaded[shard_id] = buf


def _check_single_holder(shard_id, rank, holders) -> bool:
    """True if only the loading rank needs ``shard_id`` (no exchange); error if it is another rank."""
    if len(holders) != 1:
        return False
    if holders[0] != rank:
        raise CheckpointError(
            f"shard {shard_id!r} is needed only by rank {holders[0]} but assigned to rank {rank}; a shard "
            "with one holder must be loaded by that holder (the distribution is inconsistent)."
        )
    return True


def _send_tensor(shard_id, loaded: Dict[ShardId, torch.Tensor], meta: ShardedTensor, device) -> torch.Tensor:
    if shard_id not in loaded:
        raise CheckpointError(
            f"this rank is the loading rank of shard {shard_id!r} but loaded_tensors has no entry for it; "
            "load every shard that ShardDistribution.main_rank_for_shard assigns to this rank first."
        )
    t = _dequantized(shard_id, loaded[shard_id], loaded)
    if t.dtype != meta.dtype or t.numel() != meta.numel:
        raise CheckpointError(
            f"loaded tensor for shard {shard_id!r} has dtype {t.dtype} and {t.numel()} elements but the "
            f"metadata says {meta.dtype} and {meta.numel}; the exchange would corrupt or hang."
        )
    return t.to(device).contiguous()


def _group_and_rank(parallelization_group):
    group = parallelization_group if parallelization_group is not None else dist.group.WORLD
    return group, dist.get_rank(group=group), dist.get_world_size(group=group)


class _Exchange(NamedTuple):
    """What a tensor exchange starts from."""

    sends: List[Tuple[ShardId, int]]  # (shard id, loading rank) of every shard with bytes that several ranks need
    metadata: Dict[ShardId, ShardedTensor]
    group: Any
    rank: int  # in the group
    world: int
    device: torch.device
    loaded: Dict[ShardId, torch.Tensor]  # the result: loaded_tensors, then every received shard


def _start_exchange(caller: str, loaded_tensors: Dict[ShardId, torch.Tensor],
                    shard_distribution: Optional[ShardDistribution], parallelization_group) -> _Exchange:
    if shard_distribution is None:
        raise CheckpointError(f"{caller} needs a shard_distribution (got None).")
    main_rank_for_shard, _, shard_to_metadata, all_ranks_for_shard = shard_distribution
    sends = [(sid, rank) for sid, rank in main_rank_for_shard.items()
             if not _check_single_holder(sid, rank, all_ranks_for_shard[sid]) and shard_size(shard_to_metadata[sid]) != 0]
    group, rank, world = _group_and_rank(parallelization_group)
    return _Exchange(sends, shard_to_metadata, group, rank, world, _comm_device(group), dict(loaded_tensors))


@torch.no_grad()
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: Optional[ShardDistribution] = None,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded shards in rounds of ``all_gather``: round ``i`` carries every rank's ``i``-th shard.

    Each rank's shards (those needed by more than one rank) are sorted by size, largest first, so a
    round pairs similar sizes; every round sends equal-length byte buffers (padded to the round's
    largest shard), which gloo requires and NCCL is fastest with. Collective over the group.

    Args:
        loaded_tensors: shard id -> tensor this rank loaded.
        unloaded_shards: shard id -> ShardedTensor this rank needs but did not load (its ``data``, if
            set, receives the values in place).
        shard_distribution: from :func:`determine_main_replica_uniform_distribution`.
        parallelization_group: the group the distribution was computed in (None = default group).

    Returns:
        ``loaded_tensors`` plus every shard of ``unloaded_shards``.
    """
    sends, shard_to_metadata, group, local_rank, world, device, all_loaded = _start_exchange(
        "exchange_loaded_tensors_gather_rounds", loaded_tensors, shard_distribution, parallelization_group)
    by_rank: List[List[ShardId]] = [[] for _ in range(world)]
    for sid, rank in sends:
        by_rank[rank].append(sid)
    for lst in by_rank:  # stable: equal sizes keep the (deterministic) distribution order
        lst.sort(key=lambda s: -shard_size(shard_to_metadata[s]))

    for round_ids in zip_longest(*by_rank, fillvalue=None):
        nbytes = [0 if s is None else shard_size(shard_to_metadata[s]) for s in round_ids]
        width = max(nbytes)
        mine = round_ids[local_rank]
        send = torch.zeros(width, dtype=torch.uint8, device=device)
        if mine is not None:
            send[: nbytes[local_rank]] = _byte_view(_send_tensor(mine, all_loaded, shard_to_metadata[mine], device))
        recv = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(recv, send, group=group)
        for rank, sid in enumerate(round_ids):
            if sid is None or rank == local_rank or sid not in unloaded_shards:
                continue
            buf, _ = _get_empty_tensor_for_exchange(sid, unloaded_shards, shard_to_metadata, all_loaded, device)
            _byte_view(buf).copy_(recv[rank][: nbytes[rank]])
            _finish(sid, buf, unloaded_shards, all_loaded)
    _fill_empty(unloaded_shards, all_loaded, device)
    return all_loaded


def _fill_empty(unloaded_shards: Dict[ShardId, ShardedTensor], loaded: Dict[ShardId, torch.Tensor], device) -> None:
    """Zero-byte shards need no communication but still belong in the result."""
    for sid, sh in unloaded_shards.items():
        if sid not in loaded and sh.numel == 0:
            sh.init_data(device=device)
            loaded[sid] = sh.data


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: Optional[ShardDistribution] = None,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded shards with one ``all_gather_object`` (pickles tensors; for debugging).

    Tensors are sent from CPU. Shards this rank needs land in their ShardedTensor's ``data`` if set,
    else on the communication device; shards it does not need are returned as received (CPU).

    Returns:
        Every shard loaded by any rank of the group.

    Raises:
        CheckpointError: two ranks loaded the same shard.
    """
    group, _, world = _group_and_rank(parallelization_group)
    device = _comm_device(group)
    payload = {sid: _dequantized(sid, t, {}).detach().cpu() for sid, t in loaded_tensors.items()}
    gathered: List[Optional[Dict[ShardId, torch.Tensor]]] = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    merged = _merge_unique(gathered)
    out: Dict[ShardId, torch.Tensor] = {}
    for sid, t in merged.items():
        if sid in loaded_tensors:
            out[sid] = loaded_tensors[sid]
        elif sid in unloaded_shards:
            sh = unloaded_shards[sid]
            if sh.data is not None:
                sh.data.copy_(t)
                out[sid] = sh.data
            else:
                out[sid] = t.to(device)
        else:
            out[sid] = t
    _fill_empty(unloaded_shards, out, device)
    return out


def _merge_unique(dicts: List[Optional[Dict[Any, Any]]]) -> Dict[Any, Any]:
    merged: Dict[Any, Any] = {}
    owner: Dict[Any, int] = {}
    for rank, d in enumerate(dicts):
        for k, v in (d or {}).items():
            if k in merged:
                raise CheckpointError(
                    f"shard {k!r} was loaded by rank {owner[k]} and rank {rank}; each shard must be loaded "
                    "by exactly one rank of the group (use one ShardDistribution on every rank)."
                )
            merged[k] = v
            owner[k] = rank
    return merged


def exchange_loaded_objects_gather_object(
    loaded_objects: Dict[ShardId, Any],
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, Any]:
    """Merge every rank's ``{shard id: object}`` with one ``all_gather_object`` (default: whole world).

    Raises:
        CheckpointError: two ranks loaded the same id.
    """
    group, _, world = _group_and_rank(parallelization_group)
    gathered: List[Optional[Dict[ShardId, Any]]] = [None] * world
    dist.all_gather_object(gathered, loaded_objects, group=group)
    return _merge_unique(gathered)


@torch.no_grad()
def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded shards with one ``broadcast`` per shard from its loading rank to the group.

    Shards needed by a single rank (the one that loaded them) and zero-byte shards are skipped.
    Values land in the needed ShardedTensor's ``data`` when it is set and on the communication
    device, else are moved back to ``data``'s device. Collective over the group.

    Returns:
        ``loaded_tensors`` plus every shard of ``unloaded_shards``.
    """
    sends, shard_to_metadata, group, local_rank, _, device, all_loaded = _start_exchange(
        "exchange_loaded_tensors_broadcast", loaded_tensors, shard_distribution, parallelization_group)
    for sid, rank in sends:
        if rank == local_rank:
            buf = _send_tensor(sid, all_loaded, shard_to_metadata[sid], device)
        else:
            buf, _ = _get_empty_tensor_for_exchange(sid, unloaded_shards, shard_to_metadata, all_loaded, device)
        dist.broadcast(_byte_view(buf), group=group, group_src=rank)
        if rank != local_rank:
            _finish(sid, buf, unloaded_shards, all_loaded)
    _fill_empty(unloaded_shards, all_loaded, device)
    return all_loaded


def exchange_by_distribution(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    exchange_algo: str = "broadcast",
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded shards with ``exchange_algo``: ``"broadcast"`` (default), ``"gather_rounds"``
    or ``"gather_object"``. See the individual functions; all return ``loaded_tensors`` plus every
    shard this rank needs."""
    if shard_distribution is None:
        raise CheckpointError("exchange_by_distribution needs a shard_distribution (got None).")
    fns = {
        "broadcast": exchange_loaded_tensors_broadcast,
        "gather_rounds": exchange_loaded_tensors_gather_rounds,
        "gather_object": exchange_loaded_tensors_gather_object,
    }
    if exchange_algo not in fns:
        raise CheckpointError(
            f"exchange_algo={exchange_algo!r} is not supported; use one of {', '.join(EXCHANGE_ALGORITHMS)}."
        )
    return fns[exchange_algo](loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)
