"""torchrun's elastic agent (:mod:`megashard.launch.agent`): stop instead of restarting on errors a restart cannot fix,
and count a node that left as a membership change (elastic jobs), not a restart.
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

        def _monitor_workers(self, worker_group):  # noqa: ANN001 - torch's signature
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
