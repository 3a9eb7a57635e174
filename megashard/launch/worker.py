"""Entry point of every process torchrun starts: ``python -m megashard.launch.worker RESOLVED_CONFIG.yaml``.

``megashard run`` writes the job's fully resolved config (overrides applied) to ``<out_dir>/config.yaml``
and launches this module, so every attempt after a restart reads exactly the same job.

The worker arms its lifeline first (it dies with torchrun: :mod:`megashard.launch.lifeline`) and ends with
:func:`megashard.state.end_distributed` (pooled groups, then the default group, before Python shuts down). A worker whose
collective fails only because another worker died (:func:`megashard.launch.agent.is_peer_loss`) prints
nothing: it waits to be stopped by torchrun, which reports the failure in one line, and otherwise exits
with :data:`~megashard.launch.agent.EXIT_PEER_LOST`. A megashard error (a config or checkpoint problem) is printed
once and ends the worker with :data:`~megashard.launch.agent.EXIT_NO_RESTART`: torchrun does not restart the job for
it. Under ``megashard run`` a SIGINT (Ctrl-C, forwarded by torchrun) ends the worker at once, without output.

In an elastic job (``launch.nnodes: MIN:MAX``) the rendezvous may form a world the job cannot fill (the fixed axes
or the global batch do not divide it: :mod:`megashard.train.elastic`). Then rank 0 says so in one line and, as
``launch.unfillable_world`` says, every worker ends with :data:`~megashard.launch.agent.EXIT_NO_RESTART` (``stop``) or
waits (``wait``: a barrier every few seconds, so that a node leaving is noticed; a node joining makes torchrun
restart the workers in the larger world). Nothing is read or written meanwhile.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

#: Seconds a worker that lost its peers waits for torchrun to stop it (it usually does within its monitor interval);
#: ``MEGASHARD_PEER_LOSS_GRACE_S`` (set by ``megashard run`` for an elastic job, where the peer is usually a node that
#: left) overrides it.
PEER_LOSS_GRACE_S = 15.0


def _peer_loss_grace() -> float:
    import os

    try:
        return max(0.0, float(os.environ.get("MEGASHARD_PEER_LOSS_GRACE_S", PEER_LOSS_GRACE_S)))
    except ValueError:
        return PEER_LOSS_GRACE_S


def _prints(e: BaseException, mismatch: type) -> bool:
    """Whether this rank prints error ``e``: errors every rank raises alike are printed once — a rank mismatch
    by local rank 0 of each node, an error shared from rank N ("(raised on rank N) ...",
    :mod:`megashard.checkpoint.collective`) by rank N only, any other by the first worker of the node to find it
    (:func:`_first_to_say`)."""
    import os
    import re

    if isinstance(e, mismatch):
        return os.environ.get("LOCAL_RANK", "0") == "0"
    shared = re.match(r"\(raised on rank (\d+)\) ", str(e))
    if shared is not None:
        return shared.group(1) == os.environ.get("RANK", "0")
    return _first_to_say(str(e))


def _first_to_say(text: str) -> bool:
    """Whether this worker is the first of its node to report ``text`` (the same error found by every rank, e.g. a
    damaged checkpoint every rank reads, is one line per job, not one per rank). The agent gives the workers of
    a launch a directory (``MEGASHARD_ERROR_DIR``); the first to create the file named by the text's hash says
    it, once per start of the workers (a restart that meets the same error says it again: the agent's restart line
    comes between). Without one (a worker started by hand) every worker says it."""
    import hashlib
    import os

    where = os.environ.get("MEGASHARD_ERROR_DIR")
    if not where or not os.path.isdir(where):
        return True
    start = "/".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE"))  # this start's world
    key = f"{start}\n{text}".encode("utf-8", "replace")
    name = os.path.join(where, hashlib.sha256(key).hexdigest()[:32])
    try:
        os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


#: Seconds between the barriers of workers that wait in an unfillable world (a node leaving is seen within this).
UNFILLABLE_POLL_S = 2.0


def _unfillable(job) -> bool:  # noqa: ANN001 - a JobConfig (imported late: the lifeline comes first)
    """Whether this elastic round's world cannot run ``job``: rank 0 prints the line; with ``wait`` never returns
    (a barrier every :data:`UNFILLABLE_POLL_S` seconds until torchrun restarts the workers or a peer is gone)."""
    import os
    from datetime import timedelta

    from megashard.errors import ConfigError
    from megashard.train.elastic import unfillable_line

    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if world < 1:
        return False
    try:
        job.validate(world, data=False)
        return False
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"megashard run: {unfillable_line(job, world, str(e))}", file=sys.stderr, flush=True)
    if job.launch.unfillable_world == "stop":
        return True
    import torch.distributed as dist

    from megashard.launch import startwatch

    startwatch.mark("init")
    dist.init_process_group("gloo", timeout=timedelta(seconds=job.parallel.timeout))  # ranks may start slowly
    startwatch.mark("joined")  # waiting on purpose: not a start-up hang for the launcher's watch
    while True:  # a peer that left breaks the barrier: peer loss, the agent re-forms the world without its node
        time.sleep(UNFILLABLE_POLL_S)
        dist.barrier()


def main(argv: Optional[Sequence[str]] = None) -> int:
    import signal

    from megashard.launch.lifeline import die_with_parent, env_pid

    die_with_parent(env_pid("MEGASHARD_AGENT_PID"))  # before the slow imports
    from megashard.launch import startwatch

    startwatch.mark("started")  # the launcher names a worker that never reaches init_process_group
    startwatch.arm_stack_dump()
    if env_pid("MEGASHARD_AGENT_PID"):
        # Under megashard run, torchrun stops the workers with the SIGINT of a Ctrl-C: end at once, silently. A Python
        # KeyboardInterrupt would print a traceback from wherever the worker is (an import, c10d's connect loop:
        # ~85 lines of C++ frames); nothing is lost, checkpoints are published atomically.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from megashard.errors import MegashardError, RankMismatchError, error_line
    from megashard.launch.agent import EXIT_NO_RESTART, EXIT_PEER_LOST, is_peer_loss
    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 1:
        print("usage: python -m megashard.launch.worker CONFIG.yaml [key=value ...]", file=sys.stderr)
        return 2
    name = None
    if "--name" in args:
        i = args.index("--name")
        name = args[i + 1]
        del args[i: i + 2]
    import os

    startwatch.mark("imported")
    try:
        job = JobConfig.from_yaml(args[0], args[1:])
        if name:
            job.name = name
        if job.launch.elastic and _unfillable(job):
            return EXIT_NO_RESTART  # launch.unfillable_world=stop (with wait, _unfillable only returns by an error)
        from megashard.state import init_distributed
        from megashard.train.live_world import live_enabled

        startwatch.mark("init")
        try:
            if not live_enabled(job):  # live recovery forms its worlds in the rendezvous store (train.live)
                init_distributed(job.parallel)  # train() finds it up
        except RuntimeError as e:  # a missing rank: torch's store timed out (the launcher named the missing rank)
            if type(e).__name__ not in ("DistStoreError", "DistNetworkError", "DistError"):
                raise
            print(f"megashard run: rank {os.environ.get('RANK', '?')}: init_process_group failed: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
            return 1
        startwatch.mark("joined")
        if live_enabled(job):  # across world changes, in this process
            from megashard.train.live import train_live

            train_live(job)
        else:
            train(job)
    except KeyboardInterrupt:  # torchrun forwards Ctrl-C; it reports the interruption itself
        return 130
    except Exception as e:
        if is_peer_loss(e):
            sys.stderr.flush()
            time.sleep(_peer_loss_grace())  # torchrun stops us (SIGTERM) once it sees the failed worker
            os._exit(EXIT_PEER_LOST)  # no teardown: the process group is broken
        if not isinstance(e, MegashardError):
            raise
        if _prints(e, RankMismatchError):
            print(error_line("megashard run", e), file=sys.stderr)
        return EXIT_NO_RESTART  # the same start fails the same way: torchrun does not restart (megashard.launch.agent)
    finally:
        from megashard.state import end_distributed

        end_distributed()  # pooled groups, then the default group: no backend thread outlives Python
    return 0


if __name__ == "__main__":
    sys.exit(main())
