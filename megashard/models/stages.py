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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megashard.train.config import JobConfig

__all__ = ["PIPELINE_SCHEDULES", "StageSpec", "stage_layers", "rank_stages", "stage_specs", "schedule_is_multi",
           "model_placement", "format_placement"]

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


def model_placement(job: "JobConfig", pp: int, vpp: int, ep: int) -> dict:
    """Where each pipeline stage and expert of ``job``'s model lives, for ``megashard plan``.

    ``{"stages": [{"stage", "pp_rank", "virtual", "layers", "holds"}...], "experts": {"moe_layers", "per_ep_rank":
    [[expert ids of ep rank 0], ...]}}``. ``holds`` names the embeddings / head on the first / last stage.
    """
    m = job.model
    schedule = job.train.pipeline_schedule if pp > 1 else "1f1b"
    v = vpp if pp > 1 else 1
    stages = []
    split = stage_layers(m.layers, pp * v) if m.layers >= pp * v else None
    for r in range(pp):
        for k, s in enumerate(rank_stages(r, pp, v, schedule)):
            holds = (["embeddings"] if s == 0 else []) + (["head + loss"] if s == pp * v - 1 else [])
            if s == pp * v - 1 and m.tie_embeddings and s != 0:
                holds.append("tied embedding copy")
            stages.append({"stage": s, "pp_rank": r, "virtual": k,
                           "layers": list(split[s]) if split is not None else [], "holds": holds})
    stages.sort(key=lambda d: d["stage"])
    out: dict = {"stages": stages, "schedule": schedule if pp > 1 else None,
                 "microbatches": job.microbatches(pp)}
    if m.num_experts:
        n = m.num_experts // ep if m.num_experts % ep == 0 else 0
        out["experts"] = {"moe_layers": job.moe_layers(), "num_experts": m.num_experts,
                          "per_ep_rank": [list(range(e * n, (e + 1) * n)) for e in range(ep)]}
    return out


def format_placement(placement: dict) -> list[str]:
    """The table lines of :func:`model_placement` (``megashard plan``)."""
    out = ["", "pipeline stages" + (f" ({placement['schedule']}, {placement['microbatches']} microbatches)"
                                    if placement["schedule"] else " (no pipeline)")]
    for s in placement["stages"]:
        layers = s["layers"]
        span = f"blocks {layers[0]}-{layers[-1]}" if len(layers) > 1 else (f"block {layers[0]}" if layers else "none")
        extra = f" + {', '.join(s['holds'])}" if s["holds"] else ""
        out.append(f"  stage {s['stage']:<3} pp rank {s['pp_rank']:<3} virtual {s['virtual']}  {span}{extra}")
    ex = placement.get("experts")
    if ex:
        out.append("")
        out.append(f"experts ({ex['num_experts']} per MoE block; MoE blocks {', '.join(map(str, ex['moe_layers']))})")
        for r, ids in enumerate(ex["per_ep_rank"]):
            out.append(f"  ep rank {r:<3} experts {', '.join(map(str, ids))}")
    return out
