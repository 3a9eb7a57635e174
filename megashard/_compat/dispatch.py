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


def no_dispatch_modes() -> Any:
    """A context in which no ``TorchDispatchMode`` sees the ops run (``_disable_current_modes``, private): the
    rehearsal's exact collectives (:mod:`megashard.rehearse.exact`) move peers' values without a live-memory count
    taking their transfer buffers for the program's own tensors (gloo's buffers are not tensors either)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
