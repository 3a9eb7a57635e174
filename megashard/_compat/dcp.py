"""torch.distributed.checkpoint internals (:mod:`megashard.checkpoint`): offline loading, the nested-dict helpers, what
a ``.metadata`` pickle may reference, and whether DCP's ``DefaultStager`` can stage again.
"""
from __future__ import annotations

import torch


# --- DCP internals (megashard.checkpoint: state_dict, planners, storage) ---------------------------
# Offline (no process group) loading as DCP's own `dcp_to_torch_save` does it, DCP's nested-dict helpers,
# and the globals a `.metadata` pickle may reference (for a restricted unpickler: no arbitrary code).
def dcp_empty_state_dict_load_planner_class() -> type:
    """DCP's ``_EmptyStateDictLoadPlanner`` class: rebuilds the state dict (optionally only ``keys=``)
    from the checkpoint's metadata, for loading without a model."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


def dcp_load_state_dict(state_dict, storage_reader, planner, *, process_group=None, no_dist: bool = False) -> None:
    """DCP's ``_load_state_dict`` (``load`` without its Stateful handling), also usable with ``no_dist=True``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict, storage_reader, process_group=process_group, no_dist=no_dist, planner=planner)


def dcp_flatten_state_dict(state_dict):
    """``(flat, mappings)``: DCP's flattening of a nested state dict into dotted keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)


def dcp_set_element(root, path, value) -> None:
    """DCP's ``set_element``: put ``value`` at the (mapping) ``path`` of a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dcp_metadata_global_allowed(module: str, name: str) -> bool:
    """True if a DCP ``.metadata`` pickle may reference ``module.name``: DCP's metadata/storage classes,
    torch sizes, dtypes, layouts and memory formats, paths. Functions and other globals are refused."""
    import importlib
    import inspect

    if (module, name) in {("torch._utils", "_get_layout"), ("torch.serialization", "_get_layout"),
                          ("collections", "OrderedDict"),
                          ("builtins", "set"), ("builtins", "frozenset")}:
        return True
    if module == "pathlib":
        return name in {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
    if module in {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                  "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.storage"}:
        if module == "torch.distributed.checkpoint.filesystem" and name not in {"_StorageInfo", "_StoragePrefix"}:
            return False
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        return inspect.isclass(obj) and obj.__module__ == module
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    return False


def dcp_metadata_enum_member(owner, name):
    """``owner[name]`` if ``owner`` is an Enum class :func:`dcp_metadata_global_allowed` admits and ``name``
    one of its members, else None.

    Python 3.11.0-3.11.4 (e.g. Debian's 3.11.2) pickle an Enum member as ``getattr(EnumClass, name)``,
    so DCP metadata written there references ``builtins.getattr``. A restricted unpickler resolves that
    call through this function: attribute lookup only for members of allow-listed DCP Enum classes
    (``_MEM_FORMAT_ENCODING``, ``WriteItemType``, ...), never methods, dunders or anything else.
    """
    import enum
    import importlib

    if not (isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str)):
        return None
    module, qualname = getattr(owner, "__module__", None), getattr(owner, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str) and dcp_metadata_global_allowed(module, qualname)):
        return None
    try:  # the class must be the one its module exports under that name (not a look-alike)
        if getattr(importlib.import_module(module), qualname) is not owner:
            return None
    except (ImportError, AttributeError):
        return None
    return owner.__members__.get(name)


def dcp_narrow_tensor_by_index(tensor, offsets, sizes):
    """DCP's ``narrow_tensor_by_index``: the part of a saved chunk that a read item asks for."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, sizes)


# --- DCP's DefaultStager (megashard.checkpoint.async_save) -----------------------------------------------
_STAGER_REUSABLE: list = []


def dcp_default_stager_reusable() -> bool:
    """True if one DCP ``DefaultStager`` can stage again and again (torch 2.13: it keeps its host copies from save
    to save); False where each ``stage()`` ends by closing it (torch 2.11: ``close()`` empties its deepcopy table,
    and the next ``stage()`` fails with ``KeyError: <class 'type'>``). Decided once per process by staging a
    two-entry dict twice on the CPU (microseconds)."""
    if not _STAGER_REUSABLE:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            sd = {"t": torch.zeros(2), "cls": int}
            ok = all(stager.stage(sd)["cls"] is int for _ in range(2))
        except Exception:  # noqa: BLE001 - KeyError on torch 2.11; anything else: do not reuse either
            ok = False
        finally:
            stager.close()
        _STAGER_REUSABLE.append(ok)
    return _STAGER_REUSABLE[0]
