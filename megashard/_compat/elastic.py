"""torchrun's elastic agent (:mod:`megashard.launch.agent`): stop instead of restarting on errors a restart cannot fix,
and count a node that left as a membership change (elastic jobs), not a restart; and its rendezvous
(:mod:`megashard.launch.startwatch`: which nodes joined while one is missing).
"""
from __future__ import annotations

import signal
from typing import Callable, Optional


def elastic_agent_gives_up_on(exit_codes: frozenset, membership_code: Optional[int] = None,
                              on_membership: Optional[Callable[[], None]] = None) -> bool:
    """Make the elastic agent ``torch.distributed.run`` builds (``LocalElasticAgent``, private monitoring loop) stop
    instead of restarting the workers when a failed worker exited with one of ``exit_codes``: an error a restart
    cannot fix (a bad config, a checkpoint of another model) must not burn ``--max-restarts``. The job then ends as
    if no restarts were left (ChildFailedError).

    ``membership_code`` (an elastic job): when the failed workers of this node exited with it (they lost their peers:
    another node left; the others were stopped by the agent with SIGTERM), the restart that re-forms the world does
    not use up ``--max-restarts`` — a node leaving is a membership change, as torch counts a node joining;
    ``on_membership()`` is called then (before the agent logs its restart). Returns False where this torch's agent has another shape."""
    try:
        import torch.distributed.launcher.api as launcher_api
        from torch.distributed.elastic.agent.server.api import WorkerState
    except ImportError:  # pragma: no cover - moved in some release
        return False
    base = getattr(launcher_api, "LocalElasticAgent", None)
    if base is None or not hasattr(base, "_monitor_workers"):  # pragma: no cover
        return False
    if getattr(base, "_megashard_gives_up_on", None) is not None:
        base._megashard_gives_up_on = frozenset(exit_codes)
        base._megashard_membership_code = membership_code
        base._megashard_on_membership = staticmethod(on_membership) if on_membership else None
        return True

    class Agent(base):  # type: ignore[misc, valid-type]
        _megashard_gives_up_on = frozenset(exit_codes)
        _megashard_membership_code = membership_code
        _megashard_on_membership = staticmethod(on_membership) if on_membership else None
        _megashard_live_join = None  # elastic_agent_live_hooks
        _megashard_live_monitor = None

        def _restart_workers(self, worker_group):  # noqa: ANN001 - torch's signature
            # torch restarts HEALTHY workers only for nodes waiting to join: with live recovery they stay
            join = type(self)._megashard_live_join
            if join is not None and worker_group.state == WorkerState.HEALTHY and join(self, worker_group):
                return
            super()._restart_workers(worker_group)

        def _monitor_workers(self, worker_group):  # noqa: ANN001 - torch's signature
            monitor = type(self)._megashard_live_monitor
            if monitor is not None:
                monitor(self, worker_group)
            result = super()._monitor_workers(worker_group)
            failures = getattr(result, "failures", None) or {}
            codes = {getattr(f, "exitcode", None) for f in failures.values()}
            if result.state == WorkerState.FAILED and codes & self._megashard_gives_up_on:
                self._remaining_restarts = 0
            elif (result.state == WorkerState.FAILED and self._megashard_membership_code in codes
                  and codes <= {self._megashard_membership_code, -int(signal.SIGTERM)}):
                # (-SIGTERM: the agent stops this node's other workers when the first one exits: not a failure)
                self._remaining_restarts += 1  # the agent takes one off for the restart: a node left, none failed here
                if self._megashard_on_membership is not None:
                    self._megashard_on_membership()
            return result

    launcher_api.LocalElasticAgent = Agent
    return True


