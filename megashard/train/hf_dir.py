"""A Hugging Face model directory: its safetensors files and tensor names, and ``model.init_from`` checked against
the model section (:func:`check_init_from`: ``config.json``, every tensor's name and shape from the headers; no
tensor data read).

Apart from :mod:`megashard.train.hf_io` so that :meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>`
can run the check without importing the export (which imports the job config).
"""
from __future__ import annotations

import os
from typing import Any

from megashard.errors import ConfigError, require_extra
from megashard.models.config import ModelConfig
from megashard.models.hf import check_hf_config, hf_shapes, mapping

__all__ = ["INDEX", "SINGLE", "check_init_from"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safetensors(what: str) -> Any:
    require_extra("safetensors.torch", what, "hf")  # (imports the package and its torch helpers)
    import safetensors

    return safetensors


def _weight_map(root: str) -> dict[str, str]:
    """Hugging Face tensor name -> safetensors file (absolute) of a model directory."""
    index = os.path.join(root, INDEX)
    if os.path.lexists(index):
        from megashard.readers import LARGE, read_json

        doc = read_json(index, "model.init_from:", limit=LARGE)  # a FIFO or device is named, never opened to read
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or "weight_map" not in doc:
            raise ConfigError(f"model.init_from: {index} has no weight_map (a mapping of tensor name to safetensors "
                              "file): not a safetensors index")
        if not isinstance(wm, dict) or not wm:
            raise ConfigError(f"model.init_from: {index}: weight_map must be a non-empty mapping of tensor name to "
                              f"safetensors file, got {type(wm).__name__}")
        out = {}
        for k, v in wm.items():
            if not isinstance(v, str) or not v.endswith(".safetensors") or os.path.basename(v) != v:
                raise ConfigError(f"model.init_from: {index}: weight_map[{k!r}] must be the name of a .safetensors "
                                  f"file in {root}, got {v!r}")
            path = os.path.join(root, v)
            if not os.path.isfile(path):
                raise ConfigError(f"model.init_from: {index}: weight_map[{k!r}] names {v}, which {root} does not hold")
            out[k] = path
        return out
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


def check_init_from(model: ModelConfig, ffn_hidden: int) -> None:
    """Every check of ``model.init_from`` that reads no tensor data (one-line :class:`ConfigError` s), for the
    model section and its MLP size (``JobConfig.ffn_hidden``)."""
    m = model
    root = m.init_from
    if root is None:
        return
    _safetensors("model.init_from")
    from safetensors import safe_open

    if not os.path.isdir(root):
        raise ConfigError(f"model.init_from={root!r} is not a directory: give a Hugging Face model directory "
                          "(config.json + *.safetensors)")
    cfg_path = os.path.join(root, "config.json")
    if not os.path.lexists(cfg_path):
        raise ConfigError(f"model.init_from={root!r} has no config.json: give a Hugging Face model directory")
    from megashard.readers import SMALL, read_json

    doc = read_json(cfg_path, "model.init_from:", limit=SMALL)  # a FIFO or device is named, never opened to read
    check_hf_config(doc, m, ffn_hidden, cfg_path)
    wm = _weight_map(root)
    shapes = hf_shapes(mapping(m, ffn_hidden))
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
