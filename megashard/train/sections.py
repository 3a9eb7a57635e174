"""The sections of the training job's YAML besides ``parallel``: one dataclass each, every field documented.

``model``, ``train``, ``optim``, ``data``, ``checkpoint``, ``launch`` (:data:`CONFIG_SECTIONS`); each field's
docstring states its meaning and constraint, and ``docs/config.md`` is generated from them
(``python tools/gen_config_docs.py``). :func:`section_from_dict` builds a section from its YAML mapping, checking
each value's type; :class:`~megashard.train.config.JobConfig` holds the sections and checks how they combine.
"""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from megashard.config.keys import reject_unknown_keys, yaml_bool, yaml_keys
from megashard.errors import ConfigError
from megashard.models.config import ARCHS, COMPILE_BACKENDS, ModelConfig, default_ffn_hidden  # noqa: F401 - the model section lives with the models

DTYPES = ("float32", "float64", "bfloat16")
SOURCES = ("synthetic", "text", "indexed")
#: ``data.flat_dtype``: integer token dtypes (megashard.data.tokens.DTYPES; kept torch-free here).
FLAT_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "int64")
SCHEDULES = ("cosine", "linear", "constant")
UNFILLABLE_WORLD = ("wait", "stop")
#: ``train.wandb``: no W&B, files to sync later, or live (YAML reads a bare ``off`` as false: the same).
WANDB_MODES = ("off", "offline", "online")
RECOVERY = ("live", "restart")
PIPELINE_SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv")


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
    tensorboard: bool = False
    """Log every metric (loss, lr, grad norm, throughput, MFU, validation loss, world changes, the end summary) as
    TensorBoard events under ``<out_dir>/tensorboard/``; a resumed run goes on in the same log (``purge_step``). Needs
    ``pip install 'megashard[tensorboard]'`` (checked before any process starts)."""
    wandb: Union[bool, str] = "off"
    """Log the same metrics to Weights & Biases: ``off``, ``offline`` (files under ``<out_dir>/wandb/``, upload later
    with ``wandb sync``) or ``online`` (needs a login and network). The run id is kept in ``<out_dir>/wandb.json``, so
    every start of the job resumes the same W&B run. Needs ``pip install 'megashard[wandb]'``."""
    wandb_project: str = "megashard"
    """The W&B project of ``train.wandb``."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device for ``train.dtype``: the denominator of the MFU the job reports. ``null`` = a
    table of GPUs (H100, H200, A100, B200, ...: bf16 dense; float32 without TF32), or on CPU a matmul measured at the
    start; a GPU not in the table reports no MFU."""
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
    pipeline_schedule: str = "1f1b"
    """With ``parallel.pp > 1``: PyTorch's pipeline schedule — ``1f1b``, ``gpipe``, ``interleaved_1f1b`` (needs
    ``parallel.vpp ≥ 2``: rank r runs stages r, r + pp, …) or ``zbv`` (zero-bubble V, needs ``parallel.vpp = 2``)."""
    microbatches: Optional[int] = None
    """Microbatches per step and data-parallel rank: global_batch = microbatches × micro-batch size × dp, so
    ``global_batch`` must divide by microbatches · dp. ``null`` = pp (1 without pipeline), or what
    ``micro_batch_size`` gives. With pp = 1 the microbatches accumulate gradients; ``1f1b`` needs microbatches ≥ pp."""
    micro_batch_size: Optional[int] = None
    """Sequences per microbatch and data-parallel rank, instead of ``microbatches``: the microbatches per step
    (gradient accumulation) are global_batch / (dp × micro_batch_size), recomputed for every world size of an
    elastic job, so the memory per rank stays put while dp changes. ``null`` = global_batch / (dp × microbatches)."""
    reshard_between_microbatches: bool = False
    """With a pipeline: FSDP frees the gathered parameters after every microbatch's forward (less memory, one
    all-gather per microbatch) instead of keeping them until the step's backward is done."""
    doctor: bool = True
    """The hang doctor (docs/doctor.md): when a collective on a megashard group does not finish within
    ``parallel.timeout``, every waiting rank prints one line naming the group, the operation and the ranks that never
    reached it (and what they do instead), and every rank writes ``<out_dir>/doctor/rank_<r>.json`` (at start, on a
    hang and at the end) for ``megashard doctor OUT_DIR``; metrics.jsonl gets the straggler report (``stragglers``:
    the rank that arrives last, by how much, and the ranks named slow). Costs a few µs per collective and one small
    store write per rank every ``parallel.timeout``/10 s (0.2 to 5 s); ``false`` = off."""
    compile: bool = False
    """Compile every transformer block with ``torch.compile`` (its body: norms, attention, MLP; FSDP's hooks and
    activation recompute stay outside, parameter names and checkpoints are unchanged), as torchtitan does. Works
    with FSDP2, tp, cp, pp (``1f1b``, ``gpipe``, ``interleaved_1f1b``; not ``zbv``, whose split
    backward a compiled block cannot do: a config error), experts and ``model.recompute``. The first step compiles (seconds to
    minutes); losses equal the eager job's to rounding (``dropout`` > 0 draws other masks). ``inductor`` on a
    CPU needs a C compiler."""
    compile_backend: str = "inductor"
    """Backend of ``train.compile``: ``inductor`` (generated fused kernels: the speed-up), ``aot_eager`` (the same
    graphs and AOT autograd without code generation: quick to build, for tests) or ``eager`` (dynamo only)."""


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
    decay_steps: Optional[int] = None
    """The step at which the decay reaches ``min_lr`` (counted from step 0, warm-up included; Megatron-LM's
    ``--lr-decay-iters``); after it the learning rate stays at ``min_lr``. ``null`` = the ``train.steps`` of the run
    that starts the job from scratch. Every checkpoint records the resolved value, so a resume with a larger
    ``train.steps`` goes on at ``min_lr`` instead of stretching the decay."""
    override_schedule: bool = False
    """A resumed run keeps the learning-rate schedule its checkpoint records (``schedule``, ``lr``, ``min_lr``,
    ``warmup_steps``, ``decay_steps``) and says so in one line when this config's differs; ``true`` takes this
    config's instead (Megatron-LM's ``--override-opt_param-scheduler``), also said in one line."""
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
    """``indexed``: datasets mixed by weight, ``[[weight, path], ...]`` (finite weights > 0, normalised; each at least
    1/65,536 of the total, or its dataset would never be drawn). When given it replaces
    ``path`` (and ``prepare_inputs``). On the command line: ``data.blend=[[0.7,data/a],[0.3,data/b]]``."""
    flat_dtype: str = "uint16"
    """``indexed``: token dtype of flat token files (paths without an ``.idx``): an integer type, uint8, int8, int16,
    uint16, int32 or int64 (token ids are integers: float files are refused)."""
    valid_fraction: float = 0.0
    """Share of every dataset's samples held out for validation (a seeded choice, disjoint from training), in [0, 1)."""
    prepare_inputs: Optional[list[str]] = None
    """``indexed`` with ``path``: inputs of ``megashard data prepare`` (files, directories, globs; ``{stdlib}`` = the
    Python standard library) that ``megashard run`` tokenizes into ``path`` first if no corpus is there yet."""
    prepare_tokenizer: str = "byte"
    """Tokenizer for ``prepare_inputs``: ``byte`` or the path of a Hugging Face tokenizer.json."""
    prepare_encoding: str = "utf-8"
    """Text encoding of ``prepare_inputs`` (``megashard data prepare --encoding``): utf-8, latin-1, cp1252, ..."""
    prepare_encoding_errors: str = "strict"
    """Bytes of ``prepare_inputs`` not valid in ``prepare_encoding``: ``strict`` (an error naming the file and offset,
    before any process starts), ``replace`` (U+FFFD, counted) or ``skip-file`` (such files left out, counted)."""
    num_sequences: int = 4096
    """Synthetic: sequences in the dataset (the loop cycles through a seeded permutation of them each epoch)."""
    branching: int = 4
    """Synthetic: likely successors per token (the lower, the lower the reachable loss; ≈ ln(branching))."""
    seed: int = 0
    """Offset added to ``parallel.seed`` for the data (dataset and shuffling)."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint, one directory per step, written atomically)."""

    interval: Union[int, str] = 50
    """Save every this many steps (an integer; 0 = never, except ``save_final``), or every so much time: a number
    with a unit, ``"300s"``, ``"10m"``, ``"1h"`` — the ranks decide together (rank clocks may differ: one small
    all-reduce per step takes the largest time since the last save), so every rank saves after the same step. An
    elastic job loses at most one interval of work per node lost (docs/elastic.md)."""
    save_final: bool = True
    """Also save after the last step."""
    keep: int = 2
    """Complete checkpoints of this run to keep (the most recently written; older ones deleted first); 0 = keep all.
    Checkpoints of other runs (another ``run_id`` in their ``megashard.json``) are never deleted."""
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
    move_aside: bool = False
    """With ``train.resume: false``: move the checkpoints an earlier run left in the checkpoint directory into its
    subdirectory ``earlier-<date>-<time>/`` (they stay loadable with ``load_path``) before this run starts. Without
    it such a fresh start is refused before any process starts: it would mix its checkpoints with the earlier
    run's (and the next plain run would resume whichever step is highest)."""
    async_save: bool = field(default=False, metadata={"yaml": "async"})
    """Save in the background (DCP's asynchronous save): training stops only while the state is
    copied to host memory, then continues while the copy is written, checksummed and published (marker, rename,
    retention); at most one save is in flight (the next save and the end of training wait for it). A failed
    background save is reported at the next checkpoint or at the end; the previous checkpoint stays loadable.
    (Python field: ``async_save``, as ``async`` is a keyword.)"""
    memory_copies: int = 1
    """Elastic jobs with ``launch.recovery: live``: copies of each rank's model and optimizer shards kept in the host
    memory of ranks on other nodes (0 or 1), refreshed after every step, so that the state of a node that is lost
    comes from memory, not from the newest checkpoint. 0: only HSDP replicas (``dp_outer > 1``) are live copies.
    Costs per rank twice (this step and the one before) its own shards plus as much per copy, in host memory
    (``megashard plan`` prints it); unused by jobs that are not elastic."""

    @property
    def interval_steps(self) -> int:
        """Steps between saves (0: never, or a time interval: :attr:`interval_seconds`)."""
        return parse_interval(self.interval)[0]

    @property
    def interval_seconds(self) -> Optional[float]:
        """Seconds between saves when ``interval`` is a time (``"300s"``), else None."""
        return parse_interval(self.interval)[1]