def elastic_agent_live_hooks(on_join, on_monitor) -> bool:
    """Live recovery (:mod:`megashard.launch.live_agent`): ``on_join(agent, worker_group) -> bool`` replaces the
    restart torch's agent makes for a node waiting to join while its workers are healthy (True: handled, the workers
    keep running); ``on_monitor(agent, worker_group)`` runs before each health check. Needs
    :func:`elastic_agent_gives_up_on` first; False where this torch's agent has another shape."""
    try:
        import torch.distributed.launcher.api as launcher_api
    except ImportError:  # pragma: no cover
        return False
    agent = getattr(launcher_api, "LocalElasticAgent", None)
    if agent is None or not hasattr(agent, "_megashard_live_join") or not hasattr(agent, "_rendezvous"):
        return False
    agent._megashard_live_join = staticmethod(on_join)
    agent._megashard_live_monitor = staticmethod(on_monitor)
    return True


def rendezvous_agent(agent, worker_group) -> list:  # noqa: ANN001
    """Complete the next rendezvous round in torch's agent without touching its workers (private
    ``SimpleElasticAgent._rendezvous``): the workers' new global ranks by local rank, the world size and
    ``group_world_size``. The workers' process ids are kept, so torch's monitor still recognises them."""
    ids = {w.local_rank: w.id for w in worker_group.workers}
    agent._rendezvous(worker_group)
    for w in worker_group.workers:
        w.id = ids.get(w.local_rank)
    return [(w.local_rank, w.global_rank, w.world_size) for w in worker_group.workers]


def rendezvous_dropped(handler) -> bool:  # noqa: ANN001
    """Whether torch's dynamic rendezvous (private ``_state_holder``, ``_this_node``) dropped this node from the round
    it belongs to — its heartbeats came too late and a newer round formed without it. False where unknown."""
    holder, me = getattr(handler, "_state_holder", None), getattr(handler, "_this_node", None)
    if holder is None or me is None:
        return False
    try:
        holder.sync()
        state = holder.state
    except Exception:  # noqa: BLE001 - the backend is unreachable: not this check's to say
        return False
    return bool(state.complete) and me not in state.participants and me not in getattr(state, "wait_list", ())


def set_group_world_size(worker_group, nodes: int) -> None:  # noqa: ANN001
    """The nodes of the world after a live loss (the agent's exit barrier waits for that many)."""
    worker_group.group_world_size = int(nodes)


def abort_process_groups() -> int:
    """Abort every process group of this process (``ProcessGroup.abort``, private registry ``_world.pg_map``): a
    collective blocked on a peer returns with an error at once. Returns how many were aborted."""
    import torch.distributed.distributed_c10d as c10d

    n = 0
    for pg in list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or {}):
        abort = getattr(pg, "abort", None)
        if abort is None:  # pragma: no cover - a release without abort: the broken connections raise anyway
            continue
        try:
            abort()
            n += 1
        except Exception:  # noqa: BLE001 - already aborted or shut down
            pass
    return n


# --- torchrun's rendezvous (megashard.launch.startwatch: how many nodes joined while a node is missing) --------------
def capture_rendezvous_handlers(sink: list) -> bool:
    """Append every rendezvous handler torchrun's launcher creates (in this process) to ``sink``: the launcher's
    ``rdzv_registry.get_rendezvous_handler`` is wrapped (looked up as a module attribute at launch). False where this
    torch's launcher has another shape."""
    return _on_rendezvous_handler(sink.append)


