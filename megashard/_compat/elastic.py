"""torchrun's elastic agent (:mod:`megashard.launch.agent`): stop instead of restarting on errors a restart cannot fix;
and its rendezvous (:mod:`megashard.launch.startwatch`: which nodes joined while one is missing).
"""
from __future__ import annotations


def elastic_agent_gives_up_on(exit_codes: frozenset) -> bool:
    """Make the elastic agent ``torch.distributed.run`` builds (``LocalElasticAgent``, private monitoring loop) stop
    instead of restarting the workers when a failed worker exited with one of ``exit_codes``: an error a restart
    cannot fix (a bad config, a checkpoint of another model) must not burn ``--max-restarts``. The job then ends as
    if no restarts were left (ChildFailedError). Returns False where this torch's agent has another shape."""
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
        return True

    class Agent(base):  # type: ignore[misc, valid-type]
        _megashard_gives_up_on = frozenset(exit_codes)

        def _monitor_workers(self, worker_group):  # noqa: ANN001 - torch's signature
            result = super()._monitor_workers(worker_group)
            failures = getattr(result, "failures", None) or {}
            if result.state == WorkerState.FAILED and any(
                    getattr(f, "exitcode", None) in self._megashard_gives_up_on for f in failures.values()):
                self._remaining_restarts = 0
            return result

    launcher_api.LocalElasticAgent = Agent
    return True


# --- torchrun's rendezvous (megashard.launch.startwatch: how many nodes joined while a node is missing) --------------
def capture_rendezvous_handlers(sink: list) -> bool:
    """Append every rendezvous handler torchrun's launcher creates (in this process) to ``sink``: the launcher's
    ``rdzv_registry.get_rendezvous_handler`` is wrapped (looked up as a module attribute at launch). False where this
    torch's launcher has another shape."""
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
        sink.append(handler)
        return handler

    registry.get_rendezvous_handler = get_rendezvous_handler
    return True


def rendezvous_joined(handler) -> list[str] | None:
    """The nodes (``host:pid``) that joined the current round of a dynamic rendezvous (c10d, etcd; torch's private
    ``_state_holder.state``: participants, then the wait list), or None where the handler keeps no such state."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if state is None:
        return None
    nodes = list(getattr(state, "participants", {}) or {}) + list(getattr(state, "wait_list", ()) or ())
    return [f"{getattr(n, 'addr', '?')}:{getattr(n, 'pid', '?')}" for n in nodes]
