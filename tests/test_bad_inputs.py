"""Every bad input gets one line, exit code 2 and no process (issue 9): `plan`, `run`, `ckpt` and the Python API.

CLI cases run ``megashard.cli.main`` in this process (stderr captured): exit code 2, exactly one stderr line
``megashard <cmd>: error: ...`` naming the field, empty stdout, no traceback; a `run` case must not start
torchrun (``subprocess.run`` is replaced by a failure) nor write ``<out_dir>/config.yaml``. A few of them
run as real subprocesses to prove the contract end to end. Python cases assert the megashard error type
and message.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import megashard
from megashard.cli import main
from megashard.config import ParallelConfig
from megashard.errors import CheckpointError, ConfigError, MegashardError, StateError
from megashard.layout import RankLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> str:
    """A directory of bad files: {bad}/<name> in the cases below."""
    d = tmp_path_factory.mktemp("bad")
    (d / "dup.yaml").write_text("parallel:\n  tp: 2\n  pp: 1\n  tp: 4\n")
    (d / "latin1.yaml").write_bytes(b"parallel:\n  tp: 2  # caf\xe9\n")
    (d / "typo.yaml").write_text("paralel:\n  tp: 2\nlaunch:\n  nproc_per_node: 4\n")
    (d / "syntax.yaml").write_text("parallel: {tp: 2\nmodel: {}\n")
    (d / "list.yaml").write_text("- parallel\n- model\n")
    (d / "a_file").write_text("not a directory\n")
    (d / "confdir").mkdir()
    (d / "confdir" / "x.yaml").write_text("parallel: {}\n")
    os.mkfifo(d / "fifo.yaml")
    (d / "empty").mkdir()
    (d / "unfinished" / "step_00000001").mkdir(parents=True)
    return str(d)


# (id, argv after `megashard`, text the single error line must contain: the field and the rule)
PLAN = [
    ("dup-keys", ["plan", "{bad}/dup.yaml", "-w", "4"], "duplicate key 'tp' on lines 2 and 4"),
    ("not-utf8", ["plan", "{bad}/latin1.yaml", "-w", "4"], "is not UTF-8 text: byte 0xe9 at line 2"),
    ("config-is-dir", ["plan", "{bad}/confdir", "-w", "4"], "is a directory; give one of its YAML files: x.yaml"),
    ("unreadable", ["plan", "/proc/self/mem", "-w", "4"], "'/proc/self/mem' cannot be read"),
    ("fifo", ["plan", "{bad}/fifo.yaml", "-w", "4"], "is not a regular file"),
    ("missing", ["plan", "{bad}/nope.yaml"], "nope.yaml' does not exist"),
    ("yaml-syntax", ["plan", "{bad}/syntax.yaml", "-w", "4"], "not valid YAML at line 2, column"),
    ("top-level-list", ["plan", "{bad}/list.yaml", "-w", "4"], "the top level must be a mapping, got list"),
    ("section-typo", ["plan", "{bad}/typo.yaml"], "unknown config section(s) 'paralel' (did you mean 'parallel'?)"),
    ("model-key-typo", ["plan", DEFAULT, "model.head=8"], "'model.head' (did you mean 'model.heads'?)"),
    ("train-type", ["plan", DEFAULT, "train.steps=abc"], "train.steps='abc' must be an integer"),
    ("model-rule", ["plan", DEFAULT, "model.hidden=66"], "model.hidden=66 must divide by model.heads=4"),
    ("max-members", ["plan", DEFAULT, "--max-members", "-1"], "--max-members -1: must be an integer >= 0"),
    ("rank-outside", ["plan", DEFAULT, "--rank", "4"], "--rank 4: must be in 0..3"),
    ("rank-negative", ["plan", DEFAULT, "--rank", "-1"], "--rank -1: must be in 0..3"),
    ("ranks-per-node", ["plan", DEFAULT, "--ranks-per-node", "0"], "--ranks-per-node 0: must be a positive integer"),
    ("svg-max-ranks-0", ["plan", DEFAULT, "--svg", "{bad}/x.svg", "--svg-max-ranks", "0"], "--svg-max-ranks 0: must be in 1..16,384"),
    ("svg-max-ranks-big", ["plan", DEFAULT, "--svg-max-ranks", "100000"], "--svg-max-ranks 100000: must be in 1..16,384"),
    ("world-2^40", ["plan", DEFAULT, "-w", str(2**40), "parallel.dp_shard=-1"], "--world-size 1099511627776: must be in 1..16,777,216"),
    ("world-0", ["plan", DEFAULT, "-w", "0"], "--world-size 0: must be in 1..16,777,216"),
    ("launch-world-big", ["plan", DEFAULT, "launch.nnodes=1048576", "launch.nproc_per_node=32"],
     "world size launch.nnodes × launch.nproc_per_node = 33,554,432 is larger than megashard's maximum"),
    ("pinned-dp-shard", ["plan", DEFAULT, "-w", "131072", "parallel.tp=8", "parallel.dp_shard=2"],
     "set dp_shard=-1 (parallel.dp_shard=-1 on the command line; here dp_shard=16384)"),
    ("json-too-big", ["plan", DEFAULT, "-w", "16777216", "-f", "json"], "more than the 4,194,304 a plan lists"),
    ("all-groups-too-big", ["plan", DEFAULT, "-w", "1048576", "--all-groups"], "name at most 4 with --groups"),
    ("groups-empty", ["plan", DEFAULT, "--groups", ","], "--groups ',' names no group"),
    ("groups-typo", ["plan", DEFAULT, "--groups", "tp,dp_shrd"], "unknown group 'dp_shrd' (did you mean 'dp_shard'?)"),
    ("svg-no-dir", ["plan", DEFAULT, "--svg", "{bad}/nodir/x.svg"], "--svg {bad}/nodir/x.svg: the directory"),
    ("svg-is-dir", ["plan", DEFAULT, "--svg", "{bad}/empty"], "--svg {bad}/empty: is a directory"),
    ("format-choice", ["plan", DEFAULT, "--format", "xml"], "argument --format/-f: invalid choice: 'xml'"),
    ("rank-not-int", ["plan", DEFAULT, "--rank", "abc"], "argument --rank/-r: invalid int value: 'abc'"),
    ("unknown-option", ["plan", DEFAULT, "--bogus"], "unrecognized arguments: --bogus"),
    ("size-zero", ["plan", DEFAULT, "parallel.tp=0"], "tp=0 is not a valid size"),
    ("size-huge", ["plan", DEFAULT, "parallel.tp=100000000"], "tp=100,000,000 is larger than the largest world size"),
    ("nccl-on-cpu", ["plan", DEFAULT, "parallel.backend=nccl"], "backend='nccl' runs on CUDA devices only, but device='cpu'"),
    ("timeout-nan", ["plan", DEFAULT, "parallel.timeout=.nan"], "timeout=nan must be a positive number of seconds"),
    ("order-token", ["plan", DEFAULT, "parallel.order=tp-xx-dp"], "order='tp-xx-dp' has unknown token(s) 'xx'"),
    ("override-no-value", ["plan", DEFAULT, "parallel.tp"], "override 'parallel.tp' must look like key.sub=value"),
    ("launch-nproc-0", ["plan", DEFAULT, "launch.nproc_per_node=0"], "launch.nproc_per_node=0 must be a positive integer"),
]

RUN = [
    ("ckpt-dir-is-file", ["checkpoint.dir={bad}/a_file"], "checkpoint.dir='{bad}/a_file' is an existing file"),
    ("out-dir-is-file", ["train.out_dir={bad}/a_file"], "train.out_dir='{bad}/a_file' is an existing file"),
    ("out-dir-under-file", ["train.out_dir={bad}/a_file/run"], "cannot be created: {bad}/a_file is a file"),
    ("out-dir-unwritable", ["train.out_dir=/proc/megashard-run"], "train.out_dir='/proc/megashard-run' cannot be created"),
    ("device-cuda", ["parallel.device=cuda"], "parallel.device=cuda, but this machine has no usable CUDA device"),
    ("backend-nccl", ["parallel.backend=nccl", "parallel.device=auto"], "parallel.backend=nccl needs CUDA devices"),
    ("section-typo", ["trian.steps=3"], "unknown config section(s) 'trian' (did you mean 'train'?)"),
    ("rdzv-port", ["launch.rdzv_endpoint=node0:99999"], "launch.rdzv_endpoint='node0:99999' must be host or host:port"),
    ("multi-node-no-endpoint", ["launch.nnodes=2"], "launch.nnodes=2 needs launch.rdzv_endpoint"),
    ("huge-batch", ["train.global_batch=1000000000007"], "train.global_batch=1000000000007 must divide by"),
    ("data-memory", ["data.num_sequences=1000000000000"], "data.num_sequences=1,000,000,000,000 × (model.seq_len + 1)"),
    ("pipeline-schedule", ["train.pipeline_schedule=1f2b"], "train.pipeline_schedule='1f2b' is not supported; valid: 1f1b, gpipe"),
    ("microbatches-zero", ["train.microbatches=0"], "train.microbatches=0 must be a positive integer or null"),
    ("microbatches-split", ["train.microbatches=3"], "train.global_batch=16 must divide by train.microbatches × dp = 3 × 2"),
    ("1f1b-microbatches", ["parallel.pp=2", "parallel.tp=1", "train.microbatches=1"],
     "train.microbatches=1: 1f1b needs at least pp=2 microbatches"),
    ("interleaved-no-vpp", ["parallel.pp=2", "parallel.tp=1", "train.pipeline_schedule=interleaved_1f1b"],
     "train.pipeline_schedule=interleaved_1f1b needs parallel.vpp >= 2"),
    ("vpp-with-1f1b", ["parallel.pp=2", "parallel.tp=1", "parallel.vpp=2", "model.layers=4"],
     "parallel.vpp=2 runs several stages per rank, but train.pipeline_schedule='1f1b' runs one"),
    ("zbv-vpp", ["parallel.pp=2", "parallel.tp=1", "train.pipeline_schedule=zbv"],
     "train.pipeline_schedule=zbv runs exactly two stages per rank: set parallel.vpp=2"),
    ("pipeline-layers", ["parallel.pp=4", "parallel.tp=1"], "model.layers=2 cannot fill pp × vpp = 4 × 1 = 4"),
    ("pipeline-distribute-saved", ["parallel.pp=2", "parallel.tp=1", "model.recompute=true",
                                   "model.distribute_saved_activations=true"],
     "model.distribute_saved_activations=true is not supported with pipeline parallelism"),
    ("reshard-flag", ["train.reshard_between_microbatches=maybe"], "train.reshard_between_microbatches='maybe' must be true or false"),
    ("aux-coeff", ["model.moe_aux_loss_coeff=-1"], "model.moe_aux_loss_coeff=-1.0 must be >= 0"),
    ("expert-tp", ["model.num_experts=4", "parallel.tp=1", "parallel.expt_tp=4", "model.ffn_hidden=130"],
     "model.ffn_hidden=130 (per expert) must divide by parallel.expt_tp=4"),
    ("moe-tokens-tp", ["model.num_experts=4", "model.seq_len=63", "train.global_batch=2"],
     "63 tokens per rank, not divisible by tp=2"),
    ("fail-rank", ["train.fail_at_step=2", "train.fail_rank=4"], "train.fail_rank=4 is not a rank of the world of 4"),
]
RUN_CONFIGS = [  # config files instead of overrides
    ("dup-keys", "{bad}/dup.yaml", "duplicate key 'tp' on lines 2 and 4"),
    ("not-utf8", "{bad}/latin1.yaml", "is not UTF-8 text"),
    ("config-is-dir", "{bad}/confdir", "is a directory"),
]

CKPT = [
    ("inspect-missing", ["ckpt", "inspect", "{bad}/nothing"], "{bad}/nothing"),
    ("inspect-empty", ["ckpt", "inspect", "{bad}/empty"], "no complete checkpoint in {bad}/empty"),
    ("inspect-unfinished", ["ckpt", "inspect", "{bad}/unfinished"], "without a COMPLETE.json marker"),
    ("inspect-format", ["ckpt", "inspect", "{bad}/empty", "--format", "xml"], "argument --format/-f: invalid choice"),
    ("consolidate-missing", ["ckpt", "consolidate", "{bad}/nothing", "{bad}/full.pt"], "{bad}/nothing"),
    ("action", ["ckpt", "bogus"], "argument ACTION: invalid choice: 'bogus'"),
]


def _fmt(items, bad):
    return [x.replace("{bad}", bad) for x in items]


def _one_error_line(err: str, prefix: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):  # pragma: no cover - reached only when validation let a bad job through
        raise AssertionError(f"a process was started: {a}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("name,argv,expect", PLAN + CKPT, ids=_ids(PLAN + CKPT))
def test_plan_and_ckpt_bad_input_is_one_line_exit_2(name, argv, expect, bad, capsys, no_launch):
    argv = _fmt(argv, bad)
    code = main(argv)
    out, err = capsys.readouterr()
    cmd = " ".join(argv[:2]) if argv[0] == "ckpt" and argv[1] in ("inspect", "consolidate") else argv[0]
    line = _one_error_line(err, f"megashard {cmd}: error: ")
    assert code == 2 and out == ""
    assert expect.replace("{bad}", bad) in line


@pytest.mark.parametrize("name,overrides,expect", RUN, ids=_ids(RUN))
def test_run_bad_input_is_one_line_exit_2_before_any_process(name, overrides, expect, bad, tmp_path, capsys, no_launch):
    if name in ("device-cuda", "backend-nccl") and _has_cuda():
        pytest.skip("this machine has CUDA")
    overrides = _fmt(overrides, bad)
    if not any(o.startswith("train.out_dir=") for o in overrides):
        overrides.append(f"train.out_dir={tmp_path}/out")
    code = main(["run", DEFAULT, *overrides])
    out, err = capsys.readouterr()
    line = _one_error_line(err, "megashard run: error: ")
    assert code == 2 and out == ""
    assert expect.replace("{bad}", bad) in line
    assert not (tmp_path / "out").exists()  # nothing written: no config.yaml for workers
    assert not os.path.exists(os.path.join(bad, "a_file", "run"))


@pytest.mark.parametrize("name,config,expect", RUN_CONFIGS, ids=_ids(RUN_CONFIGS))
def test_run_bad_config_file_is_one_line_exit_2(name, config, expect, bad, capsys, no_launch):
    code = main(["run", config.replace("{bad}", bad), "--dry-run"])
    out, err = capsys.readouterr()
    line = _one_error_line(err, "megashard run: error: ")
    assert code == 2 and out == "" and expect in line


# ---------------------------------------------------------------------------------------------- Python API
def _layout():
    return RankLayout(ParallelConfig(tp=2), 8)


API = [
    ("size-zero", lambda b: ParallelConfig(tp=0), ConfigError, "tp=0 is not a valid size"),
    ("size-str", lambda b: ParallelConfig(tp="2"), ConfigError, "tp='2' must be an integer"),
    ("two-free", lambda b: ParallelConfig(tp=-1, pp=-1), ConfigError, "at most one size may be -1"),
    ("vpp-no-pp", lambda b: ParallelConfig(vpp=2), ConfigError, "vpp=2 needs pipeline parallelism"),
    ("nccl-cpu", lambda b: ParallelConfig(backend="nccl", device="cpu"), ConfigError, "backend='nccl' runs on CUDA"),
    ("order", lambda b: ParallelConfig(order="tp-ddp"), ConfigError, "unknown token(s) 'ddp' (did you mean 'dp'?)"),
    ("timeout-inf", lambda b: ParallelConfig(timeout=float("inf")), ConfigError, "timeout=inf must be a positive"),
    ("device", lambda b: ParallelConfig(device="tpu"), ConfigError, "device='tpu' is not supported"),
    ("unknown-key", lambda b: ParallelConfig.from_dict({"tpp": 2}), ConfigError, "'parallel.tpp' (did you mean"),
    ("world-too-big", lambda b: ParallelConfig().resolve(2**30), ConfigError, "world size 1,073,741,824 is larger"),
    ("world-not-divisible", lambda b: ParallelConfig(tp=3).resolve(4), ConfigError, "world size 4 is not divisible"),
    ("yaml-section-typo", lambda b: ParallelConfig.from_yaml(f"{b}/typo.yaml"), ConfigError,
     "no 'parallel' section; unknown section(s) 'paralel' (did you mean 'parallel'?)"),
    ("yaml-dup", lambda b: ParallelConfig.from_yaml(f"{b}/dup.yaml"), ConfigError, "duplicate key 'tp'"),
    ("job-not-utf8", lambda b: __import__("megashard.train.config", fromlist=["JobConfig"]).JobConfig.from_yaml(
        f"{b}/latin1.yaml"), ConfigError, "is not UTF-8 text"),
    ("layout-world", lambda b: RankLayout(ParallelConfig(tp=2), 3), ConfigError, "world size 3 is not divisible"),
    ("layout-rank", lambda b: _layout().group_of("tp", 99), ConfigError, "rank 99 is outside the world of 8"),
    ("layout-name", lambda b: _layout().members("tpp", 0), ConfigError, "unknown group 'tpp' (did you mean 'tp'?)"),
    ("locality-G", lambda b: __import__("megashard.layout", fromlist=["locality"]).locality(_layout(), 0), ConfigError,
     "ranks_per_node=0 must be a positive integer"),
    ("svg-max", lambda b: __import__("megashard.layout.plan_svg", fromlist=["render_svg"]).render_svg(_layout(), max_ranks=0),
     ConfigError, "max_ranks=0 must be in 1..16,384"),
    ("init-both", lambda b: megashard.initialize(ParallelConfig(), tp=2), ConfigError, "pass either a ParallelConfig"),
    ("state-before-init", lambda b: megashard.get_parallel_state(), StateError, "call megashard.initialize(config)"),
    ("ckpt-missing", lambda b: __import__("megashard.checkpoint.consolidate", fromlist=["x"]).inspect_checkpoint(
        f"{b}/nothing"), CheckpointError, "nothing"),
]


@pytest.mark.parametrize("name,call,error,expect", API, ids=_ids(API))
def test_python_api_bad_input_raises_megashard_error(name, call, error, expect, bad):
    with pytest.raises(error) as e:
        call(bad)
    assert isinstance(e.value, MegashardError)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_initialize_outside_a_launcher_says_what_is_missing(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another module left a default group behind
        pytest.skip("a default process group is initialised in this process")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StateError) as e:
        megashard.initialize(ParallelConfig())
    msg = str(e.value)
    assert "RANK, MASTER_ADDR, MASTER_PORT are not set" in msg and "WORLD_SIZE" not in msg.split("not set")[0]
    assert "torchrun" in msg and "megashard run" in msg and "init_process_group" in msg
    assert not megashard.is_initialized() and not dist.is_initialized()


def test_initialize_with_cuda_on_a_cpu_machine(monkeypatch):
    import torch.distributed as dist

    if _has_cuda() or dist.is_initialized():
        pytest.skip("this machine has CUDA (or a default group is up)")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never contacted: the check comes first
    with pytest.raises(ConfigError, match=r"^device=cuda, but this machine has no usable CUDA device"):
        megashard.initialize(ParallelConfig(device="cuda"))
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- end to end
def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megashard", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_real_processes_one_line_exit_2(bad, tmp_path):
    """The contract seen from a shell: exit status 2, one stderr line, nothing on stdout, nothing written."""
    cases = [
        (["plan", f"{bad}/dup.yaml", "-w", "4"], "megashard plan: error: ", "duplicate key 'tp'"),
        (["plan", DEFAULT, "-w", str(2**40)], "megashard plan: error: ", "--world-size 1099511627776"),
        (["run", DEFAULT, f"checkpoint.dir={bad}/a_file", f"train.out_dir={tmp_path}/out"], "megashard run: error: ",
         "checkpoint.dir="),
        (["ckpt", "inspect", f"{bad}/empty"], "megashard ckpt inspect: error: ", "no complete checkpoint"),
    ]
    for argv, prefix, expect in cases:
        p = _cli(*argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert p.stdout == "", argv
        assert expect in _one_error_line(p.stderr, prefix), argv
    assert not (tmp_path / "out").exists()


def test_no_numpy_warning_from_the_cli_and_the_workers(tmp_path):
    """torch warns "Failed to initialize NumPy" at import when numpy is missing: hidden in megashard's entry
    points and, through PYTHONWARNINGS, in torchrun and every worker (also when the user sets filters)."""
    from megashard.launch.launcher import plan_launch

    fake = tmp_path / "nonumpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), ROOT])}
    env.pop("PYTHONWARNINGS", None)
    raw = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=300)
    assert "Failed to initialize NumPy" in raw.stderr  # the warning really happens without the filter
    p = _cli("ckpt", "inspect", str(tmp_path), env=env)  # imports torch
    assert p.returncode == 2 and "NumPy" not in p.stderr, p.stderr
    for user in (None, "default"):
        base = dict(env) if user is None else {**env, "PYTHONWARNINGS": user}
        child = {**base, **plan_launch(DEFAULT, [], env=base).env}
        w = subprocess.run([sys.executable, "-c", "import torch, warnings; warnings.warn('still shown')"],
                           capture_output=True, text=True, env=child, timeout=300)
        assert "NumPy" not in w.stderr and "still shown" in w.stderr, w.stderr  # other warnings still show
