"""Megatron-LM's ``parallel_state`` sizes, ranks, source ranks and pipeline position, over the current state.

Part of the :mod:`megashard.parallel_state` facade (which re-exports every name here): each function forwards to
:func:`megashard.state.get_parallel_state` — sizes and ranks to its layout, the virtual-pipeline rank and the
memory buffer to its per-layout state (``state.locals``).
"""
from __future__ import annotations

from typing import Optional

from megashard import state as _state
from megashard.errors import ConfigError
from megashard.state.megatron_overrides import OVERRIDES as _ov
from megashard.state.megatron_overrides import set_override as _set_override


def _st():
    return _state.get_parallel_state()


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool, with_gtp_remat: bool = False) -> str:
    """The group name of Megatron's data-parallel getters. ``with_gtp_remat`` (Megatron's default): the full
    data-distribution group (replicate dp · gtp_remat), which is the replicate group itself when gtp_remat is 1."""
    full = with_gtp_remat and _state.is_initialized() and _st().sizes.gtp_remat > 1
    if partial_data_parallel:
        if not with_context_parallel:
            raise ConfigError("partial_data_parallel=True requires with_context_parallel=True (as in Megatron-LM)")
        return "dp_cp_gtp_remat" if full else "intra_dp_cp"  # gtp_remat > 1 means one optimizer instance
    if full:
        return "dp_cp_gtp_remat" if with_context_parallel else "dp_gtp_remat"
    return "dp_cp" if with_context_parallel else "dp"


def _expt_dp_name(partial_expert_data_parallel: bool, with_gtp_remat: bool = False) -> str:
    if with_gtp_remat and _state.is_initialized() and _st().sizes.expt_gtp_remat > 1:
        return "expt_dp_gtp_remat"
    return "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"


def get_gtp_weight_remat_world_size() -> int:
    return _st().size("gtp_remat") if _state.is_initialized() else 0


def get_gtp_weight_remat_rank() -> int:
    return _st().rank_in("gtp_remat") if _state.is_initialized() else 0


# ---------------------------------------------------------------------- sizes and ranks
def get_tensor_model_parallel_world_size() -> int:
    if (o := _ov.get("tp_size")) is not None:
        return o
    return _st().size("tp")


def get_tensor_model_parallel_rank() -> int:
    if (o := _ov.get("tp_rank")) is not None:
        return o
    return _st().rank_in("tp")


def get_pipeline_model_parallel_world_size() -> int:
    if (o := _ov.get("pp_size")) is not None:
        return o
    return _st().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    if (o := _ov.get("pp_rank")) is not None:
        return o
    return _st().rank_in("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                                 partial_data_parallel: bool = False) -> int:
    if (o := _ov.get("dp_size")) is not None:
        return o
    return _st().size(_dp_name(with_context_parallel, partial_data_parallel, with_gtp_remat))


def get_data_parallel_rank(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                           partial_data_parallel: bool = False) -> int:
    if (o := _ov.get("dp_rank")) is not None:
        return o
    return _st().rank_in(_dp_name(with_context_parallel, partial_data_parallel, with_gtp_remat))


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
    if (o := _ov.get("ep_size")) is not None:
        return o
    return _st().size("ep")


def get_expert_model_parallel_rank() -> int:
    if (o := _ov.get("ep_rank")) is not None:
        return o
    return _st().rank_in("ep")


def get_expert_tensor_parallel_world_size() -> int:
    if (o := _ov.get("expt_tp_size")) is not None:
        return o
    if not _state.is_initialized():  # Megatron: the tp override (None without one), e.g. off a rank_offset layout
        return _ov.get("tp_size")
    return _st().size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    if (o := _ov.get("expt_tp_rank")) is not None:
        return o
    if not _state.is_initialized():  # as the world size above
        return _ov.get("tp_rank")
    return _st().rank_in("expt_tp")


def get_expert_data_parallel_world_size(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    return _st().size(_expt_dp_name(partial_expert_data_parallel, with_gtp_remat))


def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    return _st().rank_in(_expt_dp_name(partial_expert_data_parallel, with_gtp_remat))


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of ep-rank 0 in this rank's expert-parallel group."""
    return _st().ranks("ep")[0]


def get_all_ranks() -> str:
    """This rank's tp, gtp_remat, dp, cp, pp and ep ranks joined by ``_`` (Megatron's ``get_all_ranks``)."""
    return "_".join(str(r) for r in (get_tensor_model_parallel_rank(), get_gtp_weight_remat_rank(),
                                     get_data_parallel_rank(), get_context_parallel_rank(),
                                     get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank()))


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
    if "vpp_size" in _ov:
        return _ov["vpp_size"]
    return _st().sizes.vpp if _state.is_initialized() else None  # Megatron: None before initialisation


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


# ---------------------------------------------------------------------- Megatron's overrides (its unit tests use them)
# Each getter above returns the value set here until it is set to None or destroy_model_parallel() clears them.
def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("tp_size", world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("tp_rank", rank)


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("pp_rank", rank)


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("vpp_size", world_size)


def set_data_parallel_rank(rank: Optional[int]) -> None:
    _set_override("dp_rank", rank)


def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("ep_size", world_size)


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("ep_rank", rank)


def set_expert_tensor_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("expt_tp_size", world_size)


def set_expert_tensor_parallel_rank(rank: Optional[int]) -> None:
    _set_override("expt_tp_rank", rank)
