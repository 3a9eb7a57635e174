"""Checks of a job against the machine that launches it, before any process starts (``megashard run``).

:meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>` checks the config on its own; these
checks read the file system and the devices, so that a job that cannot work here fails with one line
instead of training until its first checkpoint (and failing again after every restart):

- ``train.out_dir`` and the checkpoint directory: an existing path must be a directory; a missing one must
  be creatable (its nearest existing ancestor a writable directory);
- ``parallel.device`` / ``parallel.backend``: cuda and nccl need a usable CUDA device (one per process of
  this node) and an NCCL build (:func:`megashard.state.check_devices`);
- synthetic token data (held by every process) must fit in half of this machine's memory.
"""
from __future__ import annotations

import os
import tempfile

from megashard.errors import ConfigError
from megashard.train.config import JobConfig

__all__ = ["check_data_memory", "check_job_here", "check_output_dir", "physical_memory"]


def check_output_dir(path: str, field: str) -> None:
    """ConfigError naming ``field`` unless ``path`` is a directory, or can be created as one, and is writable."""
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
    try:  # a real probe (os.access says yes to root on read-only file systems and /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".megashard-probe-", dir=existing))
    except OSError as e:
        what = "is not writable" if existing == full else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{field}={path!r} {what} ({e.strerror or e}); choose a writable directory") from None


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_data_memory(job: JobConfig, ram: int | None) -> None:
    """ConfigError when every process's copy of the synthetic token data (int64) would take more than half the RAM.

    Only ``data.source: synthetic`` is held in memory; ``text`` and ``indexed`` data are memory-mapped.
    """
    d, m, n = job.data, job.model, job.launch.nproc_per_node
    if d.source != "synthetic":
        return
    tokens, what = d.num_sequences * (m.seq_len + 1), f"data.num_sequences={d.num_sequences:,} × (model.seq_len + 1)"
    need = tokens * 8 * n
    if ram and need > ram // 2:
        raise ConfigError(
            f"{what} = {tokens:,} tokens of 8 bytes in each of launch.nproc_per_node={n} processes need "
            f"{need / 2**30:.1f} GiB, more than half of this machine's {ram / 2**30:.1f} GiB of memory; "
            "use less data (e.g. data.num_sequences=4096)"
        )


def check_job_here(job: JobConfig) -> None:
    """Every check of this module for a validated ``job`` (ConfigError with one line naming the field)."""
    check_data_memory(job, physical_memory())
    check_output_dir(job.out_dir, "train.out_dir")
    ckpt_field = "checkpoint.dir" if job.checkpoint.dir else "checkpoint.dir (default <train.out_dir>/checkpoints)"
    check_output_dir(job.checkpoint_dir, ckpt_field)
    from megashard.state import check_devices  # imports torch: only here, where the job is launched

    check_devices(job.parallel, processes_per_node=job.launch.nproc_per_node, prefix="parallel.")
