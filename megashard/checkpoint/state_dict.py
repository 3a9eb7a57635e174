"""What a checkpoint holds: the state dict save writes and load fills, built from model, optimizer and sections.

``{"model": ..., "optim": ..., "extra": ..., **sections}``: DCP's own FQN-keyed, sharded state dicts of
the model and optimizer (FSDP2 / TP / HSDP DTensors, uneven ones included), the caller's extra state,
and named sections saved as given. Load checks the requested keys and shapes against the checkpoint's
metadata before DCP reads anything, so a wrong model fails with the key named.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megashard._compat import dcp_flatten_state_dict
from megashard.checkpoint.planners import check_weights_only
from megashard.errors import CheckpointError

__all__ = ["apply_state_dict", "attach_uneven_layouts", "check_against_metadata", "collect_state_dict"]


def _as_list(optimizer) -> list:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else None
    if opts is None or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        what = type(optimizer).__name__ if opts is None else f"a {type(optimizer).__name__} holding " + ", ".join(
            sorted({type(o).__name__ for o in opts if not isinstance(o, torch.optim.Optimizer)}))
        hint = " (a state dict? pass the optimizer itself)" if isinstance(optimizer, dict) else ""
        raise CheckpointError(f"optimizer= expects a torch.optim.Optimizer or a list of them, got {what}{hint}")
    return opts


def _check_model(model: object) -> None:
    """CheckpointError unless ``model`` is a torch.nn.Module (or None), naming what was given and what to do."""
    if model is None or isinstance(model, torch.nn.Module):
        return
    hint = (": pass the module itself (model=model), or save a state dict of your own with sections={'model': sd} "
            "(or state_dict=sd, saved under 'extra')") if isinstance(model, dict) else ""
    raise CheckpointError(f"model= expects a torch.nn.Module, got {type(model).__name__}{hint}")


def collect_state_dict(model, optimizer, extra: Optional[dict], sections: Optional[dict] = None) -> dict:
    """``{"model": ..., "optim": ..., "extra": ..., **sections}`` with DCP's own (FQN-keyed, sharded) state dicts.

    Checks the arguments (names and types of the sections, weights-only non-tensor values) and raises
    CheckpointError naming what is wrong.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    _check_model(model)
    opts = _as_list(optimizer)
    sd: dict = {}
    if opts and model is None:
        raise CheckpointError("an optimizer was given without its model; pass model= as well (optimizer state is keyed by parameter names)")
    if model is not None:
        if opts:
            sd["model"], sd["optim"] = get_state_dict(model, opts)
        else:
            sd["model"] = get_model_state_dict(model)
    if extra:
        if not isinstance(extra, dict):
            raise CheckpointError(f"state_dict= must be a dict of tensors / DTensors / small values, got {type(extra).__name__}")
        check_weights_only(_without_tensors(extra), "state_dict= (its non-tensor values)")
        sd["extra"] = extra
    for name, section in (sections or {}).items():
        if not isinstance(name, str) or not name or "." in name or name in sd or name == "extra":
            raise CheckpointError(
                f"sections= name {name!r} is not allowed: names must be non-empty strings without '.', other than "
                f"'extra' and the sections model=/optimizer= fill ({sorted(k for k in sd if k != 'extra')})")
        if not isinstance(section, dict):
            raise CheckpointError(f"sections[{name!r}] must be a dict of tensors / DTensors / small values, got "
                                  f"{type(section).__name__}")
        check_weights_only(_without_tensors(section), f"sections[{name!r}] (its non-tensor values)")
        sd[name] = section
    if not sd:
        raise CheckpointError("nothing to checkpoint: pass model= (and optimizer=), state_dict= or sections=")
    return sd


def _without_tensors(x: Any) -> Any:
    """``x`` with every tensor replaced by None (to check the other values cheaply)."""
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, dict):
        return {k: _without_tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_without_tensors(v) for v in x]
    return x


def attach_uneven_layouts(sd: dict, cache: Optional[dict] = None) -> None:
    """Collective: give every DTensor of ``sd`` its real (possibly uneven) chunk for DCP (one exchange per mesh axis;
    ``cache``: reuse the previous call's layouts when nothing changed, see ``preprocess_state_dict_for_uneven_dtensor``)."""
    from megashard.tensors.uneven import preprocess_state_dict_for_uneven_dtensor

    preprocess_state_dict_for_uneven_dtensor(sd, cache=cache)



def check_against_metadata(sd: dict, md: Metadata, strict: bool) -> tuple[list, list]:
    """Missing keys and shape mismatches, named, before DCP sees the state dict.

    Returns ``(missing keys, notes on converted dtypes)``; raises CheckpointError for a shape mismatch,
    and for missing keys if ``strict``.
    """
    flat, _ = dcp_flatten_state_dict(sd)
    stored = md.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    notes = []
    for k, v in flat.items():
        m = stored.get(k)
        if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
            if tuple(v.shape) != tuple(m.size):
                raise CheckpointError(
                    f"{k!r} has shape {tuple(v.shape)} here but {tuple(m.size)} in the checkpoint; the model does not "
                    "match the saved one (check the model config)"
                )
            if v.dtype != m.properties.dtype:
                notes.append(f"{k}: saved as {m.properties.dtype}, loaded into {v.dtype} (converted)")
    if missing and strict:
        sections = sorted({k.split(".", 1)[0] for k in stored})
        raise CheckpointError(
            f"{len(missing)} key(s) are not in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}; the "
            f"checkpoint has sections {sections} and {len(stored)} keys. Pass strict=False to load the rest."
        )
    return missing, notes



def apply_state_dict(model, optimizer, sd: dict) -> None:
    """Put the loaded ``sd["model"]`` (and ``sd["optim"]``) into ``model`` / ``optimizer`` (DCP's ``set_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    opts = _as_list(optimizer)
    if model is None:
        return
    if opts:
        set_state_dict(model, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        set_model_state_dict(model, sd["model"])

