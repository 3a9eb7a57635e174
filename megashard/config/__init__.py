"""The first step of the flow: a parallel config, read from YAML or written in Python, checked once.

    config = ParallelConfig.from_yaml("configs/default.yaml")      # or ParallelConfig(tp=2, dp_outer=2)
    sizes = config.resolve(world_size=8)                            # ResolvedSizes -> megashard.layout.RankLayout

Modules: ``parallel`` (:class:`ParallelConfig`: fields, world-independent checks, the ``parallel:`` section of a
job YAML), ``sizes`` (:class:`ResolvedSizes` and the arithmetic that fills every ``-1`` for a world size),
``yamlfile`` (reading YAML files and ``key=value`` overrides), ``modules`` (:class:`ModulesConfig`: several layouts on
disjoint rank ranges of one job), ``nccl`` (Megatron's NCCL communicator config, read and checked with the config).
Pure Python: nothing here imports torch (``nccl.nccl_options`` does, when called).
"""
from megashard.config.modules import ModuleConfig, ModulesConfig
from megashard.config.parallel import BACKENDS, DEVICES, MAX_TIMEOUT, ParallelConfig, parallel_section
from megashard.config.sizes import (
    MAX_WORLD_SIZE,
    ORDER_TOKENS,
    ResolvedSizes,
    check_world_size,
    fmt_divisors,
    resolve_sizes,
)

__all__ = [
    "BACKENDS", "DEVICES", "MAX_TIMEOUT", "MAX_WORLD_SIZE", "ModuleConfig", "ModulesConfig", "ORDER_TOKENS", "ParallelConfig", "ResolvedSizes",
    "check_world_size", "fmt_divisors", "parallel_section", "resolve_sizes",
]
