"""Pipeline parallelism of the training job (torch.distributed.pipelining over megashard's pp group).

Three spawns share every run (a 4-block tiny GPT, 6 steps, same seed and global batch, dropout 0, clipping
at 0.5 so that a wrong gradient norm changes the loss): one process (the references), two gloo processes
(pp=2 with 1f1b, gpipe, interleaved_1f1b at vpp=2, zbv, tied embeddings; a stage that never answers) and
four (pp=2·tp=2, pp=2·dp_shard=2, llama pp=2·tp=2 with tied embeddings, pp=4 with tied embeddings over the embd
group, the gradients of every parameter after
one step, and the checkpoint reshard matrix: saved at tp=2·pp=2, loaded at pp=1, pp=4, tp=4), then one process
again (the tp=2·pp=2 checkpoint loaded by a single process). Checks:

* float64 losses within 1e-10 relative of the single process at every step (float32: 1e-4); gpipe, 1f1b,
  interleaved and zbv give identical losses;
* every gradient after one step equals the single-process gradient (pp=2·tp=2);
* a checkpoint loaded into another layout and saved again is bitwise the same checkpoint (model and AdamW
  state), and training resumed from it continues with the uninterrupted run's losses.
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
ENV = "MEGASHARD_PIPE_TEST_DIR"
STEPS = 6  # enough: every step compared, the loss falls by > 0.1, clipping acts at every step
MID = STEPS // 2  # the checkpoint the reshard matrix loads and resumes from
BASE = [f"train.steps={STEPS}", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
        "train.plot=false", "train.resume=false", "model.dropout=0.0", "optim.grad_clip=0.5", "model.layers=4",
        "train.global_batch=16", "parallel.tp=1", "parallel.dp_shard=-1"]
F64, F32 = ["train.dtype=float64"], ["train.dtype=float32"]
PP2 = ["parallel.pp=2", "train.microbatches=4"]
TIED = ["model.tie_embeddings=true"]
LLAMA = ["model.arch=llama", "model.tie_embeddings=true"]
CKPT = [f"checkpoint.interval={MID}", "checkpoint.keep=0"]


def _dir() -> str:
    return os.environ[ENV]


def _job(tag: str, overrides: list[str]):
    import torch.distributed as dist

    from megashard.train.config import JobConfig

    world = dist.get_world_size()
    return JobConfig.from_yaml(DEFAULT, BASE + [f"launch.nproc_per_node={world}", f"train.out_dir={_dir()}/{tag}"]
                               + overrides)


def _run(tag: str, overrides: list[str], *, save_params: bool = False, on_end=None) -> None:
    import torch.distributed as dist

    from megashard.train.loop import full_parameters, train

    params: dict = {}

    def end(model, state):
        if save_params:
            params.update(full_parameters(model, state))
        if on_end is not None:
            on_end(model, state)

    result = train(_job(tag, overrides), on_end=end)
    if dist.get_rank() == 0:
        with open(os.path.join(_dir(), f"{tag}.json"), "w") as f:
            json.dump({"start": result.start_step, "losses": result.losses, "norms": result.grad_norms}, f)
        if save_params:
            torch.save(params, os.path.join(_dir(), f"{tag}.pt"))
    dist.barrier()


def _grads(tag: str, overrides: list[str]) -> None:
    """Full gradients of every parameter after one forward/backward of step 0 (no optimizer step)."""
    import torch.distributed as dist

    import megashard.state as ms
    from megashard.state.devices import current_device
    from megashard.state.rng import model_parallel_manual_seed
    from megashard.train.data import Batches
    from megashard.train.loop import _forward_backward, build, full_gradients
    from megashard.models.parallelize import finish_expert_grads

    job = _job(tag, overrides)
    state = ms.initialize(job.parallel)
    try:
        job.validate(sizes=state.sizes)
        model_parallel_manual_seed(job.parallel.seed)
        model, _ = build(job, state)
        data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                       dp_size=state.size("dp"), cp_rank=state.rank_in("cp"), cp_size=state.size("cp"),
                       device=current_device(state.device_type))
        x, y = data.batch(0)
        if state.size("pp") > 1:
            from megashard.train.pipeline import Pipeline

            Pipeline(job, state, model).step(x, y, 0)
        else:
            _forward_backward(model, x, y, job.microbatches(1))
        finish_expert_grads(model, state)
        grads = full_gradients(model, state)
        if dist.get_rank() == 0:
            torch.save(grads, os.path.join(_dir(), f"{tag}.grads.pt"))
        dist.barrier()
    finally:
        ms.destroy()


def _roundtrip(tag: str, overrides: list[str]) -> None:
    """Load the tp=2·pp=2 step-MID checkpoint in this layout and save it again (under ``<tag>-again``)."""
    _roundtrip_from(os.path.join(_dir(), "pp2_tp2-f64", "checkpoints", f"step_{MID:08d}"), tag, overrides)


def _roundtrip_from(src: str, tag: str, overrides: list[str]) -> None:
    """Load checkpoint ``src`` in this layout and save it again (under ``<tag>-again``)."""
    import torch.distributed as dist

    import megashard.state as ms
    from megashard.train.checkpointing import load_checkpoint, save_checkpoint
    from megashard.train.loop import build

    job = _job(tag, overrides)
    state = ms.initialize(job.parallel)
    try:
        job.validate(sizes=state.sizes)
        model, opt = build(job, state)
        step = load_checkpoint(src, model, opt, state)
        save_checkpoint(os.path.join(_dir(), f"{tag}-again"), step, model, opt, state)
        dist.barrier()
    finally:
        ms.destroy()


def _resume(tag: str, overrides: list[str]) -> None:
    """Train steps MID+1..STEPS from the tp=2·pp=2 run's step-MID checkpoint in this layout."""
    dst = copy_checkpoint_step(_dir(), "pp2_tp2-f64", f"{tag}-ckpt", step=MID)
    _roundtrip(tag, overrides + F64)
    _run(tag, overrides + F64 + ["train.resume=true", f"checkpoint.dir={dst}"])


