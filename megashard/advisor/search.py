"""``megashard plan --suggest``: every layout of a job for a world, checked as ``megashard run`` checks it, ranked.

    result = suggest(job, world_size=64, device_memory=80 * 2**30, ranks_per_node=8)
    result.ranked[0]          # the fastest layout that fits: Candidate(sizes, recompute, microbatches, memory, cost)
    result.rejected           # [(Candidate-like description, one-line reason)], the config's own rule or the memory

Candidates (:func:`candidates`): tp and cp inside a node (tp · cp ≤ ranks per node, tp dividing heads), every pp that
divides the rest with at least one block per stage, vpp 1 or 2 (interleaved 1F1B), every dp_outer dividing dp, ep
dividing the experts, expt_tp inside a node, recompute off / on, and a few microbatch counts (1, 2, 4 · pp …). Each is
validated by :meth:`ParallelConfig.resolve` and :meth:`JobConfig.validate` — the checks ``megashard run`` makes —
so a suggestion never fails at start-up; then its memory (:mod:`megashard.advisor.memory`) is compared with the
device's and its step time estimated (:mod:`megashard.advisor.cost`). Pure arithmetic: no torch, no process.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from megashard.advisor.cost import Hardware, StepCost, estimate_step
from megashard.advisor.host import estimate_host
from megashard.advisor.memory import MemoryEstimate, estimate_memory
from megashard.advisor.shape import JobShape
from megashard.models.config import default_ffn_hidden
from megashard.errors import ConfigError
from megashard.advisor.units import check_count, parse_bytes

#: Why a world size has an upper bound (the CLI and the API say it alike).
WORLD_NOTE = " (the advisor enumerates layouts of up to 65,536 ranks)"


@dataclass
class Candidate:
    """One layout with its recompute and microbatch choice, and (when valid) its estimates."""

    sizes: dict[str, Any]
    """tp, cp, pp, vpp, dp_outer, dp_shard, ep, expt_tp (the ParallelConfig fields set)."""
    recompute: bool
    microbatches: int
    schedule: str
    resolved: Any = None
    memory: Optional[MemoryEstimate] = None
    cost: Optional[StepCost] = None
    measured_s: Optional[float] = None
    """Seconds per step measured on this machine (``--calibrate`` / ``--calibration``; None: only modelled)."""
    measure_error: Optional[str] = None
    """Why its calibration run failed."""
    traced: Any = None
    """Its traced peak (:class:`~megashard.advisor.trace.TracedPeak` of the largest rank traced; None: not traced)."""
    trace_error: Optional[str] = None
    host: Any = None
    """Its host memory per rank (:class:`~megashard.advisor.host.HostEstimate`)."""

    @property
    def peak(self) -> int:
        """The peak that decides whether it fits: traced when traced, else modelled."""
        modelled = self.memory.peak if self.memory is not None else 0
        if self.traced is not None:
            return max(self.traced.peak, modelled) if self.traced.partial else self.traced.peak
        return modelled

    def label(self) -> str:
        """``tp=2 cp=1 pp=4 vpp=2 dp_outer=1 dp_shard=8 ep=1 expt_tp=1 recompute=off mb=8``."""
        s = self.sizes
        parts = [f"{k}={s[k]}" for k in ("tp", "cp", "pp")]
        if s.get("vpp"):
            parts.append(f"vpp={s['vpp']}")
        parts += [f"dp_outer={s['dp_outer']}", f"dp_shard={s['dp_shard']}"]
        parts += [f"{k}={s[k]}" for k in ("ep", "expt_tp") if s[k] != 1]
        parts.append(f"recompute={'on' if self.recompute else 'off'}")
        parts.append(f"mb={self.microbatches}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides that make the job run this layout (``megashard run CONFIG ...``)."""
        s = self.sizes
        out = [f"parallel.{k}={s[k]}" for k in ("tp", "cp", "pp", "dp_outer", "dp_shard", "ep", "expt_tp")]
        out.append(f"parallel.vpp={s['vpp'] if s.get('vpp') else 'null'}")
        out += ["parallel.dp=-1", "parallel.expt_dp=-1", f"model.recompute={str(self.recompute).lower()}",
                f"train.microbatches={self.microbatches}"]
        if s["pp"] > 1:
            out.append(f"train.pipeline_schedule={self.schedule}")
        return out


