"""Megatron-LM 0.19's ``initialize_model_parallel`` group construction, re-stated plainly from its code (no
torch, no megashard): every ``create_group`` call in Megatron's order, with the family it builds.

The tests compare megashard's layout with it on random configs (tests/test_megatron_groups.py), and
benchmarks/init_scale.py counts from it how many communicators Megatron-LM creates on one rank (every
``create_group`` call whose ranks hold that rank: Megatron never de-duplicates equal rank sets).
"""
from __future__ import annotations

from math import log2, prod
from typing import Callable, Iterator, Optional


def masked_groups(world: int, parallel_size: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron's ``generate_masked_orthogonal_rank_groups``: the groups spanning the masked axes (axes listed
    fastest first), members and groups in mixed-radix order."""
    def prefix(a: list[int]) -> list[int]:
        r, acc = [1], 1
        for v in a:
            acc *= v
            r.append(acc)
        return r

    def decompose(index: int, shape: list[int]) -> list[int]:
        return [(index // d) % s for s, d in zip(shape, prefix(shape))]

    stride = prefix(parallel_size)
    m_shape = [s for s, m in zip(parallel_size, mask) if m]
    u_shape = [s for s, m in zip(parallel_size, mask) if not m]
    m_stride = [d for d, m in zip(stride, mask) if m]
    u_stride = [d for d, m in zip(stride, mask) if not m]
    size = prod(m_shape)
    inner = [sum(a * b for a, b in zip(decompose(i, m_shape), m_stride)) for i in range(size)]
    out = []
    for g in range(world // size):
        base = sum(a * b for a, b in zip(decompose(g, u_shape), u_stride))
        out.append([base + o for o in inner])
    return out


class RankGenerator:
    """Megatron's ``RankGenerator``: tokens of ``order``, missing ones appended; every rank plus ``rank_offset``."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, gtp_remat: int = 1,
                 rank_offset: int = 0):
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}
        order = order.lower()
        for name, s in sizes.items():
            if name not in order.split("-"):
                if s != 1:
                    raise RuntimeError(f"size of {name} is {s} but it is not in order {order}")
                order = order + "-" + name
        self.order = order.split("-")
        self.sizes = [sizes[t] for t in self.order]
        self.world = prod(self.sizes)
        self.rank_offset = rank_offset

    def get_ranks(self, token: str) -> list[list[int]]:
        toks = token.split("-")
        groups = masked_groups(self.world, self.sizes, [t in toks for t in self.order])
        return [[r + self.rank_offset for r in g] for g in groups]


def inject_gtp_remat(order: str, after: str) -> str:
    """Megatron's ``_inject_gtp_remat_axis``: the token ``gtp_remat`` right after ``after`` (else after tp, else
    first; kept where given)."""
    toks = order.lower().split("-")
    if "gtp_remat" in toks:
        return "-".join(toks)
    anchor = after if after in toks else "tp"
    pos = toks.index(anchor) + 1 if anchor in toks else 0
    toks.insert(pos, "gtp_remat")
    return "-".join(toks)


