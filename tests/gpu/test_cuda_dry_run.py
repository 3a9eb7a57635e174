"""``megashard run configs/gpu-5d.yaml --dry-run`` where CUDA is visible (it was in tests/test_train_config.py, where
tests/conftest.py hides CUDA from every test not marked gpu, so it could never pass). The config asks for 8 GPUs per
node on 4 nodes: on a machine with fewer, the dry run refuses before launch naming the count and the fix; laid out
as 32 nodes of one process each, the same 5-D job passes the preflight on one GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_5D = os.path.join(ROOT, "configs", "gpu-5d.yaml")
SUMMARY = "pp=2, dp_outer=2, dp_shard=2, ep=4, expt_dp=4, vpp=2"


def test_gpu_5d_dry_run_on_this_gpu_machine(capsys):
    from megashard import cli

    code = cli.main(["run", GPU_5D, "--dry-run", "launch.rdzv_endpoint=node0:29500"])
    err = capsys.readouterr().err
    n = torch.cuda.device_count()
    if n >= 8:
        assert code == 0 and SUMMARY in err, err
    else:
        assert code == 2, err
        assert (f"launch.nproc_per_node=8 processes on this node need one CUDA device each, but this machine has {n}; "
                f"use launch.nproc_per_node={n}") in err, err


def test_gpu_5d_dry_run_one_process_per_node(capsys):
    from megashard import cli

    code = cli.main(["run", GPU_5D, "--dry-run", "launch.rdzv_endpoint=node0:29500", "launch.nnodes=32",
                     "launch.nproc_per_node=1"])
    err = capsys.readouterr().err
    assert code == 0 and SUMMARY in err, err
