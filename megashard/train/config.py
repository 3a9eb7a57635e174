"""The training job's config: one dataclass per YAML section, plus :class:`JobConfig` that holds them all.

    job = JobConfig.from_yaml("configs/default.yaml", ["train.steps=20", "parallel.tp=1"])
    sizes = job.validate()          # ConfigError naming the key, the value and the rule, before any process starts

Sections: ``parallel`` (:class:`megashard.config.ParallelConfig`), ``model``, ``train``, ``optim``,
``data``, ``checkpoint``, ``launch``. Every field carries a docstring; ``docs/config.md`` is generated
from them (``python tools/gen_config_docs.py``).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from megashard.config import ParallelConfig, ResolvedSizes, check_world_size
from megashard.errors import ConfigError
from megashard.yamlcfg import reject_unknown_keys

DTYPES = ("float32", "float64", "bfloat16")
SOURCES = ("synthetic", "text", "indexed")
ARCHS = ("gpt", "llama")
SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class ModelConfig:
    """The example transformer: ``gpt`` (learned positions, LayerNorm, GELU) or ``llama`` (rotary, RMSNorm, SwiGLU)."""

    arch: str = "gpt"
    """``gpt``: token + learned position embeddings, pre-LayerNorm blocks with biases, GELU MLP; ``llama``: rotary
    position embeddings, RMSNorm, SwiGLU MLP, no biases."""
    tie_embeddings: bool = False
    """Use the input embedding (vocabulary-parallel over tp) as the LM head's weight too (both archs)."""
    rope_theta: float = 10000.0
    """``llama``: base of the rotary position embedding frequencies."""
    norm_eps: float = 1.0e-5
    """Epsilon of the normalisation layers (LayerNorm for ``gpt``, RMSNorm for ``llama``)."""
    vocab_size: int = 256
    """Vocabulary size: ≥ the tokenizer's (``text`` data: 256; a prepared corpus: its metadata's ``vocab_size``, e.g.
    257 for the byte tokenizer). Must divide by ``parallel.tp``; pad it, as Megatron does (multiple of 128 · tp)."""
    seq_len: int = 64
    """Tokens per sequence (context length). Must divide by ``parallel.cp``."""
    hidden: int = 64
    """Hidden size (model width). Must divide by ``heads``."""
    layers: int = 2
    """Number of transformer blocks."""
    heads: int = 4
    """Attention heads. Must divide by ``parallel.tp`` (each TP rank owns whole heads)."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; ``null`` = 4 × hidden (``gpt``) or 8/3 × hidden rounded up to a multiple of 64 (``llama``).
    Must divide by ``parallel.tp``."""
    dropout: float = 0.0
    """Dropout probability (attention and residual), in [0, 1). Attention dropout draws from the model-parallel RNG fork."""
    init_std: float = 0.02
    """Std of the normal weight init; output projections use init_std / sqrt(2 · layers)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 = dense MLP everywhere. Must divide by ``parallel.ep``; needs tp = cp = 1."""
    moe_every: int = 2
    """With experts: every ``moe_every``-th block (1-based, the last one included) uses an MoE MLP."""
    moe_top_k: int = 1
    """With experts: experts per token (top-k routing, renormalised gate weights)."""
    recompute: bool = False
    """Activation recompute of every block through ``megashard.recompute.checkpoint`` (trades compute for memory)."""
    distribute_saved_activations: bool = False
    """With recompute: keep only 1/tp of each block's saved input between forward and backward."""


@dataclass
class TrainConfig:
    """The training loop: length, batch, precision, logging and outputs."""

    steps: int = 200
    """Optimizer steps to train for (a resumed run continues up to this step)."""
    global_batch: int = 16
    """Sequences per optimizer step over all data-parallel ranks. Must divide by ``dp`` (dp_outer · dp_shard)."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32, float64 (exact parity tests) or bfloat16."""
    out_dir: str = "runs/{name}"
    """Output directory (metrics.jsonl, loss.png, checkpoints/, config.yaml); ``{name}`` = the config file's stem."""
    log_interval: int = 10
    """Steps between progress lines when stderr is not a terminal (a terminal gets a live bar)."""
    progress: bool = True
    """Show the progress bar on rank 0 (stderr)."""
    plot: bool = True
    """Write loss.png at the end (needs matplotlib: ``pip install 'megashard[plot]'``; skipped with a note otherwise)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ``checkpoint.dir`` when there is one."""
    eval_interval: int = 0
    """Validation loss (averaged over the data-parallel ranks) every this many steps and after the last; 0 = never.
    Needs ``data.valid_fraction > 0``."""
    eval_batches: int = 2
    """Batches of ``global_batch`` validation sequences per evaluation (the same ones every time)."""
    fail_at_step: Optional[int] = None
    """Fault injection for tests: rank ``fail_rank`` exits with code 1 after this step (first attempt only)."""
    fail_rank: int = 0
    """Fault injection: the global rank that fails at ``fail_at_step``."""


