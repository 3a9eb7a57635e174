"""`ParallelConfig`: the parallel layout of a training job, from YAML, a dict or Python.

Sizes follow Megatron-LM's names. The dense layout is ``world = tp · cp · dp · pp`` with
``dp = dp_outer · dp_shard`` (HSDP: FSDP shards over dp_shard·cp, replicas over dp_outer); the expert
layout re-partitions the same ranks as ``world = expt_tp · ep · expt_dp · pp`` ("MoE parallel folding").
Any one size may be ``-1`` ("whatever is left"); ``dp``, ``dp_shard`` and ``expt_dp`` default to ``-1``
and are derived. :meth:`ParallelConfig.resolve` turns a config and a world size into :class:`ResolvedSizes`,
raising :class:`~megashard.errors.ConfigError` for anything that does not fit.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from megashard.errors import ConfigError

#: Axis tokens allowed in ``order`` (Megatron's RankGenerator tokens).
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
BACKENDS = ("auto", "nccl", "gloo", "fake")
DEVICES = ("auto", "cpu", "cuda")
#: Largest world size megashard plans or initialises: 2^24 = 16,777,216 ranks (far beyond any machine; it
#: bounds the cost of per-rank work such as meshes and listing groups).
MAX_WORLD_SIZE = 1 << 24
#: Largest process-group timeout in seconds (~31 years; larger values overflow torch's timedelta handling).
MAX_TIMEOUT = 1e9


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


def _fmt_divisors(n: int, limit: int = 16) -> str:
    """The divisors of ``n`` for an error message, the middle elided beyond ``limit``."""
    if n > 1 << 40:  # a user's typo, e.g. a batch of 10^15: list the small divisors only (O(2^16) steps)
        return ", ".join(str(d) for d in range(1, 1 << 16) if n % d == 0)[:200] + ", …"
    ds = _divisors(n)
    if len(ds) > limit:
        ds = ds[: limit // 2] + ["…"] + ds[-limit // 2 :]  # type: ignore[list-item]
    return ", ".join(str(d) for d in ds)


@dataclass
class ParallelConfig:
    """How the ranks of a job are split into parallel axes.

    Every size is a positive integer up to MAX_WORLD_SIZE (2^24) or ``-1`` (at most one free size per layout:
    derived from the world size). Rank order follows Megatron-LM's ``order`` string (leftmost axis varies
    fastest). Checked at construction (:meth:`validate`): an invalid value raises ConfigError right away.
    """

    tp: int = 1
    """Tensor-parallel size. Must divide the world size; TP-sharded tensor dims must divide by it."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks)."""
    pp: int = 1
    """Pipeline-parallel size (number of stages)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); needs ``pp > 1``. ``None`` = not interleaved."""
    dp: int = -1
    """Data-parallel size = world / (tp·cp·pp). Derived when ``-1``; checked when given."""
    dp_outer: int = 1
    """HSDP replica count: data-parallel replicas that each hold a full FSDP-sharded copy. Must divide dp."""
    dp_shard: int = -1
    """FSDP shard count inside one replica = dp / dp_outer. Derived when ``-1``."""
    ep: int = 1
    """Expert-parallel size. ``ep · expt_tp`` must divide ``tp·cp·dp`` (the ranks of one pipeline stage)."""
    expt_tp: int = 1
    """Expert tensor-parallel size. Defaults to 1, *not* to tp (an implicit tp default causes divisibility surprises)."""
    expt_dp: int = -1
    """Expert data-parallel size = world / (expt_tp·ep·pp). Derived when ``-1``."""
    order: str = "tp-cp-ep-dp-pp"
    """Megatron rank order: axis tokens joined by ``-``, leftmost varies fastest. Tokens: tp, cp, ep, dp, pp;
    a token of an axis with size > 1 must appear; missing size-1 tokens are appended."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl``, ``gloo`` or ``fake`` (simulation).
    ``nccl`` needs ``device`` cuda or auto (and, when a job starts, CUDA devices)."""
    device: str = "auto"
    """Device type of the meshes: ``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    timeout: float = 600.0
    """Timeout of every process group megashard creates, in seconds (0 < timeout ≤ 1e9)."""
    seed: int = 1234
    """Base random seed (data-parallel stream = seed; model-parallel = seed + 2718 + tp_rank)."""

    def __post_init__(self) -> None:
        # Invalid values fail where they are written, not later in resolve() or initialize().
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, where: str = "parallel") -> "ParallelConfig":
        """Build from a mapping, rejecting unknown keys with a "did you mean"."""
        from megashard.yamlcfg import reject_unknown_keys

        data = dict(data or {})
        reject_unknown_keys(cls, data, where)
        return cls(**data)  # validated by __post_init__

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> "ParallelConfig":
        """Read the ``parallel:`` section of a YAML file (or the whole file if it has none), then apply
        dotted ``parallel.key=value`` overrides."""
        from megashard.yamlcfg import apply_overrides, load_yaml

        doc = apply_overrides(load_yaml(path), overrides)
        return cls.from_dict(parallel_section(doc, path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check what can be checked without a world size (types, ranges, order, backend)."""
        ints = ("tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp", "seed")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name}={v!r} must be an integer")
        sizes = ("tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp")
        for name in sizes:
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ConfigError(f"{name}={v} is not a valid size; use a positive integer or -1 (derive it)")
            if v > MAX_WORLD_SIZE:
                raise ConfigError(f"{name}={v:,} is larger than the largest world size megashard supports "
                                  f"({MAX_WORLD_SIZE:,} ranks); use a positive integer up to it, or -1 (derive it)")
        dense_free = [n for n in ("tp", "cp", "pp", "dp_outer") if getattr(self, n) == -1]
        if len(dense_free) > 1:
            raise ConfigError(
                f"at most one size may be -1, but {', '.join(f'{n}=-1' for n in dense_free)}; give all but one explicitly"
            )
        if dense_free and self.dp == -1 and self.dp_shard == -1:
            raise ConfigError(
                f"{dense_free[0]}=-1 needs dp or dp_shard to be given (dp and dp_shard are derived by default, "
                "so only one size can be free)"
            )
        expert_free = [n for n in ("ep", "expt_tp") if getattr(self, n) == -1]
        if len(expert_free) > 1 or (expert_free and self.expt_dp == -1):
            raise ConfigError(
                f"{' and '.join(n + '=-1' for n in expert_free)} with expt_dp={self.expt_dp}: at most one expert size "
                "(ep, expt_tp, expt_dp) may be -1; expt_dp is derived by default, so give it to make ep or expt_tp free"
            )
        if self.vpp is not None:
            if isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp < 1:
                raise ConfigError(f"vpp={self.vpp!r} must be a positive integer or null")
            if self.vpp > 1 and self.pp == 1:
                raise ConfigError(f"vpp={self.vpp} needs pipeline parallelism, but pp=1; set pp > 1 or vpp: null")
        if not isinstance(self.order, str):
            raise ConfigError(f"order={self.order!r} must be a string such as 'tp-cp-ep-dp-pp'")
        tokens = self.order.lower().split("-")
        bad = [t for t in tokens if t not in ORDER_TOKENS]
        if bad:
            hints = []
            for t in bad:
                close = difflib.get_close_matches(t, ORDER_TOKENS, n=1)
                hints.append(f"'{t}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            raise ConfigError(
                f"order='{self.order}' has unknown token(s) {', '.join(hints)}; tokens are {', '.join(ORDER_TOKENS)}"
            )
        dup = sorted({t for t in tokens if tokens.count(t) > 1})
        if dup:
            raise ConfigError(f"order='{self.order}' repeats {', '.join(dup)}; each axis may appear once")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not supported; valid: {', '.join(BACKENDS)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not supported; valid: {', '.join(DEVICES)}")
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend='nccl' runs on CUDA devices only, but device='cpu'; use backend 'gloo' "
                              "(or 'auto') on CPU, or device 'cuda' (or 'auto') with nccl")
        if (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                or not 0 < self.timeout <= MAX_TIMEOUT):  # also refuses nan and inf
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds, at most {MAX_TIMEOUT:.0e}")

    def full_order(self) -> list[str]:
        """The order tokens with missing size-1 axes appended (Megatron's RankGenerator rule)."""
        tokens = self.order.lower().split("-")
        return tokens + [t for t in ORDER_TOKENS if t not in tokens]

    def resolve(self, world_size: int) -> "ResolvedSizes":
        """All sizes for ``world_size`` ranks, every ``-1`` filled in; raises ConfigError naming the rule broken."""
        self.validate()
        check_world_size(world_size)
        W = world_size
        tp, cp, pp, dp, dpo, dps = self.tp, self.cp, self.pp, self.dp, self.dp_outer, self.dp_shard

        # dp = dp_outer · dp_shard: fill one from the other two when possible.
        if dp != -1 and dpo != -1 and dps == -1:
            if dp % dpo:
                raise ConfigError(
                    f"data parallel size dp={dp} must be divisible by dp_outer={dpo}; valid dp_outer: {_fmt_divisors(dp)}"
                )
            dps = dp // dpo
        elif dp != -1 and dps != -1 and dpo == -1:
            if dp % dps:
                raise ConfigError(
                    f"data parallel size dp={dp} must be divisible by dp_shard={dps}; valid dp_shard: {_fmt_divisors(dp)}"
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
                    f"valid products for this world: {_fmt_divisors(W)}"
                )
            dense[name] = W // fixed
        else:
            if fixed != W and self.dp != -1 and W % (tp * cp * pp) == 0:
                raise ConfigError(
                    f"dp={self.dp} does not match world/(tp·cp·pp) = {W}/({tp}·{cp}·{pp}) = {W // (tp * cp * pp)}; "
                    "set dp: -1 to derive it"
                )
            if fixed != W:
                others = tp * cp * pp * dpo
                fix = (f"; to let FSDP take the rest, set dp_shard=-1 (parallel.dp_shard=-1 on the command line; "
                       f"here dp_shard={W // others})" if W % others == 0 else
                       f"; tp·cp·pp·dp_outer = {others} does not divide {W} either: choose sizes whose product divides "
                       f"it (divisors: {_fmt_divisors(W)})")
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

        # Expert layout: expt_tp · ep · expt_dp = tp · cp · dp (the ranks of one pipeline stage).
        stage = tp * cp * dp_resolved
        ep, etp, edp = self.ep, self.expt_tp, self.expt_dp
        if etp == -1:
            if stage % (ep * edp):
                raise ConfigError(
                    f"ep·expt_dp = {ep}·{edp} = {ep * edp} must divide dp·cp·tp = {stage}; "
                    f"valid ep·expt_dp: {_fmt_divisors(stage)}"
                )
            etp = stage // (ep * edp)
        if stage % etp:
            raise ConfigError(
                f"expt_tp={etp} must divide dp·cp·tp = {dp_resolved}·{cp}·{tp} = {stage}; valid: {_fmt_divisors(stage)}"
            )
        if ep == -1:
            if (stage // etp) % edp:
                raise ConfigError(
                    f"expt_dp={edp} must divide dp·cp·tp/expt_tp = {stage // etp}; valid: {_fmt_divisors(stage // etp)}"
                )
            ep = stage // etp // edp
        if (stage // etp) % ep:
            raise ConfigError(
                f"ep={ep} must divide dp·cp·tp/expt_tp = {stage // etp}; valid: {_fmt_divisors(stage // etp)}"
            )
        derived_edp = stage // (etp * ep)
        if edp != -1 and edp != derived_edp:
            raise ConfigError(
                f"expt_dp={edp} does not match dp·cp·tp/(expt_tp·ep) = {stage}/({etp}·{ep}) = {derived_edp}; "
                "set expt_dp: -1 to derive it"
            )
        edp = derived_edp
        order = self.full_order()
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp_resolved, "pp": pp}
        missing = [t for t in ORDER_TOKENS if t not in self.order.lower().split("-") and sizes[t] > 1]
        if missing:
            raise ConfigError(
                f"order='{self.order}' omits {', '.join(f'{t} (size {sizes[t]})' for t in missing)}; "
                "every axis with size > 1 must appear in order"
            )
        # Megatron's rule: with pp not last, dense and expert dp must match so that the pp groups agree.
        if pp > 1 and order[-1] != "pp" and edp != dp_resolved and ep == 1 and self.expt_tp == 1:
            # No experts: fold the (unused) expert layout onto the dense one, as Megatron's default
            # expt_tp = tp does, so that its pipeline groups agree.
            etp, edp = tp * cp, dp_resolved
        if pp > 1 and order[-1] != "pp" and edp != dp_resolved:
            raise ConfigError(
                f"order='{self.order}' does not end with pp, so the dense and expert pipeline groups differ unless "
                f"expt_dp ({edp}) equals dp ({dp_resolved}); put pp last or choose ep·expt_tp = tp·cp"
            )
        return ResolvedSizes(
            world_size=W, tp=tp, cp=cp, pp=pp, dp=dp_resolved, dp_outer=dpo, dp_shard=dps,
            ep=ep, expt_tp=etp, expt_dp=edp, vpp=self.vpp, order=tuple(order),
        )


def check_world_size(world_size: Any, what: str = "world size") -> None:
    """ConfigError unless ``world_size`` is an integer in 1..MAX_WORLD_SIZE."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{what} {world_size!r} must be a positive integer")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"{what} {world_size:,} is larger than megashard's maximum of {MAX_WORLD_SIZE:,} ranks (2^24)")


def parallel_section(doc: Mapping[str, Any], path: str = "config") -> Mapping[str, Any]:
    """The ``parallel:`` mapping of a job YAML, or the whole document when it is a bare parallel config
    (every key a ParallelConfig field); ConfigError for anything else, e.g. a mistyped ``paralel:``."""
    if "parallel" in doc:
        section = doc["parallel"]
        if section is None:
            return {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"{path}: section 'parallel' must be a mapping of keys, got {type(section).__name__} "
                              f"{section!r}")
        return section
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    if all(k in names for k in doc):
        return doc
    hints = []
    for k in doc:
        if k not in names:
            close = difflib.get_close_matches(str(k), ["parallel"], n=1, cutoff=0.7)
            hints.append(f"'{k}'" + (" (did you mean 'parallel'?)" if close else ""))
    raise ConfigError(f"{path}: no 'parallel' section; unknown section(s) {', '.join(hints)}; a bare parallel config "
                      f"may hold only the keys {', '.join(names)}")


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

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["order"] = "-".join(self.order)
        return d
