"""megashard's agent with live recovery (``launch.recovery: live``): a node joining does not restart the workers.

torch's elastic agent restarts its healthy workers when a node waits to join. Here it completes the next rendezvous
round itself — the workers go on training meanwhile — and hands the workers their ranks in the new world through a
file of its own directory (:data:`megashard.train.live_world.ROUND_FILE`); the workers move at their next step
boundary (:mod:`megashard.train.live_world`). A node lost is handled by the surviving workers alone; they tell their
agent how many nodes remain (``nodes.json``), which its exit barrier counts.

Enabled by ``MEGASHARD_RECOVERY=live`` (``megashard run`` sets it from the config) for an elastic rendezvous.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Optional

__all__ = ["RECOVERY_ENV", "enable"]

RECOVERY_ENV = "MEGASHARD_RECOVERY"


def _write(path: str, rec: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def enable(endpoint: Optional[str], say: Callable[[str], None]) -> Optional[str]:
    """Install the live hooks in torch's agent when ``MEGASHARD_RECOVERY=live``; export the rendezvous store and this
    agent's directory to the workers. Returns the directory (the caller removes it at the end), or None."""
    from megashard._compat import (
        RENDEZVOUS_ROUND_ENV,
        elastic_agent_live_hooks,
        rendezvous_agent,
        rendezvous_dropped,
        rendezvous_forget_lost,
        set_group_world_size,
    )
    from megashard.train.live_world import LIVE_DIR_ENV, LIVE_STORE_ENV, ROUND_FILE

    if os.environ.get(RECOVERY_ENV) != "live" or not endpoint:
        return None
    where = tempfile.mkdtemp(prefix="megashard-live-")
    seen = {"nodes": 0.0}

    def on_join(agent, worker_group) -> bool:  # noqa: ANN001 - torch's agent and WorkerGroup
        ranks = rendezvous_agent(agent, worker_group)
        rnd = int(os.environ.get(RENDEZVOUS_ROUND_ENV, "0") or 0)
        _write(os.path.join(where, ROUND_FILE), {"round": rnd, "ranks": {str(lr): g for lr, g, _ in ranks},
                                                 "world_size": ranks[0][2] if ranks else 0})
        return True

    def on_monitor(agent, worker_group) -> None:  # noqa: ANN001
        if not seen.get("dropped") and rendezvous_dropped(worker_group.spec.rdzv_handler):
            # a world formed without this node (its heartbeats came too late): two worlds must not train one job
            seen["dropped"] = 1.0
            say("this node was dropped from the rendezvous (no heartbeat within launch.rdzv_node_timeout: an "
                "overloaded machine or network) and the others went on without it: its workers stop; start it "
                "again to rejoin")
            import signal

            for w in worker_group.workers:
                if w.id:
                    try:
                        os.kill(int(w.id), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass
            return
        path = os.path.join(where, "nodes.json")
        try:
            mtime = os.stat(path).st_mtime
            if mtime == seen["nodes"]:
                return
            seen["nodes"] = mtime
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            return
        if str(rec.get("round")) == os.environ.get(RENDEZVOUS_ROUND_ENV, "0"):
            set_group_world_size(worker_group, int(rec["nodes"]))
            if rec.get("gone"):  # the agents of the nodes found gone: their places are free for newcomers at once
                rendezvous_forget_lost(worker_group.spec.rdzv_handler, int(rec["round"]), set(rec["gone"]))

    if not elastic_agent_live_hooks(on_join, on_monitor):
        say("torchrun: this torch's elastic agent has another shape: live recovery is off (workers restart instead)")
        os.rmdir(where)
        return None
    os.environ[LIVE_DIR_ENV] = where
    os.environ[LIVE_STORE_ENV] = endpoint
    # torch's shared bootstrap store: a node that joins a round whose rank 0 did not restart waits for an address that
    # rank 0 only publishes when it builds the store anew (as megashard run sets for its workers, pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return where
