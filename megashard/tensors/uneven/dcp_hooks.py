"""DCP hooks for uneven DTensors: every DTensor of a state dict describes its real local shard to DCP.

``torch.distributed.checkpoint`` asks each DTensor for its chunk (``__create_chunk_list__``) and write
items (``__create_write_items__``) and assumes the placements predict the local shard. For an uneven
DTensor they do not: :func:`preprocess_state_dict_for_uneven_dtensor` computes every DTensor's
:class:`~megashard.tensors.uneven.layout.ChunkLayout` in one batched exchange
(:mod:`~megashard.tensors.uneven.metadata`) and overrides the two hooks per instance, so DCP saves and
loads (reshards) such tensors correctly.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from megashard._compat import dtensor_local
from megashard.errors import StateDictKeyError, UnevenDTensorError
from megashard.tensors.uneven.layout import ChunkLayout, remember_layout, require_dtensor
from megashard.tensors.uneven.metadata import compute_chunk_layouts, single_layout

__all__ = [
    "attach_chunk_layout",
    "filter_unflattened_state_dict",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
    "update_uneven_dtensor_chunk_metadata",
]


def _raise_if_partial(layout: ChunkLayout) -> None:
    if any(isinstance(p, Partial) for p in layout.placements):
        raise UnevenDTensorError(
            f"cannot checkpoint a DTensor with Partial placements {list(layout.placements)}: reduce it first "
            "(redistribute to Replicate or Shard)"
        )


def attach_chunk_layout(dtensor: DTensor, layout: ChunkLayout) -> None:
    """Make DCP use ``layout`` for this DTensor (instance overrides of DTensor's checkpoint hooks, on the DTensor
    and on its local tensor, where Megatron-FSDP code looks for them: ``dtensor._local_tensor.__create_chunk_list__()``).

    The closures hold the layout only (not the tensor), so no reference cycle keeps memory alive.
    An empty local shard contributes no chunk (an empty chunk's offset could collide with a real
    chunk's in DCP's de-duplication); a tensor that is empty everywhere keeps one empty chunk.
    """
    global_empty = 0 in layout.global_shape

    def chunks() -> list[ChunkStorageMetadata]:
        _raise_if_partial(layout)
        if layout.numel == 0 and not global_empty:
            return []
        return [layout.chunk()]

    def write_items(fqn: str, obj: Any) -> list[WriteItem]:
        _raise_if_partial(layout)
        if layout.numel == 0 and not global_empty:
            return []
        chunk = layout.chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(dtensor_local(obj)),
                size=torch.Size(layout.global_shape),
            ),
        )]

    remember_layout(dtensor, layout)
    dtensor.__create_chunk_list__ = chunks  # type: ignore[method-assign]
    dtensor.__create_write_items__ = write_items  # type: ignore[method-assign]
    # Also where Megatron-FSDP puts (and looks for) them: on the local tensor, to which DTensor's own
    # hooks delegate (``hasattr(dtensor._local_tensor, "__create_chunk_list__")``).
    local = dtensor_local(dtensor)
    local.__create_chunk_list__ = chunks  # type: ignore[attr-defined]
    local.__create_write_items__ = write_items  # type: ignore[attr-defined]


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Compute ``dtensor``'s chunk layout (collective) and attach it, in place, for DCP save/load.

    Afterwards ``dtensor.__create_chunk_list__()`` / ``__create_write_items__(fqn, dtensor)`` describe
    the real local shard, and gather/split use the attached layout without communicating.
    Returns this rank's chunk.
    """
    require_dtensor(dtensor, "update_uneven_dtensor_chunk_metadata")
    layout = single_layout(dtensor)
    attach_chunk_layout(dtensor, layout)
    return layout.chunk()


# ---------------------------------------------------------------------------------------------------
# Nested state dicts
# ---------------------------------------------------------------------------------------------------
def _children(node: Any):
    if isinstance(node, dict):
        return node.items()
    if isinstance(node, (list, tuple)):
        return enumerate(node)
    return ()


