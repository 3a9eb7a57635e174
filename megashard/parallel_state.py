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

from typing import Any, Callable, Optional

import torch.distributed as dist

from megashard import state as _state
from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError
from megashard.layout import RankLayout
from megashard.parallel_ranks import (  # noqa: F401 - sizes, ranks and pipeline position (re-exported)
    _st, _dp_name, get_gtp_weight_remat_world_size, get_gtp_weight_remat_rank, get_tensor_model_parallel_world_size,
    get_tensor_model_parallel_rank, get_pipeline_model_parallel_world_size, get_pipeline_model_parallel_rank,
    get_data_parallel_world_size, get_data_parallel_rank, get_context_parallel_world_size, get_context_parallel_rank,
    get_context_parallel_global_ranks, get_model_parallel_world_size, get_model_parallel_rank,
    get_tensor_and_data_parallel_world_size, get_tensor_and_data_parallel_rank,
    get_tensor_and_context_parallel_world_size, get_tensor_and_context_parallel_rank,
    get_expert_model_parallel_world_size, get_expert_model_parallel_rank, get_expert_tensor_parallel_world_size,
    get_expert_tensor_parallel_rank, get_expert_data_parallel_world_size, get_expert_data_parallel_rank,
    get_expert_model_parallel_src_rank, get_all_ranks, get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_rank, get_expert_tensor_model_pipeline_parallel_world_size,
    get_expert_tensor_model_pipeline_parallel_rank, get_tensor_model_parallel_src_rank, get_data_parallel_src_rank,
    get_model_parallel_src_rank, get_pipeline_model_parallel_first_rank, get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank, get_pipeline_model_parallel_prev_rank,
    get_virtual_pipeline_model_parallel_world_size, get_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_rank, set_tensor_model_parallel_world_size, set_tensor_model_parallel_rank,
    set_pipeline_model_parallel_world_size, set_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size, set_data_parallel_rank, set_expert_model_parallel_world_size,
    set_expert_model_parallel_rank, set_expert_tensor_parallel_world_size, set_expert_tensor_parallel_rank,
    _expt_dp_name, is_pipeline_first_stage, is_pipeline_last_stage, get_global_memory_buffer,
)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[list[int]], list[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[list[int]], list[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[list[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
) -> None:
    """Create the parallel groups as Megatron-LM 0.19 does (torch.distributed must be initialised).

    Megatron-LM's keyword arguments, in its order, every one of them honoured (docs/parallel_state.md). As in
    Megatron, ``expert_tensor_parallel_size=None`` means "same as tensor_model_parallel_size", and
    ``num_distributed_optimizer_instances`` splits data parallelism into replicas (megashard's ``dp_outer``; the
    expert layout gets the same replica axis). ``hybrid_context_parallel``: the power-of-two slices of each dp·cp
    group too (:func:`get_hybrid_data_context_parallel_groups`); ``pipeline_model_parallel_comm_backend``: the pp
    groups on that backend; ``use_sharp``/``sharp_enabled_group``: NCCL SHARP on the dp·cp (or replica) groups;
    ``rank_offset``/``local_world_size``: the layout on global ranks ``rank_offset .. rank_offset +
    local_world_size - 1`` (Megatron's multi-module use) — a rank outside them creates nothing and stays
    uninitialised, as in Megatron. Bad values raise ConfigError before any group exists.
    """
    from megashard.state.comm_env import drop_collnet, sharp_group_of

    from megashard.config.argcheck import check_args

    # before anything else: use_sharp="no" must not reach the SHARP rules as "yes"
    check_args("initialize_model_parallel", dict(locals()), _ARG_TYPES)
    drop_collnet()  # as Megatron: no communicator but the chosen SHARP group may be made with CollNet on
    sharp = sharp_group_of(use_sharp, sharp_enabled_group, num_distributed_optimizer_instances)
    if not dist.is_initialized():
        raise StateError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    n = world if local_world_size is None else local_world_size
    if rank_offset >= world:  # no local_world_size could fit: say what can be changed
        raise ConfigError(f"initialize_model_parallel: rank_offset={rank_offset} is past the last rank of the "
                          f"{world}-rank default group; give rank_offset in 0..{world - 1} (and local_world_size at "
                          "most world size - rank_offset)")
    if rank_offset + n > world:
        raise ConfigError(f"initialize_model_parallel: rank_offset={rank_offset} with a layout of {n} ranks "
                          f"(local_world_size{'' if local_world_size is not None else ', default: the world size'}) "
                          f"means ranks {rank_offset}..{rank_offset + n - 1}, past the {world} ranks of the default "
                          f"group; give local_world_size <= {world - rank_offset}")
    for name, fn in (("get_embedding_ranks", get_embedding_ranks),
                     ("get_position_embedding_ranks", get_position_embedding_ranks)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"initialize_model_parallel: {name}={fn!r} must be a callable (pipeline ranks -> ranks)")
    backend = dist.get_backend()
    # Megatron injects gtp_remat right after tp (dense) and after ep (expert), which is where megashard places it.
    toks = order.split("-")
    if "gtp_remat" in toks and (gtp_remat_size > 1 or expert_gtp_remat_size > 1) and (
            toks.index("gtp_remat") == 0 or toks[toks.index("gtp_remat") - 1] != "tp"):
        raise ConfigError(f"initialize_model_parallel: order={order!r} places gtp_remat elsewhere than right after tp; "
                          "megashard places it there (Megatron's default): leave gtp_remat out of order")
    order = "-".join(t for t in toks if t != "gtp_remat")
    cfg = ParallelConfig.from_dict(
        dict(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            vpp=virtual_pipeline_model_parallel_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            expt_tp=tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size,
            dp_outer=num_distributed_optimizer_instances,
            gtp_remat=gtp_remat_size,
            expt_gtp_remat=expert_gtp_remat_size,
            order=order,
            timeout=float(distributed_timeout_minutes) * 60.0,
            backend=backend if backend in ("gloo", "nccl", "fake") else "auto",
            create_gloo_process_groups=create_gloo_process_groups,
            hierarchical_context_parallel_sizes=(list(hierarchical_context_parallel_sizes)
                                                 if hierarchical_context_parallel_sizes else None),
            nccl_communicator_config_path=nccl_communicator_config_path,
            high_priority_stream_groups=list(high_priority_stream_groups) if high_priority_stream_groups else None,
            hybrid_context_parallel=hybrid_context_parallel,
            pp_backend=pipeline_model_parallel_comm_backend,
            sharp_group=sharp,
        )
    )
    layout = RankLayout(cfg.resolve(n), embedding_ranks=_global_ranks_fn(get_embedding_ranks, rank_offset),
                        position_embedding_ranks=_global_ranks_fn(get_position_embedding_ranks, rank_offset))
    if not rank_offset and n == world:
        st = _state.initialize(cfg, layout=layout)
    else:  # a layout on part of the world; every rank calls this, as in Megatron (there each create_group is global)
        from datetime import timedelta

        from megashard.state.pool import balance_world_group_count, pooled_group_count

        before = pooled_group_count()
        st = None
        if rank_offset <= dist.get_rank() < rank_offset + n:  # Megatron: a rank outside it gets no group
            st = _state.initialize(cfg, layout=layout, rank_offset=rank_offset)
        # ranks inside and outside hold as many groups afterwards, so that later groups spanning both agree on names
        balance_world_group_count(pooled_group_count() - before, timedelta(minutes=distributed_timeout_minutes))
        if st is None:
            return
    st.locals.virtual_pipeline_rank = 0 if virtual_pipeline_model_parallel_size is not None else None


#: initialize_model_parallel's arguments by the Python value each takes (megashard.config.argcheck's kinds).
_ARG_TYPES = {
    **dict.fromkeys(("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "gtp_remat_size", "expert_gtp_remat_size",
                     "num_distributed_optimizer_instances"), "int>=1"),
    **dict.fromkeys(("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size", "local_world_size"),
                    "int>=1?"),
    "rank_offset": "int>=0", "distributed_timeout_minutes": "number>0",
    **dict.fromkeys(("use_sharp", "hybrid_context_parallel", "create_gloo_process_groups"), "bool"),
    **dict.fromkeys(("pipeline_model_parallel_comm_backend", "nccl_communicator_config_path", "sharp_enabled_group"),
                    "str?"),
    "order": "str", "hierarchical_context_parallel_sizes": "ints?", "high_priority_stream_groups": "strs?",
    "get_embedding_ranks": "callable?", "get_position_embedding_ranks": "callable?",
}


def _global_ranks_fn(fn: Optional[Callable[[list[int]], list[int]]], offset: int):
    """Megatron's ``get_embedding_ranks`` takes and returns global ranks; the layout's are offset-free."""
    if fn is None or not offset:
        return fn
    return lambda ranks: [r - offset for r in fn([r + offset for r in ranks])]


def model_parallel_is_initialized() -> bool:
    return _state.is_initialized()


def is_initialized() -> bool:
    return _state.is_initialized()


def destroy_model_parallel() -> None:
    """Destroy every group, mesh, RNG tracker and buffer megashard created, and Megatron's ``set_*`` overrides;
    re-initialising works afterwards. Unlike ``megashard.destroy()`` the communicators are destroyed too (as
    Megatron-LM's), except those another live ParallelState uses: no process group or socket is left behind."""
    from megashard.state.megatron_overrides import clear
    from megashard.state.pool import release_idle_groups

    if _state.is_initialized():
        getattr(_st(), "all_gather_groups", {}).clear()
    _state.destroy()
    clear()
    # Megatron's semantics: the groups go too (megashard.destroy() keeps them pooled for a fast re-initialisation);
    # groups a still-live ParallelState uses stay.
    if dist.is_initialized() and dist.get_backend() != "fake":
        release_idle_groups()




def _group(name: str, check_initialized: bool = True):
    if not check_initialized and not _state.is_initialized():
        return None
    return _st().group(name)


# ---------------------------------------------------------------------- groups
def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp", check_initialized)




def get_data_parallel_group(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                            partial_data_parallel: bool = False):
    """The data-parallel group (``with_context_parallel``: dp·cp; ``partial_data_parallel``: the intra
    distributed-optimizer-instance part of dp·cp). ``with_gtp_remat`` (default, as Megatron): the full
    data-distribution group (replicate dp · gtp_remat); False: the replicate group (the same when gtp_remat is 1)."""
    return _st().group(_dp_name(with_context_parallel, partial_data_parallel, with_gtp_remat))


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group on gloo (for CPU-side work); the same group when the job runs on gloo. On nccl its
    twin was created at initialisation (``create_gloo_process_groups``, on by default); StateError otherwise (and
    with gtp_remat > 1, where Megatron switches gloo groups off)."""
    _no_gloo_under_gtp(expert=False)
    return _st().gloo_group(_dp_name(with_context_parallel, partial_data_parallel))


def _no_gloo_under_gtp(expert: bool) -> None:
    s = _st().sizes
    if s.gtp_remat > 1 or (expert and s.expt_gtp_remat > 1):
        raise StateError(f"no gloo groups with gtp_remat={s.gtp_remat}, expt_gtp_remat={s.expt_gtp_remat}: Megatron-LM "
                         "switches them off under weight rematerialisation (its optimizer checkpoints through DCP)")


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The group of the same shard across distributed-optimizer instances (megashard's ``expt_dp_outer``, which
    equals the dense ``dp_outer`` groups). As in Megatron it exists only with several instances."""
    if _state.is_initialized() and _st().sizes.dp_outer > 1:
        return _st().group("inter_dist_opt")
    if check_initialized:
        raise StateError("the inter distributed-optimizer instance group exists only with "
                         "num_distributed_optimizer_instances > 1 (megashard's dp_outer > 1)")
    return None


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """Every rank of one distributed-optimizer instance: Megatron builds it from consecutive tp-ep-pp expert groups
    (``intra_partial_expert_data_parallel_size`` of them), so with one instance it is the whole world."""
    return _group("intra_dist_opt", check_initialized)


def get_embedding_group(check_initialized: bool = True):
    """The group of the first and last pipeline stage (or ``get_embedding_ranks``'s choice); StateError on other
    stages (None with ``check_initialized=False``), as Megatron's assertion."""
    return _edge_group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    """The group of the first pipeline stage (or ``get_position_embedding_ranks``'s choice)."""
    return _edge_group("pos_embd", check_initialized)


def _edge_group(name: str, check_initialized: bool):
    if not check_initialized and (not _state.is_initialized() or not _st().in_group(name)):
        return None
    return _st().group(name)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank holds the embedding; unless ``ignore_virtual``, only on the virtual stage that does (the
    first stage's first virtual stage, the last stage's last)."""
    if not _state.is_initialized():
        return False
    st = _st()
    if not st.in_group("embd"):
        return False
    if ignore_virtual:
        return True
    ranks, rank = st.ranks("embd"), st.global_rank
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds the position embedding."""
    return _state.is_initialized() and _st().in_group("pos_embd")


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False):
    """The FP8 amax reduction group: tp·dp (·cp with ``with_context_parallel``), or with ``tp_only_amax_red`` tp
    (·cp)."""
    if tp_only_amax_red:
        return _st().group("tp_cp" if with_context_parallel else "tp")
    return _st().group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_hierarchical_context_parallel_groups(check_initialized: bool = True):
    """The hierarchical cp groups of this rank, fastest level first (``hierarchical_context_parallel_sizes``)."""
    if _state.is_initialized() and _st().layout.hcp_names:
        return _st().hcp_groups()
    if check_initialized:
        raise StateError("no hierarchical context-parallel groups: initialise with hierarchical_context_parallel_sizes")
    return None


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: Optional[int] = None):
    """This rank's hybrid dp·cp group of ``group_size`` ranks (``hybrid_context_parallel=True``: its dp·cp group's
    slices of 2, 4, … consecutive ranks), or its whole dp·cp group when ``group_size`` equals that group's size
    (with or without hybrid cp, as Megatron). Another size raises a KeyError naming the sizes there are (Megatron's
    ``_HYBRID_DP_CP_GROUPS[group_size]``)."""
    from megashard.errors import RankGridKeyError

    if not check_initialized and not _state.is_initialized():
        return None
    st = _st()
    # Megatron compares with get_data_parallel_world_size(with_context_parallel=True) — which spans gtp_remat — and
    # returns the dp·cp group
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return st.group("dp_cp")
    groups = st.hybrid_dp_cp_groups()
    if group_size not in groups:
        have = ", ".join(str(k) for k in groups) or "none: initialise with hybrid_context_parallel=True for more"
        whole = get_data_parallel_world_size(with_context_parallel=True)
        raise RankGridKeyError(f"get_hybrid_data_context_parallel_groups(group_size={group_size!r}): no such hybrid "
                               f"dp·cp group; the whole dp·cp group has {whole} ranks, the hybrid sizes are: {have}")
    return groups[group_size]


def get_gtp_weight_remat_group(check_initialized: bool = True):
    """Megatron's generalized-TP weight-rematerialisation group (the gtp_remat axis, right after tp)."""
    return _group("gtp_remat", check_initialized)






def get_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int]:
    return _st().ranks("gtp_remat")


