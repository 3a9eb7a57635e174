"""megashard for Megatron-LM users: :func:`install` puts ``megatron.core.parallel_state`` on megashard's state.

``import megashard.megatron`` loads neither megatron-core nor torch.distributed.tensor; ``install()`` imports
megatron-core (the ``megatron-test`` extra) and raises MissingExtraError without it.
"""
from __future__ import annotations

from megashard.megatron.install import install, installed, uninstall

__all__ = ["install", "installed", "uninstall"]
