"""Communicator options that are not NCCL ``Options``: the backend of the pipeline groups, NCCL SHARP, and the
environment Megatron-LM sets for them.

- ``pp_backend`` (Megatron's ``pipeline_model_parallel_comm_backend``): the pp groups, and only they, on another
  backend. :func:`check_pp_backend` refuses a name this torch build lacks, listing those it has; for ``ucc``,
  :func:`ucc_environment` sets the variables Megatron-LM 0.19 sets (and refuses ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
  which would serialise every UCC transfer).
- SHARP (Megatron's ``use_sharp`` / ``sharp_enabled_group``): NCCL applies in-network reductions to the first
  communicator initialised while ``NCCL_COLLNET_ENABLE=1``; :func:`collnet_enabled` sets it around the creation
  (and first use) of that one group and removes it afterwards, as Megatron does. NCCL only.
"""
from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any, Iterator

import torch.distributed as dist

from megashard.errors import ConfigError

__all__ = ["COLLNET", "SHARP_NOTE", "available_backends", "check_pp_backend", "check_sharp_backend", "collnet_enabled",
           "drop_collnet", "prepare_comm_options", "sharp_group", "sharp_group_of", "ucc_environment"]

logger = logging.getLogger(__name__)

#: NCCL's switch for CollNet (SHARP): honoured by the first communicator initialised while it is "1".
COLLNET = "NCCL_COLLNET_ENABLE"
#: What Megatron-LM logs (rank 0) when SHARP goes on the data-parallel groups.
SHARP_NOTE = ("The number of process groups to use SHARP with depends on the type of the network switch. Nvidia QM1 "
              "switch supports SAHRP up to 8 process groups and QM2 supports up to 256 process groups. We apply SHARP "
              "to the communications of the data-parallel domain. If the number of data-parallel process groups is "
              "larger than the max process groups that the network switch supports, the communication will fall "
              "back to non-SHARP operators. To enable SHARP, `#SBATCH_NETWORK=sharp` should be set in the sbatch "
              "script.")
#: Megatron-LM 0.19's UCC settings: (variable, value, keep a value the user set?).
UCC_ENV = (("TORCH_UCC_BLOCKING_WAIT", "none", True), ("UCC_EC_CUDA_STREAM_TASK_MODE", "driver", True),
           ("UCX_TLS", "ib,cuda_copy", True), ("NSYS_UCP_COMM_PARAMS", "1", False), ("UCX_RNDV_THRESH", "0", False),
           ("UCX_NET_DEVICES", "all", False), ("UCC_CL_BASIC_TLS", "^sharp,nccl", False))


def available_backends() -> list[str]:
    """The torch.distributed backends this torch build can create groups on: the built-in ones it was compiled with
    (``is_<name>_available()``) and every registered third-party one."""
    out = []
    for name in dist.Backend.backend_list:
        if name == "undefined":
            continue
        probe = getattr(dist, f"is_{name}_available", None)
        if probe is None or probe():
            out.append(name)
    return out


def check_pp_backend(name: str | None) -> None:
    """ConfigError unless ``name`` (a ``pp_backend``) is None or a backend this torch has (nccl also needs CUDA)."""
    if name is None:
        return
    have = available_backends()
    if name not in have:
        raise ConfigError(f"pp_backend={name!r} (Megatron's pipeline_model_parallel_comm_backend) is not a backend this "
                          f"torch build has; available: {', '.join(have)} (or null: the job's backend)")
    if name == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("pp_backend='nccl' needs CUDA devices, and none is visible here; use "
                              f"{', '.join(b for b in have if b != 'nccl')} or null (the job's backend)")


def check_sharp_backend(sharp_group: str | None, backend: str) -> None:
    """ConfigError when SHARP is asked for on a job whose backend is not nccl (``fake``, a simulation, passes)."""
    if sharp_group is None or "nccl" in backend or backend == "fake":
        return
    raise ConfigError(f"sharp_group={sharp_group!r} (Megatron's use_sharp) needs the nccl backend: SHARP is NCCL's "
                      f"in-network reduction (NCCL_COLLNET_ENABLE), and this job's backend is {backend!r}; run on "
                      "nccl or leave SHARP off (use_sharp=False / sharp_group: null)")


