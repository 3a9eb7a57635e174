"""Per-rank random-number streams: the current state's RNG tracker, and Megatron's seeding rule.

The tracker itself (named streams, forks that nest correctly, the device generator helpers) is
:mod:`megashard.state.rng_tracker`; its names are importable from here too. This module answers which tracker
the Megatron-style functions use and how a rank's streams are seeded.

The tracker that :func:`get_cuda_rng_tracker` returns (Megatron's "global" tracker) belongs to the current
:class:`~megashard.state.ParallelState` (``state.locals.rng_tracker``), so two states keep two trackers. Without a
current state — before ``initialize()``, e.g. a single-process test, or after ``destroy()`` — it is the process's
detached tracker (:func:`megashard.state.current.current_locals`), which ``initialize()`` hands over to the state
it creates: a tracker seeded before ``initialize()`` keeps its streams.
(This module was ``megashard.random``; renamed so it does not shadow the standard library's ``random``.)
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from megashard.errors import ConfigError, StateError
from megashard.state import current as _current
from megashard.state.rng_tracker import (  # noqa: F401  (Megatron's names, importable from here as from its utils)
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    _device_generator,
    _get_cuda_rng_state,
    _manual_seed_device,
    _set_cuda_rng_state,
    _te_tracker_class,
)

__all__ = [
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "seeds_for_ranks",
]

_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

# Megatron-LM's offsets: any positive constants work, these keep seeds identical to Megatron runs.
_MODEL_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024
_EXPERT_PARALLEL_RANK_STRIDE = 100


# --------------------------------------------------------------------------- the current state's tracker
def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the current state's RNG tracker (Megatron's global tracker) once.

    ``use_te_rng_tracker=True`` uses TransformerEngine's cudagraph-safe tracker (raises
    :class:`~megashard.errors.TransformerEngineMissingError` without TE); ``inference_rng_tracker=True``
    makes ``add``/``fork``/``set_states`` no-ops. A later call with different flags warns and keeps
    the existing tracker unless ``force_reset=True``, which replaces it (its streams are lost).
    """
    owner = _current.current_locals()
    flags = (bool(use_te_rng_tracker), bool(inference_rng_tracker), bool(use_cudagraphable_rng))
    if owner.rng_tracker is not None and not force_reset:
        if flags != owner.rng_tracker_flags:
            warnings.warn(
                f"RNG tracker already initialised with {_describe_flags(owner.rng_tracker_flags)}; the request for "
                f"{_describe_flags(flags)} is ignored. Pass force_reset=True to replace the tracker "
                "(its streams are lost, reseed afterwards).",
                stacklevel=2,
            )
        return
    # Built before the old tracker is dropped: a request this machine cannot serve (TE missing, CUDA graphs without
    # CUDA) raises and leaves the existing tracker and its streams as they were, also with force_reset=True.
    if use_te_rng_tracker:
        tracker = _te_tracker_class()(is_inference_rng_tracker=inference_rng_tracker)
    else:
        tracker = RNGStatesTracker(use_cudagraphable_rng=use_cudagraphable_rng, is_inference_rng_tracker=inference_rng_tracker)
    owner.rng_tracker, owner.rng_tracker_flags = tracker, flags


def _describe_flags(flags: Optional[tuple[bool, bool, bool]]) -> str:
    te, inf, cg = flags or (False, False, False)
    return f"(use_te_rng_tracker={te}, inference_rng_tracker={inf}, use_cudagraphable_rng={cg})"


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> Any:
    """Return the current state's RNG tracker (before ``initialize()``: the process's), creating it with these
    flags if needed.

    Called with no flags (the usual ``get_cuda_rng_tracker().fork()``) it returns the existing tracker
    whatever it was created with; explicit flags that differ from the existing tracker's warn.
    """
    owner = _current.current_locals()
    if owner.rng_tracker is None or use_te_rng_tracker or inference_rng_tracker or use_cudagraphable_rng:
        initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return owner.rng_tracker


get_rng_tracker = get_cuda_rng_tracker  # device-neutral name


