"""The job's model and optimizer for the current layout (:func:`build`), and its parameters and gradients as full
global tensors (:func:`full_parameters`, :func:`full_gradients`; for tests and exports).

    model, optimizer = build(job, state)   # under an initialised parallel state
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megashard.state.devices import current_device

if TYPE_CHECKING:
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["build", "full_parameters", "full_gradients"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def build(job: JobConfig, state: ParallelState) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The parallelized model (initialised from the seed) and its AdamW, for the current layout.

    With ``pp > 1`` the model is a :class:`~megashard.train.pipeline.PipelineModel` of this rank's stages
    (:func:`megashard.models.stages.stage_specs`), each sharded with FSDP2 on its own.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from megashard.models.gpt.model import GPT, ModelGroups, init_parameters
    from megashard.models.parallelize import parallelize

    dtype = _DTYPES[job.train.dtype]
    param_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # bf16: fp32 master weights, bf16 compute
    groups = ModelGroups.from_state(state)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else None
    device = current_device(state.device_type)

    def make(stage: Any = None) -> torch.nn.Module:
        m = GPT(job.model, groups, ffn_hidden=job.ffn_hidden, moe_layers=job.moe_layers(), dtype=param_dtype,
                device=device, stage=stage)
        init_parameters(m, job.parallel.seed, groups)
        if job.train.compile:  # each block's body; FSDP's hooks stay outside (megashard.models.compile)
            from megashard.models.compile import compile_blocks

            compile_blocks(m, job.train.compile_backend)
        return m

    pp = state.size("pp")
    if pp > 1:
        from megashard.train.pipeline import PipelineModel
        from megashard.models.stages import stage_specs

        specs = stage_specs(job.model.layers, state.rank_in("pp"), pp, state.sizes.vpp or 1, job.train.pipeline_schedule)
        parts = [make(spec) for spec in specs]
        for part in parts:
            parallelize(part, state, mp_policy=mp, reshard_after_forward=job.train.reshard_between_microbatches)
        model: torch.nn.Module = PipelineModel(parts)
    else:
        model = parallelize(make(), state, mp_policy=mp)
    if job.model.init_from is not None:  # Hugging Face weights instead of the seeded init (each rank its slices)
        from megashard.train.hf_io import load_init_from

        load_init_from(model, job, state)
    from megashard.train.optim import build_optimizer

    optimizer = build_optimizer(model, job.optim)
    return model, optimizer


def full_parameters(model: torch.nn.Module, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter as the full global tensor (on every rank; collective). For tests and exports."""
    from megashard.models.parallelize import global_dtensor, local_tensor
    from megashard.tensors.uneven.gather import full_tensor

    # Stages hold different parameters; the pp axis of each global DTensor is Replicate, so full_tensor()
    # communicates within the stage only. The stages' dicts are then shared over pp.
    out = {n: full_tensor(global_dtensor(local_tensor(p.detach()), p, state)) for n, p in model.named_parameters()}
    return _merge_over_pp(out, state)


def full_gradients(model: torch.nn.Module, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the full global tensor (on every rank; collective). For tests."""
    from megashard.models.parallelize import global_dtensor, local_tensor
    from megashard.tensors.uneven.gather import full_tensor

    out = {n: full_tensor(global_dtensor(local_tensor(p.grad.detach()), p, state))
           for n, p in model.named_parameters() if p.grad is not None}
    return _merge_over_pp(out, state)


def _merge_over_pp(out: dict[str, torch.Tensor], state: ParallelState) -> dict[str, torch.Tensor]:
    if state.size("pp") == 1:
        return out
    parts: list[Any] = [None] * state.size("pp")
    dist.all_gather_object(parts, {k: v.cpu() for k, v in out.items()}, group=state.group("pp"))
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged
