"""Megatron-LM's ``tests/unit_tests/test_utilities.Utils`` for CPU: gloo instead of NCCL, no CUDA calls (the GPU count
read as the ranks of this run), and
``megashard.megatron.install()`` done first, so Megatron's own ``parallel_state`` tests run against megashard.

Only what tests/megatron_upstream/upstream_test_parallel_state.py uses: ``rank``, ``world_size``,
``initialize_distributed``, ``initialize_model_parallel``, ``destroy_model_parallel``, ``set_world_size``.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

import megashard.megatron

if os.environ.get("MEGASHARD_UPSTREAM_INSTALL", "1") == "1":  # "0": the baseline on Megatron's own parallel_state
    megashard.megatron.install()
import megatron.core.parallel_state as ps  # noqa: E402 - after install(), as a Megatron user would

if not torch.cuda.is_available():
    # Megatron's tests read the GPU count as "ranks on this machine" (test_hybrid_dp_cp_groups picks its world by
    # it): on CPU every rank of this run is on this machine, so the count is the world size (both runs, with and
    # without install(), see the same).
    torch.cuda.device_count = lambda: int(os.environ.get("WORLD_SIZE", "1"))  # noqa: E731


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed() -> None:
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            torch.distributed.init_process_group(
                "gloo", init_method=os.environ["MEGASHARD_UPSTREAM_INIT"], rank=Utils.rank,
                world_size=Utils.world_size, timeout=timedelta(seconds=60))
            torch.distributed.barrier()
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size=None, rank=None) -> None:
        Utils.world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        if torch.distributed.is_initialized() and Utils.world_size != torch.distributed.get_world_size():
            torch.distributed.destroy_process_group()
        if rank is None:
            Utils.rank = int(os.environ["LOCAL_RANK"])
            if Utils.rank >= Utils.world_size:
                Utils.rank = -1
        else:
            Utils.rank = rank

    @staticmethod
    def destroy_model_parallel() -> None:
        if not Utils.inited:
            return
        try:
            torch.distributed.barrier()
        except Exception:  # noqa: BLE001 - as Megatron's Utils
            Utils.inited = False
            return
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs) -> None:
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        kwargs.setdefault("distributed_timeout_minutes", 1)
        ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True
