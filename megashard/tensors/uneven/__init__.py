"""Uneven DTensors: chunk metadata, validation, checkpoint (DCP) hooks, gather and split.

A DTensor is *uneven* when its local shards have sizes its placements do not predict: FSDP2's
``torch.chunk`` shards of a dim that does not divide, or any ``DTensor.from_local(..., shape=,
stride=, run_check=False)`` whose ranks hold arbitrary lengths (zero included). This package finds
where every local shard sits in the global tensor *from the actual local sizes*, so that DCP saves
and loads such tensors correctly and a full tensor can be gathered on gloo as well as NCCL.

One concept per module, in the order they build on each other:

* :mod:`~megashard.tensors.uneven.layout` — :class:`ChunkLayout`: where one rank's shard sits;
* :mod:`~megashard.tensors.uneven.metadata` — the batched metadata exchange that computes layouts
  (:func:`compute_chunk_layouts`, :func:`gather_and_compute_chunk_metadata`, :func:`validate_uneven_dtensor`);
* :mod:`~megashard.tensors.uneven.dcp_hooks` — DCP's chunk / write-item hooks and state-dict preprocessing;
* :mod:`~megashard.tensors.uneven.gather` — the full tensor on every rank;
* :mod:`~megashard.tensors.uneven.split` — ``torch.split`` of a DTensor without communication.

Names and signatures follow Megatron-FSDP's ``uneven_dtensor`` module; all of them are importable from here.
"""
from megashard.tensors.uneven.layout import ChunkLayout, Level, get_chunk_layout
from megashard.tensors.uneven.metadata import (
    compute_chunk_layouts,
    gather_and_compute_chunk_metadata,
    validate_uneven_dtensor,
)
from megashard.tensors.uneven.dcp_hooks import (  # noqa: I001  (after the metadata it builds on)
    filter_unflattened_state_dict,
    get_unflattened_state_dict,
    preprocess_state_dict_for_uneven_dtensor,
    update_uneven_dtensor_chunk_metadata,
)
from megashard.tensors.uneven.gather import (
    _assemble_full_tensor_from_uneven_chunks,
    gather_uneven_dtensor_to_full_tensor,
    redistribute_uneven_dtensor_to_replicated,
    uneven_dtensor_to_full_tensor,
)
from megashard.tensors.uneven.split import _intersection, _offset_slice, split_dtensor

__all__ = [
    "ChunkLayout",
    "Level",
    "compute_chunk_layouts",
    "filter_unflattened_state_dict",
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "get_chunk_layout",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
    # Megatron-FSDP's private helpers, importable under their names
    "_assemble_full_tensor_from_uneven_chunks",
    "_intersection",
    "_offset_slice",
]