@dataclass
class LaunchConfig:
    """How ``megashard run`` starts the job through torchrun (``torch.distributed.run``)."""

    nnodes: Union[int, str] = 1
    """Nodes (world size = nnodes × nproc_per_node), or an elastic range ``"MIN:MAX"`` (e.g. ``1:4``): the job runs
    on any node count in range, re-forms the world when a node leaves or joins and resumes there, the data-parallel
    axis absorbing the change (docs/elastic.md). Under Slurm, defaults to ``SLURM_NNODES`` (a range is kept)."""
    nproc_per_node: int = 4
    """Processes per node (one per GPU on CUDA)."""
    max_restarts: int = 0
    """How often torchrun restarts the whole worker group after a failure; the job resumes from its newest checkpoint.
    In an elastic job a node that leaves or joins re-forms the world without using one up (a failure of this
    node's own workers does)."""
    rdzv_backend: str = "c10d"
    """torchrun rendezvous backend for multi-node runs (single-node runs use ``--standalone``): ``c10d`` (a store on
    the node of ``rdzv_endpoint``), ``etcd``, ``etcd-v2`` (an etcd server) or ``static`` (fixed nodes: needs
    ``node_rank`` and ``rdzv_endpoint``, no elastic range), or one a torchrun plugin registers."""
    rdzv_endpoint: Optional[str] = None
    """``host:port`` of the rendezvous for multi-node runs (no ``http://``); under Slurm, defaults to the first node of
    the job, port 29500."""
    rdzv_id: Optional[str] = None
    """Rendezvous id shared by all nodes of one job; under Slurm, defaults to ``SLURM_JOB_ID``."""
    node_rank: Optional[int] = None
    """This node's rank (needed only for ``rdzv_backend: static``); under Slurm, defaults to ``SLURM_NODEID``."""
    monitor_interval: float = 0.5
    """Seconds between torchrun's health checks of the workers."""
    rdzv_last_call: int = 30
    """Elastic (``c10d``, ``etcd-v2``): seconds the rendezvous waits for more nodes once ``MIN`` are there, at the start
    and after a node left (torchrun's ``last_call_timeout``)."""
    rdzv_node_timeout: int = 15
    """Elastic (``c10d``, ``etcd-v2``): seconds without a heartbeat after which a node counts as gone and the
    rendezvous re-forms without it (torchrun's ``keep_alive_interval`` × ``keep_alive_max_attempt``, an interval of
    ⌈value/3⌉ s, 3 attempts; at least 3)."""
    unfillable_world: str = "wait"
    """Elastic: what the job does when the rendezvous forms a world size the fixed axes (tp, cp, pp, ep) or the global
    batch cannot fill (``megashard plan`` lists them): ``wait`` (one line, then wait for a node to join or leave;
    nothing is written) or ``stop`` (one line, the job ends with exit code 2)."""
    recovery: str = "live"
    """Elastic: what a node leaving or joining costs the running workers. ``live``: they keep running — on a loss the
    survivors re-form the world among themselves and take the lost shards from memory (``checkpoint.memory_copies``,
    HSDP replicas); a joining node is taken in at a step boundary; the checkpoint is read only when no live copy
    survives. ``restart``: torchrun restarts every worker into the new world, which resumes from the newest
    checkpoint (docs/elastic.md)."""
    slurm: Optional[bool] = None
    """Read Slurm variables: ``null`` = when ``SLURM_JOB_ID`` is set (and launch.nnodes is not given on the command
    line), ``true`` = required, ``false`` = ignore them."""

    @property
    def node_range(self) -> tuple[int, int]:
        """``(MIN, MAX)`` node counts (equal unless ``nnodes`` is an elastic range)."""
        return parse_node_range(self.nnodes)

    @property
    def elastic(self) -> bool:
        """Whether ``nnodes`` is a range ``MIN:MAX`` with MIN < MAX."""
        lo, hi = self.node_range
        return lo < hi

    @property
    def multi_node(self) -> bool:
        """Whether the job may span several nodes (a rendezvous of launchers, not ``--standalone``)."""
        return self.node_range[1] > 1

    def world_sizes(self) -> list[int]:
        """Every world size the job may run at: ``n × nproc_per_node`` for n in MIN..MAX."""
        lo, hi = self.node_range
        return [n * self.nproc_per_node for n in range(lo, hi + 1)]


