"""Hugging Face safetensors checkpoints in and out: ``megashard ckpt export-hf`` and ``model.init_from``.

    export_hf("runs/default/checkpoints", "hf-out")  # config.json + model*.safetensors (GPT2LMHeadModel / Llama...)
    # model.init_from: hf-out   in a job's YAML: start from those weights (each rank reads only its slices)

The export reads the checkpoint in one process through megashard's verified reader
(:func:`megashard.train.checkpointing.read_full_model`: every byte checked against the checksums recorded at save
time, any saved layout), maps the tensors with the table of :mod:`megashard.models.hf` and writes safetensors shards
of at most ``max_shard_bytes`` (plus ``model.safetensors.index.json`` when there is more than one) and
``config.json``. The model config is the one the checkpoint records (``megashard.json``: the job's config).

``model.init_from`` is checked before any process starts (:func:`check_init_from`: the directory, ``config.json``
against the model section, every tensor's name and shape from the safetensors headers); then every rank reads
only the rows and columns of its own TP / FSDP shard of each parameter (``safe_open(...).get_slice``), so no rank
materialises the whole model (:func:`load_init_from`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Optional

import torch

from megashard.errors import CheckpointError, ConfigError
from megashard.outputs import MARKER, claim_dir, new_file_mode, record_files
from megashard.models.hf import HF_ARCH, hf_config, hf_shapes, mapping, read_rows, to_hf
from megashard.train.hf_dir import (  # noqa: F401 - check_init_from re-exported (its old home)
    INDEX,
    SINGLE,
    _resolve_names,
    _safetensors,
    _weight_map,
    check_init_from,
)

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["export_hf", "check_init_from", "load_init_from", "job_of_checkpoint"]

# ---------------------------------------------------------------------------------------------- export
def job_of_checkpoint(ckpt: str, config_path: Optional[str] = None) -> "JobConfig":
    """The job config a checkpoint was saved with (``megashard.json``'s ``job``), or read from ``config_path``."""
    from megashard.checkpoint import safety
    from megashard.train.config import JobConfig

    if config_path is not None:
        return JobConfig.from_yaml(config_path)
    info = safety.read_json(os.path.join(ckpt, safety.LAYOUT_FILE), "layout file")
    doc = info.get("job")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{ckpt} records no job config (it was not saved by `megashard run`, or by an older "
                              "version): pass the job's YAML with --config (e.g. runs/NAME/config.yaml)")
    return JobConfig.from_dict(doc, name=str(info.get("job_name", "job")))


def export_hf(path: str, out: str, *, config_path: Optional[str] = None, max_shard_bytes: int = 2 << 30,
              overwrite: bool = False) -> dict[str, Any]:
    """Write checkpoint ``path`` (or the newest complete one under it) as a Hugging Face model directory ``out``.

    Returns ``{"path", "out", "arch", "class", "tensors", "bytes", "shards"}``. ``out`` is written to a temporary
    sibling and renamed, so it is never half-written; an existing non-empty ``out`` needs ``overwrite=True``.
    """
    _safetensors("megashard ckpt export-hf")
    from safetensors.torch import save_file

    from megashard.checkpoint import safety
    from megashard.outputs import check_output_dir
    from megashard.train.checkpointing import read_full_model

    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    ckpt = os.path.abspath(safety.resolve_checkpoint(path))
    # A file, a path under a file, an unwritable place, a directory holding (or inside) the checkpoint, or one
    # megashard did not export (which --force would delete): refused before anything is read.
    check_output_dir("OUT", out, reads=[ckpt, path], kind="hf-export", replace=True)
    given, out = out, os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise CheckpointError(f"OUT {given}: exists and is not an empty directory (an earlier export of megashard); "
                              "pass --force to replace it")
    job = job_of_checkpoint(ckpt, config_path)
    entries = mapping(job.model, job.ffn_hidden)
    tensors = to_hf(read_full_model(ckpt), entries)
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():  # greedy, in the table's order (layer by layer)
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # A new directory of its own next to OUT (never an existing name), renamed to OUT when complete.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-export-", dir=os.path.dirname(out))
    try:
        mode = new_file_mode()
        os.chmod(tmp, new_file_mode(directory=True))  # mkdtemp makes 0700; the export is meant to be shared
        claim_dir(tmp, "hf-export")  # the marker: what a later --force may replace
        for fname, names in zip(files, shards):
            save_file({k: tensors[k] for k in names}, os.path.join(tmp, fname), metadata={"format": "pt"})
            os.chmod(os.path.join(tmp, fname), mode)  # safetensors writes 0600; the directory is meant to be shared
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if n > 1:
            _write_json(os.path.join(tmp, INDEX), {"metadata": {"total_size": total},
                                                   "weight_map": {k: f for f, names in zip(files, shards) for k in names}})
        _write_json(os.path.join(tmp, "config.json"), hf_config(job.model, job.ffn_hidden, dtype))
        # No max_length: generate(max_new_tokens=...) would warn that both are set (config.json holds the context).
        _write_json(os.path.join(tmp, "generation_config.json"), {"do_sample": False})
        # the marker lists every file written: a later --force deletes those and refuses when anything else is there
        record_files(tmp, [n for n in os.listdir(tmp) if n != MARKER])
        if os.path.exists(out):
            check_output_dir("OUT", out, reads=[ckpt, path], kind="hf-export", replace=True)  # still ours, just before
            _replace_dir(out, tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the directory this call made, nothing else
        raise
    return {"path": ckpt, "out": out, "arch": job.model.arch, "class": HF_ARCH[job.model.arch][0],
            "tensors": len(tensors), "bytes": total, "shards": n}


def _replace_dir(out: str, new: str) -> None:
    """Put directory ``new`` in the place of the (checked) export ``out``: the old one is renamed aside first, so
    ``out`` is always a whole export, then deleted."""
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    os.rmdir(old)  # a fresh name for the rename
    os.rename(out, old)
    os.rename(new, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------------------------- init_from
@torch.no_grad()
def load_init_from(model: torch.nn.Module, job: "JobConfig", state: "ParallelState") -> None:
    """Fill the parallelized ``model`` (after ``fully_shard``) from ``model.init_from``; every rank reads only the
    rows and columns of its own shard of each parameter."""
    from safetensors import safe_open

    from megashard._compat import torch_compute_local_shape_and_global_offset
    from megashard.models.parallelize import global_dtensor, local_tensor

    root = job.model.init_from
    entries = {e.name: e for e in mapping(job.model, job.ffn_hidden)}
    wm = _weight_map(root)
    names = _resolve_names(wm, list(hf_shapes(list(entries.values()))))
    handles: dict[str, Any] = {}

    def read(hf: str, dim0: slice, dim1: Optional[slice]) -> torch.Tensor:
        stored = names[hf]
        path = wm[stored]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        sl = handles[path].get_slice(stored)
        return sl[dim0] if dim1 is None else sl[dim0, dim1]

    for name, p in model.named_parameters():
        entry = entries.get(name)
        if entry is None:
            raise ConfigError(f"model.init_from: parameter {name} has no Hugging Face counterpart")
        local = local_tensor(p.detach())
        if local.numel() == 0:
            continue
        dt = global_dtensor(local, p, state)
        shape, offset = torch_compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        rows = slice(offset[0], offset[0] + shape[0])
        cols = slice(offset[1], offset[1] + shape[1]) if len(shape) > 1 else None
        block = read_rows(entry, read, rows, cols)
        local.copy_(block.to(dtype=local.dtype, device=local.device).view(local.shape))
    handles.clear()
