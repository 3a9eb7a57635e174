"""In-process re-formation of an elastic job's world (``launch.recovery: live``): the same processes, a new world.

    world = LiveWorld.from_env(job.parallel)   # under megashard's agent (it exports the store and its directory)
    world.join()                               # the default group of this rendezvous round's world
    ...
    except Exception as e:                     # a collective failed: a peer is gone
        world.after_loss(e)                    # abort the broken groups, agree with the survivors, a new default group
    ...
    info = world.join_due()                    # at a step boundary (collective): a node waits to join?
    if info: world.adopt(info)                 # the new round's default group, the newcomers in it

Every group of the world lives in the rendezvous host's store (``launch.rdzv_endpoint``, the c10d store that torch's
rendezvous already needs alive), under a key prefix per world: ``r<round>`` for the world of a rendezvous round,
``r<round>.<k>`` for the k-th world the survivors of a loss formed in it.

**A loss** (a collective raised because a peer process went away) is handled by the survivors alone, not by torch's
rendezvous: the first to see it sets the world's *abort* key; a thread of every worker watches it and aborts its
process groups (``ProcessGroup.abort``, and on gloo, where that does nothing, a shutdown of the connections its
groups accepted: :mod:`megashard._compat.gloo_abort`), so that a collective blocked on a survivor that already left
fails at once instead of waiting ``parallel.timeout``; every survivor then registers. A worker's watcher also
answers the abort key at once (``here/<rank>``), before its main thread has left the broken collective. The first to
register is the leader: it waits until every rank registered or, for each node, either all its ranks did or none did
nor answered within :data:`GRACE_S` seconds (its processes are gone; a node that answered is waited for, at most ten
grace periods), then writes the decision: the surviving ranks (whole nodes only), renumbered in their old order. The
members form the next world; a worker left out (its node was too slow to answer) exits with
:data:`~megashard.launch.agent.EXIT_PEER_LOST` and its launcher brings it back through the rendezvous, as a join.

**A join** goes through torch's rendezvous: megashard's agent sees the waiting node, completes the next round
without stopping its workers (:mod:`megashard.launch.live_agent`) and writes the workers' new ranks into its
directory (``round.json``); at the next step boundary the workers agree (one all-reduce of a flag) to move, and
every worker of the round — the newcomers started by their agents meanwhile — forms its default group. The running
workers wait for the newcomers to have imported and built everything (``r<round>/ready``) before they leave their
world, so a join costs them about the time of the new group and the state transfer, not a process start.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megashard._compat.gloo_abort import listening_now

__all__ = ["LiveWorld", "LeftOut", "JobEnded", "ReformTimeout", "failover_line", "LIVE_STORE_ENV", "LIVE_DIR_ENV",
           "ROUND_FILE", "GRACE_S", "live_enabled"]

LIVE_STORE_ENV = "MEGASHARD_LIVE_STORE"
"""``host:port`` of the rendezvous store, exported to the workers by megashard's agent in live mode."""
LIVE_DIR_ENV = "MEGASHARD_LIVE_DIR"
"""The agent's directory where it hands its workers a new rendezvous round (:data:`ROUND_FILE`)."""
ROUND_FILE = "round.json"
GRACE_S = 0.5
"""Seconds from the leader's first look after which a node none of whose ranks registered nor answered the abort (its
watcher's ``here`` key, set within a poll of the abort) counts as gone (env ``MEGASHARD_LIVE_GRACE_S``); the leader
closes the new world once every other node's ranks all registered. A node that answered is waited for, at most ten
grace periods (at least 10 s)."""
_POLL_S = 0.05


def debug(msg: str) -> None:
    """``MEGASHARD_LIVE_DEBUG=1``: one line per live-recovery event on stderr (development aid)."""
    if os.environ.get("MEGASHARD_LIVE_DEBUG"):
        import sys

        print(f"[live {time.time() % 100:7.3f} rank {os.environ.get('RANK')}] {msg}", file=sys.stderr, flush=True)


class _NotArrived(RuntimeError):
    """A member of a world the survivors agreed on did not arrive (lost while the world re-formed)."""


