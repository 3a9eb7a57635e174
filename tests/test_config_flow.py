"""The config flows one way: each process reads its YAML once, validates the ParallelConfig once, resolves it
once and checks the job once — counted in real walks of `megashard run --dry-run`, `megashard plan` and one
worker start (config loading, state creation and one training step on a 1-rank gloo world)."""
from __future__ import annotations

import collections
import contextlib
import functools
import os

from megashard.cli import main
from megashard.config import ParallelConfig, yamlfile
from megashard.train.config import JobConfig
from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")

#: (owner, attribute, what it counts): every way a process parses, validates or resolves a config.
COUNTED = (
    (yamlfile, "load_yaml", "parse"),
    (ParallelConfig, "validate", "validate"),
    (ParallelConfig, "resolve", "resolve"),
    (JobConfig, "validate", "job.validate"),
)
ONCE = {"parse": 1, "validate": 1, "resolve": 1, "job.validate": 1}


@contextlib.contextmanager
def counted():
    """Count the calls of every COUNTED function while the block runs (the real functions still run)."""
    counts: collections.Counter = collections.Counter()
    saved = []
    for owner, name, key in COUNTED:
        original = owner.__dict__[name]

        @functools.wraps(original)
        def wrapper(*args, __original=original, __key=key, **kwargs):
            counts[__key] += 1
            return __original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)
    try:
        yield counts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def test_run_dry_run_parses_validates_and_resolves_once(tmp_path, capsys):
    with counted() as counts:
        code = main(["run", DEFAULT, "--dry-run", f"train.out_dir={tmp_path}/out", "train.steps=3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "megashard.launch.worker" in out and "4 processes" in err  # the real dry run: torchrun command printed
    assert dict(counts) == ONCE


def test_run_dry_run_under_slurm_reads_the_file_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[003-004]")
    with counted() as counts:
        code = main(["run", DEFAULT, "--dry-run", f"train.out_dir={tmp_path}/out"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "--rdzv-endpoint gpu003:29500" in out and "--rdzv-id slurm-77" in out  # the Slurm settings applied
    assert dict(counts) == ONCE


def test_plan_parses_validates_and_resolves_once(capsys):
    with counted() as counts:
        code = main(["plan", DEFAULT, "--world-size", "16", "parallel.pp=2"])
    out, _ = capsys.readouterr()
    assert code == 0 and "— 16 ranks" in out
    # plan checks the job as `run` would (to warn of what run refuses), with the sizes it resolved: once each
    assert dict(counts) == {"parse": 1, "validate": 1, "resolve": 1, "job.validate": 1}


# ---------------------------------------------------------------------------------------------- one worker
def check_worker_start_counts(rank, world_size):
    import tempfile

    import torch.distributed as dist

    from megashard.launch import worker

    with tempfile.TemporaryDirectory(prefix="megashard-flow-") as tmp, counted() as counts:
        code = worker.main([DEFAULT, "parallel.tp=1", "launch.nproc_per_node=1", "train.steps=1", "train.plot=false",
                            "train.progress=false", "checkpoint.interval=0", "checkpoint.save_final=false",
                            f"train.out_dir={tmp}"])
        assert code == 0
        assert os.path.getsize(os.path.join(tmp, "metrics.jsonl")) > 0  # it trained its one step
    assert dict(counts) == ONCE, dict(counts)
    assert not dist.is_initialized()  # the worker tore the default group down


def test_worker_start_parses_validates_and_resolves_once():
    spawn_checks([check_worker_start_counts], world_size=1).assert_ok("check_worker_start_counts")
