"""megashard: the parallel-state layer for large-model training on PyTorch.

    import megashard
    state = megashard.initialize(megashard.ParallelConfig(tp=2, dp_outer=2))
    state.group("tp"); state.fsdp_mesh; state.fully_shard_mesh
    megashard.destroy()

The package follows the flow of a job: ``config`` (ParallelConfig, parsed and checked once) → ``layout``
(RankLayout: which ranks form each group) → ``state`` (ParallelState: process groups, meshes, RNG tracker,
memory buffer) → ``tensors`` (sharding) → ``checkpoint`` (DCP save/load) → ``data`` → ``train`` / ``cli`` (the
example job and the ``megashard`` command). ``parallel_state`` is Megatron-LM's API over the current state.

Config, layout and errors are pure Python; the torch-dependent parts (state, meshes) load on first use,
so `megashard plan` starts without importing torch.
"""
from megashard.config import ParallelConfig, ResolvedSizes
from megashard.errors import ConfigError, MegashardError, StateError, TransformerEngineMissingError
from megashard._version import __version__
from megashard.layout import RankLayout

_LAZY = {"ParallelState", "destroy", "get_parallel_state", "initialize", "is_initialized", "set_parallel_state"}

__all__ = [
    "ConfigError", "MegashardError", "ParallelConfig", "ParallelState", "RankLayout", "ResolvedSizes", "StateError",
    "TransformerEngineMissingError", "destroy", "get_parallel_state", "initialize", "is_initialized",
    "set_parallel_state", "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        from megashard import state

        return getattr(state, name)
    raise AttributeError(f"module 'megashard' has no attribute {name!r}")
