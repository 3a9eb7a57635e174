"""Checkpoint shard metadata, save/load work distribution and shard exchange between ranks."""
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

__all__ = [
    "EXCHANGE_ALGORITHMS",
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
