"""The job config, the launcher's command line (single node, multi-node, Slurm), data, schedule, progress, metrics.

No processes are started here: everything is arithmetic on configs and strings.
"""
from __future__ import annotations

import glob
import io
import json
import os
import sys

import pytest
import torch

from megashard.errors import ConfigError, MegashardError
from megashard.train.config import JobConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")

#: Every shipped config and the layout it is meant for: (world size, tp, cp, dp_outer, dp_shard, ep, expt_dp).
EXPECTED = {
    "default": (4, 2, 1, 1, 2, 1, 4),
    "tp-only": (4, 4, 1, 1, 1, 1, 4),
    "fsdp-only": (4, 1, 1, 1, 4, 1, 4),
    "hsdp": (4, 1, 1, 2, 2, 1, 4),
    "moe-ep": (4, 1, 1, 1, 4, 2, 2),
    "gpu-tp-fsdp-cp": (16, 4, 2, 1, 2, 1, 16),
    "text": (4, 2, 1, 1, 2, 1, 4),
    "pp": (4, 2, 1, 1, 1, 1, 2),
    "pp-interleaved": (4, 2, 1, 1, 1, 1, 2),
    "moe-folding": (8, 2, 1, 1, 4, 4, 2),
    "gpu-5d": (32, 2, 2, 2, 2, 4, 4),
}


def job(*overrides: str, path: str = DEFAULT) -> JobConfig:
    return JobConfig.from_yaml(path, list(overrides))


# ---------------------------------------------------------------------------------------------- shipped configs
def test_every_shipped_config_is_listed():
    assert sorted(os.path.splitext(os.path.basename(p))[0] for p in CONFIGS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_config_parses_and_resolves_for_its_world_size(path):
    from megashard.cli.plan import load_config

    name = os.path.splitext(os.path.basename(path))[0]
    j = job(path=path)
    s = j.validate()
    assert (s.world_size, s.tp, s.cp, s.dp_outer, s.dp_shard, s.ep, s.expt_dp) == EXPECTED[name]
    assert j.name == name and j.out_dir == f"runs/{name}"
    # `megashard plan` reads the same file and gets the same layout.
    pconf, world = load_config(path)
    assert world == s.world_size and pconf.resolve(world) == s
    # The resolved config a run writes for its workers parses back to the same job.
    again = JobConfig.from_dict(j.to_dict(), name=name)
    assert again == j


def test_moe_config_really_has_experts():
    j = job(path=os.path.join(ROOT, "configs", "moe-ep.yaml"))
    assert j.model.num_experts == 4 and j.moe_layers() == [1]


def test_gpu_config_is_the_larger_cuda_run():
    j = job(path=os.path.join(ROOT, "configs", "gpu-tp-fsdp-cp.yaml"))
    assert j.parallel.device == "cuda" and j.train.dtype == "bfloat16" and j.model.recompute
    assert j.model.vocab_size % 4 == 0 and j.model.seq_len % 2 == 0


def test_gpu_5d_config_uses_every_dimension(capsys):
    """configs/gpu-5d.yaml: every axis > 1, validated for its 32 ranks; plan shows its stages and experts; the
    launch command is built from Slurm's variables (the run itself needs 4 nodes of GPUs)."""
    from megashard import cli
    from megashard.launch.launcher import plan_launch

    path = os.path.join(ROOT, "configs", "gpu-5d.yaml")
    j = job(path=path)
    s = j.validate()
    assert min(s.tp, s.cp, s.pp, s.vpp, s.dp_outer, s.dp_shard, s.ep, s.expt_dp) > 1 and s.world_size == 32
    assert j.train.pipeline_schedule == "interleaved_1f1b" and j.model.num_experts % s.ep == 0
    assert cli.main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert "stage 0   pp rank 0   virtual 0  blocks 0-5 + embeddings" in out
    assert "stage 2   pp rank 0   virtual 1  blocks 12-17" in out
    assert "stage 3   pp rank 1   virtual 1  blocks 18-23 + head + loss" in out
    assert "ep rank 3   experts 12, 13, 14, 15" in out
    env = dict(SLURM, SLURM_NNODES="4", SLURM_JOB_NODELIST="gpu[07-10]")
    c = plan_launch(path, [], env=env).command
    assert c[c.index("--nnodes") + 1] == "4" and c[c.index("--nproc-per-node") + 1] == "8"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA devices (the preflight checks them)")
def test_gpu_5d_dry_run_on_a_gpu_machine(capsys):  # pragma: no cover - CUDA only
    from megashard import cli

    path = os.path.join(ROOT, "configs", "gpu-5d.yaml")
    assert cli.main(["run", path, "--dry-run", "launch.rdzv_endpoint=node0:29500"]) == 0
    assert "pp=2, dp_outer=2, dp_shard=2, ep=4, expt_dp=4, vpp=2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("overrides,message", [
    (["model.vocab_size=255"], "model.vocab_size=255 must divide by parallel.tp=2 (each TP rank holds vocab/tp rows); pad it to 256"),
    (["model.heads=3", "model.hidden=66"], "model.heads=3 must divide by parallel.tp=2; valid tp: 1, 3"),
    (["train.global_batch=6", "parallel.tp=1", "parallel.dp_shard=4"],
     "train.global_batch=6 must divide by the data-parallel size dp=4 (dp_outer=1 × dp_shard=4); valid dp: 1, 2, 3, 6"),
    (["parallel.cp=2", "parallel.tp=1", "model.seq_len=63"], "model.seq_len=63 must divide by parallel.cp=2"),
    (["parallel.pp=2", "parallel.tp=1", "train.microbatches=1"], "train.microbatches=1: 1f1b needs at least pp=2"),
    (["parallel.ep=2"], "parallel.ep=2 needs experts: set model.num_experts"),
    (["model.num_experts=3", "parallel.ep=2", "parallel.tp=1", "parallel.dp_shard=4"], "model.num_experts=3 must divide by parallel.ep=2"),
    (["model.num_experts=4", "parallel.tp=1", "parallel.expt_tp=4", "model.ffn_hidden=130"],
     "model.ffn_hidden=130 (per expert) must divide by parallel.expt_tp=4"),
    (["model.dropout=1.0"], "model.dropout=1.0 must be in [0, 1)"),
    (["train.dtype=float16"], "train.dtype='float16' is not supported; valid: float32, float64, bfloat16"),
    (["optim.min_lr=1.0"], "optim.min_lr=1.0 must be in [0, optim.lr=0.003]"),
    (["model.distribute_saved_activations=true"], "needs model.recompute=true"),
    (["train.fail_at_step=3", "train.fail_rank=4"], "train.fail_rank=4 is not a rank of the world of 4"),
    (["data.source=text"], "data.source=text needs data.path to be an existing file, got None"),
    (["parallel.tp=3"], "world size 4 is not divisible by tp=3"),
    (["parallel.dp_shard=4"], "= 8 must equal the world size 4; to let FSDP take the rest, set dp_shard=-1"),
    (["launch.nproc_per_node=0"], "launch.nproc_per_node=0 must be a positive integer"),
])
def test_invalid_jobs_name_the_rule(overrides, message):
    with pytest.raises(ConfigError) as e:
        job(*overrides).validate()
    assert message in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["model.head=3"], "'model.head' (did you mean 'model.heads'?)"),
    (["trian.steps=3"], "'trian' (did you mean 'train'?)"),
    (["train.steps=2.5"], "train.steps=2.5 must be an integer"),
    (["train.plot=yes please"], "train.plot='yes please' must be true or false"),
    (["optim.lr=fast"], "optim.lr='fast' must be a number"),
    (["model.layers=null"], "model.layers=null is not allowed"),
    (["model=3"], "section 'model' must be a mapping"),
])
def test_bad_keys_and_types_are_rejected_while_parsing(overrides, message):
    with pytest.raises(ConfigError) as e:
        job(*overrides)
    assert message in str(e.value)


