"""Elastic jobs on one machine: several ``megashard run`` launchers ("nodes") on localhost with a c10d rendezvous.

Used by tests/test_elastic.py and benchmarks/elastic.py:

    run = ElasticRun(out_dir, "configs/default.yaml", ["train.steps=20"])   # launch.nnodes=1:2, 2 processes per node
    a = run.node("A"); run.wait_store(); b = run.node("B")                   # A hosts the rendezvous store
    run.wait_for(lambda m: top(m, world=4) >= 5, "5 steps at world 4")
    b.kill()                                                                  # SIGKILL: the node is gone

A node is killed with SIGKILL to its launcher's process group; torchrun and the workers follow through their
lifelines within milliseconds, as the processes of a machine that went down. The launcher that starts first hosts the
rendezvous store (its agent binds ``launch.rdzv_endpoint``), so the scenarios kill another one — unless the test
process hosts the store itself (``host_store=True``: then any node may go, rank 0's first). A test holds the job
before a step with :meth:`ElasticRun.pause` (``MEGASHARD_PAUSE_FILE``) while nodes leave and join.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def load() -> str:
    return "load average " + ", ".join(f"{v:.1f}" for v in os.getloadavg())


class Node:
    """One launcher (``megashard run``) in a session of its own; its output goes to ``<out>/<name>.log``."""

    def __init__(self, name: str, argv: list, env: dict, log_path: str) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w", encoding="utf-8")
        self.started = time.time()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> float:
        """SIGKILL the launcher's process group (torchrun and the workers follow); returns the time of the kill."""
        t = time.time()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        return t

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node {self.name} did not finish within {timeout:.0f} s ({load()}):\n{self.log()}")
        self._log.close()
        return code

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


class ElasticRun:
    """The launchers of one elastic job, its files and the conditions a scenario waits for."""

    def __init__(self, out_dir: str, config: str, overrides: list, *, nnodes: str = "1:2", nproc: int = 2,
                 last_call: int = 4, node_timeout: int = 3, timeout: float = 300.0, host_store: bool = False,
                 check: Optional[bool] = None) -> None:
        self.out, self.timeout = out_dir, timeout
        # the launchers' logs and the pause file beside the run directory: megashard writes only into a directory of
        # its own, and the test's files are not megashard's
        self.aux = out_dir.rstrip(os.sep) + "-launchers"
        os.makedirs(self.aux, exist_ok=True)
        self.port = free_port()
        self.store = None
        if host_store:  # the rendezvous store lives in this process: every launcher is a client (c10d falls back)
            from datetime import timedelta

            import torch.distributed as dist

            self.store = dist.TCPStore("localhost", self.port, is_master=True, wait_for_workers=False,
                                       multi_tenant=True, timeout=timedelta(seconds=timeout))
        self.pause_file = os.path.join(self.aux, "pause")
        self.argv = [sys.executable, "-m", "megashard", "run", config, *overrides,
                     f"launch.nnodes={nnodes}", f"launch.nproc_per_node={nproc}",
                     f"launch.rdzv_endpoint=localhost:{self.port}", f"launch.rdzv_id=elastic-{self.port}",
                     f"launch.rdzv_last_call={last_call}", f"launch.rdzv_node_timeout={node_timeout}",
                     "launch.max_restarts=0", f"train.out_dir={out_dir}", "train.progress=false"]
        self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1", "MEGASHARD_PAUSE_FILE": self.pause_file}
        if check is not None:  # the check before launch as a user gets it (True) or off; None: as the environment says
            self.env["MEGASHARD_CHECK"] = "auto" if check else "off"
        self.nodes: list[Node] = []

    def node(self, name: str) -> Node:
        n = Node(name, self.argv, self.env, os.path.join(self.aux, f"{name}.log"))
        self.nodes.append(n)
        return n

    def wait_store(self) -> None:
        """Until the first launcher's torchrun listens on the rendezvous port (it hosts the store)."""
        self.wait_for(lambda m: _listening(self.port), f"the rendezvous store on port {self.port}", metrics=False)

    def metrics(self) -> list:
        from megashard.train.metrics import read_metrics

        return read_metrics(os.path.join(self.out, "metrics.jsonl"))

    def world(self) -> dict:
        try:
            with open(os.path.join(self.out, "world.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def wait_for(self, cond: Callable, what: str, *, metrics: bool = True, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not cond(self.metrics() if metrics else None):
            if time.monotonic() > deadline or not any(n.alive() for n in self.nodes):
                logs = "\n".join(f"--- {n.name} ---\n{n.log()[-4000:]}" for n in self.nodes)
                raise AssertionError(f"waited in vain for {what} ({load()}):\n{logs}")
            time.sleep(0.1)

    def pause(self) -> None:
        open(self.pause_file, "w").close()

    def go_on(self) -> None:
        if os.path.exists(self.pause_file):
            os.remove(self.pause_file)

    def stop_all(self) -> None:
        for n in self.nodes:
            if n.alive():
                n.kill()
        self.store = None  # the server goes with the last reference


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("localhost", port), timeout=0.5):
            return True
    except OSError:
        return False


def top(records: list, world: Optional[int] = None, after: int = 0) -> int:
    """The highest step in ``records`` (trained at ``world`` processes, past step ``after``); 0 if none."""
    return max([r["step"] for r in records if (world is None or r.get("world_size") == world) and r["step"] > after],
               default=0)


def _saving(ckpt_dir: str) -> list:
    try:
        return [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-")]
    except OSError:
        return []


def kill_and_rejoin(run: ElasticRun, *, kill_after: int = 5, steps_at_2: int = 4, during_save: bool = False,
                    kill: int = 1) -> dict:
    """The scenario of issue 30: nodes A and B (A hosts the store) train at world 4; B is killed after step
    ``kill_after`` (``during_save``: at the first checkpoint write after it, while its ``.tmp-`` directory exists); A
    goes on at world 2 for ``steps_at_2`` steps (held there, paused); B2 starts and joins; the job grows back to world
    4 and finishes. ``kill=0`` kills A instead (the node of rank 0; the test process must host the store). Returns
    the times of the kill and of the rejoin, the exit codes, and the checkpoint writes in progress at the kill."""
    a = run.node("A")
    run.wait_store()
    run.node("B")
    run.wait_for(lambda m: top(m, world=4) >= kill_after, f"step {kill_after} at world 4")
    ckpt_dir = os.path.join(run.out, "checkpoints")
    saving: list = []
    if during_save:
        deadline = time.monotonic() + run.timeout
        while not saving and time.monotonic() < deadline and run.nodes[kill].alive():
            saving = _saving(ckpt_dir)
            time.sleep(0.001)
    t_kill = run.nodes[kill].kill()
    survivor = run.nodes[1 - kill]
    run.wait_for(lambda m: run.world().get("world_size") == 2 and run.world().get("time", 0) > t_kill,
                 "the world of 2 after the kill", metrics=False)
    s2 = run.world()["start_step"]
    run.wait_for(lambda m: top(m, world=2, after=s2) >= s2 + steps_at_2, f"{steps_at_2} steps at world 2")
    run.pause()  # hold world 2 before its next step while B2 joins
    t_join = time.time()
    b2 = run.node("B2")
    run.wait_for(lambda m: run.world().get("world_size") == 4 and run.world().get("time", 0) > t_join,
                 "the world of 4 after B2 joined", metrics=False)
    run.go_on()
    codes = {survivor.name: survivor.wait(run.timeout), "B2": b2.wait(run.timeout)}
    return {"t_kill": t_kill, "t_join": t_join, "codes": codes, "resumed_at_2": s2, "saving_at_kill": saving}


#: Overrides that change neither the losses nor the final parameters of an uninterrupted one-launcher run (how a
#: lost node is recovered, the host copies kept for it, the doctor's records): references that differ only in them
#: are one run (:func:`reference`).
_NO_EFFECT_ON_A_REFERENCE = ("launch.recovery=", "checkpoint.memory_copies=", "train.doctor=")
_REFERENCES: dict = {}  # (config, world, overrides that matter) -> the output directory of a successful run


def reference(out_dir: str, config: str, overrides: list, world: int = 4, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """The same job uninterrupted on one launcher of ``world`` processes. A reference of this process that differs
    only in overrides without effect on its metrics and checkpoints is copied to ``out_dir`` instead of run again
    (test_elastic.py and test_elastic_live.py compare with the same ones)."""
    key = (config, world, tuple(sorted(o for o in overrides if not o.startswith(_NO_EFFECT_ON_A_REFERENCE))))
    done = _REFERENCES.get(key)
    if done is not None and os.path.isdir(done):
        shutil.copytree(done, out_dir)
        return subprocess.CompletedProcess([], 0, "", f"(a copy of the reference run in {done})")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "megashard", "run", config, *overrides, "launch.nnodes=1",
                        f"launch.nproc_per_node={world}", f"train.out_dir={out_dir}", "train.progress=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode == 0:
        _REFERENCES[key] = out_dir
    return p


def loss_differences(want: list, got: list) -> dict:
    """Per step: the relative difference of the losses of two metrics files (which must cover the same steps)."""
    a = {r["step"]: r["loss"] for r in want}
    b = {r["step"]: r["loss"] for r in got}
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return {s: abs(a[s] - b[s]) / abs(a[s]) for s in a}


def param_difference(ckpt_a: str, ckpt_b: str) -> float:
    """Largest relative difference of the final parameters of two checkpoint directories (per tensor: the largest
    element difference over the largest magnitude)."""
    from megashard.train.checkpointing import read_full_model

    a, b = read_full_model(ckpt_a), read_full_model(ckpt_b)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        scale = float(a[k].abs().max()) or 1.0
        worst = max(worst, float((a[k].double() - b[k].double()).abs().max()) / scale)
    return worst
