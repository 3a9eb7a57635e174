"""``megashard plan --suggest``: the memory model against what real jobs allocate, validity, the report, errors.

The accuracy check runs eight small jobs of the example model for two steps on four gloo ranks (dense data parallel,
tp, FSDP, pipeline 1F1B, interleaved pipeline, recompute, MoE with ep, Llama with tp·cp in bf16), counting the bytes of
live tensor storages with a TorchDispatchMode (tests/_live_bytes.py) for the whole run, and compares the largest
rank's peak with :func:`megashard.advisor.memory.estimate_memory` (within 15%). Parameter counts and the activations
one block saves are checked exactly in one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from megashard.cli import main
from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
ENV = "MEGASHARD_ADVISOR_TEST_DIR"
WORLD = 4
BASE = ["train.steps=2", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
        "train.plot=false", "train.resume=false", "model.dropout=0.0", "data.num_sequences=32",
        "model.vocab_size=512", "model.hidden=128", "model.layers=4", "model.heads=4", "train.global_batch=8",
        f"launch.nproc_per_node={WORLD}"]
#: name -> overrides; every job runs on 4 ranks.
JOBS = {
    "dense dp_outer=4": ["parallel.tp=1", "parallel.dp_outer=4", "parallel.dp_shard=1"],
    "tp=4": ["parallel.tp=4", "parallel.dp_shard=1"],
    "fsdp dp_shard=4": ["parallel.tp=1", "parallel.dp_shard=4"],
    "pp=2 1f1b mb=4": ["parallel.tp=1", "parallel.pp=2", "parallel.dp_shard=2", "train.microbatches=4"],
    "pp=2 vpp=2 interleaved": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=2",
                               "train.microbatches=4", "train.pipeline_schedule=interleaved_1f1b"],
    "tp=2 recompute": ["parallel.tp=2", "parallel.dp_shard=2", "model.recompute=true"],
    "moe ep=2 top2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "model.num_experts=4",
                      "model.moe_top_k=2", "model.ffn_hidden=256"],
    "llama tp=2 cp=2 bf16": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1", "model.arch=llama",
                             "train.dtype=bfloat16"],
}


def _job(name: str):
    from megashard.train.config import JobConfig

    out = os.environ.get(ENV, tempfile.gettempdir())
    return JobConfig.from_yaml(DEFAULT, BASE + [f"train.out_dir={out}/{name.replace(' ', '_')}"] + JOBS[name])


def check_measure_peaks(rank: int, world_size: int) -> None:
    from megashard.train.loop import train
    from tests._live_bytes import LiveBytes

    peaks = {}
    for name in JOBS:
        with LiveBytes() as live:
            train(_job(name))
        peaks[name] = live.peak
    with open(os.path.join(os.environ[ENV], f"peaks{rank}.json"), "w") as f:
        json.dump(peaks, f)


@pytest.fixture(scope="module")
def measured():
    with tempfile.TemporaryDirectory(prefix="megashard-advisor-") as tmp:
        os.environ[ENV] = tmp
        try:
            res = spawn_checks([check_measure_peaks], WORLD, timeout=600)
            res.assert_ok("check_measure_peaks")
            per_rank = [json.load(open(os.path.join(tmp, f"peaks{r}.json"))) for r in range(WORLD)]
        finally:
            os.environ.pop(ENV, None)
    return {name: max(p[name] for p in per_rank) for name in JOBS}


def _predict(name: str):
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape

    job = _job(name)
    sizes = job.parallel.resolve(WORLD)
    return estimate_memory(JobShape.from_job(job), sizes, job.model.recompute, job.model.distribute_saved_activations)


@pytest.mark.parametrize("name", list(JOBS))
def test_predicted_peak_within_15_percent(measured, name):
    est = _predict(name)
    real = measured[name]
    err = est.peak / real - 1
    print(f"{name:<26} predicted {est.peak / 2**20:8.3f} MiB  measured {real / 2**20:8.3f} MiB  {err:+.1%}  ({est.phase})")
    assert abs(err) <= 0.15, f"{name}: predicted {est.peak:,} B ({est.phase}), measured {real:,} B: {err:+.1%}"


# ---------------------------------------------------------------------------------------------- exact parts
@pytest.mark.parametrize("arch,tie,experts", [("gpt", False, 0), ("llama", True, 0), ("gpt", False, 4), ("llama", False, 4)])
def test_parameter_count_is_the_models(arch, tie, experts):
    import torch

    from megashard.advisor.shape import JobShape, block_params, numel, root_params
    from megashard.models.gpt.model import GPT
    from megashard.train.sections import ModelConfig

    cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64, tie_embeddings=tie,
                      num_experts=experts, moe_top_k=2)
    shape = JobShape(arch=arch, vocab=512, hidden=128, layers=4, heads=4, seq=64, tie=tie, num_experts=experts,
                     ffn=512 if arch == "gpt" else 384)
    moe = [i for i in range(4) if shape.is_moe(i)]
    model = GPT(cfg, moe_layers=moe, device="meta")
    real = sum(p.numel() for p in model.parameters())
    dense = sum(numel(block_params(shape, 1, shape.is_moe(i))[0]) + numel(block_params(shape, 1, shape.is_moe(i))[1])
                for i in range(4))
    assert dense + numel(root_params(shape, 1, True, True)) == real
    del torch


@pytest.mark.parametrize("arch,dtype", [("gpt", "float32"), ("llama", "float32"), ("llama", "bfloat16")])
def test_saved_activations_are_exact(arch, dtype):
    """What one process's forward keeps for backward (4 blocks, head, loss) against block_activation + head."""
    import torch

    from megashard.advisor.memory import block_activation, head_activation
    from megashard.advisor.shape import JobShape
    from megashard.models.gpt.model import GPT
    from megashard.train.sections import ModelConfig
    from tests._live_bytes import LiveBytes

    cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64)
    model = GPT(cfg, dtype=getattr(torch, dtype))
    x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    with LiveBytes() as live:
        live.adopt(list(model.parameters()) + [x, y])
        before = live.live
        loss = model(x, y)
        kept = live.live - before
    shape = JobShape(arch=arch, vocab=512, hidden=128, layers=4, heads=4, seq=64, ffn=512 if arch == "gpt" else 384,
                     dtype=dtype)
    t = 2 * 64
    predicted = 4 * block_activation(shape, t, 1, False) + head_activation(shape, t, 1)[0] + t * 8
    assert abs(predicted / kept - 1) < 0.01, (predicted, kept)
    del loss


