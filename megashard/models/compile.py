"""``train.compile``: ``torch.compile`` of every transformer block, as torchtitan compiles its blocks.

What is compiled is each block's computation (:meth:`megashard.models.gpt.model.Block._body`: norms, attention, MLP or
MoE, residuals), one compiled function per block instance; everything *around* it stays eager, by design:

* FSDP2's hooks (the all-gather before a block's forward, the reduce-scatter after its backward) run in the
  block's ``__call__``, outside the compiled code, exactly as without compile;
* activation recompute (``model.recompute``) wraps the compiled body: the recompute in backward calls the same
  compiled code (one more variant, without autograd, for the first forward);
* pipeline stages compile the blocks they hold; the schedules drive them as they drive eager blocks (not
  ``zbv``: its split backward, inputs then weights, cannot run through a compiled block's single backward; the
  job config refuses the combination before launch);
* tensor/context/expert parallel collectives inside a block are traced where dynamo can, else a graph break
  runs them eagerly (correct either way).

Parameter names, checkpoints and the reshard-free layout are unchanged (no ``_orig_mod`` prefix). Compilation
happens at the first step (seconds to minutes; inductor on CPU needs a C compiler). ``train.compile_backend``
chooses the backend: ``inductor`` (generated kernels; the point of it) or ``aot_eager`` (tracing and AOT autograd
without code generation: the same graphs, fast to build; what CPU tests use).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from megashard.models.config import COMPILE_BACKENDS as BACKENDS

__all__ = ["BACKENDS", "compile_blocks", "compiled_blocks"]


def _blocks(model: nn.Module) -> Iterator[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return iter(())
    return iter(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile the body of every block of ``model`` (a :class:`~megashard.models.gpt.model.GPT` or one pipeline stage of
    it) in place; returns the number of blocks. Call before or after ``fully_shard`` (the hooks stay outside)."""
    n = 0
    for block in _blocks(model):
        # An instance attribute: Block.forward calls self._body (directly or through recompute's checkpoint).
        block._body = torch.compile(block._body, backend=backend)
        block._compiled = True
        n += 1
    return n


def compiled_blocks(model: nn.Module) -> int:
    """How many blocks of ``model`` (and of its pipeline parts) :func:`compile_blocks` compiled."""
    return sum(1 for m in model.modules() if getattr(m, "_compiled", False))
