"""Hangs before the first collective: a rank that never reaches ``init_process_group`` is named by the launcher.

The hang doctor (:mod:`megashard.doctor`) starts with the process group; before it there is start-up: torchrun's
rendezvous of the nodes, each worker's imports, ``init_process_group``. A node that never starts or a worker stuck
importing leaves every other rank waiting there, silently, until the timeout. So ``megashard run`` watches it:

- every worker marks its phase in a directory of the launch (``MEGASHARD_START_DIR``, on this node):
  ``started`` (its first line), ``imported`` (torch and the job's code), ``init`` (entering
  ``init_process_group``), ``joined`` (the process group is up). At start it also arms :mod:`faulthandler` to write
  its Python stack next to its mark after ``0.75 ×`` the timeout, unless it joined by then;
- torchrun's process (:mod:`megashard.launch.agent`) runs :class:`StartWatch`: when a worker of this node has not
  joined ``parallel.timeout`` seconds after the first one started (or 0.8 of it after the first one entered
  ``init_process_group``, which gives up after the timeout), it prints one line naming each rank still missing
  with its phase, for how long, and where it is (the innermost frame of its stack: ``stuck importing for 9.1 s (at
  /site/mymodel.py:12 in <module>)``), and the ranks that wait for it. When no worker of this node started within
  the timeout, torchrun is still in its rendezvous: the line says how many of ``launch.nnodes`` nodes joined.

Plain files, no torch: the watch costs a directory listing every half second until every worker joined.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["DIR_ENV", "TIMEOUT_ENV", "PHASES", "StartDir", "StartWatch", "arm_stack_dump", "describe", "mark",
           "read_marks", "watch_from_env"]

DIR_ENV = "MEGASHARD_START_DIR"
TIMEOUT_ENV = "MEGASHARD_START_TIMEOUT"
PHASES = ("started", "imported", "init", "joined")
_DUMP: list = []  # the open file faulthandler writes to


#: The rendezvous round megashard's agent gives its workers (``megashard._compat.RENDEZVOUS_ROUND_ENV``; not imported:
#: that package loads torch, and the first mark comes before any slow import).
ROUND_ENV = "MEGASHARD_RDZV_ROUND"


def _attempt() -> int:
    """Which start of the workers this is: the rendezvous round (a new world of an elastic job starts a new one, though
    the restart count stays), else torchrun's restart count."""
    for name in (ROUND_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def mark(phase: str) -> None:
    """Record this worker's start-up ``phase`` (a no-op outside ``megashard run``); ``joined`` also cancels the stack
    dump armed at start."""
    d = os.environ.get(DIR_ENV)
    local = os.environ.get("LOCAL_RANK", "")
    if not d or not local.isdigit():
        return
    if phase == "joined" and _DUMP:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    rec = {"local_rank": int(local), "rank": int(os.environ.get("RANK", local) or local), "pid": os.getpid(),
           "phase": phase, "time": time.time(), "attempt": _attempt()}
    path = os.path.join(d, f"rank_{local}.json")
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
    except OSError:  # the launcher's directory is gone: nothing to tell
        pass


def arm_stack_dump() -> None:
    """Write this worker's Python stack to ``<dir>/rank_<local rank>.stack`` after 0.75 × the timeout, unless it
    joined the process group first (what it was stuck in, for the launcher's line)."""
    d, local = os.environ.get(DIR_ENV), os.environ.get("LOCAL_RANK", "")
    try:
        timeout = float(os.environ.get(TIMEOUT_ENV, ""))
    except ValueError:
        return
    if not d or not local.isdigit() or not timeout > 0:
        return
    import faulthandler

    try:
        f = open(os.path.join(d, f"rank_{local}.stack"), "w", encoding="utf-8")  # noqa: SIM115 - held until dumped
    except OSError:
        return
    _DUMP.append(f)
    faulthandler.dump_traceback_later(0.75 * timeout, repeat=False, file=f, exit=False)


def read_marks(d: str) -> dict[int, dict[str, Any]]:
    """Local rank -> its newest mark, from directory ``d`` (a damaged or foreign file is left out)."""
    out = {}
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank_") and name.endswith(".json") and name[5:-5].isdigit()):
            continue
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("phase") in PHASES and isinstance(rec.get("time"), (int, float)):
            out[int(name[5:-5])] = rec
    return out


def innermost_frame(stack_text: str) -> Optional[str]:
    """``/x/model.py:12 in <module>`` from a faulthandler dump: the main thread's innermost frame outside Python's
    import machinery, and whether it is importing (``importing: ...``); None when there is none."""
    threads = stack_text.split("\n\n")
    main = next((t for t in threads if "Current thread" in t or "Thread 0x" in t), "")
    for block in threads:  # the main thread is the one whose outermost frame is the worker's entry point
        if "megashard/launch/worker.py" in block or "runpy.py" in block:
            main = block
            break
    frames = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")]
    importing = any("importlib._bootstrap" in f for f in frames)
    for f in frames:  # most recent call first
        if "importlib._bootstrap" in f or "<frozen " in f:
            continue
        try:
            path = f.split('"')[1]
            rest = f.split('"', 2)[2].strip().lstrip(",").strip()  # line 12 in <module>
            line, func = rest.replace("line ", "", 1).split(" in ", 1)
        except (IndexError, ValueError):
            continue
        return f"{'importing: ' if importing else ''}{path}:{line.strip()} in {func.strip()}"
    return None


def _pid_alive(pid: Any) -> bool:
    from megashard.processes import pid_alive

    return isinstance(pid, int) and pid_alive(pid)


def describe(marks: dict[int, dict[str, Any]], nproc: int, timeout: float, d: str,
             now: Optional[float] = None) -> Optional[str]:
    """The line for the local ranks that did not join (None when every one did): each missing rank's phase, for how
    long and where; then the ranks waiting for them in ``init_process_group``."""
    now = time.time() if now is None else now
    missing, waiting = [], []
    for local in range(nproc):
        m = marks.get(local)
        if m is not None and m["phase"] == "joined":
            continue
        if m is not None and m["phase"] == "init" and _pid_alive(m.get("pid")):
            waiting.append(m.get("rank", local))
            continue
        who = f"rank {m.get('rank', local)} (local rank {local}, pid {m.get('pid')})" if m else f"local rank {local}"
        if m is None:
            missing.append(f"{who}: no sign of life (it never reached megashard's worker: stuck in Python's start-up, "
                           "e.g. a sitecustomize or an unreachable file system, or never started)")
            continue
        since = now - float(m["time"])
        if not _pid_alive(m.get("pid")):
            missing.append(f"{who}: its process ended during start-up (after '{m['phase']}')")
            continue
        where = ""
        try:
            with open(os.path.join(d, f"rank_{local}.stack"), encoding="utf-8") as f:
                frame = innermost_frame(f.read())
            where = f" (at {frame.replace('importing: ', '')})" if frame else ""
        except OSError:
            pass
        doing = {"started": "stuck importing", "imported": "in its start-up code before init_process_group",
                 "init": "in init_process_group"}[m["phase"]]
        missing.append(f"{who}: {doing} for {since:.1f} s{where}")
    if not missing:
        return None
    head = (f"start-up: after {timeout:g} s (parallel.timeout), {len(missing)} of {nproc} local rank(s) did not reach "
            "init_process_group: ")
    tail = ""
    if waiting:
        shown = ", ".join(map(str, sorted(waiting)[:16]))
        them = "it" if len(missing) == 1 else "them"
        verb = "rank {} waits" if len(waiting) == 1 else "ranks {} wait"
        tail = f"; {verb.format(shown)} in init_process_group for {them}"
    return head + "; ".join(missing) + tail


class StartWatch(threading.Thread):
    """torchrun's watch of this node's start-up (see the module docstring); one line per attempt at most."""

    def __init__(self, d: str, nproc: int, timeout: float, nnodes: str = "1", endpoint: str = "",
                 joined_nodes: Optional[Callable[[], Optional[list[str]]]] = None,
                 say: Optional[Callable[[str], None]] = None):
        super().__init__(name="megashard-start-watch", daemon=True)
        self.d, self.nproc, self.timeout = d, nproc, timeout
        self.nnodes, self.endpoint = str(nnodes), endpoint
        self.joined_nodes = joined_nodes
        self.say = say or (lambda line: print(f"megashard run: {line}", file=sys.stderr, flush=True))
        self.lines: list[str] = []
        self._halt = threading.Event()
        self._t0 = time.time()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        reported: set = set()
        seen: dict[int, float] = {}  # attempt -> when its first worker started
        while not self._halt.wait(min(0.5, max(0.05, self.timeout / 20))):
            marks = read_marks(self.d)
            attempt = max((m.get("attempt", 0) for m in marks.values()), default=None)
            now = time.time()
            if attempt is None:
                if "rdzv" not in reported and now - self._t0 >= self.timeout:
                    reported.add("rdzv")
                    self._emit(self._rendezvous_line())
                continue
            current = {lr: m for lr, m in marks.items() if m.get("attempt", 0) == attempt}
            first = seen.setdefault(attempt, min(float(m["time"]) for m in current.values()))
            # The ranks in init_process_group give up ``timeout`` after entering it: say it before they do (at 0.8 of
            # it), or ``timeout`` after the first worker started when none got that far.
            entered = [float(m["time"]) for m in current.values() if m["phase"] == "init"]
            due = min(first + self.timeout, min(entered) + 0.8 * self.timeout) if entered else first + self.timeout
            if attempt in reported or now < due:
                continue
            line = describe(current, self.nproc, self.timeout, self.d, now)
            reported.add(attempt)
            if line:
                self._emit(line)

    def _emit(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)

    def _rendezvous_line(self) -> str:
        joined = None
        if self.joined_nodes is not None:
            try:
                joined = self.joined_nodes()
            except Exception:  # noqa: BLE001 - another torch's rendezvous: say what is known
                joined = None
        where = f" at {self.endpoint}" if self.endpoint else ""
        if joined is not None:
            nodes = f"{len(joined)} of {self.nnodes} node(s) joined ({', '.join(joined[:8])})"
        else:
            nodes = f"fewer than launch.nnodes={self.nnodes} node(s) joined"
        return (f"start-up: after {self.timeout:g} s (parallel.timeout) no worker of this node started: torchrun's "
                f"rendezvous{where} still waits: {nodes}; a node that never started, or cannot reach the endpoint?")


class StartDir:
    """The launcher's side: a private temporary directory for the marks of this launch's workers (removed by
    :meth:`remove`), and the environment that tells torchrun and the workers about it and the timeout."""

    def __init__(self, timeout: float):
        import tempfile

        self.path = tempfile.mkdtemp(prefix="megashard-start-")
        self.env = {DIR_ENV: self.path, TIMEOUT_ENV: repr(float(timeout))}

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)


def watch_from_env(argv: list[str]) -> Optional[StartWatch]:
    """The agent's watch, from the launcher's environment and torchrun's arguments; None outside ``megashard run``."""
    d = os.environ.get(DIR_ENV)
    try:
        timeout = float(os.environ.get(TIMEOUT_ENV, ""))
    except ValueError:
        return None
    if not d or not timeout > 0:
        return None

    def arg(name: str, default: str = "") -> str:
        for i, a in enumerate(argv):
            if a == name and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default

    nproc = arg("--nproc-per-node", arg("--nproc_per_node", "1"))
    handlers: list = []
    from megashard._compat import capture_rendezvous_handlers, rendezvous_joined

    capture_rendezvous_handlers(handlers)
    watch = StartWatch(d, int(nproc) if nproc.isdigit() else 1, timeout, arg("--nnodes", "1"),
                       arg("--rdzv-endpoint", arg("--rdzv_endpoint")),
                       joined_nodes=lambda: rendezvous_joined(handlers[-1]) if handlers else None)
    watch.start()
    return watch