# ---------------------------------------------------------------------------------------------- validity
def _suggest(world: int = 16, memory: int = 80 << 30, overrides=(), path: str = DEFAULT):
    from megashard.advisor.search import suggest
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(path, list(overrides))
    return job, suggest(job, world, memory, 8)


def test_every_suggestion_is_accepted_and_every_refusal_is_the_jobs_own_message():
    """The top suggestions and a sample of the rest pass JobConfig.validate (megashard run's checks) with their
    overrides; sampled refusals carry exactly validate's message."""
    from megashard.config import yamlfile
    from megashard.errors import ConfigError
    from megashard.train.config import JobConfig

    overrides = ["model.num_experts=4", "model.moe_top_k=2", "model.layers=4"]
    job, r = _suggest(16, 80 << 30, overrides)
    assert r.ranked and r.rejected and r.considered == len(r.ranked) + len(r.too_big) + len(r.rejected)
    doc = yamlfile.load_yaml(DEFAULT)

    def validate(c):
        return JobConfig.from_dict(yamlfile.apply_overrides(doc, overrides + c.overrides())).validate(16)

    step = max(1, len(r.ranked) // 30)
    for c in r.ranked[:10] + r.ranked[10::step]:
        assert validate(c) == c.resolved  # megashard run's checks pass, with the sizes the advisor sized
    for c, why in r.rejected[:: max(1, len(r.rejected) // 30)]:
        with pytest.raises(ConfigError) as e:
            validate(c)
        assert str(e.value) == why and "\n" not in why
    times = [c.cost.seconds for c in r.ranked]
    assert times == sorted(times)


def test_memory_limit_moves_layouts_to_too_large_with_a_reason():
    _, full = _suggest(8, 80 << 30, ["model.hidden=512", "model.layers=8", "model.heads=8", "train.global_batch=64"])
    peaks = sorted(c.memory.peak for c in full.ranked)
    limit = peaks[len(peaks) // 2]
    _, r = _suggest(8, limit, ["model.hidden=512", "model.layers=8", "model.heads=8", "train.global_batch=64"])
    assert all(c.memory.peak <= limit for c in r.ranked)
    assert r.too_big and all(c.memory.peak > limit for c in r.too_big)
    assert len(r.ranked) + len(r.too_big) == len(full.ranked)
    from megashard.advisor.report import too_big_reason

    assert too_big_reason(r.too_big[0], limit).startswith(f"needs {r.too_big[0].memory.peak / 2**30:.2f} GiB > ")


def test_recompute_and_sharding_change_memory_as_they_must():
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape
    from megashard.config import ParallelConfig

    s = JobShape(arch="llama", vocab=32000, seq=2048, hidden=2048, layers=16, heads=16, ffn=5632, global_batch=8,
                 dtype="bfloat16")
    one = ParallelConfig(dp_shard=-1).resolve(1)
    eight = ParallelConfig(dp_shard=-1).resolve(8)
    plain, rec = estimate_memory(s, one), estimate_memory(s, one, recompute=True)
    assert rec.parts["activations"] < plain.parts["activations"] / 4
    assert rec.activation_kept_per_block == 8 * 2048 * 2048 * 2  # the block input only: tokens · hidden · bf16
    assert rec.activation_per_block == plain.activation_per_block == plain.activation_kept_per_block
    fsdp = estimate_memory(s, eight)
    assert fsdp.parts["params"] * 8 == pytest.approx(plain.parts["params"], rel=1e-3)
    assert fsdp.parts["optimizer"] * 8 == pytest.approx(plain.parts["optimizer"], rel=1e-3)


def test_no_torch_import_for_thousands_of_layouts():
    code = ("import sys, time; from megashard.train.config import JobConfig; from megashard.advisor.search import suggest;"
            f"job = JobConfig.from_yaml({DEFAULT!r}, ['model.num_experts=8', 'model.layers=8']);"
            "t = time.perf_counter(); r = suggest(job, 64, 80 << 30, 8); dt = time.perf_counter() - t;"
            "print(r.considered, dt, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True).stdout.split()
    assert int(out[0]) > 1000 and out[2] == "False"


# ---------------------------------------------------------------------------------------------- CLI
def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table_json_and_svg(capsys, tmp_path):
    svg = tmp_path / "best.svg"
    code, out, err = _run(capsys, DEFAULT, "--suggest", "--world-size", "16", "--device-memory", "80GiB",
                          "--ranks-per-node", "8", "--top", "3", "--svg", str(svg))
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:3] == ["#", "tp", "cp"])
    assert [l.split()[0] for l in lines[head + 1: head + 4]] == ["1", "2", "3"]
    assert "#1 as overrides: parallel.tp=" in out and "refused by the job's rules" in out
    assert svg.read_text().startswith("<svg") and "wrote" in err
    code, out, _ = _run(capsys, DEFAULT, "--suggest", "-w", "16", "--device-memory", "80GB", "--format", "json")
    d = json.loads(out)
    assert d["device_memory"] == 80 * 10**9 and len(d["top"]) == min(10, d["fit"])
    assert d["considered"] == d["fit"] + d["too_large"] + d["refused"] == len(d["refused_layouts"]) + d["fit"]
    top = d["top"][0]
    assert set(top["step"]["bytes_by_axis"]) == {"tp", "cp", "dp", "dp_outer", "ep", "expt_tp", "pp"}
    assert top["memory"]["peak_bytes"] == sum(v for v in top["memory"]["parts"].values())


def test_cli_without_config_uses_overrides(capsys):
    code, out, err = _run(capsys, "--suggest", "-w", "8", "--device-memory", "24GiB", "model.hidden=256",
                          "model.layers=4", "model.heads=8")
    assert code == 0, err
    assert "(defaults) model.hidden=256" in out


@pytest.mark.parametrize("argv,message", [
    (["--suggest", "-w", "8", "--device-memory", "80 parsecs"], "--device-memory '80 parsecs': give a size such as 80GiB"),
    (["--suggest", "-w", "8"], "--suggest needs --device-memory SIZE"),
    (["--suggest", "--device-memory", "80GiB"], "--suggest needs --world-size N"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--tp", "2"], "--tp 2: --suggest chooses the parallel sizes"),
    (["-w", "8", "--device-memory", "80GiB"], "--device-memory only applies with --suggest"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--mfu", "2"], "--mfu 2.0: must be in (0, 1]"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--top", "0"], "--top 0: must be a positive integer"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    code, out, err = _run(capsys, DEFAULT, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_nothing_fits(capsys):
    code, out, err = _run(capsys, DEFAULT, "--suggest", "-w", "4", "--device-memory", "1MiB")
    assert code == 1 and "no valid layout fits" in out and "too large" in out and "needs " in out