@dataclass
class Suggestion:
    """What :func:`suggest` found."""

    world_size: int
    device_memory: int
    ranks_per_node: int
    hardware: Hardware
    ranked: list[Candidate] = field(default_factory=list)
    """Valid layouts that fit, fastest first."""
    too_big: list[Candidate] = field(default_factory=list)
    """Valid layouts that do not fit the device memory, smallest first."""
    rejected: list[tuple[Candidate, str]] = field(default_factory=list)
    """Layouts the config's rules refuse, with the rule's one-line message."""
    considered: int = 0
    moe_imbalance: Optional[float] = None
    """The routing-imbalance bound MoE memory assumed (None: the job has no experts)."""
    dtype: str = "float32"
    """The job's ``train.dtype`` (the step time's flop rate is for it)."""
    notes: list[str] = field(default_factory=list)
    """Where the world size, ranks per node, device, memory and hardware came from (the CLI fills it)."""
    kendall_tau: Optional[float] = None
    """After calibration: Kendall's τ between the model's order and the measured order of the timed layouts."""
    noise_notes: list[str] = field(default_factory=list)
    """After calibration: neighbouring measured layouts whose difference is within the noise of their rounds."""
    device: str = "cuda"
    """The device the job runs on (``cpu``: host memory includes the tensors)."""
    traced_count: int = 0
    """Layouts whose memory was traced (:func:`megashard.advisor.trace.certify`)."""
    trace_seconds: float = 0.0
    trace_notes: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n <= 1 << 16 else [d for d in range(1, 1 << 16) if n % d == 0]


