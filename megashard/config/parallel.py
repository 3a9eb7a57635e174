"""`ParallelConfig`: the parallel layout of a training job, from YAML, a dict or Python.

Sizes follow Megatron-LM's names. The dense layout is ``world = tp · cp · dp · pp`` with
``dp = dp_outer · dp_shard`` (HSDP: FSDP shards over dp_shard·cp, replicas over dp_outer); the expert
layout re-partitions the same ranks as ``world = expt_tp · ep · expt_dp · pp`` ("MoE parallel folding").
Any one size may be ``-1`` or ``auto`` ("whatever is left"); ``dp``, ``dp_shard`` and ``expt_dp`` default to
``-1`` and are derived. In an elastic job (``launch.nnodes: MIN:MAX``) the free size is the one that absorbs a change
of the world size: a data-parallel axis (``dp_shard: auto``, or ``dp_outer: auto`` for HSDP; docs/elastic.md).

A config is checked once, when it is built (:meth:`ParallelConfig.validate` from ``__post_init__``), and is frozen
afterwards, so it stays valid; :meth:`ParallelConfig.resolve` turns it and a world size into
:class:`~megashard.config.sizes.ResolvedSizes`, raising :class:`~megashard.errors.ConfigError` for anything that
does not fit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from megashard.config.sizes import MAX_WORLD_SIZE, ORDER_TOKENS, ResolvedSizes, full_order, resolve_sizes
from megashard.errors import ConfigError, unknown_names

BACKENDS = ("auto", "nccl", "gloo", "fake")
#: Groups NCCL SHARP may be enabled on (Megatron's ``sharp_enabled_group``): the dp·cp groups, or the groups across
#: distributed-optimizer instances.
SHARP_GROUPS = ("dp", "dp_replica")
DEVICES = ("auto", "cpu", "cuda")
#: The sizes that may be ``-1`` (or ``"auto"``, the same): derived from the world size.
FREE_SIZES = ("tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp")
#: The spelling of a derived size in YAML (``dp_shard: auto``), equal to ``-1``.
AUTO = "auto"
#: Largest process-group timeout in seconds (~31 years; larger values overflow torch's timedelta handling).
MAX_TIMEOUT = 1e9
#: The seeds a torch generator takes (``torch.manual_seed``: an int in this range, negatives remapped).
TORCH_SEED_RANGE = (-(2**63), 2**64 - 1)
#: ``parallel.seed``: far enough inside the generator's range that every seed derived from it (seed + 2718 + tp rank,
#: + 7919 · step for dropout, + data.seed) is one too.
MAX_SEED = 2**62
#: Smallest process-group timeout that works: every rank must connect to each new group and reach every
#: collective within it. Measured on gloo (4 ranks on one 2-core machine, 3 tries each): 0.01-0.3 s failed every
#: time or nearly, 0.5 s one time in three (DistStoreError / DistNetworkError in every worker), 1 s always worked.
MIN_TIMEOUT = 1.0


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks of a job are split into parallel axes.

    Every size is a positive integer up to MAX_WORLD_SIZE (2^24) or ``-1`` = ``"auto"`` (at most one free size per layout:
    derived from the world size). Rank order follows Megatron-LM's ``order`` string (leftmost axis varies
    fastest). Checked once, at construction (:meth:`validate`): an invalid value raises ConfigError right away.
    Frozen: change a field with ``dataclasses.replace(config, tp=4)`` (which checks the new config).
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
    """Data-parallel size = world / (tp·cp·pp). Derived when ``-1`` (or ``auto``); checked when given."""
    dp_outer: int = 1
    """HSDP replica count: data-parallel replicas that each hold a full FSDP-sharded copy. Must divide dp. ``auto``
    (= ``-1``, with ``dp_shard`` given): world / (tp·cp·pp·dp_shard), the axis an elastic HSDP job grows and shrinks."""
    dp_shard: int = -1
    """FSDP shard count inside one replica = dp / dp_outer. Derived when ``-1`` (or ``auto``): the axis an elastic job
    grows and shrinks by default."""
    ep: int = 1
    """Expert-parallel size. ``ep · expt_tp`` must divide ``tp·cp·dp`` (the ranks of one pipeline stage)."""
    expt_tp: int = 1
    """Expert tensor-parallel size. Defaults to 1, *not* to tp (an implicit tp default causes divisibility surprises)."""
    expt_dp: int = -1
    """Expert data-parallel size = world / (expt_tp·ep·expt_gtp_remat·pp). Derived when ``-1`` (or ``auto``)."""
    gtp_remat: int = 1
    """Megatron's generalized tensor-parallel weight-rematerialisation size (``gtp_remat_size``): an axis of the dense
    rank grid placed right after tp; it counts toward the model size, so ``dp = world / (tp·gtp_remat·cp·pp)`` is the
    replicate degree. > 1 needs ``dp_outer = 1`` (Megatron: one distributed-optimizer instance) and switches the gloo
    groups off, as Megatron does."""
    expt_gtp_remat: int = 1
    """Expert counterpart of ``gtp_remat`` (Megatron's ``expert_gtp_remat_size``): an axis of the expert grid placed
    right after ep; ``expt_dp = world / (expt_tp·ep·expt_gtp_remat·pp)``. > 1 needs ``dp_outer = 1`` and switches
    the expert gloo groups off."""
    order: str = "tp-cp-ep-dp-pp"
    """Megatron rank order: axis tokens joined by ``-``, leftmost varies fastest. Tokens: tp, cp, ep, dp, pp;
    a token of an axis with size > 1 must appear; missing size-1 tokens are appended."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl``, ``gloo`` or ``fake`` (simulation).
    ``nccl`` needs ``device`` cuda or auto (and, when a job starts, CUDA devices)."""
    device: str = "auto"
    """Device type of the meshes: ``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    timeout: float = 600.0
    """Timeout of every process group megashard creates, in seconds (1 ≤ timeout ≤ 1e9: shorter ones fail at random
    as the groups are created)."""
    seed: int = 1234
    """Base random seed (data-parallel stream = seed; model-parallel = seed + 2718 + tp_rank)."""
    create_gloo_process_groups: bool = True
    """With a backend other than gloo (nccl): also create a gloo twin of every data-parallel group (dp, dp_cp, hsdp,
    dp_shard_cp, the expert dp groups and their intra-instance parts, as Megatron-LM does) at initialisation, for
    CPU-side work (``ParallelState.gloo_group``, Megatron's ``get_data_parallel_group_gloo``). On gloo the twin is the
    group itself, and ``fake`` simulations create none."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """Megatron's hierarchical context parallelism: sizes of the cp levels, fastest first, whose product is cp
    (e.g. ``[2, 2]`` with cp=4). Level k's groups are ``hcp<k>`` (Megatron's ``get_hierarchical_context_parallel_groups``).
    ``null`` = not hierarchical."""
    nccl_communicator_config_path: str | None = None
    """Megatron's NCCL communicator config: a YAML file mapping Megatron group names (dp, dp_cp, tp, pp, ep, ep_dp …)
    to ``cga_cluster_size``, ``max_ctas``, ``min_ctas`` (integers), ``net_name`` (IB or socket) and
    ``is_high_priority_stream``; applied as ``ProcessGroupNCCL.Options`` when the backend is nccl (see
    docs/parallel_state.md). Read and checked when the config is built."""
    high_priority_stream_groups: list[str] | None = None
    """Megatron group names whose NCCL communicators use high-priority streams (e.g. ``[dp_cp, ep_dp]``)."""
    hybrid_context_parallel: bool = False
    """Megatron's hybrid context parallelism: also create, for every power of two from 2 up to (not including) dp·cp,
    the groups of that many consecutive ranks of each dp·cp group (``hybrid_dp_cp_<size>``; Megatron's
    ``get_hybrid_data_context_parallel_groups(group_size=...)``), so that a sequence can use any such slice of the
    dp·cp ranks as its cp group. Needs an even dp·cp."""
    pp_backend: str | None = None
    """Backend of the pipeline-parallel (``pp``) groups only, e.g. ``ucc`` (Megatron's
    ``pipeline_model_parallel_comm_backend``); ``null`` = the job's backend. Must be a backend this torch build has
    (checked when the groups are created)."""
    sharp_group: str | None = None
    """NCCL SHARP (in-network reductions, Megatron's ``use_sharp`` / ``sharp_enabled_group``) on one group: ``dp``
    (the dp·cp groups) or ``dp_replica`` (the groups across distributed-optimizer instances; needs dp_outer > 1);
    ``null`` = no SHARP. NCCL only: the group is created first with ``NCCL_COLLNET_ENABLE=1``, which is unset
    right after."""

    def __post_init__(self) -> None:
        # Invalid values fail where they are written, and only here: the config is frozen, so resolve() and
        # ParallelState trust it. Lists (from YAML) are kept as tuples so that a frozen config stays hashable.
        for name in FREE_SIZES:  # `dp_shard: auto` reads as -1: derived from the world size
            if isinstance(getattr(self, name), str) and getattr(self, name).strip().lower() == AUTO:
                object.__setattr__(self, name, -1)
        for name, item in _list_fields().items():
            v = getattr(self, name)
            _check_list(name, v, item)  # a string is not a list of names (tuple("dp") would be ('d', 'p'))
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, where: str = "parallel",
                  yaml_words: bool = False) -> "ParallelConfig":
        """Build from a mapping, rejecting unknown keys with a "did you mean"; ``yaml_words``: the mapping was read
        from YAML, so a true/false field takes YAML 1.1's yes/no/on/off (a Python caller's "no" is refused)."""
        from megashard.config.keys import reject_unknown_keys

        from megashard.config.keys import yaml_bool

        data = dict(data or {})
        reject_unknown_keys(cls, data, where)
        for name in ("create_gloo_process_groups", "hybrid_context_parallel") if yaml_words else ():
            if name in data:
                data[name] = yaml_bool(data[name])
        return cls(**data)  # validated by __post_init__

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> "ParallelConfig":
        """Read the ``parallel:`` section of a YAML file (or the whole file if it has none), then apply
        dotted ``parallel.key=value`` overrides."""
        from megashard.config import yamlfile

        doc = yamlfile.apply_overrides(yamlfile.load_yaml(path), overrides)
        return cls.from_dict(parallel_section(doc, path), yaml_words=True)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check what can be checked without a world size (types, ranges, order, backend); run once, by
        ``__post_init__``."""
        ints = ("tp", "cp", "pp", "dp", "dp_outer", "dp_shard", "ep", "expt_tp", "expt_dp", "gtp_remat", "expt_gtp_remat",
                "seed")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                also = " (or auto: derived from the world size)" if name in FREE_SIZES else ""
                raise ConfigError(f"{name}={v!r} must be an integer{also}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed} must be in 0..2**62 (0..{MAX_SEED:,}): the streams' seeds derived from "
                              "it (seed + 2718 + tp rank, + 7919 per step) must stay in a torch generator's range "
                              "-2**63..2**64-1")
        for name in FREE_SIZES:
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ConfigError(f"{name}={v} is not a valid size; use a positive integer or -1 / auto (derive it)")
            if v > MAX_WORLD_SIZE:
                raise ConfigError(f"{name}={v:,} is larger than the largest world size megashard supports "
                                  f"({MAX_WORLD_SIZE:,} ranks); use a positive integer up to it, or -1 / auto (derive it)")
        for name in ("gtp_remat", "expt_gtp_remat"):
            v = getattr(self, name)
            if not 1 <= v <= MAX_WORLD_SIZE:
                raise ConfigError(f"{name}={v} is not a valid size; use a positive integer (1 = no weight "
                                  "rematerialisation axis)")
        if (self.gtp_remat > 1 or self.expt_gtp_remat > 1) and self.dp_outer != 1:
            raise ConfigError(f"gtp_remat={self.gtp_remat}, expt_gtp_remat={self.expt_gtp_remat} with dp_outer="
                              f"{self.dp_outer}: Megatron-LM supports gtp_remat only with one distributed-optimizer "
                              "instance; set dp_outer: 1 or gtp_remat/expt_gtp_remat: 1")
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
            raise ConfigError(
                f"order='{self.order}' has unknown token(s) {unknown_names(bad, ORDER_TOKENS)}; tokens are "
                f"{', '.join(ORDER_TOKENS)}"
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
        if self.timeout < MIN_TIMEOUT:
            raise ConfigError(f"timeout={self.timeout!r} seconds is too short to be real: every rank must connect to each "
                              f"process group and reach every collective within it, and below {MIN_TIMEOUT:g} s that fails "
                              f"at random even on one machine (measured on gloo); use at least {MIN_TIMEOUT:g} (the "
                              "default is 600)")
        for name in ("create_gloo_process_groups", "hybrid_context_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        self._check_comm_options()
        hcp = self.hierarchical_context_parallel_sizes
        if hcp is not None:
            if (not isinstance(hcp, (list, tuple)) or not hcp
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in hcp)):
                shown = list(hcp) if isinstance(hcp, tuple) else hcp
                raise ConfigError(f"hierarchical_context_parallel_sizes={shown!r} must be a non-empty list of positive "
                                  "integers whose product is cp (e.g. [2, 2] with cp=4), or null")
            if self.cp != -1:
                prod = 1
                for v in hcp:
                    prod *= v
                if prod != self.cp:
                    raise ConfigError(f"hierarchical_context_parallel_sizes={list(hcp)} multiply to {prod}, but "
                                      f"cp={self.cp}; give level sizes whose product is {self.cp}")
        from megashard.config.nccl import nccl_spec

        # reads and checks the NCCL communicator config (cached): errors now, not at start-up
        nccl_spec(self.nccl_communicator_config_path, self.high_priority_stream_groups)

    def _check_comm_options(self) -> None:
        """``pp_backend`` and ``sharp_group``: what can be checked without torch (the backend's presence is checked
        where the groups are created)."""
        pb = self.pp_backend
        if pb is not None and (not isinstance(pb, str) or not pb or not pb.replace("_", "").isalnum()):
            raise ConfigError(f"pp_backend={pb!r} must be the name of a torch.distributed backend (e.g. 'ucc', "
                              "'nccl', 'gloo') or null (the job's backend)")
        sg = self.sharp_group
        if sg is None:
            return
        if sg not in SHARP_GROUPS:
            raise ConfigError(f"sharp_group={sg!r} is not supported; valid: {', '.join(SHARP_GROUPS)} (or null: no "
                              "SHARP), as Megatron-LM's sharp_enabled_group")
        if self.backend in ("gloo",):
            raise ConfigError(f"sharp_group={sg!r} needs the nccl backend (SHARP is NCCL's in-network reduction), but "
                              f"backend={self.backend!r}; use backend 'nccl' (or 'auto' on GPUs) or sharp_group: null")
        if sg == "dp_replica" and self.dp_outer == 1:
            raise ConfigError("sharp_group='dp_replica' needs several distributed-optimizer instances (dp_outer > 1; "
                              "Megatron's num_distributed_optimizer_instances > 1); use sharp_group: dp")

    def full_order(self) -> list[str]:
        """The order tokens with missing size-1 axes appended (Megatron's RankGenerator rule;
        :func:`~megashard.config.sizes.full_order`)."""
        return full_order(self.order, self.gtp_remat, self.expt_gtp_remat)

    def resolve(self, world_size: int) -> ResolvedSizes:
        """All sizes for ``world_size`` ranks, every ``-1`` filled in; raises ConfigError naming the rule broken.

        The one step from a config to sizes (:func:`~megashard.config.sizes.resolve_sizes`); the config itself was
        checked when it was built and is frozen, so nothing is validated twice."""
        return resolve_sizes(self, world_size)



_LIST_FIELDS: dict[str, type] | None = None
_EXAMPLES = {int: "[2, 2]", str: "[dp_cp, ep_dp]"}


def _list_fields() -> dict[str, type]:
    """``{field: item type}`` of ParallelConfig's list-typed fields (``list[int] | None`` ...), from the annotations."""
    global _LIST_FIELDS
    if _LIST_FIELDS is None:
        import typing

        out = {}
        for name, hint in typing.get_type_hints(ParallelConfig).items():
            for arg in (hint, *typing.get_args(hint)):
                if typing.get_origin(arg) is list:
                    out[name] = typing.get_args(arg)[0]
        _LIST_FIELDS = out
    return _LIST_FIELDS


def _check_list(name: str, value: Any, item: type) -> None:
    """ConfigError unless ``value`` is None or a list (tuple) of ``item`` values."""
    if value is None:
        return
    kind = "integers" if item is int else "strings"
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(v, item) and not isinstance(v, bool) for v in value)
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(f"{name}={shown!r} must be a list of {kind} such as {_EXAMPLES.get(item, '[...]')} "
                          f"(on the command line: parallel.{name}={_EXAMPLES.get(item, '[...]').replace(' ', '')}), "
                          "or null")


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
    hints = unknown_names([k for k in doc if k not in names], ["parallel"], cutoff=0.7)
    raise ConfigError(f"{path}: no 'parallel' section; unknown section(s) {hints}; a bare parallel config "
                      f"may hold only the keys {', '.join(names)}")