def filter_unflattened_state_dict(
    state_dict: Any,
    key_chain: Optional[List[Any]] = None,
    visit_condition: Callable[[Any], bool] = lambda x: isinstance(x, DTensor),
) -> List[List[Any]]:
    """Key chains of every item of a nested state dict for which ``visit_condition`` holds.

    Walks dicts and lists/tuples depth first in insertion order. A key chain is the list of keys
    from the root (dict keys as they are, usually ``str``; list positions as ``int``), prefixed by
    ``key_chain``. Default condition: the item is a DTensor.

    Example: ``{"model": {"w": dt}, "optim": {"state": {"w": {"exp_avg": dt2}}}}`` ->
    ``[["model", "w"], ["optim", "state", "w", "exp_avg"]]``.
    """
    prefix = list(key_chain or [])
    out: List[List[Any]] = []
    stack = [(prefix, state_dict)]
    while stack:
        chain, node = stack.pop()
        if visit_condition(node):
            out.append(chain)
            continue
        children = list(_children(node))
        stack.extend((chain + [k], v) for k, v in reversed(children))
    return out


def get_unflattened_state_dict(state_dict: Any, key_chain: Optional[List[Any]] = None) -> Any:
    """The value of a nested state dict at ``key_chain`` (``[]``: the state dict itself).

    Raises: :class:`StateDictKeyError` naming the first key that is missing.
    """
    node = state_dict
    for i, key in enumerate(key_chain or []):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise StateDictKeyError(
                f"key chain {list(key_chain)} breaks at position {i}: {key!r} is not in "
                f"{type(node).__name__} with keys {list(dict(_children(node)).keys())[:10]}"
            ) from None
    return node


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict, *, meshes: Sequence[DeviceMesh] = (),
                                             cache: Optional[dict] = None) -> dict:
    """Attach chunk layouts to every DTensor of a (nested) state dict, for DCP save or load.

    Collective over the DTensors' meshes: one batched exchange per mesh axis for the whole state
    dict. Call it on the state dict you pass to ``torch.distributed.checkpoint.save`` and on the one
    you pass to ``load`` (fresh DTensors of any, possibly different, uneven layout). Modifies the
    DTensors in place and returns ``state_dict``. See :func:`compute_chunk_layouts` for ``meshes``.

    ``cache``: a dict kept by the caller between calls (e.g. a checkpoint saver's): when every rank's DTensors
    have the keys, shapes, placements, meshes, dtypes and local shapes of its previous call, the layouts of that
    call are reused — one all-reduce of a flag over the default group instead of the exchange.

    Raises: :class:`StateDictMismatchError` on every rank if ranks of a mesh hold different DTensor
    keys, shapes, placements or dtypes; :class:`UnevenDTensorError` if local shards do not tile.
    """
    chains = filter_unflattened_state_dict(state_dict)
    named, seen = [], set()
    for chain in chains:
        key = ".".join(str(k) for k in chain)
        while key in seen:  # e.g. {"a.b": x, "a": {"b": y}}: keys must stay unique (and equal on every rank)
            key += "'"
        seen.add(key)
        named.append((key, get_unflattened_state_dict(state_dict, chain)))
    layouts = None
    if cache is not None:
        signature = [(key, tuple(dt.shape), tuple(dt.placements), id(dt.device_mesh), dt.dtype,
                      tuple(dtensor_local(dt).shape)) for key, dt in named]
        device = named[0][1].device_mesh.device_type if named else "cpu"
        if _everywhere(cache.get("signature") == signature, device):
            layouts = cache["layouts"]
    if layouts is None:
        layouts = compute_chunk_layouts(named, meshes=meshes)
        if cache is not None:
            cache.update(signature=signature, layouts=layouts)
    for key, dt in named:
        if key in layouts:
            attach_chunk_layout(dt, layouts[key])
    return state_dict


def _everywhere(flag: bool, device_type: str = "cpu") -> bool:
    """``flag`` on every rank of the default group (one all-reduce of a tensor on ``device_type``, the meshes'
    device; ``flag`` itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=device)
    dist.all_reduce(t)
    return int(t.item()) == 0
