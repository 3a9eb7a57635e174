"""Where the pipeline stages live: which transformer blocks each stage holds and which stages each pp rank runs.

    stage_layers(layers=8, stages=4)          # [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    rank_stages(pp_rank=1, pp=2, vpp=2)       # [1, 3]: Megatron's virtual-pipeline assignment

The split rule (Megatron's even split, extended to remainders): with ``S = pp · vpp`` stages and ``L`` blocks,
stage ``s`` holds blocks ``floor(s·L/S) .. floor((s+1)·L/S) - 1``, so stage sizes differ by at most one and the
*later* stages take the extra blocks (the first stage also holds the embeddings, the last the LM head and loss).
Every stage needs at least one block (``L ≥ S``). Rank ``r`` of ``pp`` runs stages ``r, r + pp, r + 2·pp, …``
(virtual stage ``v`` of rank ``r`` is stage ``v·pp + r``); the ``zbv`` schedule instead runs the V shape
``r`` and ``2·pp - 1 - r`` (two stages per rank).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PIPELINE_SCHEDULES", "StageSpec", "stage_layers", "rank_stages", "stage_specs", "schedule_is_multi"]

#: ``train.pipeline_schedule`` values → the torch.distributed.pipelining schedule class name.
PIPELINE_SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}


def schedule_is_multi(schedule: str) -> bool:
    """True for schedules that run several (virtual) stages per rank."""
    return schedule in ("interleaved_1f1b", "zbv")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the stage count, and the global indices of the blocks it holds."""

    index: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        """Holds the embeddings (its input is token ids)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm, the LM head and the loss."""
        return self.index == self.num_stages - 1


def stage_layers(layers: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` stages (floor boundaries: sizes differ by at most one, later stages larger)."""
    if stages < 1 or layers < stages:
        raise ValueError(f"{layers} blocks cannot fill {stages} pipeline stages (every stage needs at least one)")
    return [range(s * layers // stages, (s + 1) * layers // stages) for s in range(stages)]


def rank_stages(pp_rank: int, pp: int, vpp: int = 1, schedule: str = "1f1b") -> list[int]:
    """Stage indices run by pipeline rank ``pp_rank``, in virtual-stage order (``vpp`` stages per rank)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [v * pp + pp_rank for v in range(vpp)]


def stage_specs(layers: int, pp_rank: int, pp: int, vpp: int = 1, schedule: str = "1f1b") -> list[StageSpec]:
    """The :class:`StageSpec` of every stage pipeline rank ``pp_rank`` runs."""
    n = pp * vpp
    split = stage_layers(layers, n)
    return [StageSpec(s, n, tuple(split[s])) for s in rank_stages(pp_rank, pp, vpp, schedule)]
