"""Which device and backend a job runs on, whether this machine has them, and the default process group.

:func:`current_device` is the one answer to "which device": the state's meshes, the memory buffer, the training
job's tensors and the config check's collectives all ask it. :func:`resolve_backend` turns ``backend: auto``
into nccl or gloo, :func:`check_devices` refuses a job this machine cannot run (one line, before any process
starts), :func:`init_distributed` starts the default process group from torchrun's environment and
:func:`end_distributed` ends it.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megashard.config import ParallelConfig
from megashard.errors import ConfigError, StateError

__all__ = ["LAUNCHER_ENV", "check_devices", "cuda_unavailable_reason", "current_device", "end_distributed",
           "init_distributed", "resolve_backend"]


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, in one line (``None`` when ``torch.cuda.is_available()``): a CPU-only torch
    build, or a CUDA build that finds no usable device (no driver, ``CUDA_VISIBLE_DEVICES`` empty, ...). The
    reason the device checks, the GPU tests and the GPU benchmarks give."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this machine has no usable CUDA device (torch {torch.__version__}, a CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (f"this machine has no usable CUDA device (torch {torch.__version__} built for CUDA {torch.version.cuda} "
            f"finds none: no NVIDIA driver or GPU{hint})")


#: How to get a CUDA build of torch (the errors of a CPU-only torch asked for CUDA say it; docs/gpu.md explains).
CUDA_BUILD_HINT = "in a megashard checkout: TORCH_CUDA=auto bash tools/setup.sh; see docs/gpu.md"


def current_device(device: str = "auto") -> torch.device:
    """The device this process computes on for a device setting (``parallel.device``): ``"cuda"`` → the current
    CUDA device (with its index), ``"cpu"`` → the CPU, ``"auto"`` → the current CUDA device when CUDA is
    available, else the CPU. ``current_device(...).type`` is the device type of the meshes (``"cuda"`` without a
    usable CUDA device gives ``torch.device("cuda")``: the type, for checks that then refuse it)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def resolve_backend(config: ParallelConfig) -> str:
    """``config.backend``, with ``auto`` resolved: nccl on a CUDA device, gloo otherwise."""
    if config.backend != "auto":
        return config.backend
    return "nccl" if current_device(config.device).type == "cuda" else "gloo"


def check_devices(config: ParallelConfig, processes_per_node: int | None = None, prefix: str = "") -> None:
    """ConfigError when this machine cannot run ``config``'s device and backend: ``device=cuda`` or
    ``backend=nccl`` without a usable CUDA device or NCCL, or fewer CUDA devices than ``processes_per_node``.
    ``prefix`` names the fields (``"parallel."`` for a job YAML)."""
    cpu_fix = f"use {prefix}device=cpu (or auto) and {prefix}backend=gloo (or auto) on this machine"
    no_cuda = cuda_unavailable_reason()
    if no_cuda and torch.version.cuda is None:  # a CPU-only torch: say how to get one that can use GPUs
        cpu_fix = f"for GPUs install a CUDA build of torch ({CUDA_BUILD_HINT}), or {cpu_fix}"
    if config.device == "cuda" and no_cuda:
        raise ConfigError(f"{prefix}device=cuda, but {no_cuda}; {cpu_fix}")
    backend = resolve_backend(config)
    if backend == "nccl":
        if no_cuda:
            raise ConfigError(f"{prefix}backend=nccl needs CUDA devices, but {no_cuda}; {cpu_fix}")
        if not dist.is_nccl_available():
            raise ConfigError(f"{prefix}backend=nccl, but this torch build has no NCCL; use {prefix}backend=gloo")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError(f"{prefix}backend=gloo, but this torch build has no gloo; use {prefix}backend=nccl on CUDA")
    if processes_per_node and current_device(config.device).type == "cuda" and torch.cuda.device_count() < processes_per_node:
        raise ConfigError(
            f"launch.nproc_per_node={processes_per_node} processes on this node need one CUDA device each, but "
            f"this machine has {torch.cuda.device_count()}; use launch.nproc_per_node={torch.cuda.device_count()}"
        )


#: What torch.distributed's env:// initialisation reads (torchrun and `megashard run` set all of them).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(config: ParallelConfig) -> None:
    """Initialise the default process group from torchrun's environment if it is not up yet."""
    if dist.is_initialized():
        return
    missing = [v for v in LAUNCHER_ENV if v not in os.environ]
    if missing:
        raise StateError(
            f"megashard.initialize() found no torch.distributed launcher: the environment variable(s) "
            f"{', '.join(missing)} are not set. Start the script with torchrun (e.g. torchrun --nproc-per-node=4 "
            "train.py) or megashard run, or call torch.distributed.init_process_group(...) before initialize()"
        )
    check_devices(config)
    backend = resolve_backend(config)
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.timeout))


def end_distributed() -> None:
    """The orderly end of this process's distributed work: every pooled communicator destroyed first, then the
    default group, and their objects freed now — so their backend threads are joined while Python is fully alive,
    never during interpreter shutdown (:mod:`megashard.state.pool`). Call it after the last collective, on every
    rank (it is local: no collective); safe when nothing is initialised."""
    import gc

    from megashard.state.pool import release_process_groups

    release_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # meshes and modules in reference cycles may still hold a group