@dataclass
class OptimConfig:
    """AdamW, the learning-rate schedule and gradient clipping."""

    lr: float = 3.0e-3
    """Peak learning rate."""
    min_lr: float = 3.0e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to ``lr``."""
    schedule: str = "cosine"
    """Decay after warm-up: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay of parameters with 2 or more dims (biases and norms are not decayed)."""
    beta1: float = 0.9
    """AdamW β1."""
    beta2: float = 0.95
    """AdamW β2."""
    eps: float = 1.0e-8
    """AdamW ε."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping (the norm is still reported)."""


@dataclass
class DataConfig:
    """Deterministic training data, identical for every layout; each data-parallel rank reads its slice of a batch."""

    source: str = "synthetic"
    """``synthetic`` (sequences from a fixed random Markov chain: learnable, no files), ``text`` (the bytes of
    ``path``) or ``indexed`` (tokenized datasets: ``path`` or ``blend``; docs/data.md)."""
    path: Optional[str] = None
    """``text``: a text file (byte-level tokens; vocab_size ≥ 256). ``indexed``: a dataset prefix (``PREFIX.bin`` +
    ``PREFIX.idx``, e.g. from ``megashard data prepare``) or a flat token file; the same as ``blend: [[1.0, path]]``.
    Relative to the current directory."""
    blend: Optional[list] = None
    """``indexed``: datasets mixed by weight, ``[[weight, path], ...]`` (weights > 0, normalised). When given it replaces
    ``path`` (and ``prepare_inputs``). On the command line: ``data.blend=[[0.7,data/a],[0.3,data/b]]``."""
    flat_dtype: str = "uint16"
    """``indexed``: token dtype of flat token files (paths without an ``.idx``): uint8, uint16, int32, ..."""
    valid_fraction: float = 0.0
    """Share of every dataset's samples held out for validation (a seeded choice, disjoint from training), in [0, 1)."""
    prepare_inputs: Optional[list] = None
    """``indexed`` with ``path``: inputs of ``megashard data prepare`` (files, directories, globs; ``{stdlib}`` = the
    Python standard library) that ``megashard run`` tokenizes into ``path`` first if no corpus is there yet."""
    prepare_tokenizer: str = "byte"
    """Tokenizer for ``prepare_inputs``: ``byte`` or the path of a Hugging Face tokenizer.json."""
    num_sequences: int = 4096
    """Synthetic: sequences in the dataset (the loop cycles through a seeded permutation of them each epoch)."""
    branching: int = 4
    """Synthetic: likely successors per token (the lower, the lower the reachable loss; ≈ ln(branching))."""
    seed: int = 0
    """Offset added to ``parallel.seed`` for the data (dataset and shuffling)."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint, one directory per step, written atomically)."""

    interval: int = 50
    """Save every this many steps; 0 = never (except ``save_final``)."""
    save_final: bool = True
    """Also save after the last step."""
    keep: int = 2
    """Complete checkpoints to keep (oldest deleted first); 0 = keep all."""
    dir: Optional[str] = None
    """Checkpoint directory; ``null`` = ``<train.out_dir>/checkpoints``."""
    load_step: Optional[int] = None
    """Start from the checkpoint of this step in the checkpoint directory (``<dir>/step_<N>``) instead of the
    newest one; it must be complete, and if it is damaged the job stops with an error (no fallback). ``null`` =
    the newest checkpoint that verifies (a damaged newer one is skipped with a note). Exclusive with
    ``load_path``; needs ``train.resume: true``. Every start of the job, torchrun restarts included, loads it."""
    load_path: Optional[str] = None
    """Start from this checkpoint directory (a ``step_<N>`` directory holding ``COMPLETE.json``, e.g. of another
    run) instead of the newest one in ``dir``; damaged → error, no fallback. Exclusive with ``load_step``."""