def test_scientific_notation_without_a_dot_is_a_float():
    j = job("optim.lr=1e-3", "optim.min_lr=1e-4", "optim.eps=1e-10")
    assert (j.optim.lr, j.optim.min_lr, j.optim.eps) == (1e-3, 1e-4, 1e-10)


# ---------------------------------------------------------------------------------------------- launcher
def test_single_node_command_is_torchrun_standalone():
    from megashard.launch.launcher import plan_launch

    p = plan_launch(DEFAULT, ["train.steps=3"], env={})
    assert p.command == [
        sys.executable, "-m", "megashard.launch.agent", "--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
        "--monitor-interval", "0.5", "-m", "megashard.launch.worker", "runs/default/config.yaml", "--name", "default",
    ]
    assert p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and p.env["OMP_NUM_THREADS"] >= "1"
    assert p.env["PYTHONWARNINGS"] == "ignore:Failed to initialize NumPy"
    user_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "OMP_NUM_THREADS": "3", "PYTHONWARNINGS": "default"}
    # The user's own settings win; only the NumPy message is added to their warning filters.
    assert plan_launch(DEFAULT, [], env=user_env).env == {"PYTHONWARNINGS": "default,ignore:Failed to initialize NumPy"}


def test_multi_node_needs_an_endpoint_and_passes_rendezvous_options():
    from megashard.launch.launcher import plan_launch

    with pytest.raises(ConfigError, match="launch.nnodes=2 needs launch.rdzv_endpoint"):
        plan_launch(DEFAULT, ["launch.nnodes=2", "parallel.dp_shard=4"], env={})
    p = plan_launch(DEFAULT, ["launch.nnodes=2", "parallel.dp_shard=4", "launch.rdzv_endpoint=n0:29400",
                              "launch.max_restarts=3"], env={})
    c = p.command
    assert "--standalone" not in c
    assert c[c.index("--nnodes") + 1] == "2" and c[c.index("--rdzv-endpoint") + 1] == "n0:29400"
    assert c[c.index("--rdzv-backend") + 1] == "c10d" and c[c.index("--rdzv-id") + 1] == "megashard-default"
    assert c[c.index("--max-restarts") + 1] == "3" and "--node-rank" not in c


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_STEP_ID": "0"}


