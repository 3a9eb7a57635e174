"""torchrun's elastic agent (:mod:`megashard.launch.agent`): stop instead of restarting on errors a restart cannot fix.
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
