"""A Hugging Face model directory: its safetensors files and tensor names, and ``model.init_from`` checked against
the model section (:func:`check_init_from`: ``config.json``, every tensor's name and shape from the headers; no
tensor data read).

Apart from :mod:`megashard.train.hf_io` so that :meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>`
can run the check without importing the export (which imports the job config).
"""
from __future__ import annotations

import json
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
    try:
        with open(cfg_path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model.init_from={root!r} has no config.json: give a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.init_from: {cfg_path} is not valid JSON ({e})") from None
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