# ---------------------------------------------------------------------------------------------- one process
def check_single_f64(rank, world_size):
    _run("single-f64", F64 + ["launch.nproc_per_node=1"])


def check_single_f32(rank, world_size):
    _run("single-f32", F32)


def check_single_tied_f64(rank, world_size):
    _run("single-tied-f64", F64 + TIED)


def check_single_llama_f64(rank, world_size):
    _run("single-llama-f64", F64 + LLAMA)


def check_single_grads(rank, world_size):
    _grads("single", F64)


# ---------------------------------------------------------------------------------------------- two processes
def check_pp2_f64(rank, world_size):
    _run("pp2-f64", PP2 + F64)


def check_pp2_f32(rank, world_size):
    _run("pp2-f32", PP2 + F32)


def check_pp2_gpipe_f64(rank, world_size):
    _run("pp2-gpipe-f64", PP2 + F64 + ["train.pipeline_schedule=gpipe"])


def check_pp2_vpp2_f64(rank, world_size):
    _run("pp2-vpp2-f64", PP2 + F64 + ["parallel.vpp=2", "train.pipeline_schedule=interleaved_1f1b"])


def check_pp2_zbv_f64(rank, world_size):
    _run("pp2-zbv-f64", PP2 + F64 + ["parallel.vpp=2", "train.pipeline_schedule=zbv"])


def check_pp2_tied_f64(rank, world_size):
    _run("pp2-tied-f64", PP2 + F64 + TIED)


def check_a_silent_stage_is_named(rank, world_size):
    """Stage 1 never takes part (it waits until stage 0 has failed): stage 0's probe fails after parallel.timeout,
    naming itself."""
    import time

    import megashard.state as ms
    from megashard.errors import PipelineError
    from megashard.train.loop import build
    from megashard.train.pipeline import Pipeline

    job = _job("silent", PP2 + F64 + ["parallel.timeout=3"])
    state = ms.initialize(job.parallel)
    try:
        model, _ = build(job, state)
        pipe = Pipeline(job, state, model)
        if rank == 0:
            with pytest.raises(PipelineError) as e:
                pipe.probe()
            msg = str(e.value)
            assert "stage 0 of 2 (pp rank 0 of 2, global rank 0)" in msg and "parallel.timeout=3" in msg, msg
            assert "\n" not in msg, msg
            open(os.path.join(_dir(), "silent-stage-named"), "w").close()
        else:  # silent until stage 0 has named itself (however long its timeout takes on a loaded machine)
            give_up = time.monotonic() + 300  # a hang guard only
            while not os.path.exists(os.path.join(_dir(), "silent-stage-named")) and time.monotonic() < give_up:
                time.sleep(0.05)
    finally:
        ms.destroy()


