"""One rank of a user's own script, rehearsed without peers: ``megashard check SCRIPT [ARGS...] --world-size N``.

The script runs as ``python SCRIPT ARGS`` would under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ... set;
``__name__ == "__main__"``), in a process of its own per rank (:mod:`megashard.rehearse.broker`), with these
differences:

- ``torch.distributed.init_process_group`` (whatever backend it asks for; also the one ``megashard.initialize``
  makes) starts the ``fake`` backend for this rank, and every later group is a fake one too (a ``pp_backend`` or a
  gloo twin included): no peer is needed, no data moves;
- every collective and point-to-point call is recorded (:mod:`megashard.rehearse.recorder`);
- the rehearsal of a rank ends after ``steps`` training steps when the script tells the hang doctor its step
  (``megashard.doctor.set_step``), after ``max_calls`` calls when given, and otherwise when the script ends —
  ``sys.exit`` included, whatever its code: the values a rehearsal computes are garbage (the fake backend moves no
  data), so a script's own check of its results may fail; any other exception is the rank's error.

The script's own output goes to ``<log_dir>/rank_<r>.log`` when a directory is given, else nowhere (not to the
terminal: hundreds of ranks print). A script
that needs a GPU (``device="cuda"`` tensors) cannot be rehearsed on a machine without one.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

__all__ = ["ScriptRank", "StopRehearsal"]


class StopRehearsal(BaseException):
    """Raised inside the script when the rehearsed steps are done (a clean end of the rank's rehearsal)."""


class ScriptRank:
    """``body(rank, recorder)`` for :class:`~megashard.rehearse.broker.Broker`: run ``script`` with ``argv`` as rank
    ``rank`` of ``world_size`` (see the module docstring)."""

    def __init__(self, script: str, argv: Sequence[str], world_size: int, *, steps: int = 1,
                 max_calls: Optional[int] = None, log_dir: Optional[str] = None, quiet: bool = True):
        self.script = os.path.abspath(script)
        self.argv = list(argv)
        self.world_size = world_size
        self.steps = steps
        self.max_calls = max_calls
        self.log_dir = log_dir
        self.quiet = quiet
        from megashard.rehearse.job import preload

        preload(pipeline=False)

    def __call__(self, rank: int, recorder: Any) -> Any:
        import runpy

        if self.log_dir is not None:
            _redirect(os.path.join(self.log_dir, f"rank_{rank}.log"))
        elif self.quiet:
            _redirect(os.devnull)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(self.world_size), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "MEGASHARD_REHEARSAL": "1"})
        recorder.max_calls = self.max_calls
        self._patch(rank, recorder)
        recorder.install()
        sys.argv = [self.script, *self.argv]
        sys.path.insert(0, os.path.dirname(self.script))
        try:
            runpy.run_path(self.script, run_name="__main__")
        except StopRehearsal:
            pass
        except SystemExit as e:  # the end of the script: an exit code may come from a check of values (garbage here)
            if e.code not in (None, 0):
                return f"the script exited with {e.code!r}"
        return None

    def _patch(self, rank: int, recorder: Any) -> None:
        """The script's world on the fake backend (see the module docstring)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        import megashard.doctor
        import megashard.state.devices as devices
        from megashard._compat import fake_store, pipelines_infer_shapes_on_fake

        world_size = self.world_size
        original_init = c10d.init_process_group
        original_new_group = c10d.new_group

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if dist.is_initialized():
                return original_init(*args, **kwargs)  # torch's own error
            original_init("fake", store=fake_store(), rank=rank, world_size=world_size)
            pipelines_infer_shapes_on_fake()  # torch 2.15's schedules: shapes inferred through the rehearsal

        def new_group(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("backend", None)
            kwargs.pop("pg_options", None)
            if len(args) > 2:  # new_group(ranks, timeout, backend, pg_options, ...): the default group's backend
                args = args[:2]
            return original_new_group(*args, **kwargs)

        for mod in (c10d, dist):
            mod.init_process_group = init_process_group
            mod.new_group = new_group
        devices.check_devices = lambda *a, **k: None  # no device is needed: nothing runs on one
        steps = self.steps
        seen: list = []

        def set_step(step: int) -> None:
            if step not in seen:
                seen.append(step)
            if len(seen) > steps:  # the script starts a step past the ones rehearsed
                raise StopRehearsal()

        megashard.doctor.set_step = set_step


def _redirect(path: str) -> None:
    if path != os.devnull:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