def candidates(shape: JobShape, world_size: int, ranks_per_node: int, job_schedule: str) -> Iterator[Candidate]:
    """Every layout the advisor considers for ``world_size`` ranks (see the module docstring)."""
    W, G = world_size, ranks_per_node
    for tp in _divisors(W):
        if tp > G:
            break
        for cp in _divisors(W // tp):
            if tp * cp > G:
                break
            rest = W // (tp * cp)
            for pp in _divisors(rest):
                if pp > shape.layers:
                    break
                dp = rest // pp
                vpps: list[Optional[int]] = [None]
                if pp > 1 and shape.layers >= 2 * pp:
                    vpps.append(2)
                for vpp in vpps:
                    if pp == 1:
                        schedule = "1f1b"
                    elif vpp:
                        schedule = "interleaved_1f1b" if job_schedule != "zbv" else "zbv"
                    else:
                        schedule = job_schedule if job_schedule in ("1f1b", "gpipe") else "1f1b"
                    for mbs in _microbatches(shape, dp, pp):
                        for dp_outer in _divisors(dp):
                            for ep in (_divisors(shape.num_experts) if shape.num_experts else [1]):
                                if ep > tp * cp * dp:
                                    break
                                for etp in ([d for d in _divisors(shape.ffn) if d <= G] if shape.num_experts else [1]):
                                    if ep * etp > tp * cp * dp:
                                        break
                                    for recompute in (False, True):
                                        sizes = {"tp": tp, "cp": cp, "pp": pp, "vpp": vpp, "dp_outer": dp_outer,
                                                 "dp_shard": dp // dp_outer, "ep": ep, "expt_tp": etp}
                                        yield Candidate(sizes, recompute, mbs, schedule)


def _microbatches(shape: JobShape, dp: int, pp: int) -> list[int]:
    """Microbatch counts tried: 1, 2, 4 without a pipeline; pp, 2·pp, 4·pp with one (those dividing batch/dp)."""
    if shape.global_batch % dp:
        return [1 if pp == 1 else pp]  # refused by the config's rule; one candidate says why
    per_rank = shape.global_batch // dp
    base = [1, 2, 4] if pp == 1 else [pp, 2 * pp, 4 * pp]
    out = [m for m in base if per_rank % m == 0]
    return out or [base[0]]


class _Validator:
    """The job's own rules for one candidate: ParallelConfig (world-independent), resolve (world), JobConfig.validate
    (the model, batch and pipeline against the sizes). Per-candidate copies leave out what reads files (data corpus,
    checkpoint, init_from), which is checked once on the job itself by :meth:`check_files`."""

    def __init__(self, job: Any, world_size: int) -> None:
        self.job, self.world_size = job, world_size
        base = copy.copy(job)
        ffn = job.model.ffn_hidden or default_ffn_hidden(job.model)
        base.model = dataclasses.replace(job.model, ffn_hidden=ffn, init_from=None)  # no torch import, no files
        base.data = dataclasses.replace(job.data, source="synthetic", path=None, blend=None, prepare_inputs=None)
        base.checkpoint = dataclasses.replace(job.checkpoint, load_step=None, load_path=None)
        base.train = dataclasses.replace(job.train, fail_at_step=None)
        self.base = base
        self._files_checked: dict[int, Optional[str]] = {}

    def resolve(self, c: Candidate) -> Any:
        """The candidate's ResolvedSizes; ConfigError with the rule's message when the job refuses it."""
        from megashard.config import ParallelConfig

        p = self.job.parallel
        pc = ParallelConfig(**c.sizes, dp=-1, expt_dp=-1, order=p.order, backend=p.backend, device=p.device,
                            timeout=p.timeout, seed=p.seed, create_gloo_process_groups=p.create_gloo_process_groups)
        job = copy.copy(self.base)
        job.parallel = pc
        job.model = dataclasses.replace(self.base.model, recompute=c.recompute,
                                        distribute_saved_activations=self.base.model.distribute_saved_activations
                                        and c.recompute and c.sizes["pp"] == 1)
        job.train = dataclasses.replace(self.base.train, microbatches=c.microbatches,
                                        micro_batch_size=None, pipeline_schedule=c.schedule)  # the candidate's count
        sizes = pc.resolve(self.world_size)
        return job.validate(sizes=sizes, data=False)  # data files: check_files, once per tp

    def check_files(self, tp: int) -> Optional[str]:
        """The data / checkpoint checks that read files, once per tp (the corpus's vocabulary is padded to tp)."""
        if tp not in self._files_checked:
            from megashard.config import ParallelConfig

            job = copy.copy(self.job)
            job.model = self.base.model
            job.parallel = ParallelConfig(tp=tp, dp=-1, dp_shard=-1)
            try:
                if job.data.source == "indexed":
                    from megashard.train.data import check_corpus

                    check_corpus(job.data, job.model, job.parallel.seed, tp)
                elif job.data.source != "synthetic":  # synthetic data: checked by arithmetic in `megashard run`
                    from megashard.train.data import check_samples

                    check_samples(job.data, job.model, job.parallel.seed)
                job.requested_checkpoint()
                self._files_checked[tp] = None
            except ConfigError as e:
                self._files_checked[tp] = str(e)
        return self._files_checked[tp]


def suggest(job: Any, world_size: int, device_memory: int | str, ranks_per_node: int = 8,
            hardware: Optional[Hardware] = None, shape: Optional[JobShape] = None) -> Suggestion:
    """Every candidate layout of ``job`` for ``world_size`` ranks, validated, sized and timed (see the module
    docstring). ``device_memory``: bytes per device a rank may use (an int of bytes, at least 1 MiB, or text with a
    unit such as ``"80GiB"``: :func:`megashard.advisor.units.parse_bytes`). ``shape``: the job's numbers (default:
    read from ``job``). Bad arguments are a one-line :class:`~megashard.errors.ConfigError`, as on the CLI."""
    check_count("world_size", world_size, 1, 1 << 16, note=WORLD_NOTE)
    device_memory = parse_bytes(device_memory, "device_memory")
    check_count("ranks_per_node", ranks_per_node, 1)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise ConfigError(f"hardware={hardware!r}: must be a megashard.advisor.cost.Hardware (or None for the defaults)")
    if not hasattr(job, "train") or not hasattr(job, "model"):
        raise ConfigError(f"job={type(job).__name__}: must be a megashard.train.config.JobConfig "
                          "(JobConfig.from_yaml(path) or JobConfig.from_dict(doc))")
    if shape is not None and not isinstance(shape, JobShape):
        raise ConfigError(f"shape={shape!r:.60}: must be a megashard.advisor.shape.JobShape (or None: read from job)")
    hw = hardware or Hardware()
    shape = shape or JobShape.from_job(job)
    v = _Validator(job, world_size)
    out = Suggestion(world_size, device_memory, ranks_per_node, hw,
                     moe_imbalance=shape.moe_imbalance if shape.num_experts else None, dtype=shape.dtype,
                     device=hw.device)
    for c in candidates(shape, world_size, ranks_per_node, job.train.pipeline_schedule):
        out.considered += 1
        try:
            c.resolved = v.resolve(c)
        except ConfigError as e:
            out.rejected.append((c, str(e)))
            continue
        problem = v.check_files(c.sizes["tp"])
        if problem:
            out.rejected.append((c, problem))
            continue
        cs = dataclasses.replace(shape, microbatches=c.microbatches, micro_batch_size=None, schedule=c.schedule)
        c.memory = estimate_memory(cs, c.resolved, c.recompute, job.model.distribute_saved_activations and c.recompute)
        c.cost = estimate_step(cs, c.resolved, hw, ranks_per_node, c.recompute)
        c.host = estimate_host(cs, hw.device, c.memory.peak)
        (out.ranked if c.memory.peak <= device_memory else out.too_big).append(c)
    out.ranked.sort(key=lambda c: (c.cost.seconds, c.memory.peak))
    out.too_big.sort(key=lambda c: c.memory.peak)
    return out
