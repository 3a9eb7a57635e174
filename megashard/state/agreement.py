"""Ranks that disagree get an error, not a hang: every rank compares its config and versions with rank 0's.

    check_ranks_agree(fingerprint(config, {"train.steps": 200}), timeout=60.0)

A rank started with another YAML (e.g. one node of a multi-node job with an older file), another
megashard or another torch would otherwise build other groups than its peers and wait in a collective
that never completes. :class:`~megashard.state.ParallelState` runs this check first, on the default
group, before it creates any other group:

1. one all-reduce of two integers (the maximum of a 56-bit hash of the fields and of its negative) with
   a timeout: equal everywhere means every rank agrees — the usual case costs one tiny collective,
   whatever the world size;
2. only when the hashes differ: rank 0 broadcasts its fields, every rank compares, the differences are
   gathered, and every rank raises :class:`~megashard.errors.RankMismatchError` with the same message:
   ``rank 1 differs from rank 0 in parallel.tp (2 vs 1), train.steps (20 vs 10)``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

from megashard.errors import PeerLostError, RankMismatchError

__all__ = ["fingerprint", "check_ranks_agree"]

MAX_FIELDS_SHOWN = 6
MAX_GROUPS_SHOWN = 4


def fingerprint(config: Any, extra: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The fields ranks must agree on: megashard and torch versions, every ``parallel.*`` field of the
    :class:`~megashard.config.ParallelConfig` ``config``, and ``extra`` (e.g. the rest of a job config)."""
    import torch

    from megashard._version import __version__

    fields: dict[str, Any] = {"megashard": __version__, "torch": torch.__version__}
    for f in dataclasses.fields(config):
        fields[f"parallel.{f.name}"] = getattr(config, f.name)
    fields.update(extra or {})
    return fields


def _canonical(fields: Mapping[str, Any]) -> str:
    return json.dumps({str(k): fields[k] for k in fields}, sort_keys=True, default=repr)


def _hash56(fields: Mapping[str, Any]) -> int:
    return int.from_bytes(hashlib.sha256(_canonical(fields).encode()).digest()[:7], "big")


def _device(group: Any) -> Any:
    """Where the check's tensor lives: the current CUDA device on nccl, else the CPU."""
    import torch.distributed as dist

    from megashard.state.devices import current_device

    return current_device("auto" if "nccl" in str(dist.get_backend(group)) else "cpu")


def check_ranks_agree(fields: Mapping[str, Any], *, timeout: float, group: Any = None) -> None:
    """Collective over ``group`` (default: the world): raise :class:`RankMismatchError` on every rank if any
    rank's ``fields`` differ from rank 0's; :class:`RankMismatchError` too if not every rank joins within
    ``timeout`` seconds; :class:`~megashard.errors.PeerLostError` when a peer closed its connection before that
    (another rank exited: its own error says why). Values must be JSON-able or have a stable ``repr``."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return
    h = _hash56(fields)
    t = torch.tensor([h, -h], dtype=torch.int64, device=_device(group))
    t0 = time.monotonic()
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:
        waited = time.monotonic() - t0
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        if waited < 0.9 * timeout:  # not the timeout, whatever the text says (gloo: "Application timeout caused
            # pair closure", "Connection closed by peer", "Pair is not connected"): a peer process went away
            raise PeerLostError(
                f"rank {dist.get_rank()}: a peer closed its connection during megashard's config check, "
                f"{waited:.1f} s after it began (not a timeout: parallel.timeout={timeout:g} s): another rank exited or "
                f"crashed before or while joining it; its own error says why ({first})") from e
        raise RankMismatchError(
            f"rank {dist.get_rank()}: not every rank joined megashard's config check within {timeout:g} s "
            f"(parallel.timeout): a rank failed or hangs before it, or ranks run different megashard versions "
            f"(this one: {fields.get('megashard', '?')}) ({first[:120]})") from None
    hi, neg_lo = (int(v) for v in t.tolist())
    if hi == -neg_lo:
        return
    ref: list[Any] = [dict(fields) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(ref, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    base = ref[0]
    # field -> (this rank's value, rank 0's value)
    mine = {k: (fields.get(k, "<missing>"), base.get(k, "<missing>")) for k in sorted(set(base) | set(fields))
            if _canonical({k: base.get(k)}) != _canonical({k: fields.get(k)})}
    diffs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(diffs, mine or None, group=group)
    raise RankMismatchError(_message(diffs))


def _fmt(v: Any) -> str:
    s = json.dumps(v, default=repr) if not isinstance(v, str) else v
    return s if len(s) <= 40 else s[:37] + "..."


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown} differs" if len(ranks) == 1 else f"ranks {shown} differ"


def _message(diffs: list[Optional[dict[str, tuple[Any, Any]]]]) -> str:
    """One line: every distinct difference with the ranks that have it (rank 0's value second)."""
    groups: dict[str, tuple[list[int], dict]] = {}
    for rank, d in enumerate(diffs):
        if d:
            groups.setdefault(_canonical({"d": sorted(d.items())}), ([], d))[0].append(rank)
    parts = []
    for ranks, d in list(groups.values())[:MAX_GROUPS_SHOWN]:
        items = [f"{k} ({_fmt(v)} vs {_fmt(v0)})" for k, (v, v0) in list(d.items())[:MAX_FIELDS_SHOWN]]
        more = f" and {len(d) - MAX_FIELDS_SHOWN} more fields" if len(d) > MAX_FIELDS_SHOWN else ""
        parts.append(f"{_ranks(ranks)} from rank 0 in {', '.join(items)}{more}")
    if len(groups) > MAX_GROUPS_SHOWN:
        parts.append(f"and {len(groups) - MAX_GROUPS_SHOWN} more groups of ranks")
    return ("ranks disagree on the job: " + "; ".join(parts)
            + " — start every rank with the same config (and the same megashard and torch versions)")
