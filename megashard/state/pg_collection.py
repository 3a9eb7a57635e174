"""Megatron-LM's ``ProcessGroupCollection`` over a :class:`~megashard.state.ParallelState`'s groups.

Megatron model code takes its groups explicitly (``TransformerLayer(..., pg_collection=...)``);
``state.pg_collection()`` hands it megashard's communicators under Megatron's field names, with Megatron's
semantics for fields a rank has no group for (``None``: ``embd``/``pos_embd`` off the embedding stages, ``hcp``
without hierarchical cp, ``inter_dist_opt`` with one optimizer instance, the all-gather twins ``dp_cp_ag`` /
``expt_dp_ag``, which Megatron also leaves unset). When megatron-core is importable the result is a real
``megatron.core.process_groups_config.ProcessGroupCollection`` (fields that version lacks are left out);
otherwise :class:`ProcessGroupCollection`, a stand-in with the same field names.

Two kinds of groups ride along as attributes that Megatron-LM 0.19's class has no field for: the gloo groups
(:data:`GLOO_FIELDS`) and ``hybrid_dp_cp``, the hybrid dp·cp groups by size (``{2: group, 4: group}``, Megatron's
``_HYBRID_DP_CP_GROUPS``; empty without ``hybrid_context_parallel``).

It reads the groups through :class:`GroupSource` (what a ``ParallelState`` offers), so it sits below the state
class whose ``pg_collection()`` calls it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

    from megashard.config import ResolvedSizes


class GroupSource(Protocol):
    """The groups of one rank by megashard name (a :class:`~megashard.state.ParallelState` is one; documented
    there). ``all_gather_groups`` ({Megatron field: group}), when present, is read with ``getattr``."""

    @property
    def sizes(self) -> ResolvedSizes: ...

    def group(self, name: str) -> dist.ProcessGroup: ...

    def in_group(self, name: str) -> bool: ...

    def hcp_groups(self) -> list[dist.ProcessGroup]: ...

    def gloo_group(self, name: str) -> dist.ProcessGroup: ...

    def hybrid_dp_cp_groups(self) -> dict[int, dist.ProcessGroup]: ...


__all__ = ["EXTRA_FIELDS", "GLOO_FIELDS", "GroupSource", "PG_FIELDS", "ProcessGroupCollection", "pg_collection", "pg_collection_groups"]

#: Megatron-LM 0.19's ProcessGroupCollection fields -> megashard group name (None: not set, as in Megatron's
#: ``use_mpu_process_groups``; "hcp": the list of hierarchical cp groups).
PG_FIELDS: dict[str, str | None] = {
    "tp": "tp", "pp": "pp", "mp": "mp", "embd": "embd", "pos_embd": "pos_embd", "cp": "cp", "tp_cp": "tp_cp",
    "hcp": "hcp", "ep": "ep", "expt_tp": "expt_tp", "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp_with_egtp_remat", "tp_dp_cp": "tp_dp_cp", "dp": "dp", "dp_cp": "dp_cp",
    "dp_cp_gtp_remat": "dp_cp_gtp_remat", "dp_cp_ag": "ag", "gtp_remat": "gtp_remat", "expt_gtp_remat": "expt_gtp_remat",
    "expt_dp": "expt_dp", "expt_dp_gtp_remat": "expt_dp_gtp_remat", "expt_dp_ag": "ag", "intra_dp_cp": "intra_dp_cp",
    "intra_expt_dp": "intra_expt_dp", "inter_dist_opt": "inter_dist_opt", "intra_dist_opt": "intra_dist_opt",
}


#: gloo groups reachable through the collection (Megatron PR #6259's direction): attribute -> megashard group name.
#: None where the rank has none (a ``fake`` job, ``create_gloo_process_groups=False`` on nccl, gtp_remat > 1).
GLOO_FIELDS: dict[str, str] = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp", "intra_dp_cp_gloo": "intra_dp_cp",
                               "expt_dp_gloo": "expt_dp", "intra_expt_dp_gloo": "intra_expt_dp"}
#: Other attributes without a Megatron 0.19 field: the hybrid dp·cp groups, ``{size: group}``.
EXTRA_FIELDS = ("hybrid_dp_cp",)


def _gloo_groups(state: GroupSource) -> dict[str, Any]:
    from megashard.errors import StateError

    s = state.sizes
    out: dict[str, Any] = {}
    for field, name in GLOO_FIELDS.items():
        expert = name.startswith(("expt", "intra_expt"))
        if s.gtp_remat > 1 or (expert and s.expt_gtp_remat > 1):
            out[field] = None  # Megatron switches them off under weight rematerialisation
            continue
        try:
            out[field] = state.gloo_group(name)
        except StateError:
            out[field] = None
    return out


class ProcessGroupCollection:
    """Megatron's ``ProcessGroupCollection`` field names without megatron-core: ``pgs.tp``, ``pgs.dp_cp`` …;
    a declared field that was not set reads as None (as Megatron's); an unknown keyword raises ValueError."""

    def __init__(self, **kwargs: Any):
        for key, value in kwargs.items():
            if key not in PG_FIELDS:
                raise ValueError(f"Unknown attribute: {key}")
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        if name in PG_FIELDS or name in GLOO_FIELDS or name in EXTRA_FIELDS:
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    def __repr__(self) -> str:
        parts = []
        for name in PG_FIELDS:
            pg = self.__dict__.get(name)
            if isinstance(pg, list):
                parts.append(f"{name}({[g.size() for g in pg]})")
            elif pg is not None:
                parts.append(f"{name}({pg.size()})")
        return f"ProcessGroupCollection({', '.join(parts) or 'empty'})"


def pg_collection_groups(state: GroupSource) -> dict[str, Any]:
    """``{field: process group (or list, or None)}`` for every Megatron field, from ``state``."""
    out: dict[str, Any] = {}
    for field, name in PG_FIELDS.items():
        if name == "ag":  # the all-gather twins, once create_all_gather_groups made them (else None, as Megatron)
            out[field] = getattr(state, "all_gather_groups", {}).get(field)
        elif name is None:
            out[field] = None
        elif name == "hcp":
            out[field] = state.hcp_groups() or None
        elif name == "inter_dist_opt" and state.sizes.dp_outer == 1:
            out[field] = None  # Megatron creates the inter-instance group only with several instances
        elif not state.in_group(name):
            out[field] = None
        else:
            out[field] = state.group(name)
    return out


def pg_collection(state: GroupSource, megatron: bool | None = None) -> Any:
    """A ``ProcessGroupCollection`` of ``state``'s groups: megatron-core's class when importable (``megatron`` None)
    or required (True), megashard's stand-in otherwise or with ``megatron=False``. The gloo groups ride along as
    :data:`GLOO_FIELDS` attributes (``pgs.dp_gloo``, ``pgs.intra_dp_cp_gloo`` …), the hybrid dp·cp groups as
    ``pgs.hybrid_dp_cp`` (``{size: group}``)."""
    groups = pg_collection_groups(state)
    out = _collection(groups, megatron)
    for field, pg in _gloo_groups(state).items():
        object.__setattr__(out, field, pg)
    object.__setattr__(out, "hybrid_dp_cp", state.hybrid_dp_cp_groups())
    return out


def _collection(groups: dict[str, Any], megatron: bool | None) -> Any:
    import dataclasses

    if megatron is False:
        return ProcessGroupCollection(**groups)
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection as MegatronPGC
    except Exception as e:  # megatron-core absent (or failing to import on this machine): the stand-in
        if megatron:
            from megashard.errors import MissingExtraError

            raise MissingExtraError(f"pg_collection(megatron=True) needs megatron-core (pip install megatron-core): "
                                    f"{type(e).__name__}: {e}") from None
        return ProcessGroupCollection(**groups)
    known = {f.name for f in dataclasses.fields(MegatronPGC)}
    return MegatronPGC(**{k: v for k, v in groups.items() if k in known})
