"""The ``model`` section of the job's YAML: which example model to build, and its sizes.

It lives with the models (which are built from it) rather than with the job's other sections in
:mod:`megashard.train.sections`, which re-exports it, so that the models do not import the training job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ARCHS", "ModelConfig"]

ARCHS = ("gpt", "llama")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # train.compile_backend: torch.compile backends of the blocks


@dataclass
class ModelConfig:
    """The example transformer: ``gpt`` (learned positions, LayerNorm, GELU) or ``llama`` (rotary, RMSNorm, SwiGLU)."""

    arch: str = "gpt"
    """``gpt``: token + learned position embeddings, pre-LayerNorm blocks with biases, GELU MLP; ``llama``: rotary
    position embeddings, RMSNorm, SwiGLU MLP, no biases."""
    tie_embeddings: bool = False
    """Use the input embedding (vocabulary-parallel over tp) as the LM head's weight too (both archs)."""
    rope_theta: float = 10000.0
    """``llama``: base of the rotary position embedding frequencies."""
    norm_eps: float = 1.0e-5
    """Epsilon of the normalisation layers (LayerNorm for ``gpt``, RMSNorm for ``llama``)."""
    vocab_size: int = 256
    """Vocabulary size: ≥ the tokenizer's (``text`` data: 256; a prepared corpus: its metadata's ``vocab_size``, e.g.
    257 for the byte tokenizer). Must divide by ``parallel.tp``; pad it, as Megatron does (multiple of 128 · tp)."""
    seq_len: int = 64
    """Tokens per sequence (context length). Must divide by ``parallel.cp``."""
    hidden: int = 64
    """Hidden size (model width). Must divide by ``heads``."""
    layers: int = 2
    """Number of transformer blocks."""
    heads: int = 4
    """Attention heads. Must divide by ``parallel.tp`` (each TP rank owns whole heads)."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; ``null`` = 4 × hidden (``gpt``) or 8/3 × hidden rounded up to a multiple of 64 (``llama``).
    Must divide by ``parallel.tp``."""
    dropout: float = 0.0
    """Dropout probability (attention and residual), in [0, 1). Attention dropout draws from the model-parallel RNG fork."""
    init_std: float = 0.02
    """Std of the normal weight init; output projections use init_std / sqrt(2 · layers)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 = dense MLP everywhere. Must divide by ``parallel.ep``. Experts fold over the same
    ranks as attention (any tp, cp, dp) with their own ``parallel.ep`` and ``parallel.expt_tp`` (which must divide
    ``ffn_hidden``)."""
    moe_every: int = 2
    """With experts: every ``moe_every``-th block (1-based, the last one included) uses an MoE MLP."""
    moe_top_k: int = 1
    """With experts: experts per token (top-k routing, renormalised gate weights)."""
    moe_aux_loss_coeff: float = 0.0
    """With experts: weight of the router's load-balancing loss (Megatron's aux loss, per sequence:
    coeff · E · Σ_e f_e · P_e); it joins the gradient, the reported loss is the LM loss. ≥ 0; e.g. 1e-2."""
    recompute: bool = False
    """Activation recompute of every block through ``megashard.state.recompute.checkpoint`` (trades compute for memory)."""
    distribute_saved_activations: bool = False
    """With recompute: keep only 1/tp of each block's saved input between forward and backward."""
    init_from: Optional[str] = None
    """Start from a Hugging Face model directory (``config.json`` + ``*.safetensors``, e.g. ``save_pretrained`` or
    ``megashard ckpt export-hf``) instead of the seeded init: its config must describe this model section (checked
    before any process starts); each rank reads only its own slices. A resumed run loads its checkpoint instead.
    Needs ``pip install 'megashard[hf]'`` (docs/hf.md)."""


def default_ffn_hidden(model: ModelConfig) -> int:
    """MLP size when ``model.ffn_hidden`` is null: 4 · hidden (``gpt``), 8/3 · hidden rounded up to a multiple of 64
    (``llama``). Plain arithmetic: the launcher validates a job without importing torch."""
    if model.arch == "llama":
        return -(-(8 * model.hidden) // (3 * 64)) * 64
    return 4 * model.hidden
