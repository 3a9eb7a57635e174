"""Asynchronous checkpoints (``checkpoint.async: true``): same results as synchronous ones, and crash-safe.

One spawn of 2 gloo ranks (FSDP over dp_shard=2, the default tiny GPT, 6 steps, a checkpoint every 2 steps):

* ``sync`` and ``async``: the final parameters are bitwise equal, and so is every checkpoint (consolidated);
  every checkpoint of the async run is complete and verifies, retention kept the newest two;
* ``resume``: before the spawn, a job with async checkpoints (``tests/_slow_save_job.py``, a test-only storage
  writer that hangs in the background write of step 4) is SIGKILLed while that write is in flight: step 2 is the
  newest complete checkpoint and the partial step 4 is only a ``.tmp-`` directory; the job restarted in that
  directory resumes from step 2 and ends with the uninterrupted run's parameters, bit for bit.

Plus, in this process: a background save that fails is reported (one CheckpointError naming the step) by the
next save or ``wait()``, and the previous checkpoint stays the newest complete one.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megashard.checkpoint import safety
from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "MEGASHARD_TEST_ASYNC_DIR"


def job_overrides(out_dir: str, async_save: bool) -> list:
    return ["train.steps=6", "checkpoint.interval=2", "checkpoint.keep=2", "train.progress=false", "train.plot=false",
            "parallel.tp=1", "parallel.dp_shard=2", "launch.nproc_per_node=2", "train.global_batch=8",
            "optim.warmup_steps=2", "train.log_interval=100", f"train.out_dir={out_dir}",
            f"checkpoint.async={'true' if async_save else 'false'}"]


job_overrides.DEFAULT = os.path.join(REPO, "configs", "default.yaml")


def _run(tag: str, async_save: bool, extra: tuple = ()) -> None:
    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.loop import full_parameters, train

    root = os.environ[ENV]
    job = JobConfig.from_yaml(job_overrides.DEFAULT, job_overrides(f"{root}/{tag}", async_save) + list(extra))
    params: dict = {}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train(job, on_end=lambda model, state: params.update(full_parameters(model, state)))
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(root, f"{tag}.pt"))
        with open(os.path.join(root, f"{tag}.json"), "w") as f:
            json.dump({"start": result.start_step, "final": result.final_step, "stderr": err.getvalue()}, f)
    dist.barrier()


def check_sync(rank, world_size):
    _run("sync", False)


def check_async(rank, world_size):
    _run("async", True)


def check_resume_after_kill(rank, world_size):
    _run("killed", True)


def _as_on_an_accelerator() -> None:
    """Stage as for accelerator tensors (DCP's DefaultStager), though these are CPU tensors: the CUDA path."""
    from megashard.checkpoint.async_save import _HostStager

    _HostStager._on_host = staticmethod(lambda state_dict: False)


def check_default_stager(rank, world_size):
    """Three async saves (steps 2, 4, 6; all kept) through one job's DefaultStager, as on CUDA."""
    _as_on_an_accelerator()
    _run("stager", True, ("checkpoint.keep=0",))


def check_default_stager_resume(rank, world_size):
    """The DefaultStager run's first checkpoint (step 2), alone in a new out_dir: the job resumes from it."""
    from tests._helpers import copy_checkpoint_step

    _as_on_an_accelerator()
    copy_checkpoint_step(os.environ[ENV], "stager", os.path.join("stager-resume", "checkpoints"), step=2)
    _run("stager-resume", True, ("checkpoint.keep=0",))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    os.environ[ENV] = root
    # The job killed during a background write (its own process group, SIGKILLed as a whole).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(os.path.join(root, "killed.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests._slow_save_job", root], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    writing = [os.path.join(root, f"writing.{r}") for r in (0, 1)]
    while not all(os.path.exists(w) for w in writing) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    started = all(os.path.exists(w) for w in writing)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    ckpts = os.path.join(root, "killed", "checkpoints")
    after_kill = {"started": started, "log": open(os.path.join(root, "killed.log")).read()[-3000:],
                  "entries": sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else [],
                  "latest": safety.latest_checkpoint(ckpts) if os.path.isdir(ckpts) else None}
    res = spawn_checks([check_sync, check_async, check_resume_after_kill, check_default_stager,
                       check_default_stager_resume], world_size=2, timeout=600)
    return root, res, after_kill


def _result(root: str, tag: str) -> tuple[dict, dict]:
    with open(os.path.join(root, f"{tag}.json")) as f:
        return json.load(f), torch.load(os.path.join(root, f"{tag}.pt"), weights_only=True)


def test_async_checkpoints_give_the_same_parameters_and_checkpoints(runs):
    from megashard.checkpoint.consolidate import load_full_state_dict

    root, res, _ = runs
    res.assert_ok("check_sync")
    res.assert_ok("check_async")
    _, want = _result(root, "sync")
    info, got = _result(root, "async")
    assert info["final"] == 6 and got
    assert_bitwise_equal(got, want)
    for tag in ("sync", "async"):  # retention (keep=2) ran after completion: steps 4 and 6, nothing else
        assert sorted(os.listdir(os.path.join(root, tag, "checkpoints"))) == ["step_00000004", "step_00000006"], tag
    for step in (4, 6):
        a = load_full_state_dict(os.path.join(root, "async", "checkpoints", safety.checkpoint_dirname(step)))
        s = load_full_state_dict(os.path.join(root, "sync", "checkpoints", safety.checkpoint_dirname(step)))
        assert_bitwise_equal(a, s, f"step {step}")
        assert safety.read_marker(os.path.join(root, "async", "checkpoints", safety.checkpoint_dirname(step))).step == step


def test_kill_during_background_write_leaves_the_previous_checkpoint(runs):
    root, res, after = runs
    assert after["started"], f"the background write of step 4 never began; job log:\n{after['log']}"
    assert after["latest"] is not None and after["latest"].endswith("step_00000002"), after
    assert "step_00000002" in after["entries"] and "step_00000004" not in after["entries"], after
    assert any(e.startswith(safety.TMP_PREFIX) and e.endswith("step_00000004") for e in after["entries"]), after
    res.assert_ok("check_resume_after_kill")
    info, got = _result(root, "killed")
    assert info["start"] == 2, info
    _, want = _result(root, "sync")
    assert_bitwise_equal(got, want)
    assert not any(e.startswith(safety.TMP_PREFIX) for e in os.listdir(os.path.join(root, "killed", "checkpoints")))


def test_async_saves_through_dcps_default_stager_as_on_cuda(runs):
    """checkpoint.async on CUDA stages through DCP's DefaultStager (torch 2.11 closed it inside every stage(): the
    second save died with KeyError: <class 'type'>). Forced here on CPU tensors: three saves, each complete and equal
    to the synchronous run's, and a resume from the first ends with the uninterrupted run's parameters, bit for bit."""
    from megashard.checkpoint.consolidate import load_full_state_dict

    root, res, _ = runs
    res.assert_ok("check_sync")
    res.assert_ok("check_default_stager")
    _, want = _result(root, "sync")
    info, got = _result(root, "stager")
    assert info["final"] == 6
    assert_bitwise_equal(got, want)
    ckpts = os.path.join(root, "stager", "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["step_00000002", "step_00000004", "step_00000006"]
    for step in (2, 4, 6):
        path = os.path.join(ckpts, safety.checkpoint_dirname(step))
        marker = safety.read_marker(path)
        assert marker.step == step and marker.items, path  # per-item checksums recorded
        assert not safety.verify_files(path, marker), path
        full = load_full_state_dict(path)
        if step > 2:  # the sync run kept steps 4 and 6
            assert_bitwise_equal(full, load_full_state_dict(
                os.path.join(root, "sync", "checkpoints", safety.checkpoint_dirname(step))), f"step {step}")
    res.assert_ok("check_default_stager_resume")
    info, got = _result(root, "stager-resume")
    assert info["start"] == 2 and info["final"] == 6, info
    assert_bitwise_equal(got, want)


def test_one_default_stager_stages_again_where_torch_allows_it():
    """The probe: a DefaultStager is kept from save to save only where it survives stage(); the saver never reuses a
    closed one (three stagings of a dict holding a class, as a job's state does)."""
    from megashard._compat import dcp_default_stager_reusable
    from megashard.checkpoint.async_save import _HostStager

    stager = _HostStager()
    stager._on_host = lambda state_dict: False
    seen = []
    for i in range(3):
        staged = stager.stage({"w": torch.full((3,), float(i)), "kind": int})
        assert torch.equal(staged["w"], torch.full((3,), float(i))) and staged["kind"] is int
        seen.append(stager._default)
    assert (seen[0] is seen[2]) == dcp_default_stager_reusable()
    stager.close()


def test_a_failed_background_save_is_reported_at_the_next_save(tmp_path):
    from megashard.checkpoint.async_save import AsyncSaver
    from megashard.checkpoint.storage import ChecksummingFileSystemWriter
    from megashard.errors import CheckpointError

    class FailingWriter(ChecksummingFileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    sd = {"model": {"w": torch.arange(6.0)}}
    saver = AsyncSaver()
    assert saver.wait() is None
    saver.save(str(tmp_path), 1, sections=sd, sync_files=False)
    sd["model"]["w"] += 1  # training goes on: the checkpoint holds the staged values
    assert saver.wait() == str(tmp_path / "step_00000001")
    saver.writer_class = FailingWriter
    saver.save(str(tmp_path), 2, sections=sd, sync_files=False)
    with pytest.raises(CheckpointError, match=r"the background save of step 2 .*No space left on device.*previous "
                       r"complete checkpoint .* is still the newest"):
        saver.save(str(tmp_path), 3, sections=sd, sync_files=False)
    saver.close()
    assert safety.latest_checkpoint(str(tmp_path)).endswith("step_00000001")
    from megashard.checkpoint.consolidate import load_full_state_dict

    assert torch.equal(load_full_state_dict(str(tmp_path / "step_00000001"))["model"]["w"], torch.arange(6.0))


def test_async_is_the_yaml_key():
    from megashard.errors import ConfigError
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(job_overrides.DEFAULT, ["checkpoint.async=true"])
    assert job.checkpoint.async_save is True
    doc = job.to_dict()  # what `megashard run` writes to <out_dir>/config.yaml for the workers
    assert doc["checkpoint"]["async"] is True and "async_save" not in doc["checkpoint"]
    assert JobConfig.from_dict(doc).checkpoint.async_save is True
    assert JobConfig.from_yaml(job_overrides.DEFAULT).checkpoint.async_save is False
    # yes/no/on/off spell a boolean (megashard.config.keys.BOOL_WORDS); another word is refused
    assert JobConfig.from_yaml(job_overrides.DEFAULT, ["checkpoint.async=yes"]).checkpoint.async_save is True
    with pytest.raises(ConfigError, match=r"checkpoint.async='sometimes' must be true or false"):
        JobConfig.from_yaml(job_overrides.DEFAULT, ["checkpoint.async=sometimes"])
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): 'checkpoint.async_save'.*valid keys of 'checkpoint': "
                       r".*async"):
        JobConfig.from_yaml(job_overrides.DEFAULT, ["checkpoint.async_save=true"])