# ---------------------------------------------------------------------------------------------- four processes
def check_pp2_tp2_f64(rank, world_size):
    # Also the source of the reshard matrix: checkpoints at steps MID and STEPS, final parameters saved.
    _run("pp2_tp2-f64", PP2 + F64 + CKPT + ["parallel.tp=2"], save_params=True)


def check_pp2_dp2_f64(rank, world_size):
    _run("pp2_dp2-f64", PP2 + F64)


def check_pp2_dp2_f32(rank, world_size):
    _run("pp2_dp2-f32", PP2 + F32)


def check_llama_pp2_tp2_f64(rank, world_size):
    _run("llama-pp2_tp2-f64", PP2 + F64 + LLAMA + ["parallel.tp=2", "model.recompute=true"])


def check_pp4_tied_f64(rank, world_size):
    # Stages 0 and 3 on ranks 0 and 3: their tied copies meet over the state's embd group [0, 3].
    _run("pp4-tied-f64", ["parallel.pp=4", "train.microbatches=4"] + F64 + TIED)


def check_pp2_tp2_grads(rank, world_size):
    _grads("pp2_tp2", PP2 + F64 + ["parallel.tp=2"])


def check_resume_pp1(rank, world_size):
    _resume("resume-pp1", ["parallel.tp=2"])


def check_resume_pp4(rank, world_size):
    _resume("resume-pp4", ["parallel.pp=4", "train.microbatches=4"])


def check_resume_tp4(rank, world_size):
    _resume("resume-tp4", ["parallel.tp=4"])


def check_resume_one_process(rank, world_size):
    _resume("resume-one", [])


ONE = [check_single_f64, check_single_f32, check_single_tied_f64, check_single_llama_f64, check_single_grads]
TWO = [check_pp2_f64, check_pp2_f32, check_pp2_gpipe_f64, check_pp2_vpp2_f64, check_pp2_zbv_f64, check_pp2_tied_f64,
       check_a_silent_stage_is_named]
FOUR = [check_pp2_tp2_f64, check_pp2_dp2_f64, check_pp2_dp2_f32, check_llama_pp2_tp2_f64, check_pp4_tied_f64,
        check_pp2_tp2_grads,
        check_resume_pp1, check_resume_pp4, check_resume_tp4]
AFTER = [check_resume_one_process]


@pytest.fixture(scope="module")
def runs():
    tmp = tempfile.mkdtemp(prefix="megashard-pipe-")
    old = os.environ.get(ENV)
    os.environ[ENV] = tmp  # inherited by the spawned processes
    try:
        one = spawn_checks(ONE, world_size=1, timeout=300)
        two = spawn_checks(TWO, world_size=2, timeout=300)
        four = spawn_checks(FOUR, world_size=4, timeout=600)
        after = spawn_checks(AFTER, world_size=1, timeout=300)
        yield tmp, {"one": one, "two": two, "four": four, "after": after}
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
        if os.environ.get("MEGASHARD_KEEP_TEST_DIR"):
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _ok(runs, *names):
    _, spawns = runs
    for n in names:
        for s in spawns.values():
            if n in s.passed or n in s.errors:
                s.assert_ok(n)
                break
        else:
            raise AssertionError(f"{n} never ran")


def _losses(tmp: str, tag: str, key: str = "losses") -> dict[int, float]:
    with open(os.path.join(tmp, f"{tag}.json")) as f:
        return {int(k): v for k, v in json.load(f)[key].items()}


def _assert_close(got: dict[int, float], want: dict[int, float], rel: float, steps) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert abs(got[s] - want[s]) <= rel * abs(want[s]), f"step {s}: {got[s]!r} vs {want[s]!r} (rel {rel})"


