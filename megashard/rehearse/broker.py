"""Many rehearsed ranks, each in a process of its own, and the mailbox that carries what a receive needs.

    traces = Broker(body, world_size=64, jobs=2).run()       # rank -> RankTrace

Every rank is a process forked from this one (torch and megashard already imported: a fork costs milliseconds) that
calls ``body(rank, recorder)`` on the ``fake`` backend (:mod:`megashard.rehearse.job`, :mod:`~.script`) and
sends its :class:`~megashard.rehearse.recorder.RankTrace` back. Collectives need no peer (the fake backend returns at
once); a receive does when the rank goes on with the value (a pipeline's metadata, a probe's check). So sends are
posted to the broker (this process) and a receive asks for its message, ``(src, dst, k)``: the k-th message from
``src`` to ``dst``; the rank waits, blocked in its pipe, until the sender rank posts it. A rank blocked costs no CPU;
``jobs`` ranks run at a time; a sender not started yet is started first. When no rank can run and some wait for
messages nobody will send, the waiting ranks are told so (:class:`~megashard.rehearse.recorder.Unmatched`) and end
with what they recorded: an unmatched receive, or a cycle of ranks each waiting for the next.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable, Optional

from megashard.rehearse.recorder import Recorder, RankTrace, Unmatched

__all__ = ["Broker", "Channel", "default_jobs"]


def default_jobs() -> int:
    """Processes that run at a time: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _send(conn: Any, msg: Any) -> None:
    """Plain pickle, not multiprocessing's: its pickler passes a tensor's storage as a file descriptor that dies with
    the sending rank's process (which may end before the message is read)."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _shared(key: tuple) -> bool:
    """A message every member of a group takes (a broadcast: ``(src, -1, group, n)``), kept once posted."""
    return len(key) == 4 and key[1] == -1


class Channel:
    """A rank's end of its pipe to the broker: ``put`` a message, ``get`` one (waiting for its sender)."""

    def __init__(self, conn: Any):
        self.conn = conn

    def put(self, key: tuple[int, int, int], value: Any) -> None:
        _send(self.conn, ("put", key, value))

    def get(self, key: tuple[int, int, int]) -> Any:
        _send(self.conn, ("get", key))
        reply = _recv(self.conn)
        if reply[0] == "abort":
            raise Unmatched(key[0], key[1], key[2] if len(key) == 3 else 0, reply[1])
        return reply[1]


def _child(rank: int, world_size: int, conn: Any, body: Callable[[int, Recorder], Any], inherited: list,
           exact: bool = False) -> None:
    """The rank's process: run ``body``, send the trace, leave without running the parent's exit handlers."""
    for other in inherited:  # the broker's ends of the pipes (its own too): so that a broker that ends is seen
        other.close()
    code = 0
    t0 = time.perf_counter()
    recorder = Recorder(rank, world_size, Channel(conn), exact=exact)
    try:
        import torch

        torch.set_num_threads(1)
        recorder.trace.result = body(rank, recorder)
    except Unmatched as e:
        recorder.trace.status = "blocked"
        recorder.trace.blocked = (e.src, e.k, e.why)
    except BaseException as e:  # noqa: BLE001 - the rank's own error is part of its trace
        recorder.trace.status = "error"
        recorder.trace.error = _error_text(e)
    recorder.trace.seconds = time.perf_counter() - t0
    try:
        _send(conn, ("done", recorder.trace))
    except Exception as e:  # noqa: BLE001 - a result that cannot be pickled: the trace without it
        recorder.trace.result = None
        recorder.trace.error = recorder.trace.error or f"its result could not be sent back: {e}"
        _send(conn, ("done", recorder.trace))
        code = 1
    conn.close()
    os._exit(code)


def _error_text(e: BaseException) -> str:
    """``ValueError: ... (at file:line)``: the exception and the innermost frame outside torch."""
    from megashard.rehearse.recorder import _skip_dirs

    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not os.path.realpath(frame.filename).startswith(_skip_dirs()):
            where = f" (at {os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd()) else frame.filename}:{frame.lineno})"
            break
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}{where}"