def _arrival_s(timeout: float) -> float:
    """How long the members of a re-formed world wait for each other: ten grace periods, at least 10 s, at most the
    group timeout."""
    return min(float(timeout), max(10.0, 10 * _grace()))


class ReformTimeout(RuntimeError):
    """The survivors did not re-form the world within ``parallel.timeout`` (no decision, or a re-formation that kept
    failing): this worker fails over to torchrun's rendezvous (the restart path)."""


def failover_line(rank: Any, timeout: float, why: str) -> str:
    """The one line a worker prints when it gives up re-forming the world in place."""
    return (f"megashard run: rank {rank}: the world did not re-form in place within parallel.timeout={timeout:g} s "
            f"({why}); this node goes back through torchrun's rendezvous (the restart path)")


class JobEnded(RuntimeError):
    """The job ended before the world this worker came to join formed (a node that joined at the very end)."""


class LeftOut(RuntimeError):
    """The survivors formed the new world without this worker (its node answered too late)."""


def live_enabled(job: Any) -> bool:
    """Whether this worker re-forms its world in place: an elastic job with ``launch.recovery: live`` started by
    megashard's agent (which exports the rendezvous store)."""
    return bool(job.launch.elastic and job.launch.recovery == "live" and os.environ.get(LIVE_STORE_ENV))


@dataclass
class RoundInfo:
    """A rendezvous round the agent completed while its workers ran: this worker's rank and world in it."""

    round: int
    rank: int
    world_size: int


def _grace() -> float:
    try:
        return max(0.1, float(os.environ.get("MEGASHARD_LIVE_GRACE_S", GRACE_S)))
    except ValueError:
        return GRACE_S


