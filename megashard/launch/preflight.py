"""Checks of a job against the machine that launches it, before any process starts (``megashard run``).

:meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>` checks the config on its own; these
checks read the file system and the devices, so that a job that cannot work here fails with one line
instead of training until its first checkpoint (and failing again after every restart):

- ``train.out_dir`` and the checkpoint directory: an existing path must be a directory; a missing one must
  be creatable (its nearest existing ancestor a writable directory);
- ``parallel.device`` / ``parallel.backend``: cuda and nccl need a usable CUDA device (one per process of
  this node) and an NCCL build (:func:`megashard.state.check_devices`);
- synthetic token data (held by every process) must fit in half of this machine's memory;
- the collectives of every rank (:func:`check_collectives`, :mod:`megashard.rehearse.before_launch`): by default
  when the job is cheap to rehearse, not by a launcher joining a running elastic job (the first launcher checked it),
  nor with ``MEGASHARD_CHECK=off``.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Iterable, Optional

from megashard.errors import ConfigError
from megashard.train.config import JobConfig
from megashard.train.sections import LaunchConfig

__all__ = ["CHECK_ENV", "check_collectives", "check_mode", "joins_running_job", "check_data_memory", "check_job_here",
           "check_outputs", "check_output_dir", "job_inputs", "physical_memory"]


def check_output_dir(path: str, field: str, kind: str = "run", reads: Iterable[str] = ()) -> None:
    """ConfigError naming ``field`` unless ``path`` is megashard's to write (:func:`megashard.outputs.check_output_dir`):
    a new, empty or megashard-made directory (or one that can be created) that is writable and neither holds nor
    lies inside ``reads``."""
    from megashard.outputs import check_owned

    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{field}={path!r} is an existing file, not a directory; choose another directory "
                          "(or move the file away)")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{field}={path!r} cannot be created: {existing} is a file, not a directory; choose "
                          "another directory")
    check_owned(f"{field}=", path, kind, reads=reads)  # megashard's to write, away from the inputs: before the probe
    try:  # a real probe (os.access says yes to root on read-only file systems and /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".megashard-probe-", dir=existing))
    except OSError as e:
        what = "is not writable" if existing == full else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{field}={path!r} {what} ({e.strerror or e}); choose a writable directory") from None


def job_inputs(job: JobConfig, config: Optional[str] = None) -> list[str]:
    """The files and directories the job reads that its outputs must keep away from: the config file, the corpus
    (``data.path`` / ``data.blend`` files, ``data.prepare_inputs``, ``data.prepare_tokenizer``) and
    ``model.init_from``. (A checkpoint to resume from is the job's own output: not listed.)"""
    from megashard.data.corpus import META_SUFFIX, TOKENIZER_SUFFIX

    d = job.data
    found = [config] if config else []
    paths = [p for _, p in _data_paths(job)]
    for p in paths:
        found += [p + ext for ext in (".bin", ".idx", META_SUFFIX, TOKENIZER_SUFFIX) if os.path.exists(p + ext)]
        if os.path.isfile(p):
            found.append(p)
    if d.source == "indexed" and d.prepare_inputs and d.prepare_tokenizer not in ("byte", None):
        found.append(d.prepare_tokenizer)
    if job.model.init_from:
        found.append(job.model.init_from)
    return [p for p in found if isinstance(p, str) and p]


def _data_paths(job: JobConfig) -> list[tuple[float, str]]:
    d = job.data
    if d.source == "text" and d.path:
        return [(1.0, d.path)]
    if d.source != "indexed":
        return []
    from megashard.train.data import data_paths

    return data_paths(d)


def check_outputs(job: JobConfig, config: Optional[str] = None) -> None:
    """Where the job writes, before anything is: ``train.out_dir`` and the checkpoint directory are megashard's (new,
    empty, or made by megashard: :mod:`megashard.outputs`), writable, and hold none of the job's inputs; the run's
    resolved config (``<out_dir>/config.yaml``) would not overwrite the config file it is read from, nor a file of
    the user's. ConfigError, one line naming the field and the rule."""
    from megashard.outputs import is_resolved_config

    reads = job_inputs(job, config)
    out = job.out_dir
    resolved = os.path.join(out, "config.yaml")
    if config and os.path.realpath(config) == os.path.realpath(resolved):
        raise ConfigError(
            f"train.out_dir={job.train.out_dir!r}: megashard run writes the run's resolved config to {resolved}, which "
            f"is the config file {config} this command reads: it would be overwritten (and the next run would read "
            "the resolved copy); keep configs out of run directories and choose another train.out_dir, e.g. "
            "runs/{name} (the default)")
    check_output_dir(out, "train.out_dir", "run", reads)
    if os.path.isfile(resolved) and not is_resolved_config(resolved):
        raise ConfigError(f"train.out_dir={job.train.out_dir!r}: {resolved} exists and was not written by megashard run "
                          "(it has not the resolved config's first line); megashard never overwrites a file it did not "
                          "make: move it away or choose another train.out_dir")
    for name, ours in (("config.yaml", None), ("metrics.jsonl", _metrics_of_ours), ("world.json", _world_of_ours)):
        path = os.path.join(out, name)  # the files the run replaces: each a regular file megashard wrote, or none
        if not os.path.lexists(path):
            continue
        why = ("is not a regular file (a FIFO, device, directory or link)" if os.path.islink(path)
               or not os.path.isfile(path) else None if ours is None or ours(path) else "was not written by megashard")
        if why:
            raise ConfigError(f"train.out_dir={job.train.out_dir!r}: {path} {why}; megashard run would replace it, and "
                              "megashard never overwrites a file it did not make: move it away or choose another "
                              "train.out_dir")
    ckpt_field = "checkpoint.dir" if job.checkpoint.dir else "checkpoint.dir (default <train.out_dir>/checkpoints)"
    check_output_dir(job.checkpoint_dir, ckpt_field, "checkpoints", reads)


def _first_json(path: str) -> object:
    """The first line of ``path`` as JSON (None when empty or not JSON)."""
    import json

    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline(1 << 16)
        return json.loads(line) if line.strip() else {}
    except (OSError, ValueError):
        return None


def _metrics_of_ours(path: str) -> bool:
    """metrics.jsonl as MetricsWriter writes it: empty, or a JSON object with a step per line."""
    first = _first_json(path)
    return first == {} or (isinstance(first, dict) and bool({"step", "world_change", "stragglers"} & set(first)))


def _world_of_ours(path: str) -> bool:
    """world.json as the run writes it (megashard.train.world): a JSON object with its run_id and world_size."""
    first = _first_json(path)
    return isinstance(first, dict) and {"run_id", "world_size"} <= set(first)


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_data_memory(job: JobConfig, ram: int | None) -> None:
    """ConfigError when every process's copy of the synthetic token data (int16 or int32:
    :func:`megashard.train.data.synthetic_token_dtype`) would take more than half the RAM.

    Only ``data.source: synthetic`` is held in memory; ``text`` and ``indexed`` data are memory-mapped.
    """
    d, m, n = job.data, job.model, job.launch.nproc_per_node
    if d.source != "synthetic":
        return
    from megashard.train.data import synthetic_token_dtype

    item = synthetic_token_dtype(m.vocab_size).itemsize
    tokens, what = d.num_sequences * (m.seq_len + 1), f"data.num_sequences={d.num_sequences:,} × (model.seq_len + 1)"
    need = tokens * item * n
    if ram and need > ram // 2:
        raise ConfigError(
            f"{what} = {tokens:,} tokens of {item} bytes in each of launch.nproc_per_node={n} processes need "
            f"{need / 2**30:.1f} GiB, more than half of this machine's {ram / 2**30:.1f} GiB of memory; "
            "use less data (e.g. data.num_sequences=4096)"
        )


def check_job_here(job: JobConfig, config: Optional[str] = None, outputs: bool = True) -> None:
    """Every check of this module for a validated ``job`` read from ``config`` (ConfigError with one line naming the
    field): outputs (:func:`check_outputs`, unless ``outputs=False``: ``megashard run`` checks them first, before it
    reads the checkpoints), memory, devices."""
    if outputs:
        check_outputs(job, config)
    check_data_memory(job, physical_memory())
    from megashard.state import check_devices  # imports torch: only here, where the job is launched

    check_devices(job.parallel, processes_per_node=job.launch.nproc_per_node, prefix="parallel.")


def joins_running_job(la: LaunchConfig) -> bool:
    """Whether an elastic c10d job's rendezvous store already answers: a launcher of the job hosts it, and that
    launcher ran the check before launch before it started torchrun. Unsure (no port, unreachable): False."""
    import socket

    host, _, port = (la.rdzv_endpoint or "").rpartition(":")
    if not (la.elastic and la.rdzv_backend == "c10d" and host and port.isdigit()):
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


CHECK_ENV = "MEGASHARD_CHECK"
"""``MEGASHARD_CHECK=off``: every ``megashard run`` without ``--collectives`` launches as with ``--no-check`` (a site
whose CI already checks its configs, a test suite that launches many jobs); ``auto`` or unset: the default."""


def check_mode() -> str:
    """``MEGASHARD_CHECK`` read and checked: ``auto`` or ``off``."""
    mode = os.environ.get(CHECK_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "off"):
        raise ConfigError(f"{CHECK_ENV}={os.environ[CHECK_ENV]!r} is not a setting: auto (the default: check a cheap "
                          "job before launch) or off (as --no-check)")
    return mode


def check_collectives(job: JobConfig, world_size: int, dry_run: bool, collectives: Optional[bool]) -> bool:
    """The check before launch (:mod:`megashard.rehearse.before_launch`): with ``collectives`` True always, None
    (the default) when it is cheap, this is no dry run and ``MEGASHARD_CHECK`` is not ``off``, False never. True when
    it found a problem."""
    from megashard.rehearse.before_launch import check_job, is_cheap

    if collectives is None and check_mode() == "off":
        return False
    if collectives is False or (collectives is None and (dry_run or not is_cheap(job, world_size))):
        return False
    if collectives is None and joins_running_job(job.launch):  # its first launcher checked this config already
        print("megashard run: collectives: not checked again: this node joins a running job", file=sys.stderr)
        return False
    code = check_job(job, world_size, stream=sys.stderr)
    if code and not dry_run:
        print("megashard run: nothing was started: fix the calls above (or launch anyway with --no-check)",
              file=sys.stderr)
    return code != 0
