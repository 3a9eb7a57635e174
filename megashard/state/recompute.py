"""Activation recompute (Megatron-LM's ``CheckpointFunction``) that replays random streams exactly.

``checkpoint(fn, distribute_saved_activations, *args)`` runs ``fn`` without keeping its activations
and runs it again in backward. Before the rerun it restores the CPU generator, the device generator
and every stream of the RNG tracker to what they were at the forward, so dropout (also inside
``get_cuda_rng_tracker().fork()``) draws the same mask twice and gradients are bitwise those of the
plain run. Afterwards the generators are put back where backward found them.

With ``distribute_saved_activations=True`` only ``1/tp`` of the first argument is kept between
forward and backward: each tensor-parallel rank keeps its slice and backward all-gathers it back
(the first argument must therefore be replicated across the tensor-parallel group).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megashard._compat import autograd_checkpoint_valid
from megashard.chunks import chunk_bounds, chunk_size
from megashard.errors import StateError
from megashard.state.rng import _get_cuda_rng_state, _set_cuda_rng_state, get_cuda_rng_tracker

__all__ = ["CheckpointFunction", "checkpoint", "checkpoint_nonreentrant"]


def _tp_group() -> Any:
    try:
        from megashard.state.current import get_parallel_state

        return get_parallel_state().group("tp")
    except (ImportError, StateError) as exc:
        raise StateError(
            "checkpoint(..., distribute_saved_activations=True) splits the saved input over the "
            "tensor-parallel group: call megashard.state.initialize(ParallelConfig(...)) first, or pass "
            "group=<process group>."
        ) from exc


def _split_1d(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's equal slice of ``tensor`` flattened, zero-padded to a multiple of the group size.

    A new buffer, so the full tensor's storage is not kept alive by the slice.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.detach().reshape(-1)
    chunk = chunk_size(flat.numel(), size)
    start, stop = chunk_bounds(flat.numel(), size, rank)
    out = torch.zeros(chunk, dtype=tensor.dtype, device=tensor.device)
    out[: stop - start].copy_(flat[start:stop])
    return out


def _gather_1d(chunk: torch.Tensor, numel: int, group: Any) -> torch.Tensor:
    """Inverse of :func:`_split_1d`: all-gather the slices and drop the padding (gloo-safe: equal sizes)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(chunk) for _ in range(size)]
    dist.all_gather(parts, chunk.contiguous(), group=group)
    return torch.cat(parts)[:numel]


def _autocast_snapshot() -> list[tuple[str, bool, torch.dtype]]:
    """Autocast on/off and dtype per device type, so the recompute runs in the forward's precision."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


def _rng_snapshot() -> tuple[torch.Tensor, Any, dict, Optional[tuple[str, ...]]]:
    tracker = get_cuda_rng_tracker()
    # The fork stack matters too: a layer run inside fork("a") that forks "a" again continues the
    # live stream; the replay must see the same stack (TE's tracker has none: None).
    active = tracker.active_forks() if hasattr(tracker, "active_forks") else None
    return torch.get_rng_state(), _get_cuda_rng_state(), tracker.get_states(), active


def _rng_restore(snapshot: tuple[torch.Tensor, Any, dict, Optional[tuple[str, ...]]]) -> None:
    cpu, device, states, active = snapshot
    tracker = get_cuda_rng_tracker()
    torch.set_rng_state(cpu)
    _set_cuda_rng_state(device)  # without CUDA this is the CPU generator again: same state, harmless
    tracker.set_states(states)
    if active is not None and hasattr(tracker, "set_active_forks"):
        tracker.set_active_forks(active)


class CheckpointFunction(torch.autograd.Function):
    """Autograd function behind :func:`checkpoint`; see there."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable, distribute_saved_activations: bool, group: Any, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.rng = _rng_snapshot()
        ctx.autocast = _autocast_snapshot()
        with torch.no_grad():
            outputs = run_function(*args)

        # Non-tensors are kept as they are; tensors go through save_for_backward (version checks).
        ctx.tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        tensors = [args[i] for i in ctx.tensor_idx]
        ctx.distributed = None
        if distribute_saved_activations and tensors and torch.is_tensor(args[0]):
            group = _tp_group() if group is None else group
            if dist.get_world_size(group) > 1:
                # Save a slice instead of args[0] itself; args[0] is not modified (Megatron swaps its
                # .data for the slice, which breaks callers still holding it).
                first = args[0]
                ctx.distributed = (group, first.shape, first.numel())
                tensors[0] = _split_1d(first, group)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple:
        if not autograd_checkpoint_valid():
            raise RuntimeError(
                "megashard.state.recompute.checkpoint does not work with torch.autograd.grad(); use .backward()."
            )
        saved = list(ctx.saved_tensors)
        if ctx.distributed is not None:
            group, shape, numel = ctx.distributed
            saved[0] = _gather_1d(saved[0], numel, group).view(shape)
        inputs = list(ctx.others)
        for slot, i in enumerate(ctx.tensor_idx):
            inputs[i] = saved[slot].detach().requires_grad_(ctx.input_requires_grad[i])

        bwd_rng = _rng_snapshot()
        _rng_restore(ctx.rng)
        try:
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.enable_grad())
                outputs = ctx.run_function(*inputs)
        finally:
            _rng_restore(bwd_rng)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grad_outputs)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(x.grad if torch.is_tensor(x) and ctx.input_requires_grad[i] else None for i, x in enumerate(inputs))
        return (None, None, None) + grads


def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any, group: Optional[Any] = None) -> Any:
    """Run ``function(*args)`` without storing its activations; recompute them in backward.

    ``distribute_saved_activations=True`` keeps only this rank's ``1/tp`` slice of ``args[0]`` until
    backward (the saved input is split over ``group``, default: the current ParallelState's ``"tp"``
    group, and all-gathered back; the tensor need not divide evenly). As in Megatron, ``args[0]``
    must hold the same values on every rank of ``group`` (true for activations between
    tensor-parallel layers without sequence parallelism); this is not checked (it would cost a
    collective). RNG streams are replayed, so
    the recomputed activations and the gradients equal those of ``function(*args)`` bit for bit.
    Only the positional tensors in ``args`` receive gradients; parameters used inside ``function``
    get theirs accumulated in ``.grad`` as usual. Use ``.backward()``, not ``torch.autograd.grad``.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, group, *args)


@contextlib.contextmanager
def _replaying(snapshot: tuple[torch.Tensor, Any, dict, Optional[tuple[str, ...]]]) -> Any:
    """Run the recompute from the forward's RNG state, then put the generators back where they were."""
    now = _rng_snapshot()
    _rng_restore(snapshot)
    try:
        yield
    finally:
        _rng_restore(now)


def checkpoint_nonreentrant(function: Callable, *args: Any) -> Any:
    """:func:`checkpoint` for callers that differentiate with ``torch.autograd.grad`` (pipeline schedules).

    PyTorch's non-reentrant ``torch.utils.checkpoint`` with the same RNG replay (CPU and device generators and
    every tracker stream restored for the recompute); no ``distribute_saved_activations``.
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    snapshot = _rng_snapshot()
    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False,
                            context_fn=lambda: (contextlib.nullcontext(), _replaying(snapshot)))
