"""``train.compile``: every block's body compiled, the job's losses unchanged, in every kind of layout.

Each check trains a few steps of the default tiny GPT twice, eager and with ``train.compile=true``, and compares
the global losses and final parameters. Four gloo ranks, backend ``aot_eager`` (dynamo's graphs and AOT autograd,
no code generation: quick under load): tp=2·dp_shard=2, tp=2 with recompute and distributed saved activations,
cp=2·tp=2 (llama), pp=2·tp=2 with 1f1b and recompute, MoE at ep=2·tp=2. One process with the real ``inductor``
backend (a C compiler generates the kernels) on a one-block model, float32 within 1e-5. float64 compiled equals eager to 1e-12
relative (a wrong compile target, e.g. FSDP's hooks traced into the graph or a recompute that reruns another
function, breaks the run or the values). Checkpoint names stay those of the eager model (no ``_orig_mod``).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
BASE = ["train.steps=3", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
        "train.plot=false", "train.resume=false", "model.dropout=0.0", "optim.grad_clip=0.5", "train.dtype=float64",
        "train.compile_backend=aot_eager"]
LAYOUTS = {
    "tp2_dp2": ["parallel.tp=2", "parallel.dp_shard=2"],
    "tp2_recompute": ["parallel.tp=2", "parallel.dp_shard=2", "model.recompute=true",
                      "model.distribute_saved_activations=true"],
    "cp2_tp2_llama": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1", "model.arch=llama"],
    "pp2_tp2_recompute": ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "model.layers=4",
                          "train.microbatches=2", "model.recompute=true"],
    "inductor": ["parallel.tp=1", "parallel.dp_shard=1", "model.layers=1", "model.hidden=32", "model.heads=2",
                 "model.seq_len=16", "model.vocab_size=64", "train.global_batch=4"],
    "moe_ep2_tp2": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2", "model.num_experts=4",
                    "model.moe_every=2", "model.moe_top_k=2", "model.ffn_hidden=128"],
}


def _train(overrides: list[str], out: str) -> tuple[dict, dict]:
    import torch.distributed as dist

    from megashard.models.compile import compiled_blocks
    from megashard.train.config import JobConfig
    from megashard.train.loop import full_parameters, train

    world = dist.get_world_size()
    job = JobConfig.from_yaml(DEFAULT, BASE + [f"launch.nproc_per_node={world}", f"train.out_dir={out}"] + overrides)
    seen: dict = {}

    def on_end(model, state):
        seen["compiled"] = compiled_blocks(model)
        seen["params"] = full_parameters(model, state)

    result = train(job, on_end=on_end)
    return result.losses, seen


def _check(layout: str, extra: tuple = (), rtol: float = 1e-12) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    tmp = tempfile.mkdtemp(prefix="megashard-compile-") if dist.get_rank() == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    try:
        eager, e = _train(LAYOUTS[layout] + list(extra), os.path.join(box[0], "eager"))
        torch._dynamo.reset()  # compiled code of an earlier check (same code object) would be reused: count afresh
        graphs = counters["stats"]["unique_graphs"]
        compiled, c = _train(LAYOUTS[layout] + list(extra) + ["train.compile=true"], os.path.join(box[0], "compiled"))
    finally:
        dist.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    assert e["compiled"] == 0 and c["compiled"] >= 1, (e["compiled"], c["compiled"])
    assert counters["stats"]["unique_graphs"] > graphs, "train.compile=true traced no graph"
    assert list(eager) == list(compiled) == [1, 2, 3]
    for k in eager:
        assert abs(eager[k] - compiled[k]) <= rtol * abs(eager[k]), (k, eager[k], compiled[k])
    assert list(e["params"]) == list(c["params"])  # same names: checkpoints are interchangeable
    for name, v in e["params"].items():
        torch.testing.assert_close(c["params"][name], v, rtol=100 * rtol, atol=100 * rtol * 1e-2, msg=name)


def check_tp2_dp2(rank, world):
    _check("tp2_dp2")


def check_tp2_recompute(rank, world):
    _check("tp2_recompute")


def check_cp2_tp2_llama(rank, world):
    _check("cp2_tp2_llama")


def check_pp2_tp2_recompute(rank, world):
    _check("pp2_tp2_recompute")


def check_moe_ep2_tp2(rank, world):
    _check("moe_ep2_tp2")


def check_inductor(rank, world):
    _check("inductor", ("train.compile_backend=inductor", "train.dtype=float32"), rtol=1e-5)


CHECKS = [check_tp2_dp2, check_tp2_recompute, check_cp2_tp2_llama, check_pp2_tp2_recompute, check_moe_ep2_tp2]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=4, timeout=900, pg_timeout=300)


@pytest.mark.long
@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_compiled_job_equals_eager(dist4, name):
    dist4.assert_ok(name)


@pytest.fixture(scope="module")
def inductor1():
    return spawn_checks([check_inductor], world_size=1, timeout=900, pg_timeout=600)


@pytest.mark.long
def test_inductor_compiled_job_equals_eager(inductor1):
    """The real backend (generated C++ kernels) on one process: float32 losses within 1e-5 relative."""
    inductor1.assert_ok("check_inductor")


def test_compile_config_errors_before_launch():
    from megashard.errors import ConfigError
    from megashard.train.config import JobConfig

    zbv = ["launch.nproc_per_node=2", "parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=1",
           "model.layers=4", "train.microbatches=2", "train.pipeline_schedule=zbv"]
    JobConfig.from_yaml(DEFAULT, zbv).validate()  # fine without compile
    with pytest.raises(ConfigError, match=r"train\.compile=true cannot be combined with train\.pipeline_schedule=zbv.*"
                                          r"interleaved_1f1b"):
        JobConfig.from_yaml(DEFAULT, zbv + ["train.compile=true"]).validate()
    with pytest.raises(ConfigError, match=r"train\.compile_backend='cudagraphs' is not supported; valid: inductor, "
                                          r"aot_eager, eager"):
        JobConfig.from_yaml(DEFAULT, ["train.compile_backend=cudagraphs"]).validate()