class Broker:
    """Runs ``body`` for ranks of a world, ``jobs`` at a time (see the module docstring).

    Args:
        body: ``body(rank, recorder)`` in the rank's process; what it returns is the trace's ``result``.
        world_size: ranks of the world.
        ranks: the ranks to rehearse (default all), in this order; a rank whose message one of them waits for is
            started too (a pipeline's peers) and its trace returned with the others.
        jobs: ranks running at a time (default :func:`default_jobs`).
        progress: ``progress(done, total)`` after each rank ends.
        exact: collectives carry values (:mod:`megashard.rehearse.exact`; ``ranks`` should then be every rank).
    """

    def __init__(self, body: Callable[[int, Recorder], Any], world_size: int, ranks: Optional[Iterable[int]] = None,
                 *, jobs: Optional[int] = None, progress: Optional[Callable[[int, int], None]] = None,
                 exact: bool = False):
        self.body = body
        self.world_size = int(world_size)
        self.order = list(range(self.world_size) if ranks is None else ranks)
        self.jobs = max(1, jobs or default_jobs())
        self.progress = progress
        self.exact = exact
        self._ctx = multiprocessing.get_context("fork")

    def run(self) -> dict[int, RankTrace]:
        pending = deque(self.order)
        queued = set(self.order)
        started: dict[int, Any] = {}  # rank -> (process, conn)
        by_conn: dict[Any, int] = {}
        running: set[int] = set()
        waiting: dict[tuple, list[int]] = {}  # message key -> the ranks waiting for it
        # A key (src, dst, k) is one point-to-point message, taken once, and so is (src, dst, group, n, "x"), src's part
        # for dst of their n-th collective on a group (an exact rehearsal); (src, -1, group, n) is what rank src
        # broadcast in its n-th collective on a group: every member takes it.
        blocked_on: dict[int, tuple] = {}
        mailbox: dict[tuple, Any] = {}
        traces: dict[int, RankTrace] = {}
        total = len(self.order)

        def start(rank: int) -> None:
            parent, child = self._ctx.Pipe(duplex=True)
            p = self._ctx.Process(target=_child, daemon=True,
                                  args=(rank, self.world_size, child, self.body, [*by_conn, parent], self.exact))
            p.start()
            child.close()
            started[rank] = (p, parent)
            by_conn[parent] = rank
            running.add(rank)

        def finish(rank: int, trace: Optional[RankTrace]) -> None:
            p, conn = started[rank]
            by_conn.pop(conn, None)
            conn.close()
            p.join(timeout=10)
            if trace is None:
                trace = RankTrace(rank, self.world_size, status="error",
                                  error=f"its process ended without a trace (exit code {p.exitcode})")
            traces[rank] = trace
            running.discard(rank)
            if self.progress is not None:
                self.progress(len(traces), total)

        try:
            while pending or by_conn:
                while pending and len(running) < self.jobs:
                    start(pending.popleft())
                if not running and by_conn:  # every live rank waits for a message
                    if pending:
                        start(pending.popleft())
                        continue
                    for key, ranks in list(waiting.items()):  # nobody is left to send them
                        src = key[0]
                        why = ("rank {} ended without sending it".format(src) if src in traces else
                               f"rank {src} waits itself" if src in blocked_on else f"rank {src} is not rehearsed")
                        for rank in ranks:
                            _send(started[rank][1], ("abort", why))
                            running.add(rank)
                            blocked_on.pop(rank, None)
                        waiting.pop(key)
                    continue
                for conn in wait(list(by_conn)):
                    rank = by_conn[conn]
                    try:
                        msg = _recv(conn)
                    except (EOFError, OSError):
                        finish(rank, None)
                        continue
                    kind = msg[0]
                    if kind == "put":
                        key, value = msg[1], msg[2]
                        mailbox[key] = value
                        for who in waiting.pop(key, []):
                            _send(started[who][1], ("msg", mailbox[key] if _shared(key) else mailbox.pop(key)))
                            blocked_on.pop(who, None)
                            running.add(who)
                    elif kind == "get":
                        key = msg[1]
                        if key in mailbox:
                            _send(conn, ("msg", mailbox[key] if _shared(key) else mailbox.pop(key)))
                        else:
                            waiting.setdefault(key, []).append(rank)
                            blocked_on[rank] = key
                            running.discard(rank)
                            src = key[0]
                            if 0 <= src < self.world_size and src not in queued:  # a peer outside the ranks asked
                                queued.add(src)
                                total += 1
                                pending.appendleft(src)
                            elif src in pending:  # its sender next
                                pending.remove(src)
                                pending.appendleft(src)
                    elif kind == "done":
                        finish(rank, msg[1])
        finally:
            for p, conn in started.values():
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        return dict(sorted(traces.items()))
