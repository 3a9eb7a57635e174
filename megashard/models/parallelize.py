"""FSDP2 over megashard's meshes, and the layout-independent view of the sharded model.

:func:`parallelize` shards the TP-local parameters of a :class:`~megashard.models.gpt.model.GPT` with
``fully_shard`` over ``state.fully_shard_mesh`` (``dp_shard_cp``; ``(dp_outer, dp_shard_cp)`` = HSDP),
block by block, and the experts of MoE blocks over ``expt_dp``. FSDP replaces every parameter by a
DTensor on the data-parallel mesh only, so the TP attributes (and megashard's ``_global_shape``,
``_expert_parallel``) are copied onto the new parameters.

:func:`global_dtensor` describes one rank's FSDP shard of a TP slice as a DTensor of the *global*
parameter on ``state.fsdp_mesh`` (placements from :func:`megashard.tensors.placements.resolve_placements`,
e.g. ``(R, R, _StridedShard(0, sf=tp), Shard(0))`` for a column-parallel weight), which is what
checkpoints store: they load into any other layout.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from megashard._compat import _StridedShard
from megashard.chunks import contiguous_strides
from megashard.tensors.placements import resolve_placements

if TYPE_CHECKING:
    from megashard.state import ParallelState

__all__ = ["parallelize", "finish_expert_grads", "expert_shard_axis", "expert_fully_shard_mesh", "global_dtensor", "param_layout", "local_tensor", "PARAM_ATTRS"]

#: Python attributes of a parameter that survive ``fully_shard`` (copied onto FSDP's new parameter).
PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "_tensor_parallel_mode",
               "_global_shape", "_init", "_expert_parallel", "allreduce", "_tied_copy", "_expert_tp_dim")


def _saved_attrs(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {n: {a: getattr(p, a) for a in PARAM_ATTRS if hasattr(p, a)} for n, p in model.named_parameters()}


def parallelize(model: nn.Module, state: ParallelState, *, mp_policy: Optional[Any] = None,
                reshard_after_forward: Optional[bool] = None) -> nn.Module:
    """Apply FSDP2 in place: experts over ``expt_dp``, each block and the root over ``state.fully_shard_mesh``.

    ``reshard_after_forward``: free each block's gathered parameters after its forward (``True``: all-gather again
    in backward) or keep them (``False``). ``None`` (the default) chooses as torchtitan does: every block but the
    last (whose backward comes right after the forward) reshards, and none does when the FSDP mesh has one rank
    (its "all-gather" is a copy of what it holds). Only memory and time change, never a value.

    Expert gradients are divided by ``dp · cp`` (not FSDP's default ``expt_dp``) because every expert
    receives the tokens of the whole ``ep`` group: the result is the average over all data-parallel
    ranks, as for the dense parameters.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megashard.models.moe import MoE

    attrs = _saved_attrs(model)
    mp = mp_policy or MixedPrecisionPolicy()
    mesh = state.fully_shard_mesh
    blocks = getattr(model, "blocks", [])
    blocks = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    for i, block in enumerate(blocks):
        def reshard(on: Any) -> bool:
            if reshard_after_forward is None:
                return on.size() > 1 and i < len(blocks) - 1
            return reshard_after_forward

        if isinstance(getattr(block, "mlp", None), MoE):
            emesh = expert_fully_shard_mesh(state)
            experts = fully_shard(block.mlp.experts, mesh=emesh, mp_policy=mp, reshard_after_forward=reshard(emesh))
            if state.size(expert_shard_axis(state)) > 1:
                # With expt_dp = 1 torch 2.13's FSDP divides by a custom factor twice (in its world-size-1 copy and
                # after it): then no factor here, and finish_expert_grads divides once after backward.
                experts.set_gradient_divide_factor(float(state.size("dp") * state.size("cp")))
            if dist.get_backend(state.group("expt_dp")) != "nccl":
                # A custom factor becomes NCCL's PREMUL_SUM, which gloo lacks: divide outside the collective.
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard(mesh))
    # The root's parameters (embeddings, final norm, head) are used right at the start of backward: keep them gathered
    # (FSDP2 does so by itself only when reshard_after_forward is left unset).
    fully_shard(model, mesh=mesh, mp_policy=mp,
                reshard_after_forward=False if reshard_after_forward is None else reshard_after_forward)
    for name, p in model.named_parameters():
        for a, v in attrs.get(name, {}).items():
            setattr(p, a, v)
    return model


