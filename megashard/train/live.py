"""The training loop of an elastic job with live recovery (``launch.recovery: live``): the world changes, the
processes stay.

    result = train_live(job)     # megashard.train.loop.train calls it when megashard.train.live_world.live_enabled

One :class:`~megashard.train.loop.TrainRun` per world. Before each step every rank checks (one all-reduce) whether
its agent completed a rendezvous round for a joining node; after each step it captures its state in host memory
(:class:`~megashard.train.memory_copies.MemoryCopies`). When a collective fails because a peer process went away, the
survivors abort the broken groups, agree on the next world among themselves (:meth:`LiveWorld.after_loss`) and go
on in it; when a node joins, every rank moves at the same step boundary (:meth:`LiveWorld.adopt`). In the new world
the layout is resolved again (the data-parallel axis absorbs the size), the model and optimizer are built for it and
filled from the live copies (:func:`~megashard.train.memory_copies.restore`) — or, when no live copy covers the lost
shards, from the newest checkpoint, read by the same processes. Data position and RNG are functions of the step.

A worker left out of the survivors' world (its node answered too late) exits with
:data:`~megashard.launch.agent.EXIT_PEER_LOST`; its launcher brings it back through the rendezvous, as a join.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch

from megashard.train.config import JobConfig
from megashard.train.result import TrainResult

__all__ = ["train_live"]


class _Move(Exception):
    """Every rank agreed at a step boundary to move to the round the agents completed for a joining node."""

    def __init__(self, info: Any) -> None:
        super().__init__("join")
        self.info = info


def _broken(world: Any, e: BaseException) -> bool:
    """Whether ``e`` means the world is broken (a peer went away, or another survivor already aborted it)."""
    from megashard.processes import is_peer_loss

    if is_peer_loss(e) or "abort" in str(e).lower():
        return True
    try:
        return bool(world.root.check([f"{world.prefix}/abort"]))
    except Exception:  # noqa: BLE001 - the store is gone too: not a loss this module can handle
        return False


def train_live(job: JobConfig, *, on_end: Optional[Callable[..., None]] = None) -> TrainResult:
    """Train ``job`` across world changes in this process (see the module docstring). Returns the last world's
    :class:`TrainResult`."""
    from megashard.train.live_world import JobEnded, LiveWorld, LeftOut, debug
    from megashard.train.loop import TrainRun
    from megashard.train.checkpointing import fresh_entries, put_entries
    from megashard.train.memory_copies import MemoryCopies, job_entries, restore

    if os.environ.get("MEGASHARD_LIVE_DEBUG"):
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    pause = os.environ.get("MEGASHARD_PAUSE_FILE") or None
    _preload()  # a newcomer says it is ready only once what the first step needs is imported
    if int(os.environ.get("MEGASHARD_RDZV_ROUND", "0") or 0) > 0:  # maybe joining a running world: build once first
        _warm_up(job)
    world = LiveWorld.from_env(job.parallel)
    try:
        world.join()
    except JobEnded:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print("megashard run: the job ended before this node could join it: nothing to do", file=sys.stderr,
                  flush=True)
        return TrainResult(start_step=job.train.steps, final_step=job.train.steps, out_dir=job.out_dir)
    held: list[MemoryCopies] = []  # this process's live copies: this world's, and the one before until complete
    while True:
        _fillable(job)
        run = TrainRun(job)
        try:
            run.start()
            debug("built")
            # every rank of the world says what it holds (newcomers and a first world: nothing → the checkpoint)
            live_step = restore(held, lambda keys: fresh_entries(run.model, run.optimizer, run.state),
                                lambda filled: put_entries(filled, run.model, run.optimizer, run.state),
                                run.state.device_type)
            debug(f"restored {live_step}")
            run.resume(live_step=live_step)
            debug("resumed")
            run.pause_file = None  # the pause is every rank's decision here (_boundary)
            if world.changes:
                world.tell_agent()
            for step in range(run.result.start_step, job.train.steps):
                info = _boundary(world, pause)
                if info is not None:
                    raise _Move(info)
                run.step(step)
                if not held or held[-1].world_id != world.prefix:
                    held.append(MemoryCopies(lambda r=run: job_entries(r.model, r.optimizer, r.state),
                                             job.checkpoint.memory_copies, world.prefix, world.local_world_size))
                held[-1].capture(step + 1)
                if len(held[-1].gens) >= 2:  # every rank completed a capture of this world: the older is not needed
                    del held[:-1]
                run.save(step + 1)
            result = run.end(on_end)
            world.close(ended=True)
            return result
        except _Move as m:
            _forget_world(held)
            _close(run)
            world.adopt(m.info)
        except Exception as e:  # noqa: BLE001 - a broken world is handled here, anything else is re-raised
            if not _broken(world, e):
                raise
            try:
                _forget_world(held)
                world.signal_abort()
                _close(run)
                world.after_loss()
            except LeftOut as left:
                from megashard.errors import PeerLostError

                raise PeerLostError(str(left)) from None
            except Exception as lost:  # noqa: BLE001 - the store itself is gone, or no new world in time
                if not world.store_alive():
                    from megashard.errors import MegashardError

                    raise MegashardError(
                        f"the rendezvous host ({os.environ.get('MEGASHARD_LIVE_STORE')}) is gone, with the node that "
                        "was lost: the world cannot re-form without its store; this node stops — start the job again "
                        "with launch.rdzv_endpoint on a surviving node to resume from its newest checkpoint") from None
                _fail_over(world, lost)


def _fail_over(world: Any, e: BaseException) -> None:
    """This worker could not re-form the world in place within ``parallel.timeout``: one line, then the restart path
    (:class:`~megashard.errors.PeerLostError`: the worker exits as one that lost its peers)."""
    from megashard.errors import PeerLostError
    from megashard.train.live_world import ReformTimeout, _first_line, failover_line

    why = str(e) if isinstance(e, ReformTimeout) else _first_line(e)
    print(failover_line(world.rank, world.timeout, why), file=sys.stderr, flush=True)
    raise PeerLostError(why) from None


def _forget_world(held: list) -> None:
    """The copies outlive their world: let go of its model (and meshes, which equal the next world's by value)."""
    for c in held:
        c.entries = None


def _fillable(job: JobConfig) -> None:
    """A world the fixed axes or the batch cannot fill is the restart path's to handle (``launch.unfillable_world``:
    wait or stop): leave as a worker that lost its peers, and torchrun's agent re-forms it through the rendezvous."""
    import torch.distributed as dist

    from megashard.errors import ConfigError, PeerLostError

    try:
        job.validate(dist.get_world_size(), data=False)
    except ConfigError as e:
        raise PeerLostError(f"the re-formed world of {dist.get_world_size()} cannot run this job ({e}); torchrun's "
                            "rendezvous takes over") from None


def _boundary(world: Any, pause: Optional[str]) -> Any:
    """At a step boundary: the round to move to (a node joined), else None once no rank holds the world here
    (``MEGASHARD_PAUSE_FILE``, tests and benchmarks: held while the file exists, decided by every rank together)."""
    import time

    while True:
        info, held = world.join_due(hold=pause is not None and os.path.exists(pause))
        if info is not None or not held:
            return info
        time.sleep(0.05)


def _warm_up(job: JobConfig) -> None:
    """Build the model once on torch's ``fake`` backend (no communication) before saying ready: a newcomer's first
    build is slow (first calls of every kernel and dispatch path), and the running world would wait for it."""
    import torch.distributed as dist

    import megashard.state as ms
    from megashard._compat import fake_store
    from megashard.state.pool import release_process_groups
    from megashard.train.build import build

    try:
        dist.init_process_group("fake", store=fake_store(), rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))
        try:
            build(job, ms.initialize(job.parallel))
        finally:
            ms.destroy()
            release_process_groups()
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - only a head start: the real world builds it again anyway
        from megashard.train.live_world import debug

        debug(f"warm-up skipped: {type(e).__name__}: {e}")


def _preload() -> None:
    """Import what building, restoring and training a world needs (imports are lazy elsewhere: a newcomer that
    imported them after the others left their world would keep them waiting)."""
    import megashard.checkpoint.state_dict  # noqa: F401
    import megashard.progress  # noqa: F401
    import megashard.train.build  # noqa: F401
    import megashard.train.checkpointing  # noqa: F401
    import megashard.train.data  # noqa: F401
    import megashard.train.metrics  # noqa: F401
    import megashard.train.pipeline  # noqa: F401
    import megashard.train.startpoint  # noqa: F401
    import megashard.train.world  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


def _close(run: Any) -> None:
    """Let go of a run whose world ends (a broken one may fail to release parts: nothing of it is needed)."""
    from megashard.processes import quiet_stderr

    try:
        if getattr(run, "bar", None) is not None:
            run.bar.close()
        if getattr(run, "writer", None) is not None:
            run.writer.close()
        with quiet_stderr(True):  # C++ warnings of the broken groups' teardown: the new world's lines say it
            run.close()
    except Exception as e:  # noqa: BLE001
        print(f"megashard run: rank {getattr(run, 'rank', '?')}: while leaving the broken world: "
              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
