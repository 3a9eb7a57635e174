"""Sharding utilities: Megatron TP attributes, DTensor placements, local shapes/offsets, flat sharded tensors.

Submodules: :mod:`~megashard.tensors.tp_attrs`, :mod:`~megashard.tensors.shape`,
:mod:`~megashard.tensors.placements`, :mod:`~megashard.tensors.flat` (and ``uneven`` for uneven DTensors).
"""
from megashard.tensors.flat import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec
from megashard.tensors.placements import FSDP_MESH_AXES, param_mesh_axes, resolve_placements, tp_placement
from megashard.tensors.shape import (
    compute_global_index_runs,
    compute_local_shape_and_global_offset,
    get_local_shape_and_global_offset,
    global_index_runs_at,
    local_shape_and_offset_at,
    mesh_coordinate_of,
)
from megashard.tensors.tp_attrs import (
    copy_tensor_model_parallel_attributes,
    get_mcore_tensor_parallel_partition_dim,
    get_tensor_model_parallel_partition_stride,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    set_tensor_parallel_mode,
)
from megashard.tensors import uneven as _uneven  # noqa: E402  (builds on shape.py)
from megashard.tensors.uneven import (  # noqa: E402
    gather_and_compute_chunk_metadata,
    gather_uneven_dtensor_to_full_tensor,
    preprocess_state_dict_for_uneven_dtensor,
    redistribute_uneven_dtensor_to_replicated,
    split_dtensor,
    uneven_dtensor_to_full_tensor,
    update_uneven_dtensor_chunk_metadata,
    validate_uneven_dtensor,
)

__all__ = [
    "FSDP_MESH_AXES",
    "ShardedFlatParameter",
    "ShardedFlatTensor",
    "ShardingSpec",
    "compute_global_index_runs",
    "compute_local_shape_and_global_offset",
    "copy_tensor_model_parallel_attributes",
    "get_local_shape_and_global_offset",
    "get_mcore_tensor_parallel_partition_dim",
    "get_tensor_model_parallel_partition_stride",
    "global_index_runs_at",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "local_shape_and_offset_at",
    "mesh_coordinate_of",
    "param_is_not_tensor_parallel_duplicate",
    "param_mesh_axes",
    "resolve_placements",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "set_tensor_parallel_mode",
    "tp_placement",
]
# ... and uneven's public names imported above (listed once, in megashard.tensors.uneven.__all__)
__all__ += [n for n in _uneven.__all__ if not n.startswith("_") and n in globals()]
