"""Small helpers about modules and functions (Megatron-FSDP `utils` names)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch


def is_submodule(module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True) -> bool:
    """True if ``module`` is inside ``parent_module``; with ``strict=False`` a module counts as its own submodule."""
    if not strict and module is parent_module:
        return True
    return any(m is module for name, m in parent_module.named_modules() if name != "")


def create_updated_function_signature(original_function: Callable, **extended_kwargs: Any) -> Callable:
    """Wrap ``original_function`` so it also accepts the keyword-only ``extended_kwargs`` (with those defaults).

    The extra keywords are swallowed (not forwarded) and appear in the wrapper's ``inspect.signature``,
    so frameworks that introspect signatures see them. Keywords the function already has are rejected.
    """
    sig = inspect.signature(original_function)
    clash = [k for k in extended_kwargs if k in sig.parameters]
    if clash:
        from megashard.errors import MegashardError

        raise MegashardError(f"{original_function.__qualname__} already has parameter(s) {clash}; choose other names")
    params = list(sig.parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in extended_kwargs.items()]
    params += var_kw

    @functools.wraps(original_function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for k in extended_kwargs:
            kwargs.pop(k, None)
        return original_function(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper
