"""Which world a run trains in, and what changed since the previous start of the same job: nodes, layout, work lost.

    world = World.gather(job, state)            # collective: every rank names its node
    change = world.compare(job, start_step)     # rank 0: against <out_dir>/world.json (the previous start), or None
    for line in change.lines(): print(line)     # node left/joined, the new world and layout, the steps redone
    world.write(job, run_id, start_step)        # rank 0: what the next start compares with

Each start of a job — the first one, a torchrun restart after a failure, the rendezvous re-forming the world of an
elastic job (``launch.nnodes: MIN:MAX``) after a node left or joined — records its world in ``<out_dir>/world.json``:
the job id (shared by every launcher and restart of one launch), the run id, the nodes, the world size, the layout
and the step it started from. The next start of the same job compares its own world with it and says, one line each:
which node left or joined, the new world and layout, and how many steps the previous world trained past the
checkpoint the job resumed from (redone now). The first step's metrics record carries the change (``world_change``:
the world before, the nodes, the steps redone, the seconds without training and the seconds of the redone steps),
and every step's record its world size, so the loss plot marks the changes.

A node is named by its host and its launcher's pid (``megashard run``; else torchrun's), so two launchers on one
host are two nodes. ``<out_dir>`` must be shared by the nodes (it is, for checkpoints); where it is not, a start on
another node finds no record and says nothing about the change.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megashard.config import ResolvedSizes
    from megashard.state import ParallelState
    from megashard.train.config import JobConfig

__all__ = ["World", "WorldChange", "WORLD_FILE", "node_id"]

WORLD_FILE = "world.json"


def node_id() -> str:
    """``host:pid`` of this process's node: the launcher (``megashard run``) that started it, else torchrun's agent."""
    from megashard.processes import hostname

    pid = os.environ.get("MEGASHARD_LAUNCHER_PID") or os.environ.get("MEGASHARD_AGENT_PID") or str(os.getppid())
    return f"{hostname()}:{pid}"


def _names(nodes: list[str], others: list[str]) -> dict[str, str]:
    """How to print each node id: its host where the hosts tell the nodes apart, else ``host (launcher pid N)``."""
    hosts = [n.rsplit(":", 1)[0] for n in set(nodes) | set(others)]
    unique = len(set(hosts)) == len(hosts)
    out = {}
    for n in set(nodes) | set(others):
        host, _, pid = n.rpartition(":")
        out[n] = host if unique else f"{host} (launcher pid {pid})"
    return out


def _list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclass
class WorldChange:
    """What changed between the previous start of a job and this one (rank 0)."""

    before: dict
    """The previous start's record (``world.json``)."""
    world_size: int
    nodes: list
    left: list
    joined: list
    layout: str
    """This world's layout (:func:`megashard.train.elastic.layout_text`)."""
    start_step: int
    last_step: int
    """The last step the previous world trained (from metrics.jsonl; ``start_step`` if it trained none past it)."""
    last_time: Optional[float]
    """When that step ended (seconds since the epoch), None if unknown."""
    seconds_redone: float
    """Training time of the steps the previous world trained past ``start_step`` (lost, trained again now)."""
    names: dict = field(default_factory=dict)

    @property
    def steps_redone(self) -> int:
        return max(0, self.last_step - self.start_step)

    @property
    def changed(self) -> bool:
        """Whether the world differs from the previous start's (nodes or size), not just restarted."""
        return bool(self.left or self.joined) or self.before.get("world_size") != self.world_size

    def lines(self) -> list[str]:
        """One line each: the nodes that left or joined, the new world and its layout ([] for a restart in the same
        world: torchrun's restart line said it)."""
        if not self.changed:
            return []
        before = self.before.get("world_size")
        was = f"world {before} → {self.world_size}" if before != self.world_size else f"world {self.world_size}"
        who = []
        if self.left:
            who.append(f"node{'s' if len(self.left) > 1 else ''} {_list([self.names[n] for n in self.left])} left")
        if self.joined:
            who.append(f"node{'s' if len(self.joined) > 1 else ''} {_list([self.names[n] for n in self.joined])} "
                       "joined")
        first = (f"megashard run: {'; '.join(who)} ({was})" if who else
                 f"megashard run: the world changed size on the same node{'s' if len(self.nodes) != 1 else ''} ({was})")
        nodes = len(self.nodes)
        return [first, f"megashard run: new world of {self.world_size} processes on {nodes} node"
                       f"{'s' if nodes != 1 else ''}: {self.layout}"]

    def redone_text(self) -> str:
        """``"; 7 steps redone (31-37 of the previous start)"`` for the resumed line."""
        n = self.steps_redone
        if n <= 0:
            return "; no step redone"
        span = f"steps {self.start_step + 1}-{self.last_step}" if n > 1 else f"step {self.last_step}"
        return f"; {n} step{'s' if n != 1 else ''} redone ({span} of the previous start)"

    def record(self, first_step_end: float, first_step_s: float) -> dict[str, Any]:
        """The ``world_change`` entry of the first step's metrics record: the time from the previous world's last step
        to this one's first (minus that step's own time) is the time the job did not train."""
        down = (first_step_end - first_step_s - self.last_time) if self.last_time is not None else None
        return {"world_size_before": self.before.get("world_size"), "nodes_left": [self.names[n] for n in self.left],
                "nodes_joined": [self.names[n] for n in self.joined], "resumed_from": self.start_step,
                "last_step_before": self.last_step, "steps_redone": self.steps_redone,
                "seconds_down": None if down is None else round(max(0.0, down), 3),
                "seconds_redone": round(self.seconds_redone, 3)}


@dataclass
class World:
    """This start's world: the node of every rank (rank order), its size and layout."""

    nodes: list
    """Distinct node ids in the order of their lowest rank."""
    world_size: int
    sizes: "ResolvedSizes"

    @classmethod
    def gather(cls, state: "ParallelState", sizes: "ResolvedSizes") -> "World":
        """Every rank's node (one all-gather on the default group: a collective of every rank)."""
        import torch.distributed as dist

        me = node_id()
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, me)
        else:
            every = [me]
        return cls(list(dict.fromkeys(every)), len(every), sizes)

    @staticmethod
    def job_id() -> Optional[str]:
        from megashard.train.ckptlock import job_id_from_env

        return job_id_from_env()

    @classmethod
    def previous(cls, job: "JobConfig") -> Optional[dict]:
        """The record of the previous start of this same job (same job id, not ended), or None (rank 0)."""
        path = os.path.join(job.out_dir, WORLD_FILE)
        from megashard.errors import MegashardError
        from megashard.readers import SMALL, read_json

        try:
            rec = read_json(path, "world record", limit=SMALL)
        except MegashardError:
            return None
        jid = cls.job_id()
        if not isinstance(rec, dict) or rec.get("ended") or jid is None or rec.get("job_id") != jid:
            return None
        return rec

    def compare(self, job: "JobConfig", before: dict, start_step: int) -> WorldChange:
        """What changed since ``before`` (:meth:`previous`), with the work lost read from metrics.jsonl (rank 0,
        before the resumed run drops the steps past ``start_step`` from it)."""
        from megashard.train.elastic import layout_text
        from megashard.train.metrics import read_metrics

        old = [n for n in before.get("nodes") or [] if isinstance(n, str)]
        left = [n for n in old if n not in self.nodes]
        joined = [n for n in self.nodes if n not in old]
        records = [r for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl")) if isinstance(r.get("step"), int)]
        past = [r for r in records if r["step"] > start_step]
        last = max(records, key=lambda r: r["step"], default=None)
        return WorldChange(before=before, world_size=self.world_size, nodes=list(self.nodes), left=left, joined=joined,
                           layout=layout_text(job, self.sizes, per_rank=True), start_step=start_step,
                           last_step=max(start_step, last["step"]) if last else start_step,
                           last_time=last.get("time") if last else None,
                           seconds_redone=sum(float(r.get("step_time_s") or 0.0) for r in past),
                           names=_names(self.nodes, old))

    def write(self, job: "JobConfig", run_id: str, start_step: int, *, ended: bool = False) -> None:
        """Record this start in ``<out_dir>/world.json`` (rank 0; atomically replaced)."""
        path = os.path.join(job.out_dir, WORLD_FILE)
        rec = {"job_id": self.job_id(), "run_id": run_id, "world_size": self.world_size, "nodes": self.nodes,
               "sizes": self.sizes.as_dict(), "start_step": start_step, "time": time.time(), "ended": ended}
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(rec, f)
            os.replace(tmp, path)
        except OSError:
            pass  # the record is for messages only: a read-only or full disk must not stop training