def get_expert_gtp_weight_remat_group(check_initialized: bool = True):
    """The expert counterpart of :func:`get_gtp_weight_remat_group` (the expt_gtp_remat axis, right after ep)."""
    return _group("expt_gtp_remat", check_initialized)


def get_expert_gtp_weight_remat_world_size() -> int:
    return _st().size("expt_gtp_remat") if _state.is_initialized() else 0


def get_expert_gtp_weight_remat_rank() -> int:
    return _st().rank_in("expt_gtp_remat") if _state.is_initialized() else 0


def get_expert_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int]:
    return _st().ranks("expt_gtp_remat")


def create_all_gather_groups(for_expert_parallelism: bool = False, timeout: Any = None, nccl_comm_cfgs: Any = None):
    """Megatron's all-gather twins for AG/RS overlap: ``(dp_cp_ag, expt_dp_ag)``, communicators with the ranks of
    dp·cp (and, with ``for_expert_parallelism`` and ep > 1, of expt_dp) but separate from them. Members only."""
    from datetime import timedelta

    from megashard.state.pool import pooled_group

    st = _st()
    t = timeout if timeout is not None else timedelta(seconds=st.config.timeout)

    def twin(name: str):
        return pooled_group(tuple(st.ranks(name)), t, None, f"megashard:{name}:ag", options_key=("all_gather",))[0]

    expt = twin("expt_dp") if for_expert_parallelism and st.size("ep") > 1 else None
    dp_cp_ag = twin("dp_cp")
    # kept on the state: its pg_collection() then carries them as dp_cp_ag / expt_dp_ag
    st.all_gather_groups = {"dp_cp_ag": dp_cp_ag, "expt_dp_ag": expt}
    return dp_cp_ag, expt


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp", check_initialized)


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False):
    if not check_initialized and not _state.is_initialized():
        return None
    return _st().group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _group("expt_tp", check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, with_gtp_remat: bool = True,
                                   partial_expert_data_parallel: bool = False):
    """The expert data-parallel group (``partial_expert_data_parallel``: its intra-instance part, expt_dp_shard;
    ``with_gtp_remat``: spanning expt_gtp_remat too, when that is > 1)."""
    if not check_initialized and not _state.is_initialized():
        return None
    return _st().group(_expt_dp_name(partial_expert_data_parallel, with_gtp_remat))


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    """The expert data-parallel group on gloo (see :func:`get_data_parallel_group_gloo`)."""
    _no_gloo_under_gtp(expert=True)
    return _st().gloo_group("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True, with_egtp_remat: bool = False):
    """The expert tp·ep·pp group (``with_egtp_remat``: tp·ep·expt_gtp_remat·pp, the same when expt_gtp_remat is 1)."""
    return _group("tp_ep_pp_with_egtp_remat" if with_egtp_remat else "tp_ep_pp", check_initialized)
