"""``megashard plan --suggest``: validity of every suggestion, the memory limit, the report, CLI errors.

The memory model against measured jobs: tests/test_advisor_memory.py; inputs: tests/test_advisor_inputs.py;
calibration: tests/test_advisor_calibrate.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megashard.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


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
