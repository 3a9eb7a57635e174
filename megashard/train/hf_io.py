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
from typing import TYPE_CHECKING, Any, Optional

import torch

from megashard.errors import CheckpointError, ConfigError, require_extra
from megashard.models.hf import HF_ARCH, check_hf_config, hf_config, hf_shapes, mapping, read_rows, to_hf

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["export_hf", "check_init_from", "load_init_from", "job_of_checkpoint"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safetensors(what: str) -> Any:
    require_extra("safetensors.torch", what, "hf")  # (imports the package and its torch helpers)
    import safetensors

    return safetensors


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
    from megashard.train.checkpointing import read_full_model

    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise CheckpointError(f"{out} exists and is not an empty directory; pass --force to replace it")
    ckpt = os.path.abspath(safety.resolve_checkpoint(path))
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
    tmp = out + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for fname, names in zip(files, shards):
        save_file({k: tensors[k] for k in names}, os.path.join(tmp, fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if n > 1:
        _write_json(os.path.join(tmp, INDEX), {"metadata": {"total_size": total},
                                               "weight_map": {k: f for f, names in zip(files, shards) for k in names}})
    _write_json(os.path.join(tmp, "config.json"), hf_config(job.model, job.ffn_hidden, dtype))
    _write_json(os.path.join(tmp, "generation_config.json"), {"do_sample": False, "max_length": job.model.seq_len})
    if os.path.exists(out):
        shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    os.replace(tmp, out)
    return {"path": ckpt, "out": out, "arch": job.model.arch, "class": HF_ARCH[job.model.arch][0],
            "tensors": len(tensors), "bytes": total, "shards": n}


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------------------------- init_from
def _weight_map(root: str) -> dict[str, str]:
    """Hugging Face tensor name -> safetensors file (absolute) of a model directory."""
    index = os.path.join(root, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index ({e})") from None
        return {k: os.path.join(root, v) for k, v in wm.items()}
    single = os.path.join(root, SINGLE)
    if not os.path.isfile(single):
        raise ConfigError(f"model.init_from={root!r} holds neither {SINGLE} nor {INDEX}: give a Hugging Face model "
                          "directory saved with safetensors (save_pretrained(..., safe_serialization=True))")
    from safetensors import safe_open

    try:
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(f"model.init_from: cannot read {single} ({type(e).__name__}: {e})") from None


def _resolve_names(wm: dict[str, str], wanted: list[str]) -> dict[str, str]:
    """Our Hugging Face names -> the names in the files (a bare GPT2Model / LlamaModel has no prefix)."""
    out = {}
    for name in wanted:
        bare = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else None
        out[name] = name if name in wm or bare is None or bare not in wm else bare
    return out


def check_init_from(job: "JobConfig") -> None:
    """Every check of ``model.init_from`` that reads no tensor data (one-line :class:`ConfigError` s)."""
    m = job.model
    root = m.init_from
    if root is None:
        return
    _safetensors("model.init_from")
    from safetensors import safe_open

    if not os.path.isdir(root):
        raise ConfigError(f"model.init_from={root!r} is not a directory: give a Hugging Face model directory "
                          "(config.json + *.safetensors)")
    cfg_path = os.path.join(root, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model.init_from={root!r} has no config.json: give a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.init_from: {cfg_path} is not valid JSON ({e})") from None
    check_hf_config(doc, m, job.ffn_hidden, cfg_path)
    wm = _weight_map(root)
    shapes = hf_shapes(mapping(m, job.ffn_hidden))
    names = _resolve_names(wm, list(shapes))
    missing = [n for n in shapes if names[n] not in wm]
    if missing:
        raise ConfigError(f"model.init_from: {root} has no tensor {missing[0]!r} (model.arch={m.arch}, "
                          f"model.tie_embeddings={str(m.tie_embeddings).lower()})")
    by_file: dict[str, list[str]] = {}
    for name in shapes:
        by_file.setdefault(wm[names[name]], []).append(name)
    for path, group in by_file.items():  # headers only: one open per file
        try:
            with safe_open(path, framework="pt") as f:
                got = {name: tuple(f.get_slice(names[name]).get_shape()) for name in group}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"model.init_from: cannot read {path} ({type(e).__name__}: {e})") from None
        for name in group:
            want = shapes[name]
            positions = name.endswith("wpe.weight") and got[name][1:] == want[1:] and got[name][0] >= want[0]
            if got[name] != want and not positions:
                raise ConfigError(f"model.init_from: tensor {names[name]!r} in {path} has shape {list(got[name])}, "
                                  f"the model section needs {list(want)}")


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
