"""A 2-rank training job whose background checkpoint write of step 4 hangs (test-only storage writer).

Run by tests/test_checkpoint_async.py as ``python -m tests._slow_save_job OUT_DIR``: every rank substitutes
:class:`SlowWriter` for the async saver's writer, trains the job with ``checkpoint.async=true`` and, once the
background write of step 4 has begun, creates ``OUT_DIR/writing.<rank>`` and sleeps; the test then SIGKILLs the
process group. Nothing in megashard knows about it.
"""
from __future__ import annotations

import os
import sys
import time

ENV = "MEGASHARD_TEST_SLOW_SAVE_DIR"
STALL_STEP = 4


def _slow_writer_class():
    from megashard.checkpoint.storage import ChecksummingFileSystemWriter

    class SlowWriter(ChecksummingFileSystemWriter):
        def write_data(self, plan, planner):
            if f"step_{STALL_STEP:08d}" in str(self.path):
                import torch.distributed as dist

                out = os.environ[ENV]
                with open(os.path.join(out, f"writing.{dist.get_rank()}"), "w") as f:
                    f.write(str(self.path))
                time.sleep(3600)  # the test kills the job now
            return super().write_data(plan, planner)

    return SlowWriter


def check_run_until_killed(rank, world_size):
    from megashard.checkpoint.async_save import AsyncSaver
    from megashard.train.config import JobConfig
    from megashard.train.loop import train
    from tests.test_checkpoint_async import job_overrides

    AsyncSaver.writer_class = _slow_writer_class()
    out = os.environ[ENV]
    train(JobConfig.from_yaml(job_overrides.DEFAULT, job_overrides(f"{out}/killed", async_save=True)))


if __name__ == "__main__":
    from tests._dist import spawn_checks

    os.environ[ENV] = os.path.abspath(sys.argv[1])
    spawn_checks([check_run_until_killed], world_size=2, timeout=3600, pg_timeout=3600)
