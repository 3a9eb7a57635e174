"""torchrun as ``megashard run`` starts it: ``python -m megashard.launch.agent <torchrun arguments>``.

The same elastic agent as ``python -m torch.distributed.run`` (same arguments, same rendezvous, restarts
and worker environment), with three differences:

- **it dies with its launcher**: the lifeline of :mod:`megashard.launch.lifeline` is armed first thing
  (parent = ``MEGASHARD_LAUNCHER_PID``), and the workers get theirs from ``MEGASHARD_AGENT_PID``;
- **short output**: torch's elastic log lines ("Sending process … closing signal SIGTERM", "failed
  (exitcode: 1) …", the final ``ChildFailedError`` traceback) are replaced by one line per event::

      megashard run: rank 1 failed (exit code 1); the other ranks lost their peers; torchrun restarts the job from the newest checkpoint (restart 1 of 1)
      megashard run: rank 1 failed (exit code 1); no restarts left (launch.max_restarts=1)

  Other warnings and errors of torchrun are still shown, one line each, prefixed ``megashard run: torchrun:``.
- workers that only **lost their peers** (a gloo/NCCL connection broke because another worker died) exit
  quietly with :data:`EXIT_PEER_LOST` instead of printing a traceback (see :func:`is_peer_loss`);
- **no restart for an error a restart cannot fix**: a worker that stops on a megashard error (a bad config, a
  checkpoint of another model, a damaged requested checkpoint: printed once, by the rank that found it) exits
  with :data:`EXIT_NO_RESTART`, and the agent then ends the job instead of restarting it
  (:func:`megashard._compat.elastic_agent_gives_up_on`)::

      megashard run: the job stopped on the error above; not restarted: a restart cannot fix it

- **elastic jobs** (``--nnodes MIN:MAX``): a node leaving or joining is a membership change, not a failure: the
  world is re-formed without using up ``--max-restarts`` (torch already counts a join so; a node whose workers all
  only lost their peers counts a leave so too), one line each::

      megashard run: a node left: the workers here lost their peers; the rendezvous re-forms the world without it (not counted against launch.max_restarts)
      megashard run: 1 node joined the rendezvous; the workers restart in the larger world (not counted against launch.max_restarts)

Exit code: 0 success, 1 the job failed, 2 it stopped on an error a restart cannot fix, 128 + N after signal N
(a Ctrl-C or SIGINT before torchrun's own handlers are in place ends it quietly with 130).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Optional, Sequence

from megashard.processes import EXIT_PEER_LOST, is_peer_loss  # noqa: E402 - re-exported (workers, user scripts)

__all__ = ["main", "is_peer_loss", "EXIT_PEER_LOST", "describe_exit", "is_elastic"]

EXIT_NO_RESTART = 2
"""Exit code of a worker that stopped on a megashard error (:class:`megashard.errors.MegashardError`): the same
start would fail the same way, so the agent does not restart the job (and exits with this code itself)."""

# torch's elastic log messages replaced by megashard's own lines (matched on the unformatted template).
_FAILED = "failed (exitcode"
_RESTART = "attempts left; will restart worker group"
_JOINED = "new nodes from group_rank"
_QUIET = ("closing signal", "death signal", "Got termination signal", "Setting OMP_NUM_THREADS",
          "config has no run_id")


def is_elastic(nnodes: Any) -> bool:
    """Whether torchrun's ``--nnodes`` value is a range MIN:MAX with MIN < MAX."""
    lo, _, hi = str(nnodes).partition(":")
    try:
        return bool(hi) and int(lo) < int(hi)
    except ValueError:
        return False


def describe_exit(code: int) -> str:
    """``1`` -> "exit code 1"; ``-9`` -> "killed by SIGKILL"; :data:`EXIT_PEER_LOST` -> "lost its peers"."""
    if code == EXIT_PEER_LOST:
        return "lost its peers"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Reporter(logging.Handler):
    """Turns torchrun's log records into megashard's one-line messages (see the module docstring)."""

    def __init__(self, nnodes: str, host: str) -> None:
        super().__init__(logging.INFO)
        self.single_node = str(nnodes) in ("1", "1:1")
        self.elastic = is_elastic(nnodes)
        self.host = host
        self.failure: Optional[tuple[int, int]] = None  # (local rank, exit code) of the newest failure
        self.membership = False  # the agent gave the coming restart back: every worker here only lost its peers
        self.live = False  # launch.recovery=live: a join does not restart the workers (megashard.launch.live_agent)

    def on_membership(self) -> None:
        """Called by the agent (megashard._compat) when a node left: the next restart re-forms the world."""
        self.membership = True

    def who(self, rank: Any, local: bool = True) -> str:
        return f"rank {rank}" if self.single_node or not local else f"local rank {rank} on {self.host}"

    def emit(self, record: logging.LogRecord) -> None:
        template = record.msg if isinstance(record.msg, str) else str(record.msg)
        try:
            if template.startswith(_FAILED):
                exitcode, local_rank = record.args[0], record.args[1]  # type: ignore[index]
                self.failure = (int(local_rank), int(exitcode))
                return
            if _JOINED in template:  # torch: "[role] Detected N new nodes from group_rank=G; will restart worker group"
                n = int(record.args[1])  # type: ignore[index]
                if self.live:
                    _say(f"{n} node{'s' if n != 1 else ''} joined the rendezvous; the running workers take "
                         f"{'them' if n != 1 else 'it'} in at their next step (no restart)")
                    return
                _say(f"{n} node{'s' if n != 1 else ''} joined the rendezvous; the workers restart in the larger world "
                     "(not counted against launch.max_restarts)")
                return
            if _RESTART in template:
                _, _, remaining, max_restarts = record.args  # type: ignore[misc]
                if self.membership:  # megashard._compat gave the restart back: the workers here only lost their peers
                    self.membership, self.failure = False, None
                    _say("a node left: the workers here lost their peers; the rendezvous re-forms the world without "
                         "it (not counted against launch.max_restarts)")
                    return
                n = int(max_restarts) - int(remaining) + 1
                cause = "a worker failed"
                if self.failure is not None:
                    rank, code = self.failure
                    who = self.who(rank)
                    cause = (f"{who} lost its peers (a worker on another node failed)" if code == EXIT_PEER_LOST
                             else f"{who} failed ({describe_exit(code)}); the other ranks lost their peers")
                _say(f"{cause}; torchrun restarts the job from the newest checkpoint (restart {n} of {max_restarts})")
                self.failure = None
                return
        except (TypeError, ValueError, IndexError):
            pass  # another torch's record layout: fall through to the generic line
        if record.levelno >= logging.WARNING and not any(q in template for q in _QUIET):
            _say("torchrun: " + record.getMessage().strip().replace("\n", " "))