def test_slurm_variables_fill_nodes_and_rendezvous():
    from megashard.launch.launcher import plan_launch

    gpu = os.path.join(ROOT, "configs", "gpu-tp-fsdp-cp.yaml")
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        plan_launch(gpu, [], env={})
    p = plan_launch(gpu, [], env=SLURM)
    c = p.command
    assert c[c.index("--nnodes") + 1] == "2" and c[c.index("--nproc-per-node") + 1] == "8"
    assert c[c.index("--rdzv-endpoint") + 1] == "gpu07:29500" and c[c.index("--rdzv-id") + 1] == "slurm-4242"
    assert p.job.launch.node_rank == 1 and "OMP_NUM_THREADS" not in p.env  # CUDA job: no CPU thread split
    # Command-line values win over Slurm's; launch.slurm=false ignores Slurm.
    p = plan_launch(DEFAULT, ["launch.nnodes=1"], env=SLURM)
    assert "--standalone" in p.command and p.job.launch.nnodes == 1 and p.job.launch.node_rank is None
    assert "--standalone" in plan_launch(DEFAULT, ["launch.slurm=false"], env=SLURM).command
    with pytest.raises(ConfigError, match="SLURM_JOB_ID is not set"):
        plan_launch(DEFAULT, ["launch.slurm=true"], env={})


def test_slurm_without_job_step_warns():
    from megashard.launch.launcher import plan_launch

    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    notes = plan_launch(DEFAULT, ["parallel.dp_shard=4"], env=env).notes
    assert any("srun --ntasks-per-node=1" in n for n in notes)


