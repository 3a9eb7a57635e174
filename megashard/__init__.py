"""megashard: the parallel-state layer for large-model training on PyTorch.

    import megashard
    state = megashard.initialize(megashard.ParallelConfig(tp=2, dp_outer=2))
    state.group("tp"); state.fsdp_mesh; state.fully_shard_mesh
    megashard.destroy()
"""
from megashard.config import ParallelConfig, ResolvedSizes
from megashard.errors import ConfigError, MegashardError, StateError, TransformerEngineMissingError
from megashard.layout import RankLayout
from megashard.state import ParallelState, destroy, get_parallel_state, initialize, is_initialized

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "MegashardError", "ParallelConfig", "ParallelState", "RankLayout", "ResolvedSizes", "StateError",
    "TransformerEngineMissingError", "destroy", "get_parallel_state", "initialize", "is_initialized", "__version__",
]