def drop_collnet() -> None:
    """Remove ``NCCL_COLLNET_ENABLE`` from the environment (Megatron does so at the start of its initialisation, so that
    no communicator but the chosen one gets SHARP)."""
    os.environ.pop(COLLNET, None)


@contextlib.contextmanager
def collnet_enabled() -> Iterator[None]:
    """``NCCL_COLLNET_ENABLE=1`` inside, removed afterwards (also on error)."""
    os.environ[COLLNET] = "1"
    try:
        yield
    finally:
        drop_collnet()


def ucc_environment() -> None:
    """Megatron-LM 0.19's environment for pipeline groups on UCC (before they are created)."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ConfigError("pp_backend='ucc' needs CUDA_DEVICE_MAX_CONNECTIONS > 1 (it is 1, which serialises every UCC "
                          "transfer; Megatron: \"UCC-backend requires CUDA_DEVICE_MAX_CONNECTIONS > 1\"); unset it or "
                          "raise it")
    for var, value, keep in UCC_ENV:
        if keep and var in os.environ:
            continue
        os.environ[var] = value


def sharp_group(ranks: tuple[int, ...], timeout: timedelta, desc: str, nccl_opts: Any = None,
                note: bool = False) -> tuple[dist.ProcessGroup, bool]:
    """Megatron's SHARP set-up for one group (its members only): ``NCCL_COLLNET_ENABLE`` removed, then set while the
    group is made — a communicator of its own in the pool, never one made earlier without SHARP — and, on nccl, used
    once (NCCL creates communicators lazily), then removed, so that no other communicator gets SHARP. ``note``: log
    Megatron's note on switch limits (rank 0, SHARP on the dp groups). Returns ``(group, created_now)``."""
    from megashard.config.nccl import nccl_options, options_key
    from megashard.state.pool import pooled_group

    drop_collnet()
    if note:
        logger.info(SHARP_NOTE)
    with collnet_enabled():
        pg, new = pooled_group(ranks, timeout, None, desc, pg_options=nccl_options(nccl_opts) if nccl_opts else None,
                               options_key=(options_key(nccl_opts), "sharp"))
        if "nccl" in str(dist.get_backend()):
            import torch

            dist.barrier(group=pg, device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
    return pg, new


def prepare_comm_options(pp_backend: str | None, sharp: str | None) -> str | None:
    """Before a state creates its groups: refuse SHARP off nccl and a ``pp_backend`` this torch lacks, set UCC's
    environment for ``ucc``; returns the backend the pp groups get (None: the job's — also when ``pp_backend`` names
    the job's own backend, or in a ``fake`` simulation, where every group is ``fake``)."""
    backend = str(dist.get_backend())
    check_sharp_backend(sharp, backend)
    if backend == "fake" or pp_backend in (None, backend):
        return None
    check_pp_backend(pp_backend)
    if pp_backend == "ucc":
        ucc_environment()
    return pp_backend


def sharp_group_of(use_sharp: bool, sharp_enabled_group: str | None, instances: int) -> str | None:
    """megashard's ``sharp_group`` for Megatron's ``use_sharp`` / ``sharp_enabled_group`` with Megatron's rules and
    default (``dp`` unless named; a group only with ``use_sharp``; ``dp_replica`` only with several
    distributed-optimizer instances)."""
    from megashard.config.parallel import SHARP_GROUPS

    if not use_sharp:
        if sharp_enabled_group is not None:
            raise ConfigError(f"initialize_model_parallel: sharp_enabled_group={sharp_enabled_group!r} is only valid "
                              "when use_sharp is True (Megatron's rule); pass use_sharp=True or leave it None")
        return None
    if sharp_enabled_group is None:
        return "dp"
    if sharp_enabled_group not in SHARP_GROUPS:
        raise ConfigError(f"initialize_model_parallel: sharp_enabled_group={sharp_enabled_group!r} is invalid "
                          f"(Megatron: \"Invalid sharp_enabled_group\"); valid: {', '.join(SHARP_GROUPS)}")
    if sharp_enabled_group == "dp_replica" and instances <= 1:
        raise ConfigError("initialize_model_parallel: sharp_enabled_group='dp_replica' requires "
                          f"num_distributed_optimizer_instances > 1 (it is {instances}); use 'dp'")
    return sharp_enabled_group
