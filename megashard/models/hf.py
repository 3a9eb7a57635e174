"""The one table between megashard's example model and Hugging Face's ``GPT2LMHeadModel`` / ``LlamaForCausalLM``.

Both directions use it: ``megashard ckpt export-hf`` (:func:`to_hf`: full megashard tensors -> Hugging Face
tensors) and ``model.init_from`` (:func:`read_rows`: one rank's block of a megashard parameter, read from the
Hugging Face tensors slice by slice). Every megashard parameter is described as a stack, along its dim 0, of
:class:`Piece` s — row ranges of Hugging Face tensors, possibly transposed:

* the fused QKV projection: megashard orders its rows head by head (``[q_h0, k_h0, v_h0, q_h1, ...]``, so a
  contiguous TP split gives whole heads); Llama keeps ``q_proj``, ``k_proj``, ``v_proj`` apart, GPT-2 keeps
  ``c_attn`` = ``[q; k; v]`` (all heads each) as a ``Conv1D``;
* GPT-2's ``Conv1D`` weights are stored ``[in, out]``: the transpose of megashard's ``[out, in]`` Linear;
* Llama's rotary convention is megashard's (``rotate_half``: dimension ``i`` pairs with ``i + head_dim/2``),
  so ``q_proj`` / ``k_proj`` rows map one to one (no permutation);
* tied embeddings: no ``lm_head.weight`` (``tie_word_embeddings: true``); GPT-2's learned positions ``wpe``.

:func:`hf_config` gives the ``config.json`` of a megashard model section; :func:`check_hf_config` compares a
Hugging Face ``config.json`` with the model section and names the first field that differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megashard.errors import ConfigError
from megashard.models.config import ModelConfig

__all__ = ["Piece", "Entry", "mapping", "hf_config", "check_hf_config", "to_hf", "read_rows", "HF_ARCH"]

#: megashard ``model.arch`` -> (Hugging Face class, ``model_type``).
HF_ARCH = {"gpt": ("GPT2LMHeadModel", "gpt2"), "llama": ("LlamaForCausalLM", "llama")}


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + length)`` of Hugging Face tensor ``hf`` along its dim 0 (``transposed``: its dim 1),
    which are ``length`` consecutive rows of the megashard parameter."""

    hf: str
    start: int
    length: int
    transposed: bool = False


@dataclass(frozen=True)
class Entry:
    """One megashard parameter (its global ``shape``) = its :class:`Piece` s stacked along dim 0."""

    name: str
    shape: tuple
    pieces: tuple


def _whole(name: str, hf: str, shape: tuple, transposed: bool = False) -> Entry:
    return Entry(name, shape, (Piece(hf, 0, shape[0], transposed),))


def _qkv(name: str, hf: Callable[[int], tuple[str, int]], shape: tuple, heads: int, transposed: bool) -> Entry:
    """megashard's head-by-head QKV rows: head ``h``'s q, k, v rows come from ``hf(w)`` = (tensor, first row)."""
    hd = shape[0] // (3 * heads)
    pieces = []
    for h in range(heads):
        for w in range(3):
            tensor, base = hf(w)
            pieces.append(Piece(tensor, base + h * hd, hd, transposed))
    return Entry(name, shape, tuple(pieces))