@dataclass
class LaunchConfig:
    """How ``megashard run`` starts the job through torchrun (``torch.distributed.run``)."""

    nnodes: int = 1
    """Nodes (world size = nnodes × nproc_per_node). Under Slurm, defaults to ``SLURM_NNODES``."""
    nproc_per_node: int = 4
    """Processes per node (one per GPU on CUDA)."""
    max_restarts: int = 0
    """How often torchrun restarts the whole worker group after a failure; the job resumes from its newest checkpoint."""
    rdzv_backend: str = "c10d"
    """torchrun rendezvous backend for multi-node runs (single-node runs use ``--standalone``)."""
    rdzv_endpoint: Optional[str] = None
    """``host:port`` of the rendezvous for multi-node runs; under Slurm, defaults to the first node of the job, port 29500."""
    rdzv_id: Optional[str] = None
    """Rendezvous id shared by all nodes of one job; under Slurm, defaults to ``SLURM_JOB_ID``."""
    node_rank: Optional[int] = None
    """This node's rank (needed only for ``rdzv_backend: static``); under Slurm, defaults to ``SLURM_NODEID``."""
    monitor_interval: float = 0.5
    """Seconds between torchrun's health checks of the workers."""
    slurm: Optional[bool] = None
    """Read Slurm variables: ``null`` = when ``SLURM_JOB_ID`` is set (and launch.nnodes is not given on the command
    line), ``true`` = required, ``false`` = ignore them."""


#: The sections documented in docs/config.md after ``parallel`` (read by megashard.configdoc).
CONFIG_SECTIONS: list[tuple[str, type]] = [
    ("model", ModelConfig),
    ("train", TrainConfig),
    ("optim", OptimConfig),
    ("data", DataConfig),
    ("checkpoint", CheckpointConfig),
    ("launch", LaunchConfig),
]
SECTION_NAMES = ("parallel",) + tuple(n for n, _ in CONFIG_SECTIONS)


# ---------------------------------------------------------------------------------------------- parsing
def _check_type(cls: type, section: str, name: str, value: Any) -> Any:
    """Check (and mildly coerce: int → float, "1e-3" → float) ``value`` against the field's annotation."""
    hints = typing.get_type_hints(cls)
    hint = hints[name]
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    where = f"{section}.{name}"
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}=null is not allowed; give a {base.__name__}")
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}={value!r} must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value  # pragma: no cover - no other field types