def rendezvous_joined(handler) -> list[str] | None:
    """The nodes (``host:pid``) that joined the current round of a dynamic rendezvous (c10d, etcd; torch's private
    ``_state_holder.state``: participants, then the wait list), or None where the handler keeps no such state."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if state is None:
        return None
    nodes = list(getattr(state, "participants", {}) or {}) + list(getattr(state, "wait_list", ()) or ())
    return [f"{getattr(n, 'addr', '?')}:{getattr(n, 'pid', '?')}" for n in nodes]


# --- which world the workers start in (megashard.doctor: every rank of one rendezvous round shares its records) -----
#: The environment variable through which megashard's agent tells its workers the rendezvous round they started in.
RENDEZVOUS_ROUND_ENV = "MEGASHARD_RDZV_ROUND"


#: ``addr:pid`` of this agent in torch's dynamic rendezvous (its private ``_this_node``), exported with the round.
RENDEZVOUS_NODE_ENV = "MEGASHARD_RDZV_NODE"


def rendezvous_forget_lost(handler, round_: int, gone: set) -> list[str]:  # noqa: ANN001
    """Live recovery: the surviving workers of round ``round_`` found the nodes of agents ``gone`` (``addr:pid``) gone
    — none of their workers answered; free their places in torch's dynamic rendezvous at once instead of after
    ``launch.rdzv_node_timeout`` of missing heartbeats. While a lost node is still a participant, the round counts as
    complete and a node that comes to join waits on the wait list. Each such participant gets a last heartbeat of
    long ago, written with torch's compare-and-set (private ``_state_holder``, ``_heartbeat_lock``); the next sync of
    any node drops it as torch drops a node whose heartbeats stopped. Nothing is written where this node is among
    ``gone`` or the shared state is no longer at ``round_``. Returns the nodes marked (empty where nothing was done)."""
    from datetime import datetime, timezone

    holder, me = getattr(handler, "_state_holder", None), getattr(handler, "_this_node", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    if holder is None or me is None or lock is None or f"{me.addr}:{me.pid}" in gone:
        return []
    long_ago = datetime(1970, 1, 1, tzinfo=timezone.utc)
    for _ in range(5):  # another node wrote meanwhile: read again and retry
        with lock:
            try:
                holder.sync()
                state = holder.state
                if state.round != round_ or not state.complete:
                    return []
                lost = [n for n in state.participants if f"{n.addr}:{n.pid}" in gone
                        and state.last_heartbeats.get(n, long_ago) > long_ago]
                if not lost:
                    return []
                for n in lost:
                    state.last_heartbeats[n] = long_ago
                holder.mark_dirty()
                if holder.sync():
                    return [f"{n.addr}:{n.pid}" for n in lost]
            except Exception:  # noqa: BLE001 - another shape or the store unreachable: torch's own timeout stands
                return []
    return []


def export_rendezvous_round(env_name: str) -> bool:
    """After each rendezvous torchrun's launcher completes in this process, set ``os.environ[env_name]`` to the round
    it completed (a dynamic rendezvous — c10d, etcd — numbers its rounds in state shared by every node: the ranks of
    one world see one number, a later world a higher one). The workers started next inherit it (torch's subprocess
    handler copies this process's environment). Reads torch's private ``_state_holder.state.round``; a rendezvous
    without it (static) leaves the variable unset. False where this torch's launcher has another shape."""
    import os

    def after(handler) -> None:  # noqa: ANN001 - torch's RendezvousHandler
        original = getattr(handler, "next_rendezvous", None)
        if original is None or getattr(original, "_megashard_round", False):
            return

        def next_rendezvous(*args, **kwargs):
            info = original(*args, **kwargs)
            state = getattr(getattr(handler, "_state_holder", None), "state", None)
            number = getattr(state, "round", None)
            if isinstance(number, int) and not isinstance(number, bool):
                os.environ[env_name] = str(number)
            else:
                os.environ.pop(env_name, None)
            me = getattr(handler, "_this_node", None)  # this agent in the rendezvous: its workers name it (live)
            if me is not None and hasattr(me, "addr") and hasattr(me, "pid"):
                os.environ[RENDEZVOUS_NODE_ENV] = f"{me.addr}:{me.pid}"
            return info

        next_rendezvous._megashard_round = True  # type: ignore[attr-defined]
        handler.next_rendezvous = next_rendezvous

    return _on_rendezvous_handler(after)


def _on_rendezvous_handler(callback) -> bool:  # noqa: ANN001
    """Call ``callback(handler)`` for every rendezvous handler torchrun's launcher creates in this process."""
    try:
        import torch.distributed.launcher.api as launcher_api
    except ImportError:  # pragma: no cover
        return False
    registry = getattr(launcher_api, "rdzv_registry", None)
    original = getattr(registry, "get_rendezvous_handler", None)
    if original is None:  # pragma: no cover
        return False

    def get_rendezvous_handler(params, *args, **kwargs):
        handler = original(params, *args, **kwargs)
        callback(handler)
        return handler

    registry.get_rendezvous_handler = get_rendezvous_handler
    return True
