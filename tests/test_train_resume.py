"""The training job resumes from the newest checkpoint that verifies, or from the one it is told to load.

One spawn of 2 gloo ranks (FSDP over dp_shard=2, the default tiny GPT, 6 steps, a checkpoint every 2):

* ``full``: the uninterrupted run (checkpoints 2, 4, 6; final parameters kept);
* ``fallback``: checkpoints 2 and 4 of ``full``, step 4 bit-flipped: the job says in one line that it skips
  step 4 (which file, why), resumes from step 2 and ends with ``full``'s parameters bit for bit;
* ``checkpoint.load_step=2`` (with 4 and 6 present) and ``checkpoint.load_path=<full>/step_00000004``: start
  there and end with ``full``'s parameters; a damaged requested checkpoint and a directory where nothing
  verifies are errors, not a fallback or a silent fresh start.

The config errors of ``load_step`` / ``load_path`` (one line each, before any process starts) and the
consolidated file of a job checkpoint (``full["model"]``) are checked in this process.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from megashard.checkpoint import safety
from megashard.cli import main
from megashard.errors import CheckpointCorruptedError, ConfigError
from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal, flip_bit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")
ENV = "MEGASHARD_TEST_RESUME_DIR"
BASE = ["train.steps=6", "checkpoint.interval=2", "checkpoint.keep=0", "train.progress=false", "train.plot=false",
        "parallel.tp=1", "parallel.dp_shard=2", "launch.nproc_per_node=2", "train.global_batch=8",
        "optim.warmup_steps=2", "train.log_interval=100"]


def _dir() -> str:
    return os.environ[ENV]


def _ckpt(tag: str, step: int) -> str:
    return os.path.join(_dir(), tag, "checkpoints", safety.checkpoint_dirname(step))


def _run(tag: str, overrides: list[str] = ()) -> None:
    """Train ``tag`` (out_dir <tmp>/<tag>); rank 0 writes its stderr, start step and final parameters."""
    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.loop import full_parameters, train

    job = JobConfig.from_yaml(DEFAULT, BASE + [f"train.out_dir={_dir()}/{tag}"] + list(overrides))
    params: dict = {}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train(job, on_end=lambda model, state: params.update(full_parameters(model, state)))
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(_dir(), f"{tag}.pt"))
        with open(os.path.join(_dir(), f"{tag}.json"), "w") as f:
            json.dump({"start": result.start_step, "losses": result.losses, "stderr": err.getvalue()}, f)
    dist.barrier()


def _prepare(tag: str, steps: list[int], damage: dict[int, str] = None) -> None:
    """Rank 0: copy ``full``'s checkpoints ``steps`` into ``<tag>/checkpoints``; flip a byte of ``damage[step]``."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for s in steps:
            shutil.copytree(_ckpt("full", s), _ckpt(tag, s))
        for s, name in (damage or {}).items():
            path = os.path.join(_ckpt(tag, s), name)
            flip_bit(path, os.path.getsize(path) // 2, bit=2)
    dist.barrier()


def check_full(rank, world_size):
    _run("full")


def check_fallback_to_previous_verified(rank, world_size):
    _prepare("fallback", [2, 4], {4: "__1_0.distcp"})
    _run("fallback")


def check_load_step(rank, world_size):
    _prepare("step", [2, 4, 6])
    _run("step", ["checkpoint.load_step=2"])


def check_load_path(rank, world_size):
    _run("path", [f"checkpoint.load_path={_ckpt('full', 4)}"])


def check_requested_damaged_is_an_error(rank, world_size):
    _prepare("reqbad", [2, 4], {2: "__0_0.distcp"})
    with pytest.raises(CheckpointCorruptedError, match=r"the requested checkpoint .*step_00000002 \(checkpoint.load_step=2\) "
                       r"is damaged: .*__0_0\.distcp: crc32 checksum .*; no other checkpoint is tried"):
        _run("reqbad", ["checkpoint.load_step=2"])


def check_nothing_verifies_is_an_error(rank, world_size):
    _prepare("allbad", [2], {2: ".metadata"})
    with pytest.raises(CheckpointCorruptedError, match=r"no checkpoint in .*allbad/checkpoints verifies \(step_00000002"):
        _run("allbad")


CHECKS = [check_full, check_fallback_to_previous_verified, check_load_step, check_load_path,
          check_requested_damaged_is_an_error, check_nothing_verifies_is_an_error]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    os.environ[ENV] = tmp
    try:
        yield tmp, spawn_checks(CHECKS, world_size=2, timeout=600)
    finally:
        os.environ.pop(ENV, None)


def _result(tmp: str, tag: str) -> tuple[dict, dict]:
    with open(os.path.join(tmp, f"{tag}.json")) as f:
        info = json.load(f)
    return info, torch.load(os.path.join(tmp, f"{tag}.pt"), weights_only=True)


def _assert_same_parameters(got: dict, want: dict) -> None:
    assert got
    assert_bitwise_equal(got, want)


def test_damaged_newest_checkpoint_is_skipped_and_the_run_matches_an_uninterrupted_one(runs):
    tmp, res = runs
    res.assert_ok("check_full")
    res.assert_ok("check_fallback_to_previous_verified")
    full, want = _result(tmp, "full")
    info, got = _result(tmp, "fallback")
    assert full["start"] == 0 and info["start"] == 2
    _assert_same_parameters(got, want)
    assert {k: v for k, v in info["losses"].items()} == {k: v for k, v in full["losses"].items() if int(k) > 2}
    lines = info["stderr"].splitlines()
    skip = [li for li in lines if "skipping damaged checkpoint" in li]
    assert len(skip) == 1, lines
    assert skip[0].startswith("megashard run: skipping damaged checkpoint step_00000004: ")
    assert "step_00000004/__1_0.distcp: crc32 checksum" in skip[0] and "of item '" in skip[0]
    assert any(li.startswith("megashard run: resumed from ") and li.endswith("step_00000002 (step 2)") for li in lines)
    assert "Traceback" not in info["stderr"]
    # The run saved a good step 4 over the damaged one.
    assert safety.verify_files(os.path.join(tmp, "fallback", "checkpoints", "step_00000004"),
                               safety.read_marker(os.path.join(tmp, "fallback", "checkpoints", "step_00000004"))) == []


def test_load_step_and_load_path_pick_the_requested_checkpoint(runs):
    tmp, res = runs
    res.assert_ok("check_load_step")
    res.assert_ok("check_load_path")
    _, want = _result(tmp, "full")
    for tag, start in (("step", 2), ("path", 4)):
        info, got = _result(tmp, tag)
        assert info["start"] == start, tag
        _assert_same_parameters(got, want)
    note = [li for li in _result(tmp, "step")[0]["stderr"].splitlines() if "will be replaced" in li]
    assert len(note) == 1 and "step_00000004, step_00000006" in note[0]


def test_damaged_requested_checkpoint_and_nothing_verifying_are_errors(runs):
    _, res = runs
    res.assert_ok("check_requested_damaged_is_an_error")
    res.assert_ok("check_nothing_verifies_is_an_error")


def test_consolidated_job_checkpoint_holds_model_and_optim(runs, tmp_path, capsys):
    tmp, res = runs
    res.assert_ok("check_full")
    _, want = _result(tmp, "full")
    out = tmp_path / "full.pt"
    assert main(["ckpt", "consolidate", _ckpt("full", 6), str(out), "-q"]) == 0
    full = torch.load(out, weights_only=True)
    assert set(full) == {"model", "optim"}
    _assert_same_parameters(full["model"], want)
    assert set(full["optim"]) == {f"{n}.{k}" for n in want for k in ("exp_avg", "exp_avg_sq", "step")}
    assert all(float(full["optim"][f"{n}.step"]) == 6.0 for n in want)
    from megashard.train.config import JobConfig
    from megashard.models.gpt.model import GPT

    plain = GPT(JobConfig.from_yaml(DEFAULT, BASE).model)  # no process groups: a plain module
    plain.load_state_dict(full["model"])  # strict: every parameter, nothing else
    _assert_same_parameters(dict(plain.named_parameters()), want)
    from megashard.train.checkpointing import read_full_model

    _assert_same_parameters(read_full_model(_ckpt("full", 6)), want)
    capsys.readouterr()


def test_checkpoints_saved_under_extra_still_load(tmp_path):
    """Earlier versions saved the job's sections through state_dict= (section "extra"): load(sections=) finds them."""
    from megashard import checkpoint
    from megashard.train.checkpointing import read_full_model

    torch.manual_seed(0)
    saved = {"model": {"w": torch.randn(4, 3)}, "optim": {"w.exp_avg": torch.randn(4, 3), "w.step": torch.tensor(3.0)}}
    checkpoint.save(str(tmp_path), 3, state_dict=saved)
    target = {"model": {"w": torch.zeros(4, 3)}, "optim": {"w.exp_avg": torch.zeros(4, 3), "w.step": torch.tensor(0.0)}}
    assert checkpoint.load(str(tmp_path), sections=target).step == 3
    assert torch.equal(target["model"]["w"], saved["model"]["w"]) and float(target["optim"]["w.step"]) == 3.0
    assert torch.equal(target["optim"]["w.exp_avg"], saved["optim"]["w.exp_avg"])
    assert torch.equal(read_full_model(str(tmp_path))["w"], saved["model"]["w"])


# ---------------------------------------------------------------------------------------------- config errors
def _fake_checkpoint(root, step: int, files: dict = None) -> str:
    """A step directory with a completion marker (listing ``files``: name -> (bytes on disk, bytes recorded))."""
    path = os.path.join(str(root), safety.checkpoint_dirname(step))
    os.makedirs(path)
    records = {}
    for name, (on_disk, recorded) in (files or {}).items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x" * on_disk)
        records[name] = {"size": recorded, "checksum": "0"}
    safety.write_marker(path, step, records, "crc32")
    return path


def _error(overrides: list[str]) -> str:
    from megashard.train.config import JobConfig

    with pytest.raises(ConfigError) as e:
        JobConfig.from_yaml(DEFAULT, BASE + overrides).validate()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_load_step_and_load_path_errors_are_one_line(tmp_path):
    root = tmp_path / "ck"
    _fake_checkpoint(root, 10)
    _fake_checkpoint(root, 20, {"a.distcp": (5, 9)})
    os.makedirs(root / "step_00000030")  # a save that did not finish
    (tmp_path / "file.txt").write_text("x")
    d = f"checkpoint.dir={root}"
    assert "checkpoint.load_step=-1 must be >= 0" in _error(["checkpoint.load_step=-1"])
    assert "are exclusive: give one" in _error(["checkpoint.load_step=1", f"checkpoint.load_path={root}"])
    assert "train.resume=false starts from scratch" in _error([d, "checkpoint.load_step=10", "train.resume=false"])
    msg = _error([d, "checkpoint.load_step=5"])
    assert msg.startswith("checkpoint.load_step=5: checkpoint ") and "does not exist" in msg and "steps 10, 20" in msg
    assert "has no COMPLETE.json" in _error([d, "checkpoint.load_step=30"])
    msg = _error([d, "checkpoint.load_step=20"])
    assert "is damaged" in msg and "a.distcp: truncated: 5 bytes on disk, 9 bytes" in msg
    msg = _error([f"checkpoint.load_path={root}"])
    assert "is a checkpoint root, not a checkpoint" in msg and msg.endswith("step_00000020")
    assert _error([f"checkpoint.load_path={tmp_path / 'nope'}"]).endswith("does not exist")
    assert _error([f"checkpoint.load_path={tmp_path / 'file.txt'}"]).endswith("is a file, not a checkpoint directory")
    assert "is not a complete checkpoint (no COMPLETE.json" in _error([f"checkpoint.load_path={root / 'step_00000030'}"])
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(DEFAULT, BASE + [d, "checkpoint.load_step=10"])
    job.validate()
    assert job.requested_checkpoint() == str(root / "step_00000010")


def test_bad_load_step_stops_megashard_run_before_any_process_starts(tmp_path, capsys, monkeypatch):
    import subprocess

    def no_launch(*a, **k):  # pragma: no cover - reached only if validation let the config through
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "run", no_launch)
    ck = tmp_path / "ck"
    for extra in (["checkpoint.load_step=-3"], [f"checkpoint.dir={ck}", "checkpoint.load_step=7"],
                  [f"checkpoint.load_path={tmp_path}"]):
        assert main(["run", DEFAULT] + BASE + [f"train.out_dir={tmp_path}/o"] + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("megashard run: error: checkpoint.load_"), err