PARITY = {  # run -> (check, reference run, relative tolerance)
    "pp2-f64": ("check_pp2_f64", "single-f64", 1e-10),
    "pp2-f32": ("check_pp2_f32", "single-f32", 1e-4),
    "pp2-gpipe-f64": ("check_pp2_gpipe_f64", "single-f64", 1e-10),
    "pp2-vpp2-f64": ("check_pp2_vpp2_f64", "single-f64", 1e-10),
    "pp2-zbv-f64": ("check_pp2_zbv_f64", "single-f64", 1e-10),
    "pp2-tied-f64": ("check_pp2_tied_f64", "single-tied-f64", 1e-10),
    "pp4-tied-f64": ("check_pp4_tied_f64", "single-tied-f64", 1e-10),
    "pp2_tp2-f64": ("check_pp2_tp2_f64", "single-f64", 1e-10),
    "pp2_dp2-f64": ("check_pp2_dp2_f64", "single-f64", 1e-10),
    "pp2_dp2-f32": ("check_pp2_dp2_f32", "single-f32", 1e-4),
    "llama-pp2_tp2-f64": ("check_llama_pp2_tp2_f64", "single-llama-f64", 1e-10),
}


@pytest.mark.parametrize("run", sorted(PARITY))
def test_loss_parity_with_one_process(runs, run):
    check, ref, rel = PARITY[run]
    _ok(runs, check, "check_" + ref.replace("-", "_"))
    tmp, _ = runs
    want = _losses(tmp, ref)
    _assert_close(_losses(tmp, run), want, rel, range(1, STEPS + 1))
    # The gradient norm (summed over pp, tp, dp_shard; a tied copy once) is the single process's, and clipping acts.
    _assert_close(_losses(tmp, run, "norms"), _losses(tmp, ref, "norms"), rel, range(1, STEPS + 1))
    assert min(_losses(tmp, ref, "norms").values()) > 0.5
    assert want[STEPS] < want[1] - 0.1, f"the model must learn something in {STEPS} steps"


def test_schedules_give_identical_losses(runs):
    _ok(runs, "check_pp2_f64", "check_pp2_gpipe_f64")
    tmp, _ = runs
    assert _losses(tmp, "pp2-gpipe-f64") == _losses(tmp, "pp2-f64")


def test_tied_embeddings_change_the_model(runs):
    _ok(runs, "check_single_tied_f64", "check_single_f64")
    tmp, _ = runs
    assert _losses(tmp, "single-tied-f64")[STEPS] != _losses(tmp, "single-f64")[STEPS]


def test_every_gradient_equals_the_single_process_gradient(runs):
    _ok(runs, "check_single_grads", "check_pp2_tp2_grads")
    tmp, _ = runs
    want = torch.load(os.path.join(tmp, "single.grads.pt"))
    got = torch.load(os.path.join(tmp, "pp2_tp2.grads.pt"))
    assert sorted(got) == sorted(want) and len(want) > 20
    for name, g in want.items():
        assert got[name].shape == g.shape, name
        err = (got[name] - g).abs().max().item()
        assert err <= 1e-10 * max(1.0, g.abs().max().item()), f"{name}: max abs error {err}"


def test_a_silent_stage_is_named_when_the_timeout_fires(runs):
    _ok(runs, "check_a_silent_stage_is_named")


def _full(path: str) -> dict:
    from megashard.checkpoint.consolidate import load_full_state_dict

    return load_full_state_dict(path, keys={"model", "optim"})


def _flat(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _flat(v, f"{key}.{k}" if key else str(k))
    else:
        yield key, node


@pytest.mark.parametrize("tag,check", [("resume-pp1", "check_resume_pp1"), ("resume-pp4", "check_resume_pp4"),
                                       ("resume-tp4", "check_resume_tp4"), ("resume-one", "check_resume_one_process")])
def test_checkpoint_reshards_bitwise_and_resumes(runs, tag, check):
    _ok(runs, "check_pp2_tp2_f64", check)
    tmp, _ = runs
    src = dict(_flat(_full(os.path.join(tmp, "pp2_tp2-f64", "checkpoints", f"step_{MID:08d}"))))
    again = dict(_flat(_full(os.path.join(tmp, f"{tag}-again", f"step_{MID:08d}"))))
    assert sorted(again) == sorted(src)
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in src)
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(again[k], v), f"{tag}: {k} differs after load + save"
    got = _losses(tmp, tag)
    assert _losses(tmp, tag) and json.load(open(os.path.join(tmp, f"{tag}.json")))["start"] == MID
    _assert_close(got, _losses(tmp, "pp2_tp2-f64"), 1e-10, range(MID + 1, STEPS + 1))