@pytest.mark.parametrize("nodelist,first", [
    ("node1", "node1"), ("gpu[003-005,9],cpu1", "gpu003"), ("a1,b[1-2]", "a1"), ("rack[2]-n[1-4]", "rack2-n[1-4]"),
    ("x[10,2]", "x10"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    from megashard.launch.launcher import first_host

    assert first_host(nodelist) == first


def test_cli_dry_run_prints_the_command(capsys):
    from megashard import cli

    assert cli.main(["run", DEFAULT, "train.steps=3", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("-m megashard.launch.worker runs/default/config.yaml --name default")
    assert "megashard.launch.agent --standalone --nproc-per-node 4" in out
    assert "4 processes (1 node(s) × 4), tp=2, dp_shard=2, 3 steps" in err


# ---------------------------------------------------------------------------------------------- data
def test_batches_are_a_function_of_the_step_and_split_by_dp_and_cp():
    from megashard.train.data import Batches

    j = job("data.num_sequences=40")
    full = Batches(j.data, j.model, 16, seed=7)
    x, y = full.batch(3)
    assert x.shape == (16, 64) and torch.equal(x[:, 1:], y[:, :-1])
    parts = [Batches(j.data, j.model, 16, seed=7, dp_rank=r, dp_size=4, cp_rank=c, cp_size=2).batch(3)
             for r in range(4) for c in range(2)]
    xs = torch.cat([torch.cat([parts[2 * r][0], parts[2 * r + 1][0]], dim=1) for r in range(4)])
    ys = torch.cat([torch.cat([parts[2 * r][1], parts[2 * r + 1][1]], dim=1) for r in range(4)])
    assert torch.equal(xs, x) and torch.equal(ys, y)
    # Steps 2 and 3 straddle the epoch boundary at sample 40; every sample of an epoch is used once.
    rows = sum((full.sample_indices(s) for s in range(40 // 16 + 1)), [])[:40]
    assert sorted(rows) == list(range(40))
    assert not torch.equal(Batches(j.data, j.model, 16, seed=8).batch(3)[0], x)


def test_synthetic_data_is_learnable_markov_chain():
    from megashard.train.data import synthetic_sequences

    seqs = synthetic_sequences(64, 33, vocab=256, branching=4, seed=1)
    assert torch.equal(seqs, synthetic_sequences(64, 33, vocab=256, branching=4, seed=1))
    successors = {}
    for a, b in zip(seqs[:, :-1].flatten().tolist(), seqs[:, 1:].flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert max(len(v) for v in successors.values()) <= 4


def test_text_source_reads_byte_windows_from_the_mapped_file(tmp_path):
    from megashard.train.data import Batches

    p = tmp_path / "t.txt"
    p.write_bytes(bytes(range(200)))
    j = job("data.source=text", f"data.path={p}", "model.seq_len=64")
    b = Batches(j.data, j.model, 3, seed=0)
    assert b.samples.sources[0].num_windows == 3  # (200 - 1) // 64 windows of 65 bytes, sharing boundary bytes
    x, y = b.batch(0)
    starts = sorted(x[:, 0].tolist())
    assert starts == [0, 64, 128] and torch.equal(x[:, 1:], y[:, :-1])
    assert all(row.tolist() == list(range(row[0], row[0] + 64)) for row in x)


def test_data_config_errors(tmp_path):
    from megashard.errors import ConfigError

    for overrides, message in [
        (["data.source=indexed"], "needs data.path (one dataset) or data.blend"),
        (["data.source=indexed", "data.blend=[[0.5, a], [0, b]]"], "got the entry [0, 'b']"),
        (["data.source=indexed", "data.blend=[a, b]"], "must be a non-empty list of [weight, path] pairs"),
        (["data.source=indexed", f"data.path={tmp_path}/none"], "none: no such dataset: neither"),
        (["data.source=indexed", "data.path=x", "data.prepare_inputs=a.txt"], "data.prepare_inputs must be a non-empty list"),
        (["train.eval_interval=10"], "train.eval_interval=10 needs validation data: set data.valid_fraction > 0"),
        (["data.valid_fraction=1.0"], "data.valid_fraction=1.0 must be in [0, 1)"),
        (["model.arch=bert"], "model.arch='bert' is not supported; valid: gpt, llama"),
        (["model.arch=llama", "model.hidden=60", "model.heads=4"], "head size hidden/heads=60/4 must be even"),
    ]:
        with pytest.raises(MegashardError) as e:
            job(*overrides).validate()
        assert message in str(e.value), (overrides, str(e.value))


# ---------------------------------------------------------------------------------------------- schedule, progress, metrics
def test_learning_rate_schedule():
    from megashard.train.loop import lr_at

    j = job("train.steps=120", "optim.warmup_steps=20", "optim.lr=1.0", "optim.min_lr=0.1")
    assert lr_at(0, j) == pytest.approx(0.05) and lr_at(19, j) == pytest.approx(1.0)
    assert lr_at(70, j) == pytest.approx(0.55) and lr_at(120, j) == pytest.approx(0.1)
    assert lr_at(70, job("train.steps=120", "optim.warmup_steps=20", "optim.lr=1.0", "optim.min_lr=0.1",
                         "optim.schedule=linear")) == pytest.approx(0.55)
    assert lr_at(99, job("optim.schedule=constant")) == pytest.approx(3e-3)


def test_progress_bar_text():
    from megashard.progress import ProgressBar, format_duration, format_rate

    assert format_duration(3725.2) == "1:02:05" and format_duration(65) == "1:05"
    assert format_rate(12345.0) == "12.3k" and format_rate(999) == "999" and format_rate(2.5e6) == "2.5M"
    bar = ProgressBar(200, 0, stream=io.StringIO(), width=10)
    assert bar.render(50, 3.14159, 12345.0, 30.0) == \
        "step  50/200 [##........] loss 3.1416 | 12.3k tok/s | 0:30 elapsed, 1:30 left"


def test_progress_lines_when_not_a_terminal():
    from megashard.progress import ProgressBar

    out = io.StringIO()
    bar = ProgressBar(25, 5, stream=out, log_interval=10)
    for step in range(6, 26):
        bar.update(step, 1.0, 100.0)
    bar.close()
    steps = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()]
    assert steps == [6, 15, 25]
    quiet = io.StringIO()
    ProgressBar(5, stream=quiet, enabled=False).update(5, 1.0, 1.0)
    assert quiet.getvalue() == ""


def test_metrics_file_is_truncated_to_the_resumed_step(tmp_path):
    from megashard.train.metrics import MetricsWriter, plot_loss, read_metrics

    path = str(tmp_path / "m" / "metrics.jsonl")
    w = MetricsWriter(path)
    for s in range(1, 8):
        w.write({"step": s, "loss": 10.0 - s})
    w.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # torn line of a killed run
    w = MetricsWriter(path, resume_step=4)
    w.write({"step": 5, "loss": 0.5})
    w.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 0.5)]
    assert read_metrics(str(tmp_path / "absent.jsonl")) == []
    note = plot_loss(read_metrics(path), str(tmp_path / "loss.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert note is not None and "pip install 'megashard[plot]'" in note
    else:
        assert note is None and os.path.getsize(tmp_path / "loss.png") > 1000
    json.dumps(read_metrics(path))  # plain JSON values