_UNION_EXAMPLES = {"nnodes": "2, or 1:4 for an elastic range", "interval": "50 steps, or '300s'"}


def parse_node_range(nnodes: Union[int, str], where: str = "launch.nnodes") -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:4"`` -> (1, 4): the node counts a job may run on. ConfigError (one line) otherwise."""
    rule = (f"must be a positive integer (e.g. 2) or an elastic range MIN:MAX of node counts with 1 <= MIN <= MAX "
            f"(e.g. 1:4)")
    if isinstance(nnodes, bool):
        raise ConfigError(f"{where}={nnodes!r} {rule}")
    if isinstance(nnodes, int):
        if nnodes < 1:
            raise ConfigError(f"{where}={nnodes} {rule}")
        return nnodes, nnodes
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    if not m:
        raise ConfigError(f"{where}={_short(nnodes)} {rule}")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= lo <= hi:
        raise ConfigError(f"{where}={_short(nnodes)} {rule}")
    return lo, hi


#: Units of a checkpoint interval given as a time, in seconds.
TIME_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_interval(interval: Union[int, str], where: str = "checkpoint.interval") -> tuple[int, Optional[float]]:
    """``50`` -> (50, None): every 50 steps (0 = never); ``"300s"`` / ``"10m"`` / ``"1.5h"`` -> (0, seconds).
    ConfigError (one line) otherwise."""
    rule = ("must be a number of steps (an integer >= 0, e.g. 50; 0 = never) or a time with a unit: '300s', '10m', "
            "'1h' (s, m or min, h)")
    if isinstance(interval, bool):
        raise ConfigError(f"{where}={interval!r} {rule}")
    if isinstance(interval, int):
        if interval < 0:
            raise ConfigError(f"{where}={interval} {rule}")
        return interval, None
    text = str(interval).strip()
    if text.isdigit():
        return int(text), None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)", text.lower())
    if not m or m.group(2) not in TIME_UNITS:
        raise ConfigError(f"{where}={_short(interval)} {rule}")
    seconds = float(m.group(1)) * TIME_UNITS[m.group(2)]
    if not seconds > 0:
        raise ConfigError(f"{where}={_short(interval)} must be a time > 0 (or 0 steps for never)")
    return 0, seconds


