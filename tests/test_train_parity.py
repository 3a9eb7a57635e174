"""The training job gives the same losses in every layout, and a checkpoint resumes into another layout.

Two spawns share all the runs: one process (the reference) and four gloo processes (tp=2·dp=2,
dp_shard=4, dp_outer=2·dp_shard=2, cp=2, ep=2). Each run trains 10 steps of the default tiny GPT with
the same seed and global batch (dropout 0) and writes its per-step global losses (and, where needed,
its final full parameters) to a shared temporary directory; the pytest tests compare them:

* float64: every step within 1e-10 relative of the single process; float32: within 1e-4;
* reshard: the tp=2·dp=2 run's step-5 checkpoint resumed at dp_shard=4 matches steps 6-10 and the final
  parameters of the run that stayed at tp=2·dp=2;
* recompute (megashard.state.recompute.checkpoint) changes nothing; with dropout > 0 it replays the masks;
* ``model.arch: llama`` with tied embeddings on a prepared (memory-mapped, byte-tokenized) corpus of the
  repository's docs, with a validation split: tp=2·dp=2 equals one process at every step (training and
  validation losses, float64, 1e-10), and its step-5 checkpoint resumed at dp_shard=4 continues identically.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

from tests._dist import spawn_checks
from tests._helpers import copy_checkpoint_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
ENV = "MEGASHARD_TRAIN_TEST_DIR"
STEPS = 10
# grad_clip 0.5 is below the gradient norm of every step (0.7-0.9): clipping acts, so a wrong norm changes the loss.
BASE = [f"train.steps={STEPS}", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
        "train.plot=false", "train.resume=false", "model.dropout=0.0", "optim.grad_clip=0.5"]
SINGLE = ["parallel.tp=1", "parallel.dp_shard=1", "launch.nproc_per_node=1"]
LAYOUTS = {
    "tp2_dp2": ["parallel.tp=2", "parallel.dp_shard=2"],
    "dp4": ["parallel.tp=1", "parallel.dp_shard=4"],
    "hsdp": ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2"],
}
MOE = ["model.num_experts=4", "model.moe_every=2", "model.moe_top_k=2", "model.ffn_hidden=128"]
CORPUS = "MEGASHARD_TRAIN_TEST_CORPUS"
# Llama-style, tied embeddings, on the prepared corpus: 257 byte-tokenizer ids padded to 258 (divisible by tp=2).
LLAMA = ["model.arch=llama", "model.tie_embeddings=true", "model.vocab_size=258", "data.source=indexed",
         "data.valid_fraction=0.05", "train.eval_interval=5", "train.eval_batches=2", "train.dtype=float64"]


def _llama() -> list[str]:
    return LLAMA + [f"data.path={os.environ[CORPUS]}"]


def _dir() -> str:
    return os.environ[ENV]


def _run(tag: str, overrides: list[str], *, save_params: bool = False, on_rank0=None) -> None:
    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.loop import full_parameters, train

    world = dist.get_world_size()
    job = JobConfig.from_yaml(DEFAULT, BASE + [f"launch.nproc_per_node={world}", f"train.out_dir={_dir()}/{tag}"] + overrides)
    params: dict = {}

    def on_end(model, state):
        if save_params:
            params.update(full_parameters(model, state))

    import time

    t0 = time.perf_counter()
    result = train(job, on_end=on_end)
    if dist.get_rank() == 0:
        with open(os.path.join(_dir(), f"{tag}.json"), "w") as f:
            json.dump({"start": result.start_step, "losses": result.losses, "norms": result.grad_norms,
                       "valid": result.valid_losses,
                       "seconds": result.seconds,
                       "total": time.perf_counter() - t0}, f)
        if save_params:
            torch.save(params, os.path.join(_dir(), f"{tag}.pt"))
    dist.barrier()


# ---------------------------------------------------------------------------------------------- single process
def check_single_f64(rank, world_size):
    _run("single-f64", SINGLE + ["train.dtype=float64"])


def check_single_f32(rank, world_size):
    _run("single-f32", SINGLE + ["train.dtype=float32"])


def check_single_moe_f64(rank, world_size):
    _run("single-moe-f64", SINGLE + MOE + ["train.dtype=float64"])


def check_single_llama_f64(rank, world_size):
    _run("single-llama", SINGLE + _llama())


# ---------------------------------------------------------------------------------------------- four processes
def check_tp2_dp2_f64(rank, world_size):
    # Also the reference of the reshard test: checkpoints every 5 steps, final parameters saved.
    _run("tp2_dp2-f64", LAYOUTS["tp2_dp2"] + ["train.dtype=float64", "checkpoint.interval=5", "checkpoint.keep=0"],
         save_params=True)


def check_dp4_f64(rank, world_size):
    _run("dp4-f64", LAYOUTS["dp4"] + ["train.dtype=float64"])


def check_hsdp_f64(rank, world_size):
    _run("hsdp-f64", LAYOUTS["hsdp"] + ["train.dtype=float64"])


def check_tp2_dp2_f32(rank, world_size):
    _run("tp2_dp2-f32", LAYOUTS["tp2_dp2"] + ["train.dtype=float32"])


def check_dp4_f32(rank, world_size):
    _run("dp4-f32", LAYOUTS["dp4"] + ["train.dtype=float32"])


def check_hsdp_f32(rank, world_size):
    _run("hsdp-f32", LAYOUTS["hsdp"] + ["train.dtype=float32"])


def check_cp2_f64(rank, world_size):
    _run("cp2-f64", ["parallel.tp=1", "parallel.cp=2", "parallel.dp_shard=2", "train.dtype=float64"])


def check_tp2_cp2_f64(rank, world_size):
    _run("tp2_cp2-f64", ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1", "train.dtype=float64"])


def check_moe_ep2_f64(rank, world_size):
    _run("moe_ep2-f64", ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "train.dtype=float64",
                         "checkpoint.interval=5", "checkpoint.keep=0"] + MOE)


def check_moe_ep2_f32(rank, world_size):
    _run("moe_ep2-f32", ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "train.dtype=float32"] + MOE)


def check_moe_reshard_ep1(rank, world_size):
    # The ep=2 run's step-5 checkpoint (experts split over ep, then FSDP over expt_dp=2) resumed at ep=1 (expt_dp=4).
    dst = copy_checkpoint_step(_dir(), "moe_ep2-f64", "moe-reshard-ckpt")
    _run("moe-reshard-ep1-f64", ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=1", "train.dtype=float64",
                                 "train.resume=true", f"checkpoint.dir={dst}"] + MOE)


def check_reshard_resume_dp4(rank, world_size):
    dst = copy_checkpoint_step(_dir(), "tp2_dp2-f64", "reshard-ckpt")
    _run("reshard-dp4-f64", LAYOUTS["dp4"] + ["train.dtype=float64", "train.resume=true", f"checkpoint.dir={dst}"],
         save_params=True)


def check_llama_tp2_dp2_f64(rank, world_size):
    _run("llama-tp2_dp2", LAYOUTS["tp2_dp2"] + _llama() + ["checkpoint.interval=5", "checkpoint.keep=0"])


def check_llama_tp2_cp2_f64(rank, world_size):
    # Rotary positions of each cp chunk are its global positions.
    _run("llama-tp2_cp2", ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1"] + _llama())


def check_llama_reshard_dp4(rank, world_size):
    dst = copy_checkpoint_step(_dir(), "llama-tp2_dp2", "llama-reshard-ckpt")
    _run("llama-reshard-dp4", LAYOUTS["dp4"] + _llama() + ["train.resume=true", f"checkpoint.dir={dst}"])


def check_recompute_tp2_dp2_f64(rank, world_size):
    _run("recompute-f64", LAYOUTS["tp2_dp2"] + ["train.dtype=float64", "model.recompute=true",
                                                "model.distribute_saved_activations=true"])


def check_dropout_plain(rank, world_size):
    _run("dropout-plain", LAYOUTS["tp2_dp2"] + ["train.dtype=float64", "model.dropout=0.1", "train.steps=3"])


def check_dropout_recompute(rank, world_size):
    _run("dropout-recompute", LAYOUTS["tp2_dp2"] + ["train.dtype=float64", "model.dropout=0.1", "train.steps=3",
                                                    "model.recompute=true"])


FOUR = [check_tp2_dp2_f64, check_dp4_f64, check_hsdp_f64, check_tp2_dp2_f32, check_dp4_f32, check_hsdp_f32,
        check_cp2_f64, check_tp2_cp2_f64, check_moe_ep2_f64, check_moe_ep2_f32, check_moe_reshard_ep1, check_reshard_resume_dp4, check_recompute_tp2_dp2_f64,
        check_dropout_plain, check_dropout_recompute, check_llama_tp2_dp2_f64, check_llama_reshard_dp4,
        check_llama_tp2_cp2_f64]
ONE = [check_single_f64, check_single_f32, check_single_moe_f64, check_single_llama_f64]


@pytest.fixture(scope="module")
def runs():
    from megashard.data.prepare import prepare

    tmp = tempfile.mkdtemp(prefix="megashard-train-")
    old = os.environ.get(ENV)
    os.environ[ENV] = tmp  # inherited by the spawned processes
    os.environ[CORPUS] = os.path.join(tmp, "docs-corpus")
    prepare([os.path.join(ROOT, "docs", "*.md")], os.environ[CORPUS], "byte", progress=False)
    try:
        one = spawn_checks(ONE, world_size=1, timeout=300)
        four = spawn_checks(FOUR, world_size=4, timeout=600)
        yield tmp, one, four
    finally:
        os.environ.pop(CORPUS, None)
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
        if os.environ.get("MEGASHARD_KEEP_TEST_DIR"):
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _losses(tmp: str, tag: str, key: str = "losses") -> dict[int, float]:
    with open(os.path.join(tmp, f"{tag}.json")) as f:
        return {int(k): v for k, v in json.load(f)[key].items()}


def _assert_close(got: dict[int, float], want: dict[int, float], rel: float, steps) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert abs(got[s] - want[s]) <= rel * abs(want[s]), f"step {s}: {got[s]!r} vs {want[s]!r} (rel {rel})"


def _ok(results, *names):
    for n in names:
        results.assert_ok(n)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_parity_float64(runs, layout):
    tmp, one, four = runs
    _ok(one, "check_single_f64")
    _ok(four, f"check_{layout}_f64")
    ref = _losses(tmp, "single-f64")
    _assert_close(_losses(tmp, f"{layout}-f64"), ref, 1e-10, range(1, STEPS + 1))
    assert ref[STEPS] < ref[1] - 0.1, "the model must learn something in 10 steps"
    # The gradient norm (reduced over tp / dp_shard_cp, replicas counted once) is the same in every layout,
    # and large enough that clipping at 0.5 acted at every step.
    norms = _losses(tmp, "single-f64", "norms")
    _assert_close(_losses(tmp, f"{layout}-f64", "norms"), norms, 1e-10, range(1, STEPS + 1))
    assert min(norms.values()) > 0.5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_parity_float32(runs, layout):
    tmp, one, four = runs
    _ok(one, "check_single_f32")
    _ok(four, f"check_{layout}_f32")
    got, ref = _losses(tmp, f"{layout}-f32"), _losses(tmp, "single-f32")
    _assert_close(got, ref, 1e-4, range(1, STEPS + 1))
    # float32 really ran in float32: it differs from float64 somewhere, but not by much.
    ref64 = _losses(tmp, "single-f64")
    assert any(got[s] != ref64[s] for s in got)
    _assert_close(got, ref64, 1e-4, range(1, STEPS + 1))


@pytest.mark.parametrize("tag", ["cp2", "tp2_cp2"])
def test_context_parallel_parity(runs, tag):
    tmp, one, four = runs
    _ok(one, "check_single_f64")
    _ok(four, f"check_{tag}_f64")
    _assert_close(_losses(tmp, f"{tag}-f64"), _losses(tmp, "single-f64"), 1e-10, range(1, STEPS + 1))
    _assert_close(_losses(tmp, f"{tag}-f64", "norms"), _losses(tmp, "single-f64", "norms"), 1e-10, range(1, STEPS + 1))


def test_expert_parallel_parity(runs):
    tmp, one, four = runs
    _ok(one, "check_single_moe_f64")
    _ok(four, "check_moe_ep2_f64")
    ref = _losses(tmp, "single-moe-f64")
    _assert_close(_losses(tmp, "moe_ep2-f64"), ref, 1e-10, range(1, STEPS + 1))
    _assert_close(_losses(tmp, "moe_ep2-f64", "norms"), _losses(tmp, "single-moe-f64", "norms"), 1e-10, range(1, STEPS + 1))
    assert ref[1] != _losses(tmp, "single-f64")[1], "the MoE model must differ from the dense one"
    _ok(four, "check_moe_ep2_f32")  # float32: FSDP's expert gradient division takes another path on gloo
    _assert_close(_losses(tmp, "moe_ep2-f32"), ref, 1e-4, range(1, STEPS + 1))


def test_reshard_resume_experts_ep2_to_ep1(runs):
    tmp, _, four = runs
    _ok(four, "check_moe_ep2_f64", "check_moe_reshard_ep1")
    _assert_close(_losses(tmp, "moe-reshard-ep1-f64"), _losses(tmp, "moe_ep2-f64"), 1e-10, range(6, STEPS + 1))


def test_reshard_resume_tp2_dp2_to_dp4(runs):
    tmp, _, four = runs
    _ok(four, "check_tp2_dp2_f64", "check_reshard_resume_dp4")
    with open(os.path.join(tmp, "reshard-dp4-f64.json")) as f:
        assert json.load(f)["start"] == 5
    ref = _losses(tmp, "tp2_dp2-f64")
    _assert_close(_losses(tmp, "reshard-dp4-f64"), ref, 1e-10, range(6, STEPS + 1))
    want = torch.load(os.path.join(tmp, "tp2_dp2-f64.pt"))
    got = torch.load(os.path.join(tmp, "reshard-dp4-f64.pt"))
    assert sorted(got) == sorted(want) and len(want) > 10
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_recompute_changes_nothing(runs):
    tmp, _, four = runs
    _ok(four, "check_tp2_dp2_f64", "check_recompute_tp2_dp2_f64")
    _assert_close(_losses(tmp, "recompute-f64"), _losses(tmp, "tp2_dp2-f64"), 1e-12, range(1, STEPS + 1))


def test_dropout_replayed_by_recompute(runs):
    tmp, _, four = runs
    _ok(four, "check_dropout_plain", "check_dropout_recompute")
    plain, rec = _losses(tmp, "dropout-plain"), _losses(tmp, "dropout-recompute")
    assert plain == rec  # bit for bit: recompute replays the model-parallel RNG fork
    nodrop = _losses(tmp, "tp2_dp2-f64")
    assert plain[1] != nodrop[1], "dropout 0.1 must change the loss"


def test_llama_parity_on_a_prepared_corpus(runs):
    tmp, one, four = runs
    _ok(one, "check_single_llama_f64")
    _ok(four, "check_llama_tp2_dp2_f64")
    ref = _losses(tmp, "single-llama")
    _assert_close(_losses(tmp, "llama-tp2_dp2"), ref, 1e-10, range(1, STEPS + 1))
    _assert_close(_losses(tmp, "llama-tp2_dp2", "norms"), _losses(tmp, "single-llama", "norms"), 1e-10, range(1, STEPS + 1))
    valid = _losses(tmp, "single-llama", "valid")
    _assert_close(_losses(tmp, "llama-tp2_dp2", "valid"), valid, 1e-10, [5, 10])
    assert ref[STEPS] < ref[1] - 0.5 and valid[10] < valid[5], "the model must learn the text"
    _ok(four, "check_llama_tp2_cp2_f64")
    _assert_close(_losses(tmp, "llama-tp2_cp2"), ref, 1e-10, range(1, STEPS + 1))
    _assert_close(_losses(tmp, "llama-tp2_cp2", "valid"), valid, 1e-10, [5, 10])


def test_llama_reshard_resume_tp2_dp2_to_dp4(runs):
    tmp, _, four = runs
    _ok(four, "check_llama_tp2_dp2_f64", "check_llama_reshard_dp4")
    with open(os.path.join(tmp, "llama-reshard-dp4.json")) as f:
        assert json.load(f)["start"] == 5
    _assert_close(_losses(tmp, "llama-reshard-dp4"), _losses(tmp, "llama-tp2_dp2"), 1e-10, range(6, STEPS + 1))
    _assert_close(_losses(tmp, "llama-reshard-dp4", "valid"), _losses(tmp, "llama-tp2_dp2", "valid"), 1e-10, [10])
