"""Optional NVIDIA TransformerEngine (TE): detection, version checks, and a clear error when it is missing.

Nothing here imports TE at module import time, and nothing here raises when TE is absent except
:func:`require_te`, which is meant for code paths that cannot work without it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
from types import ModuleType
from typing import Any, Optional

from megashard.errors import TransformerEngineMissingError

__all__ = ["get_te_version", "have_te", "is_te_min_version", "parse_version", "require_te"]

_TE_MODULE = "transformer_engine"
_TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine")


def parse_version(text: str) -> Any:
    """Parse a version string into a comparable object.

    Uses ``packaging.version.Version`` when `packaging` is installed (it is not a torch dependency);
    otherwise a tuple of the leading release numbers, so ``"1.13.0+cu12"`` → ``(1, 13, 0)``.
    """
    try:
        from packaging.version import Version
    except ImportError:  # pragma: no cover - packaging is almost always present
        match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
        if match is None:
            raise ValueError(f"cannot parse version {text!r}: expected something like '1.13.0'") from None
        return tuple(int(p) for p in match.group(1).split("."))
    return Version(str(text))


@functools.lru_cache(maxsize=None)
def _import_te() -> tuple[Optional[ModuleType], Optional[BaseException]]:
    """Import TE once; return ``(module, None)`` or ``(None, the exception)``.

    Any exception counts as "TE unavailable": a TE wheel on a machine without CUDA libraries fails
    with OSError/RuntimeError rather than ImportError.
    """
    try:
        return importlib.import_module(_TE_MODULE), None
    except Exception as exc:  # noqa: BLE001 - see docstring
        return None, exc


def have_te() -> bool:
    """True when ``import transformer_engine`` succeeds (cached)."""
    return _import_te()[0] is not None


@functools.lru_cache(maxsize=None)
def get_te_version() -> Any:
    """Version of the importable TransformerEngine, or ``None`` when TE is not installed or not importable.

    Taken from ``transformer_engine.__version__``, else from the pip metadata of the
    ``transformer-engine`` distribution. Cached; never raises.
    """
    te, _ = _import_te()
    if te is None:
        return None
    text = getattr(te, "__version__", None)
    if text is None:
        for dist in _TE_DISTRIBUTIONS:
            try:
                text = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if text is None:
        return None
    try:
        return parse_version(str(text))
    except Exception:  # noqa: BLE001 - an unparseable version must not break callers
        return None


def is_te_min_version(vers: str, check_equality: bool = True) -> bool:
    """True when TE is installed and its version is ``>= vers`` (``> vers`` if ``check_equality=False``).

    Always ``False`` without TE.
    """
    installed = get_te_version()
    if installed is None:
        return False
    wanted = parse_version(vers)
    return installed >= wanted if check_equality else installed > wanted


def require_te(what: str, submodule: str = "pytorch") -> ModuleType:
    """Return ``transformer_engine.<submodule>`` (or the top package if ``submodule`` is empty).

    Raises :class:`~megashard.errors.TransformerEngineMissingError` naming ``what`` needed TE and how to
    install it (``pip install 'megashard[te]'``); the original import error is chained as the cause.
    """
    te, exc = _import_te()
    if te is None:
        raise TransformerEngineMissingError(what) from exc
    if not submodule:
        return te
    try:
        return importlib.import_module(f"{_TE_MODULE}.{submodule}")
    except Exception as sub_exc:  # noqa: BLE001
        raise TransformerEngineMissingError(what) from sub_exc


def _reset_te_cache() -> None:
    """Forget the cached import and version (tests that fake or remove TE call this)."""
    _import_te.cache_clear()
    get_te_version.cache_clear()