def section_from_dict(cls: type, data: Optional[Mapping[str, Any]], section: str) -> Any:
    """Build section dataclass ``cls`` from a mapping; unknown keys get a "did you mean"."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"section '{section}' must be a mapping of keys, got {type(data).__name__} {data!r}")
    reject_unknown_keys(cls, data, section)
    return cls(**{k: _check_type(cls, section, k, v) for k, v in data.items()})


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _divisors(n: int) -> str:
    from megashard.config import _fmt_divisors

    return _fmt_divisors(n)


def _check_endpoint(endpoint: str) -> None:
    """``host`` or ``host:port`` (port 1..65535; IPv6 hosts in brackets), as torchrun's --rdzv-endpoint reads it."""
    host, sep, port = endpoint.strip().rpartition(":") if not endpoint.strip().endswith("]") else ("", "", "")
    if not sep:
        host, port = endpoint.strip(), None
    ok = bool(host) and (port is None or (port.isdigit() and 1 <= int(port) <= 65535))
    _need(ok, f"launch.rdzv_endpoint={endpoint!r} must be host or host:port with a port in 1..65535 (e.g. node0:29500)")


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
            msgs = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), SECTION_NAMES, n=1)
                msgs.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            raise ConfigError(f"unknown config section(s) {', '.join(msgs)}; sections are: {', '.join(SECTION_NAMES)}")
        par = doc.get("parallel") or {}
        if not isinstance(par, Mapping):
            raise ConfigError(f"section 'parallel' must be a mapping of keys, got {type(par).__name__}")
        kwargs: dict[str, Any] = {"parallel": ParallelConfig.from_dict(par), "name": name}
        for sec, sec_cls in CONFIG_SECTIONS:
            kwargs[sec] = section_from_dict(sec_cls, doc.get(sec), sec)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> "JobConfig":
        """Read ``path`` and apply dotted ``section.key=value`` overrides; validated field by field (not yet
        against the world size: call :meth:`validate`)."""
        import os

        from megashard.yamlcfg import apply_overrides, load_yaml

        doc = apply_overrides(load_yaml(path), list(overrides))
        name = os.path.splitext(os.path.basename(path))[0]
        return cls.from_dict(doc, name=name)

    def to_dict(self) -> dict[str, Any]:
        """The YAML-ready dict of every section (what a run writes to ``<out_dir>/config.yaml``)."""
        out = {"parallel": self.parallel.to_dict()}
        for sec, _ in CONFIG_SECTIONS:
            out[sec] = dataclasses.asdict(getattr(self, sec))
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

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
        from megashard.train.model import default_ffn_hidden

        return default_ffn_hidden(self.model)

    def moe_layers(self) -> list[int]:
        """0-based indices of the blocks with an MoE MLP."""
        m = self.model
        if m.num_experts == 0:
            return []
        return [i for i in range(m.layers) if (i + 1) % m.moe_every == 0]

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: Optional[int] = None) -> ResolvedSizes:
        """Check every section and their combination for ``world_size`` (default: launch.nnodes × nproc_per_node).

        Returns the resolved parallel sizes; raises :class:`ConfigError` naming the keys, values and rule.
        """
        self._validate_sections()
        w = self.world_size if world_size is None else world_size
        if world_size is None:
            check_world_size(w, f"world size launch.nnodes × launch.nproc_per_node = {self.launch.nnodes} × "
                                f"{self.launch.nproc_per_node} =")
        s = self.parallel.resolve(w)
        m, t = self.model, self.train
        _need(s.pp == 1, f"parallel.pp={s.pp}: the example training loop has no pipeline schedule; use pp: 1")
        _need(m.vocab_size % s.tp == 0,
              f"model.vocab_size={m.vocab_size} must divide by parallel.tp={s.tp} (each TP rank holds vocab/tp rows); "
              f"pad it to {-(-m.vocab_size // s.tp) * s.tp}")
        _need(m.heads % s.tp == 0, f"model.heads={m.heads} must divide by parallel.tp={s.tp}; valid tp: {_divisors(m.heads)}")
        _need(self.ffn_hidden % s.tp == 0, f"model.ffn_hidden={self.ffn_hidden} must divide by parallel.tp={s.tp}")
        _need(m.seq_len % s.cp == 0,
              f"model.seq_len={m.seq_len} must divide by parallel.cp={s.cp}; valid cp: {_divisors(m.seq_len)}")
        _need(t.global_batch % s.dp == 0,
              f"train.global_batch={t.global_batch} must divide by the data-parallel size dp={s.dp} "
              f"(dp_outer={s.dp_outer} × dp_shard={s.dp_shard}); valid dp: {_divisors(t.global_batch)}")
        if m.num_experts:
            _need(m.num_experts % s.ep == 0,
                  f"model.num_experts={m.num_experts} must divide by parallel.ep={s.ep}; valid ep: {_divisors(m.num_experts)}")
            _need(s.tp == 1 and s.cp == 1 and s.expt_tp == 1,
                  f"MoE layers (model.num_experts={m.num_experts}) support tp=1, cp=1, expt_tp=1 only "
                  f"(got tp={s.tp}, cp={s.cp}, expt_tp={s.expt_tp}): experts are spread over ep, data over dp")
            _need(1 <= m.moe_top_k <= m.num_experts, f"model.moe_top_k={m.moe_top_k} must be in 1..num_experts={m.num_experts}")
            _need(bool(self.moe_layers()),
                  f"model.moe_every={m.moe_every} > model.layers={m.layers}: no block would be an MoE block")
        else:
            _need(s.ep == 1, f"parallel.ep={s.ep} needs experts: set model.num_experts (a multiple of ep) or ep: 1")
        if t.fail_at_step is not None:
            _need(0 <= t.fail_rank < w, f"train.fail_rank={t.fail_rank} is not a rank of the world of {w}")
        if self.data.source == "text":
            import os

            _need(self.data.path is not None and os.path.isfile(self.data.path),
                  f"data.source=text needs data.path to be an existing file, got {self.data.path!r}")
        if self.data.source == "indexed":
            from megashard.train.data import check_corpus

            check_corpus(self, s.tp)  # the files exist and open, the vocabulary fits
        self.requested_checkpoint()
        return s

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

    def _validate_sections(self) -> None:
        m, t, o, d, c, la = self.model, self.train, self.optim, self.data, self.checkpoint, self.launch
        for where, v in (("model.vocab_size", m.vocab_size), ("model.seq_len", m.seq_len), ("model.hidden", m.hidden),
                         ("model.layers", m.layers), ("model.heads", m.heads), ("model.moe_every", m.moe_every),
                         ("model.moe_top_k", m.moe_top_k), ("train.steps", t.steps), ("train.global_batch", t.global_batch),
                         ("train.log_interval", t.log_interval), ("data.num_sequences", d.num_sequences),
                         ("data.branching", d.branching), ("launch.nnodes", la.nnodes),
                         ("launch.nproc_per_node", la.nproc_per_node)):
            _need(v >= 1, f"{where}={v} must be a positive integer")
        for where, v in (("model.num_experts", m.num_experts), ("optim.warmup_steps", o.warmup_steps),
                         ("checkpoint.interval", c.interval), ("checkpoint.keep", c.keep),
                         ("launch.max_restarts", la.max_restarts)):
            _need(v >= 0, f"{where}={v} must be >= 0")
        if c.load_step is not None:
            _need(c.load_step >= 0, f"checkpoint.load_step={c.load_step} must be >= 0 (a saved step) or null (the newest)")
        _need(c.load_step is None or c.load_path is None,
              f"checkpoint.load_step={c.load_step} and checkpoint.load_path={c.load_path!r} are exclusive: give one "
              "(load_step picks <checkpoint.dir>/step_<N>, load_path any checkpoint directory)")
        _need(c.load_step is None and c.load_path is None or t.resume,
              "checkpoint.load_step / checkpoint.load_path load a checkpoint but train.resume=false starts from "
              "scratch; drop one of them")
        if m.ffn_hidden is not None:
            _need(m.ffn_hidden >= 1, f"model.ffn_hidden={m.ffn_hidden} must be a positive integer or null")
        _need(m.hidden % m.heads == 0, f"model.hidden={m.hidden} must divide by model.heads={m.heads}")
        _need(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
        _need(m.init_std > 0, f"model.init_std={m.init_std} must be > 0")
        _need(not m.distribute_saved_activations or m.recompute,
              "model.distribute_saved_activations=true needs model.recompute=true")
        _need(t.dtype in DTYPES, f"train.dtype={t.dtype!r} is not supported; valid: {', '.join(DTYPES)}")
        _need(bool(t.out_dir), "train.out_dir must not be empty")
        if t.fail_at_step is not None:
            _need(1 <= t.fail_at_step, f"train.fail_at_step={t.fail_at_step} must be >= 1 or null")
        _need(o.lr > 0, f"optim.lr={o.lr} must be > 0")
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
            _need(m.num_experts == 0, f"model.arch=llama has dense SwiGLU MLPs only: use model.num_experts=0 "
                  f"(got {m.num_experts}) or model.arch=gpt for experts")
            _need((m.hidden // m.heads) % 2 == 0,
                  f"model.arch=llama: the head size hidden/heads={m.hidden}/{m.heads} must be even (rotary pairs)")
        _need(d.source in SOURCES, f"data.source={d.source!r} is not supported; valid: {', '.join(SOURCES)}")
        _need(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
        _need(t.eval_interval >= 0 and t.eval_batches >= 1,
              f"train.eval_interval={t.eval_interval} must be >= 0 and train.eval_batches={t.eval_batches} >= 1")
        _need(t.eval_interval == 0 or d.valid_fraction > 0,
              f"train.eval_interval={t.eval_interval} needs validation data: set data.valid_fraction > 0 (e.g. 0.05)")
        if d.source == "indexed":
            from megashard.train.data import data_paths

            data_paths(d)  # path xor blend, well-formed
        if d.source == "text":
            _need(m.vocab_size >= 256, f"data.source=text is byte-level: model.vocab_size={m.vocab_size} must be >= 256")
        _need(d.branching <= m.vocab_size, f"data.branching={d.branching} must be <= model.vocab_size={m.vocab_size}")
        _need(la.monitor_interval > 0, f"launch.monitor_interval={la.monitor_interval} must be > 0")
        if la.node_rank is not None:
            _need(0 <= la.node_rank < la.nnodes, f"launch.node_rank={la.node_rank} must be in 0..nnodes-1={la.nnodes - 1}")
        _need(bool(la.rdzv_backend), "launch.rdzv_backend must not be empty (c10d, etcd-v2 or static)")
        if la.rdzv_endpoint is not None:
            _check_endpoint(la.rdzv_endpoint)
