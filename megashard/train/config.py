"""The training job's config: :class:`JobConfig` holds every YAML section and checks how they combine.

    job = JobConfig.from_yaml("configs/default.yaml", ["train.steps=20", "parallel.tp=1"])
    sizes = job.validate()          # ConfigError naming the key, the value and the rule, before any process starts

Sections: ``parallel`` (:class:`megashard.config.ParallelConfig`) and the job's own (:mod:`megashard.train.sections`:
``model``, ``train``, ``optim``, ``data``, ``checkpoint``, ``launch``). The file is read once (:meth:`from_yaml`),
each section checked field by field when it is built, and :meth:`validate` checks the combination once for a world
size — or for sizes already resolved (a worker's ParallelState resolved them).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from megashard.config import ParallelConfig, ResolvedSizes, check_world_size, fmt_divisors
from megashard.config.keys import yaml_key
from megashard.errors import ConfigError, unknown_names
from megashard.train.sections import (  # noqa: F401  (the section classes are importable from here too)
    ARCHS,
    COMPILE_BACKENDS,
    CONFIG_SECTIONS,
    DTYPES,
    FLAT_DTYPES,
    PIPELINE_SCHEDULE_NAMES,
    SCHEDULES,
    SECTION_NAMES,
    SOURCES,
    CheckpointConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    section_from_dict,
)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class JobConfig:
    """Every section of a job YAML. Build with :meth:`from_yaml` / :meth:`from_dict`, check with :meth:`validate`."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    name: str = "job"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, name: str = "job") -> "JobConfig":
        if not isinstance(doc, Mapping):
            raise ConfigError(f"a job config must be a mapping of sections, got {type(doc).__name__}")
        unknown = [k for k in doc if k not in SECTION_NAMES]
        if unknown:
            raise ConfigError(f"unknown config section(s) {unknown_names(unknown, SECTION_NAMES)}; sections are: "
                              f"{', '.join(SECTION_NAMES)}")
        par = doc.get("parallel") or {}
        if not isinstance(par, Mapping):
            raise ConfigError(f"section 'parallel' must be a mapping of keys, got {type(par).__name__}")
        kwargs: dict[str, Any] = {"parallel": ParallelConfig.from_dict(par, yaml_words=True), "name": name}
        for sec, sec_cls in CONFIG_SECTIONS:
            kwargs[sec] = section_from_dict(sec_cls, doc.get(sec), sec)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> "JobConfig":
        """Read ``path`` and apply dotted ``section.key=value`` overrides; validated field by field (not yet
        against the world size: call :meth:`validate`)."""
        import os

        from megashard.config import yamlfile

        doc = yamlfile.apply_overrides(yamlfile.load_yaml(path), list(overrides))  # the one read of the file
        name = os.path.splitext(os.path.basename(path))[0]
        return cls.from_dict(doc, name=name)

    def to_dict(self) -> dict[str, Any]:
        """The YAML-ready dict of every section (what a run writes to ``<out_dir>/config.yaml``)."""
        out = {"parallel": self.parallel.to_dict()}
        for sec, _ in CONFIG_SECTIONS:
            obj = getattr(self, sec)
            out[sec] = {yaml_key(f): copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        """launch.nnodes × launch.nproc_per_node; for an elastic range (``nnodes: MIN:MAX``) the largest world."""
        return self.launch.node_range[1] * self.launch.nproc_per_node

    @property
    def out_dir(self) -> str:
        return self.train.out_dir.replace("{name}", self.name)

    @property
    def checkpoint_dir(self) -> str:
        import os

        return self.checkpoint.dir or os.path.join(self.out_dir, "checkpoints")

    @property
    def ffn_hidden(self) -> int:
        if self.model.ffn_hidden:
            return self.model.ffn_hidden
        from megashard.train.sections import default_ffn_hidden

        return default_ffn_hidden(self.model)

    def microbatches(self, pp: int, dp: Optional[int] = None) -> int:
        """Microbatches per step and data-parallel rank: ``train.microbatches``; with ``train.micro_batch_size``
        global_batch / (dp × micro_batch_size) (``dp`` required then; rounded down: :meth:`validate` checks it
        divides); pp when both are null."""
        t = self.train
        if t.micro_batch_size is not None:
            if dp is None:
                raise TypeError("JobConfig.microbatches(pp, dp): train.micro_batch_size needs the data-parallel size")
            return max(1, t.global_batch // (dp * t.micro_batch_size))
        return t.microbatches if t.microbatches is not None else pp

    def moe_layers(self) -> list[int]:
        """0-based indices of the blocks with an MoE MLP."""
        m = self.model
        if m.num_experts == 0:
            return []
        return [i for i in range(m.layers) if (i + 1) % m.moe_every == 0]

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: Optional[int] = None, *, sizes: Optional[ResolvedSizes] = None,
                 data: bool = True) -> ResolvedSizes:
        """Check every section and their combination for ``world_size`` (default: launch.nnodes × nproc_per_node).

        ``sizes``: the parallel section already resolved for the world (e.g. ``ParallelState.sizes`` in a worker):
        used as they are, not resolved again. Returns the resolved parallel sizes; raises :class:`ConfigError`
        naming the keys, values and rule. ``data=False`` skips the data files and samples (the same for every
        layout: the layout advisor checks them once, not per layout, and stays free of torch).
        """
        self._validate_sections()
        if sizes is None and world_size is None and self.launch.elastic:
            from megashard.train.elastic import validate_range

            return validate_range(self, data=data)  # every world size of launch.nnodes: MIN:MAX
        if sizes is not None:
            w = sizes.world_size
        else:
            w = self.world_size if world_size is None else world_size
            if world_size is None:
                check_world_size(w, f"world size launch.nnodes × launch.nproc_per_node = {self.launch.nnodes} × "
                                    f"{self.launch.nproc_per_node} =")
        try:
            s = sizes if sizes is not None else self.parallel.resolve(w)
        except ConfigError as e:
            if world_size is not None:
                raise
            raise ConfigError(f"{e}{self._nproc_hint()}") from None
        m, t = self.model, self.train
        _need(m.vocab_size % s.tp == 0,
              f"model.vocab_size={m.vocab_size} must divide by parallel.tp={s.tp} (each TP rank holds vocab/tp rows); "
              f"pad it to {-(-m.vocab_size // s.tp) * s.tp}")
        _need(m.heads % s.tp == 0, f"model.heads={m.heads} must divide by parallel.tp={s.tp}; valid tp: {fmt_divisors(m.heads)}")
        _need(self.ffn_hidden % s.tp == 0, f"model.ffn_hidden={self.ffn_hidden} must divide by parallel.tp={s.tp}")
        _need(m.seq_len % s.cp == 0,
              f"model.seq_len={m.seq_len} must divide by parallel.cp={s.cp}; valid cp: {fmt_divisors(m.seq_len)}")
        _need(t.global_batch % s.dp == 0,
              f"train.global_batch={t.global_batch} must divide by the data-parallel size dp={s.dp} "
              f"(dp_outer={s.dp_outer} × dp_shard={s.dp_shard}); valid dp: {fmt_divisors(t.global_batch)}")
        self._validate_pipeline(s)
        if m.num_experts:
            _need(m.num_experts % s.ep == 0,
                  f"model.num_experts={m.num_experts} must divide by parallel.ep={s.ep}; valid ep: {fmt_divisors(m.num_experts)}")
            _need(self.ffn_hidden % s.expt_tp == 0,
                  f"model.ffn_hidden={self.ffn_hidden} (per expert) must divide by parallel.expt_tp={s.expt_tp} (each "
                  f"expert tensor-parallel rank holds ffn/expt_tp of every local expert); valid expt_tp: "
                  f"{fmt_divisors(self.ffn_hidden)}")
            mb = self.microbatches(s.pp, s.dp)
            if t.global_batch % (s.dp * mb) == 0 and m.seq_len % s.cp == 0:
                tokens = t.global_batch // (s.dp * mb) * (m.seq_len // s.cp)
                _need(tokens % s.tp == 0,
                      f"MoE with parallel.tp={s.tp}: each tp rank dispatches 1/tp of a microbatch's tokens, but a "
                      f"microbatch has global_batch/(dp·microbatches) · seq_len/cp = {tokens} tokens per rank, not "
                      f"divisible by tp={s.tp}; change train.global_batch, train.microbatches or model.seq_len")
            _need(1 <= m.moe_top_k <= m.num_experts, f"model.moe_top_k={m.moe_top_k} must be in 1..num_experts={m.num_experts}")
            _need(bool(self.moe_layers()),
                  f"model.moe_every={m.moe_every} > model.layers={m.layers}: no block would be an MoE block")
        else:
            _need(s.ep == 1, f"parallel.ep={s.ep} needs experts: set model.num_experts (a multiple of ep) or ep: 1")
        if t.fail_at_step is not None:
            _need(0 <= t.fail_rank < w, f"train.fail_rank={t.fail_rank} is not a rank of the world of {w}")
        if self.data.source == "text":
            import os

            p = self.data.path
            _need(p is not None and os.path.isfile(p),
                  f"data.source=text needs data.path to be an existing file, got {p!r}"
                  + (" (it exists but is not a regular file: a FIFO, device or directory)"
                     if p is not None and os.path.lexists(p) else ""))
        if not data:
            pass
        elif self.data.source == "indexed":
            from megashard.train.data import check_corpus

            check_corpus(self.data, self.model, self.parallel.seed, s.tp)  # the files exist and open, the vocabulary fits, the samples (check_samples)
        else:
            from megashard.train.data import check_samples

            check_samples(self.data, self.model, self.parallel.seed)  # what each worker would find: enough data for a training sample
        self.requested_checkpoint()
        return s

    def _nproc_hint(self) -> str:
        """``"; or run 8 processes: launch.nproc_per_node=8"``: the smallest process count per node, above the
        configured one, for which the parallel section resolves (the launcher's world size is nnodes × that)."""
        la = self.launch
        nnodes = la.node_range[1]
        for n in range(la.nproc_per_node + 1, 4 * max(la.nproc_per_node, 256) + 1):
            try:
                self.parallel.resolve(nnodes * n)
            except ConfigError:
                continue
            nodes = f" (× launch.nnodes={nnodes} = {nnodes * n})" if nnodes > 1 else ""
            return f"; or run {n} processes per node: launch.nproc_per_node={n}{nodes}"
        return ""

    def _validate_pipeline(self, s: ResolvedSizes) -> None:
        """train.pipeline_schedule / train.microbatches against pp, vpp, dp and the model's blocks."""
        t = self.train
        if t.micro_batch_size is not None:
            _need(t.global_batch % (s.dp * t.micro_batch_size) == 0,
                  f"train.global_batch={t.global_batch} must divide by dp × train.micro_batch_size = {s.dp} × "
                  f"{t.micro_batch_size} = {s.dp * t.micro_batch_size} (the microbatches per step are their quotient); "
                  f"valid micro_batch_size at dp={s.dp}: {fmt_divisors(t.global_batch // s.dp) if t.global_batch % s.dp == 0 else 'none'}")
        mb = self.microbatches(s.pp, s.dp)
        _need(t.global_batch % (s.dp * mb) == 0,
              f"train.global_batch={t.global_batch} must divide by train.microbatches × dp = {mb} × {s.dp} = "
              f"{mb * s.dp} (global batch = microbatches × micro-batch size × dp); valid microbatches: "
              f"{fmt_divisors(t.global_batch // s.dp)}")
        self.check_pipeline(s.pp, s.vpp, s.dp)

    def check_pipeline(self, pp: int, vpp: Optional[int], dp: int = 1, model: bool = True) -> None:
        """The rules of the pipeline that need no world size (``megashard plan`` applies them too): the schedule
        against pp and vpp, microbatches >= pp for the schedules that keep one in flight per rank, and (``model``) a
        block per stage. ConfigError naming the keys, values and the way out."""
        m, t = self.model, self.train
        if pp == 1:
            return
        v = vpp or 1
        mb = self.microbatches(pp, dp)
        sched = t.pipeline_schedule
        if sched in ("1f1b", "gpipe"):
            _need(v == 1, f"parallel.vpp={v} runs several stages per rank, but train.pipeline_schedule={sched!r} "
                  "runs one: use train.pipeline_schedule=interleaved_1f1b (or zbv with vpp=2), or vpp: null")
        elif sched == "interleaved_1f1b":
            _need(v >= 2, f"train.pipeline_schedule=interleaved_1f1b needs parallel.vpp >= 2 (virtual stages per "
                  f"rank), got vpp={vpp}; or use train.pipeline_schedule=1f1b")
            rounds = max(1, mb // pp)
            _need(mb % rounds == 0, f"train.microbatches={mb}: interleaved_1f1b needs a multiple of "
                  f"max(1, microbatches // pp) = {rounds}; e.g. {pp} or {2 * pp}")
        elif sched == "zbv":
            _need(v == 2, f"train.pipeline_schedule=zbv runs exactly two stages per rank: set parallel.vpp=2 "
                  f"(got vpp={vpp})")
        if sched in ("1f1b", "interleaved_1f1b", "zbv"):
            # With fewer microbatches than ranks some rank never has one in flight: all bubble, and Megatron
            # refuses it too. gpipe runs any number.
            other = "train.pipeline_schedule=gpipe" if v == 1 else "parallel.vpp: null with train.pipeline_schedule=gpipe"
            _need(mb >= pp, f"train.microbatches={mb}: {sched} needs at least pp={pp} microbatches (every pipeline "
                  f"rank must have one in flight); use train.microbatches >= {pp} (null = pp) or {other}")
        _need(not (t.compile and sched == "zbv"),
              "train.compile=true cannot be combined with train.pipeline_schedule=zbv: zero-bubble splits each "
              "backward into an input pass and a weight pass, which a compiled block's backward cannot do; use "
              "train.pipeline_schedule=interleaved_1f1b (or 1f1b, gpipe) or train.compile=false")
        _need(not m.distribute_saved_activations, "model.distribute_saved_activations=true is not supported with "
              f"pipeline parallelism (parallel.pp={pp}): pipeline schedules recompute through torch.utils.checkpoint; "
              "set it to false (model.recompute=true still works)")
        stages = pp * v
        _need(not model or m.layers >= stages, f"model.layers={m.layers} cannot fill pp × vpp = {pp} × {v} = {stages} "
              f"pipeline stages (every stage holds at least one block); use model.layers >= {stages} or lower "
              "parallel.pp / parallel.vpp")

    def requested_checkpoint(self) -> Optional[str]:
        """The checkpoint ``checkpoint.load_step`` / ``checkpoint.load_path`` asks for (absolute path), or None.

        Raises :class:`ConfigError` (one line: the key, the value, what is there instead) if both are given, if
        it is not a complete checkpoint, or if its files are missing or truncated (sizes against its marker).
        """
        import os

        c = self.checkpoint
        if c.load_step is None and c.load_path is None:
            return None
        from megashard.checkpoint import safety
        from megashard.errors import CheckpointError

        if c.load_step is not None:
            key, path = f"checkpoint.load_step={c.load_step}", os.path.join(self.checkpoint_dir, safety.checkpoint_dirname(c.load_step))
        else:
            key, path = f"checkpoint.load_path={c.load_path!r}", str(c.load_path)
        if not safety.is_checkpoint_dir(path):
            root = self.checkpoint_dir if c.load_step is not None else path
            steps = [e.step for e in safety.list_checkpoints(root) if e.complete]
            if c.load_step is not None:
                there = (f"complete checkpoints in {root}: steps {', '.join(map(str, steps))}" if steps
                         else f"{root} holds no complete checkpoint")
                why = "exists but has no COMPLETE.json (its save did not finish)" if os.path.isdir(path) else "does not exist"
                raise ConfigError(f"{key}: checkpoint {path} {why}; {there}")
            if steps:
                why = (f"is a checkpoint root, not a checkpoint: give one of its checkpoints, e.g. "
                       f"{os.path.join(path, safety.checkpoint_dirname(steps[-1]))}")
            elif os.path.isdir(path):
                why = f"is not a complete checkpoint (no {safety.MARKER_FILE}: not saved by megashard, or its save did not finish)"
            else:
                why = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"{key} {why}")
        try:
            marker = safety.read_marker(path)
            problems = safety.verify_files(path, marker, checksum=False)
        except CheckpointError as e:
            raise ConfigError(f"{key}: {e}") from None
        _need(not problems, f"{key}: checkpoint {path} is damaged: {'; '.join(problems[:3])}")
        return os.path.abspath(path)

    def validate_sections(self) -> None:
        """Every check of :meth:`validate` that needs no world size (what ``megashard plan`` checks of a job)."""
        self._validate_sections()

    def _validate_loggers(self) -> None:
        """train.tensorboard, train.wandb (a mode, its package installed: before any process starts), peak_tflops."""
        import importlib.util

        from megashard.train.sections import WANDB_MODES

        t = self.train
        _need(t.wandb in (False,) + WANDB_MODES, f"train.wandb={t.wandb!r} is not a W&B mode; valid: "
              f"{', '.join(WANDB_MODES)}")
        _need(bool(t.wandb_project), "train.wandb_project must not be empty")
        if t.peak_tflops is not None:
            _need(t.peak_tflops > 0, f"train.peak_tflops={t.peak_tflops} must be > 0 (TFLOP/s of one device) or null")
        _need(not t.tensorboard or importlib.util.find_spec("tensorboard") is not None,
              "train.tensorboard=true needs the tensorboard package, which is not installed: pip install "
              "'megashard[tensorboard]' (or pip install tensorboard), or set train.tensorboard=false")
        mode = "off" if t.wandb is False else t.wandb
        _need(mode == "off" or importlib.util.find_spec("wandb") is not None,
              f"train.wandb={mode} needs the wandb package, which is not installed: pip install 'megashard[wandb]' "
              "(or pip install wandb), or set train.wandb=off")

    def _validate_sections(self) -> None:
        m, t, o, d, c, la = self.model, self.train, self.optim, self.data, self.checkpoint, self.launch
        for where, v in (("model.vocab_size", m.vocab_size), ("model.seq_len", m.seq_len), ("model.hidden", m.hidden),
                         ("model.layers", m.layers), ("model.heads", m.heads), ("model.moe_every", m.moe_every),
                         ("model.moe_top_k", m.moe_top_k), ("train.steps", t.steps), ("train.global_batch", t.global_batch),
                         ("train.log_interval", t.log_interval), ("data.num_sequences", d.num_sequences),
                         ("data.branching", d.branching), ("launch.nproc_per_node", la.nproc_per_node)):
            _need(v >= 1, f"{where}={v} must be a positive integer")
        for where, v in (("model.num_experts", m.num_experts), ("optim.warmup_steps", o.warmup_steps),
                         ("checkpoint.keep", c.keep),
                         ("launch.max_restarts", la.max_restarts)):
            _need(v >= 0, f"{where}={v} must be >= 0")
        _need(c.memory_copies in (0, 1), f"checkpoint.memory_copies={c.memory_copies} must be 0 or 1 (copies of each "
              "rank's shards kept in the memory of a rank on another node)")
        if c.load_step is not None:
            _need(c.load_step >= 0, f"checkpoint.load_step={c.load_step} must be >= 0 (a saved step) or null (the newest)")
        _need(c.load_step is None or c.load_path is None,
              f"checkpoint.load_step={c.load_step} and checkpoint.load_path={c.load_path!r} are exclusive: give one "
              "(load_step picks <checkpoint.dir>/step_<N>, load_path any checkpoint directory)")
        _need(c.load_step is None and c.load_path is None or t.resume,
              "checkpoint.load_step / checkpoint.load_path load a checkpoint but train.resume=false starts from "
              "scratch; drop one of them")
        _need(not c.move_aside or not t.resume,
              "checkpoint.move_aside=true moves an earlier run's checkpoints aside for a fresh start: add "
              "train.resume=false (a resumed run continues the checkpoints in place), or drop it")
        if m.ffn_hidden is not None:
            _need(m.ffn_hidden >= 1, f"model.ffn_hidden={m.ffn_hidden} must be a positive integer or null")
        _need(m.hidden % m.heads == 0, f"model.hidden={m.hidden} must divide by model.heads={m.heads}")
        _need(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
        _need(m.init_std > 0, f"model.init_std={m.init_std} must be > 0")
        _need(m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0 (0 = no "
              "load-balancing loss)")
        _need(not m.distribute_saved_activations or m.recompute,
              "model.distribute_saved_activations=true needs model.recompute=true")
        _need(t.dtype in DTYPES, f"train.dtype={t.dtype!r} is not supported; valid: {', '.join(DTYPES)}")
        _need(bool(t.out_dir), "train.out_dir must not be empty")
        _need(t.pipeline_schedule in PIPELINE_SCHEDULE_NAMES,
              f"train.pipeline_schedule={t.pipeline_schedule!r} is not supported; valid: {', '.join(PIPELINE_SCHEDULE_NAMES)}")
        _need(t.compile_backend in COMPILE_BACKENDS, f"train.compile_backend={t.compile_backend!r} is not supported; "
              f"valid: {', '.join(COMPILE_BACKENDS)}")
        if t.microbatches is not None:
            _need(t.microbatches >= 1, f"train.microbatches={t.microbatches} must be a positive integer or null (= pp)")
        if t.micro_batch_size is not None:
            _need(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be a positive integer or null")
            _need(t.microbatches is None, f"train.microbatches={t.microbatches} and train.micro_batch_size="
                  f"{t.micro_batch_size} are exclusive: give the microbatch count or the sequences per microbatch")
        if t.fail_at_step is not None:
            _need(1 <= t.fail_at_step, f"train.fail_at_step={t.fail_at_step} must be >= 1 or null")
        self._validate_loggers()
        _need(o.lr > 0, f"optim.lr={o.lr} must be > 0")
        if o.decay_steps is not None:
            _need(o.decay_steps >= 1, f"optim.decay_steps={o.decay_steps} must be a positive integer (the step at "
                  "which the decay reaches optim.min_lr) or null (= train.steps of the first run)")
        _need(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
        _need(o.schedule in SCHEDULES, f"optim.schedule={o.schedule!r} is not supported; valid: {', '.join(SCHEDULES)}")
        _need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
        _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optim.beta1={o.beta1}, optim.beta2={o.beta2} must be in [0, 1)")
        _need(o.eps > 0, f"optim.eps={o.eps} must be > 0")
        _need(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 = no clipping)")
        _need(m.arch in ARCHS, f"model.arch={m.arch!r} is not supported; valid: {', '.join(ARCHS)}")
        _need(m.norm_eps > 0 and m.rope_theta > 0, f"model.norm_eps={m.norm_eps} and model.rope_theta={m.rope_theta} "
              "must be > 0")
        if m.arch == "llama":
            _need((m.hidden // m.heads) % 2 == 0,
                  f"model.arch=llama: the head size hidden/heads={m.hidden}/{m.heads} must be even (rotary pairs)")
        if m.init_from is not None:
            from megashard.train.hf_dir import check_init_from

            check_init_from(self.model, self.ffn_hidden)  # config.json against this section, tensor names and shapes: before any process
        _need(d.source in SOURCES, f"data.source={d.source!r} is not supported; valid: {', '.join(SOURCES)}")
        _need(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
        _need(d.prepare_encoding_errors in ("strict", "replace", "skip-file"),
              f"data.prepare_encoding_errors={d.prepare_encoding_errors!r} is not supported; valid: strict, replace, "
              "skip-file")
        _need(d.flat_dtype in FLAT_DTYPES, f"data.flat_dtype={d.flat_dtype!r} is not a token dtype"
              + ("; token ids are integers" if str(d.flat_dtype).startswith(("float", "bfloat")) else "")
              + f"; valid: {', '.join(FLAT_DTYPES)}")
        _need(t.eval_interval >= 0 and t.eval_batches >= 1,
              f"train.eval_interval={t.eval_interval} must be >= 0 and train.eval_batches={t.eval_batches} >= 1")
        _need(t.eval_interval == 0 or d.valid_fraction > 0,
              f"train.eval_interval={t.eval_interval} needs validation data: set data.valid_fraction > 0 (e.g. 0.05)")
        if d.source == "indexed":
            from megashard.train.data import data_paths

            data_paths(d)  # path xor blend, well-formed
        elif d.blend is not None:
            from megashard.train.data import blend_pairs

            blend_pairs(d.blend)  # well-formed even where it is not used
        if d.source == "text":
            _need(m.vocab_size >= 256, f"data.source=text is byte-level: model.vocab_size={m.vocab_size} must be >= 256")
        _need(d.branching <= m.vocab_size, f"data.branching={d.branching} must be <= model.vocab_size={m.vocab_size}")
        c.interval_steps  # noqa: B018 - parses checkpoint.interval (steps, or a time such as "300s")
        from megashard.train.launch_checks import check_launch

        check_launch(la)  # as torchrun reads it: node range, backend, endpoint, static rendezvous, elastic settings