def expert_shard_axis(state: ParallelState) -> str:
    """The axis expert parameters are FSDP-sharded over: ``expt_dp_shard`` (inside an HSDP replica; = ``expt_dp``
    without HSDP)."""
    return "expt_dp_shard"


def expert_fully_shard_mesh(state: ParallelState) -> Any:
    """The mesh of ``fully_shard`` for experts: ``state.expert_fully_shard_mesh`` (FSDP over ``expt_dp_shard``,
    HSDP across the ``expt_dp_outer`` replicas when dp_outer > 1)."""
    return state.expert_fully_shard_mesh


def finish_expert_grads(model: nn.Module, state: ParallelState) -> None:
    """Divide expert gradients by ``dp · cp / expt_dp`` when FSDP had no shard peers to reduce-scatter with (shard
    axis of size 1: :func:`parallelize` then sets no divide factor, and FSDP divides by the replicas it all-reduces
    over, if any). Call after backward, before clipping."""
    if state.size(expert_shard_axis(state)) > 1:
        return
    factor = state.size("dp") * state.size("cp") / state.size("expt_dp")
    if factor == 1:
        return
    for p in model.parameters():
        if getattr(p, "_expert_parallel", False) and p.grad is not None:
            p.grad.div_(factor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: ``t.to_local()`` for a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


_STAGE_MESHES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def forget_stage_meshes() -> None:
    """Drop the cached stage meshes: a world re-formed in the same process (live recovery) has meshes equal to an
    earlier world's (DeviceMesh compares by value) whose groups are gone."""
    _STAGE_MESHES.clear()


def _stage_mesh(mesh: Any) -> Any:
    """``mesh`` without its leading ``pp`` axis (cached): what one pipeline stage's parameters live on."""
    sub = _STAGE_MESHES.get(mesh)
    if sub is None:
        sub = _STAGE_MESHES[mesh] = mesh[tuple(mesh.mesh_dim_names[1:])]
    return sub


def param_layout(p: torch.Tensor, state: ParallelState) -> tuple[Any, tuple[Placement, ...], tuple[int, ...]]:
    """``(mesh, placements, global_shape)`` of parameter ``p`` (after :func:`parallelize`) as a global DTensor.

    Dense parameters live on ``state.fsdp_mesh`` (pp, dp_outer, dp_shard_cp, tp); experts on
    ``state.expert_hsdp_mesh`` (pp, expt_dp_outer, expt_dp_shard, ep, expt_tp): experts split dim 0 over ep, then
    FSDP chunks this rank's experts over expt_dp_shard (the expt_dp_outer replicas hold the same chunks), their ffn
    dim over expt_tp. With a pipeline (pp > 1) each stage holds other parameters, so they live on
    the mesh without its ``pp`` axis (the ranks of this stage).
    """
    shape = tuple(getattr(p, "_global_shape", tuple(p.shape)))
    if getattr(p, "_expert_parallel", False):
        ep = state.size("ep")
        fsdp = _StridedShard(0, split_factor=ep) if ep > 1 else Shard(0)
        etp_dim = getattr(p, "_expert_tp_dim", None)
        etp = Shard(etp_dim) if etp_dim is not None and state.size("expt_tp") > 1 else Replicate()
        rest: tuple[Placement, ...] = (fsdp, Shard(0) if ep > 1 else Replicate(), etp)
        # (pp, expt_dp_outer, expt_dp_shard, ep, expt_tp): the replicas hold the same shards
        mesh, placements = state.expert_hsdp_mesh, (Replicate(), Replicate()) + rest
    else:
        proxy = torch.empty(shape, device="meta")  # carries the TP attributes only (p itself is FSDP's DTensor)
        for a in ("tensor_model_parallel", "partition_dim", "partition_stride", "_tensor_parallel_mode"):
            if hasattr(p, a):
                setattr(proxy, a, getattr(p, a))
        mesh = state.fsdp_mesh
        placements = tuple(resolve_placements(proxy, mesh, global_shape=shape))
    if state.size("pp") > 1:
        return _stage_mesh(mesh), placements[1:], shape
    return mesh, placements, shape


def global_dtensor(local: torch.Tensor, p: torch.Tensor, state: ParallelState) -> DTensor:
    """Wrap ``local`` (this rank's FSDP shard of ``p``'s TP slice, or a tensor shaped like it) as the global DTensor."""
    mesh, placements, shape = param_layout(p, state)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_strides(shape))


def iter_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Named parameters (FSDP keeps the module paths as names)."""
    yield from model.named_parameters()
