"""megashard: the parallel-state layer for large-model training on PyTorch."""
from megashard.errors import ConfigError, MegashardError, StateError, TransformerEngineMissingError

__version__ = "0.1.0"

__all__ = ["ConfigError", "MegashardError", "StateError", "TransformerEngineMissingError", "__version__"]
