"""The learning-rate schedule is the user's, and a resume keeps it (issue 40).

One spawn of 2 gloo ranks (FSDP over dp_shard=2, a tiny GPT so that 1,000 steps stay cheap), real checkpoints:

* ``first``: 200 steps from scratch (``optim.decay_steps: null`` = 200), its checkpoint at step 200;
* ``kept``: ``first``'s checkpoint resumed with ``train.steps=400``: it keeps the stored schedule (lr 3e-4 =
  ``min_lr`` from step 201 on), says so in one line, and its checkpoints record ``decay_steps: 200``;
* ``override``: the same with ``optim.override_schedule=true``: every lr of steps 201..400 is, exactly, that of
* ``straight``: an uninterrupted 400-step run.

The lines, the config checks and the old behaviour of checkpoints without ``decay_steps`` are checked in this process.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil

import pytest

from megashard.checkpoint import safety
from megashard.errors import ConfigError
from tests._dist import spawn_checks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")
ENV = "MEGASHARD_TEST_SCHEDULE_DIR"
TINY = ["model.hidden=16", "model.heads=2", "model.layers=1", "model.seq_len=8", "model.vocab_size=64",
        "train.global_batch=4", "data.num_sequences=64", "parallel.tp=1", "parallel.dp_shard=2",
        "launch.nproc_per_node=2", "train.progress=false", "train.plot=false", "train.doctor=false",
        "checkpoint.interval=0", "checkpoint.keep=0", "optim.lr=3.0e-3", "optim.min_lr=3.0e-4",
        "optim.warmup_steps=20"]


def _dir() -> str:
    return os.environ[ENV]


def _run(tag: str, overrides: list[str]) -> None:
    """Train ``tag`` (out_dir <tmp>/<tag>); rank 0 writes its stderr and start step."""
    import torch.distributed as dist

    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    job = JobConfig.from_yaml(DEFAULT, TINY + [f"train.out_dir={_dir()}/{tag}"] + overrides)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train(job)
    if dist.get_rank() == 0:
        with open(os.path.join(_dir(), f"{tag}.json"), "w") as f:
            json.dump({"start": result.start_step, "stderr": err.getvalue()}, f)
    dist.barrier()


def _copy_first(tag: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        name = safety.checkpoint_dirname(200)
        shutil.copytree(os.path.join(_dir(), "first", "checkpoints", name), os.path.join(_dir(), tag, "checkpoints", name))
    dist.barrier()


def check_first(rank, world_size):
    _run("first", ["train.steps=200"])


def check_kept(rank, world_size):
    _copy_first("kept")
    _run("kept", ["train.steps=400"])


def check_override(rank, world_size):
    _copy_first("override")
    _run("override", ["train.steps=400", "optim.override_schedule=true"])


def check_straight(rank, world_size):
    _run("straight", ["train.steps=400"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("schedule"))
    os.environ[ENV] = tmp
    try:
        yield tmp, spawn_checks([check_first, check_kept, check_override, check_straight], world_size=2, timeout=900)
    finally:
        os.environ.pop(ENV, None)


def _lrs(tmp: str, tag: str) -> dict[int, float]:
    from megashard.train.metrics import read_metrics

    return {r["step"]: r["lr"] for r in read_metrics(os.path.join(tmp, tag, "metrics.jsonl"))}


def _info(tmp: str, tag: str) -> dict:
    with open(os.path.join(tmp, f"{tag}.json")) as f:
        return json.load(f)


def _recorded_optim(tmp: str, tag: str, step: int) -> dict:
    from megashard.train.startpoint import read_record

    return read_record(os.path.join(tmp, tag, "checkpoints", safety.checkpoint_dirname(step)))["job"]["optim"]


def _cosine(step: int, decay: int) -> float:
    progress = min(1.0, (step - 20) / (decay - 20))
    return 3.0e-4 + 0.5 * (3.0e-3 - 3.0e-4) * (1.0 + math.cos(math.pi * progress))


def test_a_longer_resume_keeps_the_stored_schedule_and_says_so(runs):
    tmp, res = runs
    for name in ("check_first", "check_kept"):
        res.assert_ok(name)
    first, kept = _lrs(tmp, "first"), _lrs(tmp, "kept")
    assert first[200] == _cosine(199, 200) and first[100] == _cosine(99, 200)  # step 100 trains with lr_at(99)
    assert _info(tmp, "kept")["start"] == 200
    assert sorted(kept) == list(range(201, 401))  # (the checkpoint was copied, not the first run's metrics)
    assert all(kept[s] == 3.0e-4 for s in range(201, 401))  # the decay ended at step 200: min_lr from there on
    err = _info(tmp, "kept")["stderr"]
    lines = [ln for ln in err.splitlines() if "learning-rate schedule" in ln]
    assert lines == [
        "megashard run: keeping the checkpoint's learning-rate schedule (cosine 0.003 → 0.0003, warm-up 20 steps, "
        "decay to step 200): this config would change it (optim.decay_steps: 200 in the checkpoint, 400 here "
        "(train.steps)); lr at step 201: 0.0003 (0.001761 with this config's: add optim.override_schedule=true to "
        "take it)"], err
    # the launcher's line for the finished first run says where the learning rate goes on
    from megashard.train.config import JobConfig
    from megashard.train.startpoint import find_start

    done = find_start(JobConfig.from_yaml(DEFAULT, TINY + [f"train.out_dir={tmp}/first", "train.steps=200"]))
    assert done.finished.endswith("raise train.steps to train on (at lr 0.0003: the checkpoint's schedule decayed "
                                  "until optim.decay_steps=200; optim.override_schedule=true decays again over the "
                                  "new length)"), done.finished
    # what the resumed run's checkpoint records: the resolved schedule, so a third run keeps it too
    assert _recorded_optim(tmp, "kept", 400)["decay_steps"] == 200
    assert _recorded_optim(tmp, "first", 200)["decay_steps"] == 200


def test_override_takes_the_schedule_of_an_uninterrupted_longer_run(runs):
    tmp, res = runs
    for name in ("check_first", "check_override", "check_straight"):
        res.assert_ok(name)
    over, straight = _lrs(tmp, "override"), _lrs(tmp, "straight")
    assert sorted(over) == list(range(201, 401)) and sorted(straight) == list(range(1, 401))
    assert [over[s] for s in range(201, 401)] == [straight[s] for s in range(201, 401)]  # exactly equal floats
    assert over[201] == straight[201] == _cosine(200, 400)
    assert round(over[201], 7) == 1.7615e-3  # the jump from 3e-4 that a resume no longer makes silently
    err = _info(tmp, "override")["stderr"]
    assert ("megashard run: learning-rate schedule from this config (optim.override_schedule=true), not the "
            "checkpoint's: optim.decay_steps: 200 in the checkpoint, 400 here (train.steps); lr at step 201: "
            "0.001761 (the checkpoint's schedule: 0.0003)\n") in err, err
    assert _recorded_optim(tmp, "override", 400)["decay_steps"] == 400
    assert "learning-rate schedule" not in _info(tmp, "straight")["stderr"]


# ---------------------------------------------------------------------------------------------- in this process
def _job(*overrides: str):
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(DEFAULT, list(overrides))


def _record(**optim) -> dict:
    base = {"schedule": "cosine", "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20}
    return {"job": {"optim": {**base, **optim}, "train": {"steps": 200}}}


def test_decay_steps_is_its_own_length():
    from megashard.train.schedule import lr_at

    short = _job("train.steps=1000", "optim.decay_steps=100", "optim.warmup_steps=0", "optim.schedule=linear")
    assert lr_at(0, short) == 3e-3 and lr_at(50, short) == pytest.approx(1.65e-3)
    assert lr_at(100, short) == lr_at(999, short) == pytest.approx(3e-4)  # min_lr after the decay, to the end
    assert lr_at(150, _job("train.steps=200")) == pytest.approx(_cosine(150, 200))  # null = train.steps


def test_resume_schedule_lines_and_the_checkpoints_of_earlier_versions():
    from megashard.train.schedule import Schedule, resume_schedule

    same, line = resume_schedule(_job("train.steps=200"), _record(decay_steps=200), 200)
    assert line is None and same == Schedule("cosine", 3e-3, 3e-4, 20, 200)
    # a checkpoint of a version without decay_steps decayed over its train.steps: that is its schedule
    kept, line = resume_schedule(_job("train.steps=400"), _record(), 200)
    assert kept.decay_steps == 200 and "optim.decay_steps: 200 in the checkpoint, 400 here (train.steps)" in line
    # several keys: every one named; the checkpoint's kept
    kept, line = resume_schedule(_job("train.steps=200", "optim.lr=1e-3", "optim.schedule=linear"), _record(), 150)
    assert kept == Schedule("cosine", 3e-3, 3e-4, 20, 200)
    assert "optim.schedule: cosine in the checkpoint, linear here; optim.lr: 0.003 in the checkpoint, 0.001 here" in line
    # no job recorded (a checkpoint of another script): this config's schedule, nothing said
    assert resume_schedule(_job("train.steps=400"), {"layout": {}}, 200) == (Schedule.of(_job("train.steps=400")), None)


def test_decay_steps_must_be_positive():
    with pytest.raises(ConfigError, match=r"^optim.decay_steps=0 must be a positive integer"):
        _job("optim.decay_steps=0").validate_sections()
    with pytest.raises(ConfigError, match=r"optim.override_schedule='always' must be true or false"):
        _job("optim.override_schedule=always")
