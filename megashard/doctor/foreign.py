"""A collective on a group the doctor does not watch that belongs to another megashard layout than the current one
(a ``pg_collection`` of another grid, another module's groups): named at once, once per group and operation — the
call may well complete, with a silently wrong result (Megatron-LM #6307). :mod:`megashard.doctor.intercept` calls
:func:`note_foreign` for every call on an unwatched group; the lookup (:func:`megashard.state.identity.foreign_group_note`)
runs once per group.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

__all__ = ["note_foreign"]

_FOREIGN: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, note): groups the doctor does not watch, looked up once
_FOREIGN_SAID: set = set()


def note_foreign(doctor: Any, group: Any, name: str, sig: str) -> None:
    """A call on a group the doctor does not watch: when it is a group of another megashard layout than the current
    one (a ``pg_collection`` of another grid: :func:`megashard.state.identity.foreign_group_note`), say so once per
    group and operation — the call itself may complete, with a silently wrong result."""
    hit = _FOREIGN.get(id(group))
    if hit is None or hit[0] is not group:
        try:
            from megashard.state.identity import foreign_group_note

            hit = _FOREIGN[id(group)] = (group, foreign_group_note(group))
        except Exception:  # noqa: BLE001 - the doctor must never take a job down
            hit = _FOREIGN[id(group)] = (group, "")
    note = hit[1]
    if not note or (id(group), name) in _FOREIGN_SAID:
        return
    _FOREIGN_SAID.add((id(group), name))
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001
        ranks = []
    f = sys._getframe(2)  # the caller of the wrapped function
    while f is not None and (os.sep + "torch" + os.sep) in f.f_code.co_filename:
        f = f.f_back
    where = f" ({f.f_code.co_filename}:{f.f_lineno})" if f is not None else ""
    doctor._say(f"megashard doctor: rank {doctor.ledger.rank} calls {name} {sig} on the group of ranks {ranks}, {note}"
                f"{where}")


def forget() -> None:
    """Drop the groups looked up (when the doctor stops: no process group is referenced after it)."""
    _FOREIGN.clear()
    _FOREIGN_SAID.clear()