#: The sections documented in docs/config.md after ``parallel`` (read by tools/gen_config_docs.py).
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
def _check_type(cls: type, section: str, name: str, value: Any, key: Optional[str] = None) -> Any:
    """Check (and mildly coerce: int → float, "1e-3" → float) ``value`` against the field's annotation."""
    hints = typing.get_type_hints(cls)
    hint = hints[name]
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    where = f"{section}.{key or name}"
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}=null is not allowed; give {_KIND.get(base, 'a value')}")
    if set(typing.get_args(base)) == {int, str}:  # e.g. launch.nnodes: 2 or "1:4"; the field's parser checks the text
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}={_short(value)} must be an integer or a string (e.g. "
                              f"{_UNION_EXAMPLES.get(name, '2')})")
        return value
    if base is bool:
        value = yaml_bool(value)  # yes/no/on/off: YAML 1.1's spellings (docs/config.md)
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={_short(value)} must be true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={_short(value)} must be an integer{_as_text(value)}")
        return value
    if base is float:
        if isinstance(value, str):  # a number written as text ("1e-3" in quotes)
            try:
                value = float(value.strip()) if re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", value) \
                    else value
            except ValueError:  # pragma: no cover - the pattern is a float's
                pass
            if isinstance(value, str):
                raise ConfigError(f"{where}={_short(value)} must be a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={_short(value)} must be a number{_as_text(value)}")
        if not math.isfinite(value):  # .inf, .nan: no field of a job means them
            raise ConfigError(f"{where}={_short(value)} must be a finite number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={_short(value)} must be a string{_as_text(value, True)}")
        return value
    if base is list or typing.get_origin(base) is list:
        item = (typing.get_args(base) or (None,))[0]
        if not isinstance(value, list) or (item is not None and not all(isinstance(v, item) for v in value)):
            what = {str: "a list of strings", int: "a list of integers", None: "a list"}.get(item, "a list")
            raise ConfigError(f"{where}={_short(value)} must be {what} such as [a, b] (on the command line: "
                              f"{where}=[a,b]){', or null' if optional else ''}")
        return value
    return value  # pragma: no cover - no other field types


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}


def _as_text(value: Any, text_field: bool = False) -> str:
    """What an error adds when YAML read a value as another type than the field's (true/false, a number)."""
    if isinstance(value, bool):
        return " (YAML read true/false here" + ("; quote it to keep it as text)" if text_field else ")")
    if text_field and isinstance(value, (int, float)):
        return " (YAML read a number here; quote it to keep it as written)"
    return ""


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def section_from_dict(cls: type, data: Optional[Mapping[str, Any]], section: str) -> Any:
    """Build section dataclass ``cls`` from a mapping (each value type-checked); unknown keys get a "did you mean"."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"section '{section}' must be a mapping of keys, got {type(data).__name__} {data!r}")
    reject_unknown_keys(cls, data, section)
    fields = yaml_keys(cls)
    return cls(**{fields[k]: _check_type(cls, section, fields[k], v, k) for k, v in data.items()})
