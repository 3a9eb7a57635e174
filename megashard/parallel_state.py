"""Megatron-LM's ``parallel_state`` API over megashard's current :class:`~megashard.state.ParallelState`.

Existing model code can switch ``from megatron.core import parallel_state`` to
``from megashard import parallel_state``: the function names, arguments and group layouts are
Megatron-LM's (for the same sizes and ``order`` every group equals Megatron's ``RankGenerator``).
Every function forwards to the current state (:func:`megashard.state.get_parallel_state`): the groups and sizes
to its layout, the virtual-pipeline rank and the memory buffer to its per-layout state (``state.locals``; before
``initialize_model_parallel`` the process's detached one, as Megatron's globals work before initialisation);
`destroy_model_parallel` tears it down completely.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megashard import state as _state
from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    **unsupported,
) -> None:
    """Create the parallel groups as Megatron-LM does (torch.distributed must be initialised).

    As in Megatron, ``expert_tensor_parallel_size=None`` means "same as tensor_model_parallel_size", and
    ``num_distributed_optimizer_instances`` splits data parallelism into replicas (megashard's ``dp_outer``).
    """
    ignored = {k: v for k, v in unsupported.items() if v not in (None, False, True)}
    if ignored:
        raise ConfigError(f"initialize_model_parallel: unsupported argument(s) {sorted(ignored)}")
    if hierarchical_context_parallel_sizes:
        raise ConfigError("hierarchical_context_parallel_sizes is not supported by megashard; use cp only")
    if not dist.is_initialized():
        raise StateError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    backend = dist.get_backend()
    cfg = ParallelConfig.from_dict(
        dict(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            vpp=virtual_pipeline_model_parallel_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            expt_tp=tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size,
            dp_outer=num_distributed_optimizer_instances,
            order=order,
            timeout=float(distributed_timeout_minutes) * 60.0,
            backend=backend if backend in ("gloo", "nccl", "fake") else "auto",
        )
    )
    st = _state.initialize(cfg)
    st.locals.virtual_pipeline_rank = 0 if virtual_pipeline_model_parallel_size is not None else None


def model_parallel_is_initialized() -> bool:
    return _state.is_initialized()


def is_initialized() -> bool:
    return _state.is_initialized()


def destroy_model_parallel() -> None:
    """Destroy every group, mesh, RNG tracker and buffer megashard created; re-initialising works afterwards."""
    _state.destroy()


def _st():
    return _state.get_parallel_state()


def _group(name: str, check_initialized: bool = True):
    if not check_initialized and not _state.is_initialized():
        return None
    return _st().group(name)


# ---------------------------------------------------------------------- groups
def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp", check_initialized)


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel:
        if not with_context_parallel:
            raise ConfigError("partial_data_parallel=True requires with_context_parallel=True (as in Megatron-LM)")
        return "dp_shard_cp"
    return "dp_cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    return _st().group(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group on gloo (for CPU-side work); the same group when the job runs on gloo. On nccl its
    twin was created at initialisation (``create_gloo_process_groups``, on by default); StateError otherwise."""
    return _st().gloo_group(_dp_name(with_context_parallel, partial_data_parallel))


def get_inter_distributed_optimizer_instance_group():
    """Groups of the same shard across optimizer instances (megashard's dp_outer)."""
    return _st().group("dp_outer")


def get_intra_distributed_optimizer_instance_group():
    return _st().group("dp_shard_cp")


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp", check_initialized)


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _st().group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _group("expt_tp", check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, partial_expert_data_parallel: bool = False):
    return _group("expt_dp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    return _group("tp_ep_pp", check_initialized)


# ---------------------------------------------------------------------- sizes and ranks
def get_tensor_model_parallel_world_size() -> int:
    return _st().size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _st().rank_in("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return _st().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _st().rank_in("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _st().size(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _st().rank_in(_dp_name(with_context_parallel, partial_data_parallel))


def get_context_parallel_world_size() -> int:
    return _st().size("cp")


def get_context_parallel_rank() -> int:
    return _st().rank_in("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int]:
    return _st().ranks("cp")


def get_model_parallel_world_size() -> int:
    return _st().size("mp")


def get_model_parallel_rank() -> int:
    return _st().rank_in("mp")


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _st().size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _st().rank_in("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _st().size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _st().rank_in("tp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _st().size("ep")


def get_expert_model_parallel_rank() -> int:
    return _st().rank_in("ep")


def get_expert_tensor_parallel_world_size() -> int:
    return _st().size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _st().rank_in("expt_tp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    return _st().size("expt_dp")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    return _st().rank_in("expt_dp")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _st().size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _st().rank_in("tp_ep")


def get_expert_tensor_model_pipeline_parallel_world_size() -> int:
    return _st().size("tp_ep_pp")


def get_expert_tensor_model_pipeline_parallel_rank() -> int:
    return _st().rank_in("tp_ep_pp")


# ---------------------------------------------------------------------- src ranks and pipeline
def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tp-rank 0 in this rank's tensor-parallel group."""
    return _st().ranks("tp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _st().ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_model_parallel_src_rank() -> int:
    return _st().ranks("mp")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _st().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _st().ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _st().ranks("pp")
    return ranks[(_st().rank_in("pp") + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _st().ranks("pp")
    return ranks[(_st().rank_in("pp") - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _st().sizes.vpp


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _state.current_locals().virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    _state.current_locals().virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, on its first virtual stage)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        stage = get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage
        if stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, on its last virtual stage)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None:
        stage = get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage
        if stage != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_global_memory_buffer():
    """The current state's scratch-memory buffer (:class:`~megashard.state.memory.GlobalMemoryBuffer`)."""
    return _state.current_locals().memory_buffer