def mapping(cfg: ModelConfig, ffn: int) -> list[Entry]:
    """The table of megashard parameter -> Hugging Face tensors of a dense ``gpt`` or ``llama`` model."""
    if cfg.num_experts:
        raise ConfigError(f"model.num_experts={cfg.num_experts}: MoE models have no Hugging Face GPT-2 / Llama "
                          "equivalent; use model.num_experts=0")
    h, v = cfg.hidden, cfg.vocab_size
    out: list[Entry] = []
    if cfg.arch == "llama":
        out.append(_whole("embed.weight", "model.embed_tokens.weight", (v, h)))
        for i in range(cfg.layers):
            b, hb = f"blocks.{i}.", f"model.layers.{i}."
            proj = ("q_proj", "k_proj", "v_proj")
            out += [
                _whole(b + "ln1.weight", hb + "input_layernorm.weight", (h,)),
                _qkv(b + "attn.qkv.weight", lambda w, hb=hb: (f"{hb}self_attn.{proj[w]}.weight", 0), (3 * h, h),
                     cfg.heads, False),
                _whole(b + "attn.proj.weight", hb + "self_attn.o_proj.weight", (h, h)),
                _whole(b + "ln2.weight", hb + "post_attention_layernorm.weight", (h,)),
                _whole(b + "mlp.gate.weight", hb + "mlp.gate_proj.weight", (ffn, h)),
                _whole(b + "mlp.up.weight", hb + "mlp.up_proj.weight", (ffn, h)),
                _whole(b + "mlp.down.weight", hb + "mlp.down_proj.weight", (h, ffn)),
            ]
        out.append(_whole("ln_f.weight", "model.norm.weight", (h,)))
    else:
        out += [_whole("embed.weight", "transformer.wte.weight", (v, h)),
                _whole("pos", "transformer.wpe.weight", (cfg.seq_len, h))]
        for i in range(cfg.layers):
            b, hb = f"blocks.{i}.", f"transformer.h.{i}."
            out += [
                _whole(b + "ln1.weight", hb + "ln_1.weight", (h,)),
                _whole(b + "ln1.bias", hb + "ln_1.bias", (h,)),
                _qkv(b + "attn.qkv.weight", lambda w, hb=hb: (hb + "attn.c_attn.weight", w * h), (3 * h, h),
                     cfg.heads, True),
                _qkv(b + "attn.qkv.bias", lambda w, hb=hb: (hb + "attn.c_attn.bias", w * h), (3 * h,), cfg.heads,
                     False),
                _whole(b + "attn.proj.weight", hb + "attn.c_proj.weight", (h, h), True),
                _whole(b + "attn.proj.bias", hb + "attn.c_proj.bias", (h,)),
                _whole(b + "ln2.weight", hb + "ln_2.weight", (h,)),
                _whole(b + "ln2.bias", hb + "ln_2.bias", (h,)),
                _whole(b + "mlp.fc1.weight", hb + "mlp.c_fc.weight", (ffn, h), True),
                _whole(b + "mlp.fc1.bias", hb + "mlp.c_fc.bias", (ffn,)),
                _whole(b + "mlp.fc2.weight", hb + "mlp.c_proj.weight", (h, ffn), True),
                _whole(b + "mlp.fc2.bias", hb + "mlp.c_proj.bias", (h,)),
            ]
        out += [_whole("ln_f.weight", "transformer.ln_f.weight", (h,)),
                _whole("ln_f.bias", "transformer.ln_f.bias", (h,))]
    if not cfg.tie_embeddings:
        out.append(_whole("head.weight", "lm_head.weight", (v, h)))
    return out


def hf_shapes(entries: list[Entry]) -> dict[str, tuple]:
    """Shape of every Hugging Face tensor the table covers (covering it whole)."""
    rows: dict[str, int] = {}
    other: dict[str, tuple] = {}
    for e in entries:
        for p in e.pieces:
            rows[p.hf] = max(rows.get(p.hf, 0), p.start + p.length)
            other[p.hf] = (tuple(e.shape[1:]), p.transposed)
    out = {}
    for name, n in rows.items():
        rest, transposed = other[name]
        out[name] = (rest + (n,)) if transposed else ((n,) + rest)
    return out


def to_hf(full: dict[str, torch.Tensor], entries: list[Entry]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from megashard's full parameters (every parameter must be in the table, and back)."""
    extra = sorted(set(full) - {e.name for e in entries})
    missing = sorted({e.name for e in entries} - set(full))
    if extra or missing:
        raise ConfigError(f"the checkpoint's parameters do not match its model config: unexpected {extra[:4]}, "
                          f"missing {missing[:4]}")
    shapes = hf_shapes(entries)
    out = {n: torch.empty(s, dtype=full[entries[0].name].dtype) for n, s in shapes.items()}
    for e in entries:
        t = full[e.name]
        if tuple(t.shape) != tuple(e.shape):
            raise ConfigError(f"parameter {e.name} has shape {tuple(t.shape)} in the checkpoint, but its model config "
                              f"gives {tuple(e.shape)}")
        row = 0
        for p in e.pieces:
            part = t[row: row + p.length]
            (out[p.hf][:, p.start: p.start + p.length] if p.transposed
             else out[p.hf][p.start: p.start + p.length]).copy_(part.t() if p.transposed else part)
            row += p.length
    return {n: t.contiguous() for n, t in out.items()}


def read_rows(entry: Entry, read: Callable[[str, slice, Optional[slice]], torch.Tensor], rows: slice,
              cols: Optional[slice]) -> torch.Tensor:
    """Rows ``rows`` (and columns ``cols`` for 2-dim parameters) of megashard parameter ``entry``.

    ``read(hf_name, dim0, dim1)`` returns that block of a Hugging Face tensor (e.g. a safetensors slice), so only
    the requested rows and columns are read.
    """
    parts, row = [], 0
    for p in entry.pieces:
        lo, hi = max(rows.start, row), min(rows.stop, row + p.length)
        if lo < hi:
            r = slice(p.start + lo - row, p.start + hi - row)
            parts.append(read(p.hf, cols, r).t() if p.transposed else read(p.hf, r, cols))
        row += p.length
    if not parts:
        return torch.empty((0,) + tuple(entry.shape[1:]))
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------- config.json
def hf_config(cfg: ModelConfig, ffn: int, dtype: str = "float32") -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a megashard model section (``transformers`` 4.4x and 5.x read it)."""
    cls, model_type = HF_ARCH[cfg.arch]
    common = {"architectures": [cls], "model_type": model_type, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype, "use_cache": True,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.arch == "llama":
        return {**common, "hidden_size": cfg.hidden, "intermediate_size": ffn, "num_hidden_layers": cfg.layers,
                "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads, "head_dim": cfg.hidden // cfg.heads,
                "max_position_embeddings": cfg.seq_len, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
                "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "pretraining_tp": 1, "initializer_range": cfg.init_std}
    # megashard's GPT uses exact (erf) GELU: Hugging Face's "gelu" (GPT-2's own default is the tanh "gelu_new").
    return {**common, "n_embd": cfg.hidden, "n_inner": ffn, "n_layer": cfg.layers, "n_head": cfg.heads,
            "n_positions": cfg.seq_len, "activation_function": "gelu", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "initializer_range": cfg.init_std}


def _rope_theta(doc: dict) -> Any:
    params = doc.get("rope_parameters") or {}
    return params.get("rope_theta", doc.get("rope_theta", 10000.0))


#: The ``config.json`` keys megashard reads, by ``model_type``: (key, expected type, required). Every value is
#: type-checked before it is compared, so a string where a number belongs is named as such (not "64 != 64").
_INT, _NUM, _BOOL, _STR, _MAP = "an integer", "a number", "true or false", "a string", "a mapping"
_HF_KEYS = {
    "llama": [("hidden_size", _INT, True), ("num_hidden_layers", _INT, True), ("num_attention_heads", _INT, True),
              ("intermediate_size", _INT, True), ("vocab_size", _INT, True), ("max_position_embeddings", _INT, True),
              ("num_key_value_heads", _INT, False), ("head_dim", _INT, False), ("rms_norm_eps", _NUM, False),
              ("rope_theta", _NUM, False), ("tie_word_embeddings", _BOOL, False), ("attention_bias", _BOOL, False),
              ("mlp_bias", _BOOL, False), ("hidden_act", _STR, False), ("rope_scaling", _MAP, False),
              ("rope_parameters", _MAP, False)],
    "gpt2": [("n_embd", _INT, True), ("n_layer", _INT, True), ("n_head", _INT, True), ("vocab_size", _INT, True),
             ("n_positions", _INT, True), ("n_inner", _INT, False), ("layer_norm_epsilon", _NUM, False),
             ("tie_word_embeddings", _BOOL, False), ("activation_function", _STR, False),
             ("scale_attn_by_inverse_layer_idx", _BOOL, False)],
}


def _is(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {_BOOL: bool, _STR: str, _MAP: dict}[kind])


def _check_types(doc: dict, model_type: str, where: str) -> None:
    """ConfigError naming the file, the key and the expected type for a missing required key or a value of
    another type (null is allowed for the optional ones: Hugging Face's default)."""
    for key, kind, required in _HF_KEYS[model_type]:
        if key not in doc or doc[key] is None:
            if required:
                raise ConfigError(f"model.init_from: {where} has no {key} ({kind}), which every {model_type} "
                                  "config.json holds: the file is incomplete or not a Hugging Face config")
            continue
        v = doc[key]
        if not _is(v, kind):
            raise ConfigError(f"model.init_from: {where}: {key} must be {kind}, got {json_repr(v)} "
                              f"({type(v).__name__}); the file is damaged or hand-edited")
        if kind == _INT and v < 1 and key != "head_dim":
            raise ConfigError(f"model.init_from: {where}: {key}={v} must be a positive integer")
    for key in ("rope_scaling", "rope_parameters"):
        rope = doc.get(key)
        if isinstance(rope, dict) and "rope_type" in rope and not isinstance(rope["rope_type"], (str, type(None))):
            raise ConfigError(f"model.init_from: {where}: {key}.rope_type must be a string, got "
                              f"{json_repr(rope['rope_type'])}")
        if isinstance(rope, dict) and "rope_theta" in rope and not _is(rope["rope_theta"], _NUM):
            raise ConfigError(f"model.init_from: {where}: {key}.rope_theta must be a number, got "
                              f"{json_repr(rope['rope_theta'])}")


def json_repr(v: Any) -> str:
    """A value as the JSON file writes it (``"64"`` for a string, ``[1, 2]``), cut at 60 characters."""
    import json

    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_hf_config(doc: dict, cfg: ModelConfig, ffn: int, where: str) -> None:
    """Raise a one-line :class:`ConfigError` naming the first field of Hugging Face ``config.json`` ``doc`` that
    does not describe the model section ``cfg`` (``where``: the file, for the message): a document that is not a
    JSON object, a missing required key or a value of the wrong type first, then a value that differs."""
    if not isinstance(doc, dict):
        raise ConfigError(f"model.init_from: {where} must hold a JSON object (a Hugging Face config), got a "
                          f"{type(doc).__name__}: {json_repr(doc)}")
    _, model_type = HF_ARCH[cfg.arch]
    if not isinstance(doc.get("model_type"), (str, type(None))):
        raise ConfigError(f"model.init_from: {where}: model_type must be a string, got {json_repr(doc['model_type'])}")
    if doc.get("model_type") != model_type:
        other = [a for a, (_, t) in HF_ARCH.items() if t == doc.get("model_type")]
        fix = (f"set model.arch={other[0]}" if other
               else f"supported: {', '.join(t for _, t in HF_ARCH.values())}")
        raise ConfigError(f"model.init_from: {where} has model_type={doc.get('model_type')!r} but model.arch="
                          f"{cfg.arch!r} needs {model_type!r}; {fix}")
    _check_types(doc, model_type, where)
    want = hf_config(cfg, ffn)
    if cfg.arch == "llama":
        checks = [("hidden_size", "model.hidden", None), ("num_hidden_layers", "model.layers", None),
                  ("num_attention_heads", "model.heads", None), ("intermediate_size", "model.ffn_hidden", None),
                  ("vocab_size", "model.vocab_size", None), ("rms_norm_eps", "model.norm_eps", None),
                  ("tie_word_embeddings", "model.tie_embeddings", None)]
        got = {k: v for k, v in doc.items() if v is not None}  # null: Hugging Face's default (LlamaConfig's below)
        got.setdefault("rms_norm_eps", 1e-6)
        got.setdefault("tie_word_embeddings", False)
        got.setdefault("num_key_value_heads", doc.get("num_attention_heads"))
        got.setdefault("head_dim", (doc.get("hidden_size") or 0) // max(1, doc.get("num_attention_heads") or 1))
        got["rope_theta"] = _rope_theta(doc)
        got.setdefault("hidden_act", "silu")
        got.setdefault("attention_bias", False)
        got.setdefault("mlp_bias", False)
        checks += [("rope_theta", "model.rope_theta", None),
                   ("num_key_value_heads", "model.heads", "grouped-query attention is not supported"),
                   ("head_dim", None, "megashard's head size is model.hidden / model.heads"),
                   ("hidden_act", None, "megashard's SwiGLU uses silu"),
                   ("attention_bias", None, "megashard's Llama has no biases"),
                   ("mlp_bias", None, "megashard's Llama has no biases")]
        rope = (doc.get("rope_parameters") or doc.get("rope_scaling") or {}).get("rope_type", "default")
        if rope not in ("default", None):
            raise ConfigError(f"model.init_from: {where} has rope_type={rope!r}; megashard's rotary embedding is the "
                              "default (unscaled) one")
        pos_key = "max_position_embeddings"
    else:
        got = {k: v for k, v in doc.items() if v is not None}  # null: Hugging Face's default (GPT2Config's below)
        got["n_inner"] = doc.get("n_inner") or 4 * (doc.get("n_embd") or 0)
        got.setdefault("tie_word_embeddings", True)
        got.setdefault("activation_function", "gelu_new")
        got.setdefault("layer_norm_epsilon", 1e-5)
        checks = [("n_embd", "model.hidden", None), ("n_layer", "model.layers", None), ("n_head", "model.heads", None),
                  ("n_inner", "model.ffn_hidden", None), ("vocab_size", "model.vocab_size", None),
                  ("layer_norm_epsilon", "model.norm_eps", None), ("tie_word_embeddings", "model.tie_embeddings", None),
                  ("activation_function", None, "megashard's GPT uses the exact (erf) GELU, Hugging Face's 'gelu'"),
                  ("scale_attn_by_inverse_layer_idx", None, "megashard scales attention by 1/sqrt(head_dim) only")]
        got.setdefault("scale_attn_by_inverse_layer_idx", False)
        pos_key = "n_positions"
    for key, field, rule in checks:
        a, b = got.get(key), want[key]
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) and isinstance(a, (int, float)) else a == b
        if not same:
            fix = f"set {field}={_yaml(a)}" if field and rule is None and a is not None else rule or f"add {key}"
            raise ConfigError(f"model.init_from: {where} has {key}={_yaml(a)} but the model section gives {_yaml(b)}"
                              + (f" ({field})" if field and rule is None else "") + f": {fix}")
    positions = doc.get(pos_key)
    if not isinstance(positions, int) or positions < cfg.seq_len:
        raise ConfigError(f"model.init_from: {where} has {pos_key}={positions!r} but model.seq_len={cfg.seq_len} needs "
                          f"at least that many positions: set model.seq_len <= {positions}")


def _yaml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)
