"""The Llama-style parts of the example model (``model.arch: llama``): RMSNorm, rotary positions, SwiGLU.

:class:`megashard.models.gpt.model.GPT` builds either architecture from the same tensor-parallel layers; with
``arch: llama`` its blocks use :class:`RMSNorm` instead of LayerNorm, :class:`SwiGLU` instead of the GELU
MLP, no biases, and :class:`Rotary` position embeddings applied to queries and keys instead of learned
positions. The conventions are Hugging Face's ``LlamaForCausalLM`` ones (``rotate_half`` pairs dimension
``i`` with ``i + head_dim/2``; RMSNorm computed in float32), so weights map one to one.

With context parallelism each rank rotates its own chunk with the chunk's *global* positions
(``cp_rank · s/cp + arange(s/cp)``) before keys are gathered, so every layout computes the same values.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megashard.tensors.tp_attrs import set_tensor_model_parallel_attributes
from megashard.models.layers import ColumnParallelLinear, RowParallelLinear, init_spec, scaled_std

__all__ = ["RMSNorm", "Rotary", "SwiGLU", "llama_ffn_hidden"]


def llama_ffn_hidden(hidden: int) -> int:
    """Llama's default MLP size: 8/3 · hidden rounded up to a multiple of 64."""
    return -(-(8 * hidden) // (3 * 64)) * 64


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim (computed in float32, as Hugging Face does)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, False, -1, 1)
        init_spec(self.weight, "ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary:
    """Rotary position embedding tables for positions ``0 .. seq_len-1`` (not parameters, not saved).

    ``apply(x, start)`` rotates ``x [b, s, heads, head_dim]`` as positions ``start .. start+s-1``.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float, device: Any = None) -> None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)  # [seq, head_dim/2]
        angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim]: pairs (i, i + head_dim/2)
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        s = x.shape[1]
        cos = self.cos[start: start + s].to(x.dtype)[None, :, None, :]
        sin = self.sin[start: start + s].to(x.dtype)[None, :, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``: gate and up column-parallel (``hidden -> ffn``), down row-parallel."""

    def __init__(self, hidden: int, ffn: int, layers: int, init_std: float, group: Optional[dist.ProcessGroup],
                 dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate = ColumnParallelLinear(hidden, ffn, group, init_std=init_std, **kw)
        self.up = ColumnParallelLinear(hidden, ffn, group, init_std=init_std, **kw)
        self.down = RowParallelLinear(ffn, hidden, group, init_std=scaled_std(init_std, layers), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