def _say(msg: str) -> None:
    print(f"megashard run: {msg}", file=sys.stderr, flush=True)


def _summary(err: Any, max_restarts: int) -> str:
    """One line for torchrun's final ChildFailedError: the root failures (not the ranks they took down)."""
    failures = dict(getattr(err, "failures", {}) or {})
    if not failures:
        return "the job failed"
    if any(f.exitcode == EXIT_NO_RESTART for f in failures.values()):  # the rank that found it printed it
        return "the job stopped on the error above; not restarted: a restart cannot fix it"
    secondary = {EXIT_PEER_LOST, -int(signal.SIGTERM)}
    roots = {r: f for r, f in failures.items() if f.exitcode not in secondary} or failures
    by_exit: dict[str, list[int]] = {}
    for rank in sorted(roots, key=lambda r: (roots[r].timestamp, r)):  # the first failure first
        by_exit.setdefault(describe_exit(roots[rank].exitcode), []).append(rank)
    parts = []
    for what, ranks in by_exit.items():
        ranks = sorted(ranks)
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {shown} failed ({what})")
    left = (f"no restarts left (launch.max_restarts={max_restarts})" if max_restarts
            else "no restarts (launch.max_restarts=0)")
    return f"{'; '.join(parts)}; {left}"


def _quiet_torchrun_logs(reporter: logging.Handler) -> None:
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        lg = logging.getLogger(name)
        lg.addHandler(reporter)
        lg.propagate = False  # not through torch's own handler
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.INFO)  # the restart record is INFO


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megashard.launch.lifeline import die_with_parent, env_pid, hostname

    die_with_parent(env_pid("MEGASHARD_LAUNCHER_PID"))
    os.environ["MEGASHARD_AGENT_PID"] = str(os.getpid())  # the workers' lifeline
    import shutil
    import tempfile

    # Where the workers of this node agree who reports an error every rank finds (megashard.launch.worker): a
    # directory of this agent's own, removed when it ends.
    errors = tempfile.mkdtemp(prefix="megashard-errors-")
    os.environ["MEGASHARD_ERROR_DIR"] = errors
    try:
        return _main(argv)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _main(argv: Optional[Sequence[str]]) -> int:
    from megashard.launch.lifeline import hostname

    try:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        from megashard._compat import RENDEZVOUS_ROUND_ENV, elastic_agent_gives_up_on, export_rendezvous_round

        argv = list(sys.argv[1:] if argv is None else argv)
        args = parse_args(argv)
        reporter = _Reporter(args.nnodes, hostname())
        _quiet_torchrun_logs(reporter)
        from megashard.launch.startwatch import watch_from_env

        watch_from_env(argv)  # a worker that never reaches init_process_group is named (megashard run only)
        export_rendezvous_round(RENDEZVOUS_ROUND_ENV)  # the world the workers start in: the doctor's run identity
        elastic_agent_gives_up_on(frozenset({EXIT_NO_RESTART}), membership_code=EXIT_PEER_LOST
                                  if reporter.elastic else None, on_membership=reporter.on_membership)
        from megashard.launch import live_agent

        live_dir = live_agent.enable(args.rdzv_endpoint if reporter.elastic else None, _say)
        reporter.live = live_dir is not None
        try:
            run(args)
        except ChildFailedError as e:
            _say(_summary(e, int(args.max_restarts)))
            failures = dict(getattr(e, "failures", {}) or {})
            return EXIT_NO_RESTART if any(f.exitcode == EXIT_NO_RESTART for f in failures.values()) else 1
        except SignalException as e:  # our launcher died or was interrupted; the workers were stopped
            return 128 + int(e.sigval)
        except Exception as e:  # noqa: BLE001 - a node that comes to join a job which has ended, a lost store
            if type(e).__name__ == "RendezvousClosedError":
                _say("the job this node came to join has ended (its rendezvous is closed): nothing to do here")
                return 0
            if type(e).__name__ != "RendezvousConnectionError":
                raise
            _say(f"the rendezvous store at {args.rdzv_endpoint} is gone (its host, the launcher that started first, "
                 "was lost): this node cannot meet the others and stops; start the job again to resume from its "
                 "newest checkpoint")
            return 1
        finally:
            if live_dir is not None:
                import shutil

                shutil.rmtree(live_dir, ignore_errors=True)
    except KeyboardInterrupt:  # a SIGINT before torchrun's handlers (imports, rendezvous): the launcher reports it
        return 128 + int(signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
