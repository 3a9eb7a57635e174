"""What ties a rank's records to its world: the run id its ranks agree on, the world's number in its job, where its
records go, and how often it publishes (:mod:`megashard.doctor.watch`; the file layout in
:mod:`megashard.doctor.records`)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

__all__ = ["default_interval", "record_dir", "run_identity"]


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def run_identity(store: Any) -> dict[str, Any]:
    """What ties this rank's records to its world (see the module docstring of :mod:`megashard.doctor.records`):

    - ``run``: one id for every rank of this world, agreed through the store without a collective (the first rank
      to ask sets it; the store is new for each rendezvous round under ``megashard run``, so a new world gets a new id);
    - ``world``: the number of this world within its job, agreed with the id — the rendezvous round the workers started
      in (megashard's agent exports it: an old node and a node that joined see the same round, while their torchrun
      restart counts differ), else the restart count of the rank that set the id. 0 writes ``doctor/``, k > 0
      ``doctor/restart_<k>/``;
    - ``job``: what every launcher and restart of one launch share (``MEGASHARD_JOB_ID`` of ``megashard run``, else
      torchrun's rendezvous id), None outside a launcher; ``launch``: ``MEGASHARD_RUN_ID``, else torchrun's id;
    - ``attempt``: this rank's torchrun restart count; ``started``: when this rank's doctor started (seconds since the
      epoch)."""
    import uuid

    from megashard._compat import RENDEZVOUS_ROUND_ENV

    launch = os.environ.get("MEGASHARD_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None
    if launch == "none":  # torchrun's default --rdzv-id: the same for every launch
        launch = None
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID")
    job = os.environ.get("MEGASHARD_JOB_ID") or (torchrun if torchrun and torchrun != "none" else None)
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT") or 0
    world = _env_int(RENDEZVOUS_ROUND_ENV)
    world = attempt if world is None else world
    mine = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]
    try:
        agreed = store.compare_set("run", "", json.dumps({"run": mine, "world": world}))
        agreed = agreed.decode("utf-8", "replace") if isinstance(agreed, bytes) else str(agreed)
        try:
            value = json.loads(agreed)
            run, world = str(value["run"]), int(value["world"])
        except (ValueError, TypeError, KeyError):  # another doctor's plain id
            run = agreed
    except Exception:  # noqa: BLE001 - a store without compare_set: the launch's id, if any
        run = f"{launch}/{world}" if launch else mine
    return {"run": run, "world": world, "job": job, "launch": launch, "attempt": attempt, "started": time.time()}


def record_dir(out_dir: str, world: Any) -> str:
    """Where the ranks of world number ``world`` write their records: ``<out_dir>/doctor`` for the first world of a
    job, ``<out_dir>/doctor/restart_<k>`` for world k > 0 (a torchrun restart, or a new world of an elastic job)."""
    d = os.path.join(out_dir, "doctor")
    return os.path.join(d, f"restart_{world}") if isinstance(world, int) and world > 0 else d


def default_interval(timeout: float) -> float:
    """Seconds between two publications of a rank's record: a tenth of the timeout, within [0.2, 5] s."""
    return min(5.0, max(0.2, timeout / 10.0))
