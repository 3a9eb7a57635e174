"""Every name the seed API documents (``../shared/seeds``) is importable from megashard, and the DTensor
helpers PyTorch keeps private (``torch.distributed.tensor._utils``) agree with megashard's public ones.

The name list is written out here (the seed files are not part of a clone); each entry says which seed
document it comes from. Acceptance checks outside the repository look these names up.
"""

from __future__ import annotations

import importlib
import pkgutil
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import megashard
from megashard.tensors import dtensor_info

SEED_NAMES = {
    "000 Megatron-FSDP uneven_dtensor": [
        "gather_and_compute_chunk_metadata", "update_uneven_dtensor_chunk_metadata", "validate_uneven_dtensor",
        "filter_unflattened_state_dict", "get_unflattened_state_dict", "preprocess_state_dict_for_uneven_dtensor",
        "gather_uneven_dtensor_to_full_tensor", "_assemble_full_tensor_from_uneven_chunks", "split_dtensor",
        "_intersection", "_offset_slice", "uneven_dtensor_to_full_tensor", "redistribute_uneven_dtensor_to_replicated"],
    "001 OLMo-core distributed.tensors": [
        "ShardedFlatTensor", "ShardedFlatParameter", "ShardingSpec", "compute_local_shape_and_global_offset",
        "get_local_shape_and_global_offset"],
    "002 Megatron-FSDP utils": [
        "FSDPDistributedIndex", "GlobalMemoryBuffer", "get_global_memory_buffer", "get_cuda_rng_tracker",
        "initialize_rng_tracker", "_get_cuda_rng_state", "_set_cuda_rng_state", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
        "get_te_version", "is_te_min_version", "is_submodule", "get_mesh_names", "contains_submesh",
        "create_updated_function_signature", "get_mcore_tensor_parallel_partition_dim",
        "is_mcore_tensor_model_parallel", "is_mcore_tensor_parallel_duplicated"],
    "003 Megatron dist_checkpointing.exchange_utils": [
        "ShardDistribution", "is_float8tensor", "_shard_size", "_get_empty_tensor_for_exchange",
        "distribute_shards_to_ranks", "determine_main_replica_uniform_distribution", "exchange_by_distribution",
        "exchange_loaded_tensors_gather_rounds", "exchange_loaded_tensors_gather_object",
        "exchange_loaded_objects_gather_object", "exchange_loaded_tensors_broadcast"],
    "004 PyTorch uneven strided sharding": [
        "_explicit_order_placements", "compute_local_shape_and_global_offset", "compute_global_tensor_info",
        "compute_local_stride", "normalize_to_torch_size", "try_find_mesh_from_args"],
}


def _modules():
    mods = [megashard]
    for info in pkgutil.walk_packages(megashard.__path__, "megashard."):
        mods.append(importlib.import_module(info.name))
    return mods


def test_every_seed_name_is_in_the_package():
    mods = _modules()
    missing = [f"{doc}: {name}" for doc, names in SEED_NAMES.items() for name in names
               if not any(name in vars(m) for m in mods)]
    assert not missing, "seed names megashard does not define: " + "; ".join(missing)


class _Mesh:
    """What these helpers ask of a mesh: the size of each axis."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def size(self, axis: int) -> int:
        return self.shape[axis]


def _random_case(rng: random.Random):
    ndim = rng.randint(1, 4)
    local = [rng.randint(1, 5) for _ in range(ndim)]
    t = torch.empty(local)
    if ndim > 1 and rng.random() < 0.5:  # a non-contiguous local tensor: strides out of dim order
        perm = list(range(ndim))
        rng.shuffle(perm)
        t = torch.empty([local[p] for p in perm]).permute(*[perm.index(i) for i in range(ndim)])
    axes = rng.randint(1, 3)
    mesh = _Mesh([rng.randint(1, 4) for _ in range(axes)])
    placements = [rng.choice([Replicate(), Partial(), Shard(rng.randrange(ndim))]) for _ in range(axes)]
    return t, mesh, placements


def test_dtensor_info_matches_pytorch_private_helpers():
    from torch.distributed.tensor import _utils as torch_utils  # the oracle (private; tests only)

    rng = random.Random(0)
    for _ in range(500):
        t, mesh, placements = _random_case(rng)
        ours = dtensor_info.compute_global_tensor_info(t, mesh, placements)
        assert ours == torch_utils.compute_global_tensor_info(t, mesh, placements), (t.shape, t.stride(), placements)
        # the seed's compute_local_stride(global_stride, mesh, placements) inverts it (torch 2.13's private
        # function of that name takes (global_stride, local_shape) instead: the round trip is the oracle)
        assert dtensor_info.compute_local_stride(ours[1], mesh, placements) == tuple(t.stride()), placements
    # the docstring's example
    t = torch.empty(4, 2, 8).permute(0, 2, 1)  # size (4, 8, 2), stride (16, 1, 8)
    assert dtensor_info.compute_global_tensor_info(t, _Mesh([2]), [Shard(2)]) == ([4, 8, 4], [32, 1, 8])
    for size in (3, [2, 3], (4,), ([5, 6],), torch.Size([7]), ()):
        assert dtensor_info.normalize_to_torch_size(size) == torch_utils.normalize_to_torch_size(size)


def test_dtensor_info_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match="shard dim 3 is not a dim of a 2-dim tensor"):
        dtensor_info.compute_global_tensor_info(torch.empty(2, 2), _Mesh([2]), [Shard(3)])
    with pytest.raises(ValueError, match="Cannot find device mesh from args for op : aten.add"):
        dtensor_info.try_find_mesh_from_args("aten.add", [torch.ones(1), [1, 2]])
