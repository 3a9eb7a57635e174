"""Where a job's model lives, for ``megashard plan``: each pipeline stage's blocks and pp rank, each ep rank's experts.

Built on the stage split of :mod:`megashard.models.stages`; here because it reads the job's sections (schedule,
microbatches, MoE blocks), which the models do not know.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megashard.models.stages import rank_stages, stage_layers

if TYPE_CHECKING:
    from megashard.train.config import JobConfig

__all__ = ["model_placement", "format_placement"]


def model_placement(job: "JobConfig", pp: int, vpp: int, ep: int, dp: int = 1) -> dict:
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
                 "microbatches": job.microbatches(pp, dp)}
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
