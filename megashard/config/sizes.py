"""Resolved sizes: every axis size of a parallel config for one world size (the step after parsing).

:func:`resolve_sizes` (called as :meth:`ParallelConfig.resolve <megashard.config.ParallelConfig.resolve>`) fills
every ``-1`` of a validated config for a world size and checks that the sizes fit it, raising
:class:`~megashard.errors.ConfigError` naming the rule broken; :class:`ResolvedSizes` is what it returns and
what :class:`~megashard.layout.RankLayout` is built from. It reads the requested sizes through
:class:`SizeRequest` (what a :class:`~megashard.config.ParallelConfig` offers), so this arithmetic sits below the
config class that calls it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from megashard.errors import ConfigError

#: Axis tokens allowed in ``order`` (Megatron's RankGenerator tokens).
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: Largest world size megashard plans or initialises: 2^24 = 16,777,216 ranks (far beyond any machine; it
#: bounds the cost of per-rank work such as meshes and listing groups).
MAX_WORLD_SIZE = 1 << 24


class SizeRequest(Protocol):
    """The requested sizes :func:`resolve_sizes` reads (a :class:`~megashard.config.ParallelConfig` is one): the
    fields of the same names, ``-1`` = derive; documented there."""

    @property
    def tp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def vpp(self) -> Optional[int]: ...
    @property
    def dp(self) -> int: ...
    @property
    def dp_outer(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def expt_tp(self) -> int: ...
    @property
    def expt_dp(self) -> int: ...
    @property
    def gtp_remat(self) -> int: ...
    @property
    def expt_gtp_remat(self) -> int: ...
    @property
    def order(self) -> str: ...
    @property
    def hierarchical_context_parallel_sizes(self) -> Optional[Sequence[int]]: ...


def full_order(order: str, gtp_remat: int = 1, expt_gtp_remat: int = 1) -> list[str]:
    """The tokens of ``order`` with the missing (size-1) axes appended: Megatron's RankGenerator rule."""
    tokens = order.lower().split("-")
    missing = [t for t in ORDER_TOKENS if t not in tokens]
    if gtp_remat > 1 or expt_gtp_remat > 1:
        # Megatron injects gtp_remat after tp (expert: after ep, else after tp) and at the front when the anchor
        # is not in order: a missing (size-1) tp goes first, a missing ep right after tp, so that the axes
        # placed after them (RankLayout) land where Megatron's do.
        front = ["tp"] if "tp" in missing else []
        if "ep" in missing and expt_gtp_remat > 1:
            if front:
                front.append("ep")
            else:
                tokens.insert(tokens.index("tp") + 1, "ep")
        tokens = front + tokens
        missing = [t for t in missing if t not in tokens]
    return tokens + missing


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n`` in increasing order, in O(sqrt(n)) steps (n may be huge in an error message)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def fmt_divisors(n: int, limit: int = 16) -> str:
    """The divisors of ``n`` for an error message ("valid tp: 1, 2, 4"), the middle elided beyond ``limit``."""
    if n > 1 << 40:  # a user's typo, e.g. a batch of 10^15: list the small divisors only (O(2^16) steps)
        return ", ".join(str(d) for d in range(1, 1 << 16) if n % d == 0)[:200] + ", …"
    ds = _divisors(n)
    if len(ds) > limit:
        ds = ds[: limit // 2] + ["…"] + ds[-limit // 2 :]  # type: ignore[list-item]
    return ", ".join(str(d) for d in ds)


def check_world_size(world_size: Any, what: str = "world size") -> None:
    """ConfigError unless ``world_size`` is an integer in 1..MAX_WORLD_SIZE."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{what} {world_size!r} must be a positive integer")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"{what} {world_size:,} is larger than megashard's maximum of {MAX_WORLD_SIZE:,} ranks (2^24)")


@dataclass(frozen=True)
class ResolvedSizes:
    """Every axis size for one world size; produced by :meth:`ParallelConfig.resolve`."""

    world_size: int
    tp: int
    cp: int
    pp: int
    dp: int
    dp_outer: int
    dp_shard: int
    ep: int
    expt_tp: int
    expt_dp: int
    vpp: int | None = None
    order: tuple[str, ...] = field(default=("tp", "cp", "ep", "dp", "pp"))
    hierarchical_cp: tuple[int, ...] | None = None
    """Sizes of the hierarchical context-parallel levels (product = cp), fastest first; None = not hierarchical."""
    gtp_remat: int = 1
    """Megatron's gtp_remat axis (dense grid, right after tp): world = tp·gtp_remat·cp·dp·pp."""
    expt_gtp_remat: int = 1
    """Megatron's expert gtp_remat axis (expert grid, right after ep): world = expt_tp·ep·expt_gtp_remat·expt_dp·pp."""
    hybrid_cp: bool = False
    """Megatron's hybrid context parallelism: the power-of-two slices of every dp·cp group are groups too."""

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["hybrid_cp"]:
            d.pop("hybrid_cp")  # absent = off: saved sizes and plans of layouts without it read as before
        for k in ("gtp_remat", "expt_gtp_remat"):
            if d[k] == 1:
                d.pop(k)  # absent = 1: saved sizes and plans of layouts without the axis read as before
        d["order"] = "-".join(self.order)
        if d.get("hierarchical_cp") is None:
            d.pop("hierarchical_cp", None)  # keep older readers of saved sizes happy
        else:
            d["hierarchical_cp"] = list(d["hierarchical_cp"])
        return d


def resolve_sizes(config: SizeRequest, world_size: int) -> ResolvedSizes:
    """All sizes of ``config`` (validated when it was built) for ``world_size`` ranks, every ``-1`` filled in;
    raises ConfigError naming the rule broken. Pure arithmetic: the config is not checked again."""
    check_world_size(world_size)
    G, E = config.gtp_remat, config.expt_gtp_remat
    if world_size % G:
        raise ConfigError(f"world size {world_size} is not divisible by gtp_remat={G}; valid gtp_remat: "
                          f"{fmt_divisors(world_size)}")
    try:
        sizes = _resolve(config, world_size // G, G, E)
    except ConfigError as e:
        if G == 1:
            raise
        raise ConfigError(f"{e} (with gtp_remat={G}: the sizes are checked on world/gtp_remat = {world_size // G})") from None
    return dataclasses.replace(sizes, world_size=world_size)


def _resolve(config: SizeRequest, world_size: int, G: int, E: int) -> ResolvedSizes:
    """:func:`resolve_sizes` on ``world_size`` = world / gtp_remat (the dense grid without its gtp_remat axis)."""
    W = world_size
    tp, cp, pp, dp, dpo, dps = config.tp, config.cp, config.pp, config.dp, config.dp_outer, config.dp_shard

    # dp = dp_outer · dp_shard: fill one from the other two when possible.
    if dp != -1 and dpo != -1 and dps == -1:
        if dp % dpo:
            raise ConfigError(
                f"data parallel size dp={dp} must be divisible by dp_outer={dpo}; valid dp_outer: {fmt_divisors(dp)}"
            )
        dps = dp // dpo
    elif dp != -1 and dps != -1 and dpo == -1:
        if dp % dps:
            raise ConfigError(
                f"data parallel size dp={dp} must be divisible by dp_shard={dps}; valid dp_shard: {fmt_divisors(dp)}"
            )
        dpo = dp // dps
    elif dp == -1 and dpo != -1 and dps != -1:
        dp = dpo * dps
    dense = {"tp": tp, "cp": cp, "pp": pp, "dp_outer": dpo, "dp_shard": dps}
    free = [k for k, v in dense.items() if v == -1]
    fixed = 1
    for k, v in dense.items():
        if v != -1:
            fixed *= v
    if len(free) > 1:  # only possible as dp given with dp_outer=-1 and dp_shard=-1
        raise ConfigError(
            f"{' and '.join(n + '=-1' for n in free)} with dp={dp}: give dp_outer or dp_shard so the split of dp is known"
        )
    if free:
        name = free[0]
        if W % fixed:
            known = "·".join(f"{k}={v}" for k, v in dense.items() if v != -1)
            raise ConfigError(
                f"world size {W} is not divisible by {known} = {fixed}; "
                f"valid products for this world: {fmt_divisors(W)}"
            )
        dense[name] = W // fixed
    else:
        if fixed != W and config.dp != -1 and W % (tp * cp * pp) == 0:
            raise ConfigError(
                f"dp={config.dp} does not match world/(tp·cp·pp) = {W}/({tp}·{cp}·{pp}) = {W // (tp * cp * pp)}; "
                "set dp: -1 to derive it"
            )
        if fixed != W:
            others = tp * cp * pp * dpo
            fix = (f"; to let FSDP take the rest, set dp_shard=-1 (parallel.dp_shard=-1 on the command line; "
                   f"here dp_shard={W // others})" if W % others == 0 else
                   f"; tp·cp·pp·dp_outer = {others} does not divide {W} either: choose sizes whose product divides "
                   f"it (divisors: {fmt_divisors(W)})")
            raise ConfigError(
                f"tp·cp·pp·dp_outer·dp_shard = {tp}·{cp}·{pp}·{dpo}·{dps} = {fixed} must equal the world size {W}"
                + fix
            )
    tp, cp, pp, dpo, dps = (dense[k] for k in ("tp", "cp", "pp", "dp_outer", "dp_shard"))
    dp_resolved = dpo * dps
    if dp != -1 and dp != dp_resolved:
        raise ConfigError(
            f"dp={dp} does not match world/(tp·cp·pp) = {W}/({tp}·{cp}·{pp}) = {dp_resolved}; set dp: -1 to derive it"
        )

    # Expert layout: expt_tp · ep · expt_gtp_remat · expt_dp = tp · gtp_remat · cp · dp (the ranks of one stage).
    stage = tp * cp * dp_resolved * G
    if stage % E:
        raise ConfigError(f"expt_gtp_remat={E} must divide the ranks of one pipeline stage tp·gtp_remat·cp·dp = "
                          f"{stage}; valid: {fmt_divisors(stage)}")
    stage //= E
    ep, etp, edp = config.ep, config.expt_tp, config.expt_dp
    if etp == -1:
        if stage % (ep * edp):
            raise ConfigError(
                f"ep·expt_dp = {ep}·{edp} = {ep * edp} must divide dp·cp·tp = {stage}; "
                f"valid ep·expt_dp: {fmt_divisors(stage)}"
            )
        etp = stage // (ep * edp)
    if stage % etp:
        raise ConfigError(
            f"expt_tp={etp} must divide dp·cp·tp = {dp_resolved}·{cp}·{tp} = {stage}; valid: {fmt_divisors(stage)}"
        )
    if ep == -1:
        if (stage // etp) % edp:
            raise ConfigError(
                f"expt_dp={edp} must divide dp·cp·tp/expt_tp = {stage // etp}; valid: {fmt_divisors(stage // etp)}"
            )
        ep = stage // etp // edp
    if (stage // etp) % ep:
        raise ConfigError(
            f"ep={ep} must divide dp·cp·tp/expt_tp = {stage // etp}; valid: {fmt_divisors(stage // etp)}"
        )
    derived_edp = stage // (etp * ep)
    if edp != -1 and edp != derived_edp:
        raise ConfigError(
            f"expt_dp={edp} does not match dp·cp·tp/(expt_tp·ep) = {stage}/({etp}·{ep}) = {derived_edp}; "
            "set expt_dp: -1 to derive it"
        )
    edp = derived_edp
    order = full_order(config.order, G, E)
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp_resolved, "pp": pp}
    missing = [t for t in ORDER_TOKENS if t not in config.order.lower().split("-") and sizes[t] > 1]
    if missing:
        raise ConfigError(
            f"order='{config.order}' omits {', '.join(f'{t} (size {sizes[t]})' for t in missing)}; "
            "every axis with size > 1 must appear in order"
        )
    # Megatron's rule: with pp not last, dense and expert dp must match so that the pp groups agree. "Last" as Megatron
    # reads it: the order as written ends with pp (size-1 axes appended after it change no stride).
    pp_last = config.order.lower().split("-")[-1] == "pp"
    if pp > 1 and not pp_last and edp != dp_resolved and ep == 1 and config.expt_tp == 1 and G == E:
        # No experts: fold the (unused) expert layout onto the dense one, as Megatron's default
        # expt_tp = tp does, so that its pipeline groups agree.
        etp, edp = tp * cp, dp_resolved
    if pp > 1 and not pp_last and edp != dp_resolved:
        raise ConfigError(
            f"order='{config.order}' does not end with pp, so the dense and expert pipeline groups differ unless "
            f"expt_dp ({edp}) equals dp ({dp_resolved}); put pp last or choose ep·expt_tp = tp·cp"
        )
    if edp % dpo:
        # The expert replica axis: experts shard inside an HSDP replica (expt_dp_outer = dp_outer), as Megatron's
        # partial distributed optimizer requires (expt_dp divisible by num_distributed_optimizer_instances).
        raise ConfigError(
            f"expt_dp={edp} must be divisible by dp_outer={dpo} (experts shard inside an HSDP replica and replicate "
            f"across the {dpo} replicas); choose ep·expt_tp dividing tp·cp·dp/dp_outer = {stage // dpo} "
            f"(valid: {fmt_divisors(stage // dpo)})"
        )
    hcp = config.hierarchical_context_parallel_sizes
    if hcp is not None:
        prod = 1
        for s in hcp:
            prod *= s
        if prod != cp:
            raise ConfigError(
                f"hierarchical_context_parallel_sizes={list(hcp)} multiply to {prod}, but cp={cp}; give level sizes "
                f"whose product is {cp} (fastest level first, e.g. [{cp // 2 if cp % 2 == 0 and cp > 2 else cp}"
                f"{', 2' if cp % 2 == 0 and cp > 2 else ''}])"
            )
    if config.hybrid_context_parallel and (dp_resolved * cp) % 2:
        # Megatron asserts "Hybrid context parallel requires an even number of ranks" (per dp·cp group)
        raise ConfigError(
            f"hybrid_context_parallel needs an even number of ranks in each dp·cp group (Megatron: \"Hybrid context "
            f"parallel requires an even number of ranks\"), but dp·cp = {dp_resolved}·{cp} = {dp_resolved * cp}; "
            "choose sizes with an even dp·cp or set hybrid_context_parallel: false"
        )
    if config.sharp_group == "dp_replica" and dpo == 1:
        raise ConfigError("sharp_group='dp_replica' needs several distributed-optimizer instances, but dp_outer "
                          "resolved to 1 (Megatron: \"dp_replica group requires num_distributed_optimizer_instances > "
                          "1\"); use sharp_group: dp or a dp_outer > 1")
    return ResolvedSizes(
        world_size=W, tp=tp, cp=cp, pp=pp, dp=dp_resolved, dp_outer=dpo, dp_shard=dps,
        ep=ep, expt_tp=etp, expt_dp=edp, vpp=config.vpp, order=tuple(order),
        hierarchical_cp=tuple(hcp) if hcp is not None else None, gtp_remat=G, expt_gtp_remat=E,
        hybrid_cp=config.hybrid_context_parallel,
    )
