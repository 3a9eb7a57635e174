"""The dispatcher hooks megashard's live-memory count uses (:mod:`megashard.advisor.live_bytes`): ``TorchDispatchMode``,
``is_traceable_wrapper_subclass`` and pytree's ``tree_leaves`` — private modules (``torch.utils._python_dispatch``,
``torch.utils._pytree``) with the same names in torch 2.11 - 2.15. Imported on first use (``dispatch_api()``)."""
from __future__ import annotations

from typing import Any


def dispatch_api() -> tuple[Any, Any, Any]:
    """``(TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves)``."""
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves

    return TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves
