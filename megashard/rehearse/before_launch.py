"""The check before launch: every rank of the training job rehearsed and its collectives compared, by ``megashard run``
(:func:`megashard.launch.launcher.run`) before any process starts — always with ``--collectives``, by default when it
is cheap (:func:`is_cheap`), never with ``--no-check``.

    code = check_job(job, sizes.world_size, command="run")     # prints the result; 0 OK, 1 a problem found
"""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

__all__ = ["CHEAP_PARAMS", "CHEAP_WORLD", "check_job", "is_cheap", "print_result"]

#: ``megashard run`` checks by default up to this many ranks ...
CHEAP_WORLD = 16
#: ... of a model of up to this many parameters (each rank's rehearsal builds its shard on the CPU).
CHEAP_PARAMS = 50_000_000


def model_params(job: Any) -> int:
    """About the model's parameter count: 12·layers·hidden² + vocab·hidden (+ experts)."""
    m = job.model
    dense = 12 * m.layers * m.hidden ** 2 + m.vocab_size * m.hidden
    experts = max(0, getattr(m, "num_experts", 0) or 0) * len(job.moe_layers()) * 2 * m.hidden * job.ffn_hidden
    return dense + experts


def is_cheap(job: Any, world_size: int) -> bool:
    """Whether the check takes seconds, not minutes: at most :data:`CHEAP_WORLD` ranks of a model of at most
    :data:`CHEAP_PARAMS` parameters."""
    return world_size <= CHEAP_WORLD and model_params(job) <= CHEAP_PARAMS


def print_result(traces: Any, command: str, fmt: str = "table", stream: Any = None, seconds: Optional[float] = None) -> int:
    """Check ``traces`` (:func:`~megashard.rehearse.compare.check_traces`) and print ``megashard <command>: OK: ...``
    (with the time taken) or the findings, or their JSON; returns 0 (OK) or 1 (a problem found)."""
    from megashard.rehearse.compare import check_traces

    result = check_traces(traces)
    out = stream or sys.stdout
    if fmt == "json":
        import json

        d = result.as_dict()
        if seconds is not None:
            d["seconds"] = round(seconds, 2)
        out.write(json.dumps(d) + "\n")
    else:
        lines = result.text().splitlines()
        if seconds is not None:
            lines[0] += f" ({seconds:.1f} s)"
        out.write("\n".join(f"megashard {command}: collectives: {line}" if i == 0 else line
                            for i, line in enumerate(lines)) + "\n")
    out.flush()
    return 0 if result.ok else 1


def check_job(job: Any, world_size: int, *, jobs: Optional[int] = None, stream: Any = None, command: str = "run",
              fmt: str = "table") -> int:
    """Rehearse every rank of ``job`` for ``world_size`` ranks and print the result; 0 OK, 1 a problem found."""
    from megashard.rehearse.runs import rehearse_job

    t0 = time.perf_counter()
    traces = rehearse_job(job, world_size, jobs=jobs)
    return print_result(traces, command, fmt, stream, time.perf_counter() - t0)