def hierarchical(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """Megatron's ``create_hierarchical_groups`` rank lists: per level, ``rearrange("(l s u) -> (l u) s")``."""
    levels = []
    for level, s in enumerate(sizes):
        u, l = prod(sizes[:level]), prod(sizes[level + 1:])
        levels.append([[ranks[li * s * u + si * u + ui] for si in range(s)] for li in range(l) for ui in range(u)])
    return levels


def hybrid_dp_cp(ranks: list[int]) -> list[tuple[int, list[int]]]:
    """Megatron's ``create_hybrid_dp_cp_groups`` for one dp-cp group: ``(group_size, ranks)`` per group, in its
    order (every power of two from 2 below ``len(ranks)``, then the consecutive slices)."""
    assert len(ranks) % 2 == 0, "Hybrid context parallel requires an even number of ranks"
    out = []
    for size in [2 ** i for i in range(int(log2(len(ranks))))][1:]:
        for i in range(0, len(ranks), size):
            out.append((size, ranks[i:i + size]))
    return out


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    return [pp_ranks[0]]


def create_group_calls(
    world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: Optional[int] = None, n_inst: int = 1,
    hcp: Optional[list[int]] = None, order: str = "tp-cp-ep-dp-pp", gloo: bool = True,
    embedding_ranks: Optional[Callable] = None, position_embedding_ranks: Optional[Callable] = None,
    gtp: int = 1, egtp: int = 1, hybrid: bool = False, rank_offset: int = 0, pp_backend: Optional[str] = None,
) -> Iterator[tuple[str, list[int], str]]:
    """Every ``create_group`` call of Megatron-LM 0.19's ``initialize_model_parallel``, in its order:
    ``(family, ranks, backend)``; backend "gloo" for the gloo groups, ``pp_backend`` for the pp groups when given,
    else "default". ``gtp``/``egtp``: ``gtp_remat_size``/``expert_gtp_remat_size`` (axes injected after tp / after
    ep; gloo groups off when > 1); ``hybrid``: ``hybrid_context_parallel`` (families ``hybrid_dp_cp_<size>``);
    ``world`` with ``rank_offset``: Megatron's ``local_world_size`` (the layout on ranks ``rank_offset ..
    rank_offset + world - 1``). SHARP changes no group (only the environment while the dp-cp groups are made)."""
    etp = tp if etp is None else etp
    emb = embedding_ranks or default_embedding_ranks
    pos = position_embedding_ranks or default_position_embedding_ranks
    dp = world // (tp * pp * cp * gtp)
    dense = RankGenerator(tp, 1, dp, pp, cp, inject_gtp_remat(order, "tp"), gtp_remat=gtp, rank_offset=rank_offset)
    edp = world // (etp * ep * pp * egtp)
    expert = RankGenerator(etp, ep, edp, pp, 1, inject_gtp_remat(order, "ep"), gtp_remat=egtp, rank_offset=rank_offset)
    intra = dp * cp // n_inst

    for r in dense.get_ranks("gtp_remat"):
        yield "gtp_remat", r, "default"
    if gtp > 1:
        gloo = False
    for r in dense.get_ranks("dp-cp"):
        yield "dp_cp", r, "default"
        if gloo:
            yield "dp_cp", r, "gloo"
        if n_inst > 1:
            for i in range(n_inst):
                sub = r[i * intra:(i + 1) * intra]
                yield "intra_dp_cp", sub, "default"
                if gloo:
                    yield "intra_dp_cp", sub, "gloo"
    if hybrid:
        for r in dense.get_ranks("dp-cp"):
            for size, sub in hybrid_dp_cp(r):
                yield f"hybrid_dp_cp_{size}", sub, "default"
    for r in dense.get_ranks("dp"):
        yield "dp", r, "default"
        if gloo:
            yield "dp", r, "gloo"
    if gtp > 1:
        for r in dense.get_ranks("gtp_remat-dp"):
            yield "dp_gtp_remat", r, "default"
        for r in dense.get_ranks("gtp_remat-dp-cp"):
            yield "dp_cp_gtp_remat", r, "default"
    for r in dense.get_ranks("cp"):
        yield "cp", r, "default"
        if hcp:
            for level, groups in enumerate(hierarchical(r, list(hcp))):
                for g in groups:
                    yield f"hcp{level}", g, "default"
    for r in dense.get_ranks("tp-gtp_remat-pp"):
        yield "mp", r, "default"
    for r in dense.get_ranks("tp"):
        yield "tp", r, "default"
    for r in dense.get_ranks("pp"):
        yield "pp", r, pp_backend or "default"
        yield "embd", list(emb(r)), "default"
        yield "pos_embd", list(pos(r)), "default"
    for r in dense.get_ranks("tp-gtp_remat-dp-cp"):
        yield "tp_dp_cp", r, "default"
    for r in dense.get_ranks("tp-gtp_remat-dp"):
        yield "tp_dp", r, "default"
    for r in dense.get_ranks("tp-cp"):
        yield "tp_cp", r, "default"
    for r in expert.get_ranks("gtp_remat"):
        yield "expt_gtp_remat", r, "default"
    for r in expert.get_ranks("ep"):
        yield "ep", r, "default"
    for r in expert.get_ranks("tp"):
        yield "expt_tp", r, "default"
    for r in expert.get_ranks("tp-ep"):
        yield "tp_ep", r, "default"
    for r in expert.get_ranks("tp-ep-pp"):
        yield "tp_ep_pp", r, "default"
    for r in expert.get_ranks("tp-ep-gtp_remat-pp"):
        yield "tp_ep_pp_with_egtp_remat", r, "default"
    intra_e = edp // n_inst
    if egtp > 1:
        gloo = False
    for r in expert.get_ranks("dp"):
        yield "expt_dp", r, "default"
        if gloo:
            yield "expt_dp", r, "gloo"
        if n_inst > 1:
            inner, outer = hierarchical(r, [intra_e, n_inst])
            for g in inner:
                yield "intra_expt_dp", g, "default"
                if gloo:
                    yield "intra_expt_dp", g, "gloo"
            for g in outer:
                yield "inter_dist_opt", g, "default"
                if gloo:
                    yield "inter_dist_opt", g, "gloo"
    if egtp > 1:
        for r in expert.get_ranks("gtp_remat-dp"):
            yield "expt_dp_gtp_remat", r, "default"
    if gtp > 1 or egtp > 1:
        yield "intra_dist_opt", sorted(r for g in expert.get_ranks("tp-ep-pp") for r in g), "default"
        return
    acc: list[int] = []
    for k, r in enumerate(expert.get_ranks("tp-ep-pp"), 1):
        acc.extend(r)
        if k % intra_e == 0:
            yield "intra_dist_opt", acc, "default"
            acc = []


def megatron_groups(world: int, **kw) -> dict[str, list[list[int]]]:
    """``{family: groups}`` of the non-gloo ``create_group`` calls (Megatron's aliases filled in: with one optimizer
    instance its intra partial groups are the whole dp·cp / expert dp groups)."""
    out: dict[str, list[list[int]]] = {}
    for fam, ranks, backend in create_group_calls(world, **kw):
        if backend != "gloo":
            out.setdefault(fam, []).append(ranks)
    out.setdefault("intra_dp_cp", out["dp_cp"])
    out.setdefault("intra_expt_dp", out["expt_dp"])
    out.setdefault("dp_gtp_remat", out["dp"])  # aliases when gtp_remat is 1
    out.setdefault("dp_cp_gtp_remat", out["dp_cp"])
    out.setdefault("expt_dp_gtp_remat", out["expt_dp"])
    return out


def communicators_of_rank(world: int, rank: int, **kw) -> dict[str, int]:
    """What Megatron-LM creates on ``rank``: ``calls`` (every ``create_group`` call whose ranks hold it — each one a
    communicator: Megatron never de-duplicates), split into ``default`` (nccl on GPUs) and ``gloo``; and ``sets``, the
    distinct (rank set, backend) pairs among them (the default group not counted)."""
    out = {"calls": 0, "default": 0, "gloo": 0}
    sets = set()
    for _, ranks, backend in create_group_calls(world, **kw):
        if rank in ranks:
            out["calls"] += 1
            out[backend if backend == "gloo" else "default"] += 1
            sets.add((tuple(sorted(ranks)), backend))
    out["sets"] = len(sets)
    return out