# --------------------------------------------------------------------------- Megatron's seeding rule
def seeds_for_ranks(seed: int, tp_rank: int, ep_rank: int, expt_tp_rank: int) -> dict[str, int]:
    """The seeds of a rank's three streams, Megatron-LM's rule.

    ``data-parallel-rng`` = seed (also the default generator), ``model-parallel-rng`` =
    seed + 2718 + tp_rank, ``expert-parallel-rng`` = seed + 1024 + 100·ep_rank + expt_tp_rank.
    Raises :class:`ConfigError` when two of them coincide (e.g. ep_rank=17, tp_rank=6, expt_tp_rank=0).
    """
    for what, value in (("seed", seed), ("tp_rank", tp_rank), ("ep_rank", ep_rank), ("expt_tp_rank", expt_tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"model_parallel_manual_seed: {what} must be an int, got {value!r}")
        if what != "seed" and value < 0:
            raise ConfigError(f"model_parallel_manual_seed: {what} must be >= 0, got {value}")
    from megashard.config.parallel import TORCH_SEED_RANGE

    lo, hi = TORCH_SEED_RANGE
    top = seed + max(_MODEL_PARALLEL_SEED_OFFSET + tp_rank,
                     _EXPERT_PARALLEL_SEED_OFFSET + _EXPERT_PARALLEL_RANK_STRIDE * ep_rank + expt_tp_rank)
    if not lo <= seed or top > hi:
        raise ConfigError(f"model_parallel_manual_seed: seed {seed} gives stream seeds up to {top}, outside the range a "
                          f"torch generator takes, -2**63..2**64-1 ({lo}..{hi}); use a seed in 0..2**62")
    seeds = {
        _DATA_PARALLEL_RNG_TRACKER_NAME: seed,
        _MODEL_PARALLEL_RNG_TRACKER_NAME: seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank,
        _EXPERT_PARALLEL_RNG_TRACKER_NAME: seed
        + _EXPERT_PARALLEL_SEED_OFFSET
        + _EXPERT_PARALLEL_RANK_STRIDE * ep_rank
        + expt_tp_rank,
    }
    by_seed: dict[int, str] = {}
    for name, value in seeds.items():
        if value in by_seed:
            raise ConfigError(
                f"RNG seed collision on this rank: streams {by_seed[value]!r} and {name!r} would both get seed "
                f"{value} (seed={seed}, tp_rank={tp_rank}, ep_rank={ep_rank}, expt_tp_rank={expt_tp_rank}; "
                f"rule: data=seed, model=seed+2718+tp_rank, expert=seed+1024+100*ep_rank+expt_tp_rank), "
                "so they would draw identical numbers. The collision depends only on the ranks "
                "(100*ep_rank + expt_tp_rank == 1694 + tp_rank), not on `seed`: use ep < 17 or a different "
                "tp/expt_tp size, or seed the streams yourself with get_cuda_rng_tracker().add()."
            )
        by_seed[value] = name
    return seeds


def _ranks_from_state() -> tuple[int, int, int]:
    """(tp, ep, expt_tp) ranks of this process from the current megashard ParallelState.

    A single process without torch.distributed is rank 0 of every axis.
    """
    import torch.distributed as dist

    try:
        st = _current.get_parallel_state()
    except StateError as exc:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise StateError(
                "model_parallel_manual_seed needs this rank's tp/ep/expt_tp ranks: call "
                "megashard.state.initialize(ParallelConfig(...)) first, or pass tp_rank=, ep_rank= and "
                "expt_tp_rank= explicitly."
            ) from exc
        return 0, 0, 0
    return st.rank_in("tp"), st.rank_in("ep"), st.rank_in("expt_tp")


def model_parallel_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    expt_tp_rank: Optional[int] = None,
    force_reset_rng: bool = False,
    *,
    etp_rank: Optional[int] = None,
) -> dict[str, int]:
    """Seed this rank's streams the way Megatron-LM does, and return ``{stream name: seed}``.

    Also Megatron-LM's ``model_parallel_cuda_manual_seed`` (the same function): its ``etp_rank`` keyword is
    ``expt_tp_rank``; positional arguments are in Megatron's order.

    The device default generator gets ``seed`` (identical on every rank: data-parallel randomness);
    the tracker is reset and gets ``data-parallel-rng`` (seed), ``model-parallel-rng``
    (seed + 2718 + tp_rank: differs across tensor-parallel ranks) and ``expert-parallel-rng``
    (seed + 1024 + 100·ep_rank + expt_tp_rank). Ranks default to the current ParallelState's
    ``rank_in("tp"/"ep"/"expt_tp")``. The tracker flags act as in :func:`get_cuda_rng_tracker`: none
    given means "seed the existing tracker"; ``force_reset_rng=True`` replaces it. Only the device
    generator is seeded (CUDA current device, or the CPU generator without CUDA); seed Python/NumPy/CPU
    yourself, and add a per-pipeline-stage offset to ``seed`` if stages must differ (Megatron's
    training loop uses seed + 100·pp_rank).
    """
    if etp_rank is not None:
        if expt_tp_rank is not None and expt_tp_rank != etp_rank:
            raise ConfigError(f"expt_tp_rank={expt_tp_rank} and etp_rank={etp_rank} name the same rank; give one")
        expt_tp_rank = etp_rank
    if tp_rank is None or ep_rank is None or expt_tp_rank is None:
        st_tp, st_ep, st_etp = _ranks_from_state()
        tp_rank = st_tp if tp_rank is None else tp_rank
        ep_rank = st_ep if ep_rank is None else ep_rank
        expt_tp_rank = st_etp if expt_tp_rank is None else expt_tp_rank
    seeds = seeds_for_ranks(seed, tp_rank, ep_rank, expt_tp_rank)  # validates before touching any state
    if force_reset_rng:
        initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=True)
    tracker = get_cuda_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    tracker.reset()
    _manual_seed_device(seed)
    for name, value in seeds.items():
        tracker.add(name, value)
    return seeds


#: Megatron-LM's name (its ``etp_rank=`` keyword is accepted).
model_parallel_cuda_manual_seed = model_parallel_manual_seed