class LiveWorld:
    """This worker's place in the live job: the store, the current world's prefix, rank and nodes, the watcher."""

    def __init__(self, endpoint: str, run_id: str, backend: str, timeout: float, device_type: str = "cpu") -> None:
        host, _, port = endpoint.rpartition(":")
        self.timeout = float(timeout)
        self.backend, self.device_type = backend, device_type
        self._endpoint = (host or "localhost", int(port))
        self.root = self._client()
        self.round = int(os.environ.get("MEGASHARD_RDZV_ROUND", "0") or 0)
        self.prefix = f"r{self.round}"
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.nodes: list[str] = []
        self.agent_of: dict[str, str] = {}  # node id -> its agent in torch's rendezvous (``addr:pid``)
        self.gone_agents: set[str] = set()  # agents of the nodes the survivors found gone (tell_agent)
        self.agent_dir = os.environ.get(LIVE_DIR_ENV) or None
        self._seen_round_mtime = 0.0
        self._watch: Optional[threading.Thread] = None
        self._leaving = threading.Event()
        self._listening: frozenset = frozenset()  # TCP listeners before this world's groups (see abort_groups)
        self._stop = threading.Event()
        self.run_id = run_id
        self.changes = 0  # worlds formed after the first

    @classmethod
    def from_env(cls, parallel: Any) -> "LiveWorld":
        from megashard.state.devices import resolve_backend

        return cls(os.environ[LIVE_STORE_ENV], os.environ.get("TORCHELASTIC_RUN_ID", "job"), resolve_backend(parallel),
                   parallel.timeout, parallel.device)

    def _client(self) -> Any:
        store = dist.TCPStore(self._endpoint[0], self._endpoint[1], is_master=False,
                              timeout=timedelta(seconds=self.timeout))
        return dist.PrefixStore(f"megashard-live/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}", store)

    # ------------------------------------------------------------------------------------------- forming a world
    def join(self) -> None:
        """Form the default group of this round's world (this worker's first; RANK / WORLD_SIZE from torchrun)."""
        self.root.add(f"{self.prefix}/ready", 1)  # running workers of an earlier world wait for the newcomers
        self._form(self.rank, self.world_size, arrival_s=self.timeout)

    def _form(self, rank: int, world_size: int, arrival_s: Optional[float] = None) -> None:
        """The default group of world ``self.prefix``; ``arrival_s``: first wait at most that long for every member
        to arrive (a member that died meanwhile raises :class:`_NotArrived` instead of a hang in the group's start)."""
        from megashard.train.world import node_id

        if arrival_s is not None:
            key = f"{self.prefix}/arrived"
            self.root.add(key, 1)
            deadline = time.monotonic() + arrival_s
            while self.root.add(key, 0) < world_size:
                if self.root.check(["ended"]):
                    raise JobEnded("the job ended before this world formed")
                if time.monotonic() > deadline:
                    raise _NotArrived(self.prefix)
                time.sleep(_POLL_S)
        if self.backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self._listening = listening_now()  # what listened before this world's groups (abort_groups spares it)
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{self.prefix}/pg", self.root), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=self.timeout))
        debug(f"forming world {self.prefix} as rank {rank} of {world_size}")
        self.rank, self.world_size = rank, world_size
        from megashard._compat import RENDEZVOUS_NODE_ENV

        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, (node_id(), os.environ.get(RENDEZVOUS_NODE_ENV, "")))
        self.nodes = [n for n, _ in every]
        self.agent_of = {n: a for n, a in every}
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        self._start_watch()

    def _start_watch(self) -> None:
        from megashard.processes import EXIT_PEER_LOST

        self._stop, self._leaving = threading.Event(), threading.Event()
        key, stop, leaving, client = f"{self.prefix}/abort", self._stop, self._leaving, self._client()
        here = f"{self.prefix}/here/{self.rank}"
        before, timeout, rank = self._listening, self.timeout, self.rank

        def watch() -> None:  # a survivor blocked in a collective with another survivor that already left
            while not stop.wait(_POLL_S):
                try:
                    if client.check([key]):
                        debug(f"watcher: {key} set: aborting")
                        try:
                            client.set(here, "1")  # this process lives: the survivors' leader waits for it (_decide)
                        except Exception:  # noqa: BLE001 - the store's host is gone: abort all the same
                            pass
                        abort_groups(before)
                        break
                except Exception:  # noqa: BLE001 - the store's host is gone: the main thread finds out
                    return
            else:
                return
            # the last resort, should anything still block the main thread (a wait no abort reaches): the restart path
            if not leaving.wait(timeout):
                import sys

                print(failover_line(rank, timeout, "this worker stayed blocked in the broken world after its abort"),
                      file=sys.stderr, flush=True)
                os._exit(EXIT_PEER_LOST)

        self._watch = threading.Thread(target=watch, name="megashard-live-watch", daemon=True)
        self._watch.start()

    def leave(self, *, abort: bool) -> None:
        """Let go of this world's groups: aborted (a peer is gone: nothing may block) or destroyed (a planned move);
        megashard's state and pooled groups first, then the default group."""
        import gc

        import megashard.state as ms
        from megashard.state.pool import release_process_groups

        from megashard.models.parallelize import forget_stage_meshes

        self._leaving.set()  # the main thread got out of the broken world (the watcher's last resort stands down)
        self._stop.set()
        if self._watch is not None:  # its abort must not reach the next world's groups
            self._watch.join(timeout=self.timeout)
        if abort:
            abort_groups(self._listening)
        forget_stage_meshes()
        ms.destroy()
        release_process_groups()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - an aborted group: forgetting it is all that is left to do
                pass
        gc.collect()

    # ------------------------------------------------------------------------------------------- a loss
    def signal_abort(self) -> None:
        """This world is broken: tell every rank (their watchers abort their groups) and abort this rank's. This
        rank's watcher stays until :meth:`leave`: should the main thread stay blocked in the broken world longer than
        ``parallel.timeout``, it ends the process for the restart path (one line)."""
        try:
            self.root.set(f"{self.prefix}/abort", "1")
        finally:
            abort_groups(self._listening)

    def after_loss(self) -> None:
        """A peer is gone: abort this world, agree with the survivors on the next one and form it. Raises
        :class:`LeftOut` when the others formed it without this worker. A member that does not arrive at the new
        world within :func:`_arrival_s` (a second node lost meanwhile) makes the members agree again, without it.
        Every wait is bounded by ``parallel.timeout``, and no new attempt starts after it: :class:`ReformTimeout`."""
        root, rank, nodes, prefix = self.root, self.rank, list(self.nodes), self.prefix
        root.set(f"{prefix}/abort", "1")
        self.leave(abort=True)
        give_up, why = time.monotonic() + self.timeout, ""
        while True:
            if time.monotonic() > give_up:
                raise ReformTimeout(f"the members of {prefix} kept failing to form it: {why}")
            decision = self._agree(prefix, rank, nodes)
            members = decision["members"]
            debug(f"decision after loss in {prefix}: {decision}")
            # nodes none of whose workers answered: their processes are gone (not a live node left out)
            self.gone_agents |= {self.agent_of.get(node, "") for node in decision.get("gone", ())} - {""}
            if rank not in members:
                raise LeftOut(f"the survivors re-formed the world without rank {rank} (its node answered too late)")
            self.prefix = decision["prefix"]
            self.changes += 1
            # the hang doctor files each world's records apart (megashard.doctor.watch): a number of its own
            os.environ["MEGASHARD_RDZV_ROUND"] = str(self.round * 1000 + self.changes)
            try:
                self._form(members.index(rank), len(members), arrival_s=_arrival_s(self.timeout))
                return
            except Exception as e:  # noqa: BLE001 - lost again while re-forming: the members agree once more
                why = "a member did not arrive" if isinstance(e, _NotArrived) else _first_line(e)
                debug(f"re-forming {self.prefix} failed: {why}")
                prefix, rank, nodes = self.prefix, members.index(rank), [nodes[m] for m in members]
                root.set(f"{prefix}/abort", "1")
                if dist.is_initialized():  # the group formed, a peer went during its first collective
                    self.leave(abort=True)

    def _agree(self, prefix: str, rank: int, nodes: list[str]) -> dict:
        """Register as a survivor of world ``prefix``; the first to register decides (:meth:`_decide`)."""
        root = self.root
        root.set(f"{prefix}/alive/{rank}", "1")
        count = root.add(f"{prefix}/count", 1)
        if root.compare_set(f"{prefix}/leader", "", str(rank)).decode() == str(rank):
            decision = self._decide(prefix, nodes, count)
            root.set(f"{prefix}/decision", json.dumps(decision))
            return decision
        try:
            root.wait([f"{prefix}/decision"], timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - torch's store timeout (the leader was lost while it decided)
            if not root.check([f"{prefix}/decision"]):  # (the store's host gone: this check raises for the caller)
                leader = root.get(f"{prefix}/leader").decode()
                raise ReformTimeout(f"no decision from the survivors' leader, rank {leader}") from e
        return json.loads(root.get(f"{prefix}/decision").decode())

    def _decide(self, prefix: str, nodes: list[str], count: int) -> dict:
        """Leader: which ranks of world ``prefix`` form the next world (whole nodes whose ranks all registered)."""
        root, n = self.root, len(nodes)
        by_node: dict[str, list[int]] = {}
        for r, node in enumerate(nodes):
            by_node.setdefault(node, []).append(r)
        start = time.monotonic()
        deadline, answered_by = start + self.timeout, start + _arrival_s(self.timeout)
        last, alive = count, set()
        while True:
            now = root.add(f"{prefix}/count", 0)
            if now != last or not alive:
                alive = {r for r in range(n) if root.check([f"{prefix}/alive/{r}"])}
                last = now
            here = alive | {r for r in range(n) if r not in alive and root.check([f"{prefix}/here/{r}"])}
            t = time.monotonic()
            # a node is settled when all its ranks registered, or none did nor answered the abort within the grace
            # period (its processes are gone); one that answered (alive, leaving the broken collective) is waited
            # for, at most ten grace periods
            settled = all(set(rs) <= alive or (not set(rs) & here and t - start >= _grace()) or t > answered_by
                          for rs in by_node.values())
            if len(alive) == n or settled:
                break
            if t > deadline:
                break
            time.sleep(_POLL_S)
        members = sorted(r for rs in by_node.values() if set(rs) <= alive for r in rs)
        gone = sorted(node for node, rs in by_node.items() if not set(rs) & here)
        return {"members": members, "prefix": f"{prefix}.{self.changes + 1}", "gone": gone}

    # ------------------------------------------------------------------------------------------- a join
    def _pending(self) -> Optional[RoundInfo]:
        """The round the agent completed while this world trained (newer than this world's), or None."""
        if not self.agent_dir:
            return None
        path = os.path.join(self.agent_dir, ROUND_FILE)
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._seen_round_mtime:
                return None
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            return None
        info = RoundInfo(int(rec["round"]), int(rec["ranks"][os.environ.get("LOCAL_RANK", "0")]),
                         int(rec["world_size"]))
        if info.round <= self.round:
            self._seen_round_mtime = mtime
            return None
        return info

    def join_due(self, hold: bool = False) -> tuple[Optional[RoundInfo], bool]:
        """At a step boundary (collective over the world): whether every rank moves to a new round now, and whether
        any rank wants to hold the world here (``hold``: tests and benchmarks pause a world between steps; the
        decision must be every rank's, or the ranks would leave the pause at different steps). A rank sees its
        agent's round once the newcomers are ready; one all-reduce (MAX) of both flags decides for every rank."""
        info = self._pending()
        ready = 0
        if info is not None:
            newcomers = info.world_size - self.world_size
            ready = int(newcomers <= 0 or self.root.add(f"r{info.round}/ready", 0) >= newcomers)
        held = int(hold)
        if self.world_size > 1:
            from megashard.state.devices import current_device

            flag = torch.tensor([ready, held], dtype=torch.int32, device=current_device(self.device_type))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ready, held = (int(v) for v in flag.tolist())
        if not ready:
            return None, bool(held)
        debug(f"join due: {info}")
        deadline = time.monotonic() + self.timeout
        while info is None or info.round <= self.round:  # another rank saw it first: this agent's file follows
            if time.monotonic() > deadline:
                raise RuntimeError("megashard live: the agent did not hand over the new rendezvous round in time")
            time.sleep(_POLL_S)
            info = self._pending()
        return info, bool(held)

    def adopt(self, info: RoundInfo) -> None:
        """Leave this world (healthy: destroyed, not aborted) and form the round's."""
        self.leave(abort=False)
        self.round, self.prefix = info.round, f"r{info.round}"
        self.gone_agents = set()  # a new rendezvous round: the lost nodes are no participants of it
        os.environ["MEGASHARD_RDZV_ROUND"] = str(info.round)
        self.changes += 1
        self._form(info.rank, info.world_size, arrival_s=self.timeout)

    def tell_agent(self) -> None:
        """Local rank 0: how many nodes the world has now (the agent's exit barrier counts them) and the agents of
        the nodes found gone (torch's rendezvous lets go of them at once:
        :func:`megashard._compat.rendezvous_forget_lost`; a live node left out is not among them: it rejoins through
        the rendezvous)."""
        if self.agent_dir and os.environ.get("LOCAL_RANK", "0") == "0":
            path = os.path.join(self.agent_dir, "nodes.json")
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"nodes": len(set(self.nodes)), "round": self.round, "gone": sorted(self.gone_agents)}, f)
            os.replace(tmp, path)

    def store_alive(self) -> bool:
        """Whether the rendezvous store answers (its host may be the node that was lost)."""
        try:
            self.root.check(["alive?"])
            return True
        except Exception:  # noqa: BLE001
            return False

    def close(self, *, ended: bool = False) -> None:
        """The end of this worker's live training; ``ended`` (the job finished): nodes still on their way into a new
        world are told so (they wait for it in :meth:`_form`)."""
        self._stop.set()
        if ended:
            try:
                self.root.set("ended", "1")
            except Exception:  # noqa: BLE001 - the store's host left first: nobody waits on it then
                pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def abort_groups(before: frozenset = frozenset()) -> None:
    """Abort every process group of this process (none blocks any more; each raises in its next call).
    ``ProcessGroup.abort`` does nothing on gloo (NCCL worlds have gloo groups too: the memory copies' transfer, the
    async save's): the connections accepted on listeners opened since ``before``
    (:func:`~megashard._compat.gloo_abort.listening_now`, taken as the world formed) are shut down as well, after
    the aborts, which fails a collective in flight at once on both ends, a survivor's that waits for this process
    included."""
    from megashard._compat import abort_process_groups
    from megashard._compat.gloo_abort import shut_down_gloo_connections

    abort_process_groups()
    n = shut_down_gloo_connections(before)
    debug(f"aborted: {n} gloo connections shut down")
