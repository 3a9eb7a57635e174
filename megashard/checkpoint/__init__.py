"""Checkpoints: shard metadata, work distribution, shard exchange, and DCP save/load with resharding.

    from megashard import checkpoint
    path = checkpoint.save("ckpt", step, model, optimizer, consumed_samples=n, keep_last=3)
    report = checkpoint.load(checkpoint.latest_checkpoint("ckpt"), model, optimizer)
"""
from megashard.checkpoint.exchange import (
    EXCHANGE_ALGORITHMS,
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    exchange_loaded_tensors_broadcast,
    exchange_loaded_tensors_gather_object,
    exchange_loaded_tensors_gather_rounds,
    is_float8tensor,
)
from megashard.checkpoint.mapping import (
    ReplicaId,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
    sharded_state_dict_from_dtensors,
    sharded_tensor_from_dtensor,
)

from megashard.checkpoint.dcp import LoadReport, load, save  # noqa: E402  (after the pieces it builds on)
from megashard.checkpoint.safety import latest_checkpoint, list_checkpoints

__all__ = [
    "EXCHANGE_ALGORITHMS",
    "LoadReport",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "save",
    "ReplicaId",
    "ShardDistribution",
    "ShardedStateDict",
    "ShardedTensor",
    "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "is_float8tensor",
    "is_main_replica",
    "sharded_state_dict_from_dtensors",
    "sharded_tensor_from_dtensor",
]
