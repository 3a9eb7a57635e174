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
                          "--ranks-per-node", "8", "--top", "3", "--svg", str(svg), "--trace", "0")
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:3] == ["#", "tp", "cp"])
    assert [l.split()[0] for l in lines[head + 1: head + 4]] == ["1", "2", "3"]
    assert "#1 as overrides: parallel.tp=" in out and "refused by the job's rules" in out
    assert svg.read_text().startswith("<svg") and "wrote" in err
    code, out, _ = _run(capsys, DEFAULT, "--suggest", "-w", "16", "--device-memory", "80GB", "--format", "json",
                        "--trace", "0")
    d = json.loads(out)
    assert d["device_memory"] == 80 * 10**9 and len(d["top"]) == min(10, d["fit"])
    assert d["considered"] == d["fit"] + d["too_large"] + d["refused"] == len(d["refused_layouts"]) + d["fit"]
    top = d["top"][0]
    assert set(top["step"]["bytes_by_axis"]) == {"tp", "cp", "dp", "dp_outer", "ep", "expt_tp", "pp"}
    assert top["memory"]["peak_bytes"] == sum(v for v in top["memory"]["parts"].values())
    assert top["memory"]["source"] == "modelled" and top["host_memory"]["peak_bytes"] > 0


def test_cli_without_config_uses_overrides(capsys):
    code, out, err = _run(capsys, "--suggest", "-w", "8", "--device-memory", "24GiB", "model.hidden=256",
                          "model.layers=4", "model.heads=8", "--trace", "0")
    assert code == 0, err
    assert "(defaults) model.hidden=256" in out


@pytest.mark.parametrize("argv,message", [
    (["--suggest", "-w", "8", "--device-memory", "80 parsecs"], "--device-memory '80 parsecs': give a size such as 80GiB"),
    (["--suggest", "-w", "8", "parallel.device=cuda"], "--suggest needs --device-memory SIZE here: the job runs on cuda"),
    (["--suggest", "--trace", "-1"], "--trace -1: must be in 0..64"),
    (["-w", "8", "--trace", "3"], "--trace only applies with --suggest"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--tp", "2"], "--tp 2: --suggest chooses the parallel sizes"),
    (["-w", "8", "--device-memory", "80GiB"], "--device-memory only applies with --suggest"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--mfu", "2"], "--mfu 2.0: must be in (0, 1]"),
    (["--suggest", "-w", "8", "--device-memory", "80GiB", "--top", "0"], "--top 0: must be a positive integer"),
])
def test_cli_errors_are_one_line(capsys, argv, message, monkeypatch):
    import megashard.advisor.machine as machine

    monkeypatch.setattr(machine, "_cuda_count", lambda: 0)  # "no GPU here", also on a machine with one
    code, out, err = _run(capsys, DEFAULT, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_nothing_fits(capsys):
    code, out, err = _run(capsys, DEFAULT, "--suggest", "-w", "4", "--device-memory", "1MiB", "--trace", "0")
    assert code == 1 and "no valid layout fits" in out and "too large" in out and "needs " in out


# ---------------------------------------------------------------------------------------------- the config and machine
def test_suggest_without_flags_reads_the_config_and_models_a_cpu_job(capsys):
    """`plan configs/default.yaml --suggest`: world size, ranks per node, device and memory from the config and this
    machine; a CPU job is modelled as one (no H100, no 0.0 ms rows), the dtype as configured."""
    from megashard.advisor.machine import host_ram

    code, out, err = _run(capsys, DEFAULT, "--suggest", "--trace", "0", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["world_size"] == 4 and d["ranks_per_node"] == 4 and d["hardware"]["device"] == "cpu"
    assert d["device_memory"] == host_ram() // 4 and d["dtype"] == "float32"
    assert all(t["step"]["seconds"] > 1e-3 for t in d["top"])  # CPU milliseconds, not an H100's microseconds
    assert any("world size 4 from the config" in n for n in d["notes"])
    code, out, err = _run(capsys, DEFAULT, "--suggest", "--trace", "0", "train.dtype=bfloat16")
    assert code == 0, err
    head = out.splitlines()[1]
    assert head.startswith("assumed: CPU") and "bfloat16" in head and "fp32 ×" not in head


def test_cpu_model_ranks_the_replicated_layout_first_and_calibration_picks_layouts_that_differ():
    """On 4 CPU ranks the measured order (docs/advisor.md): HSDP over 4 replicas without recompute and one
    microbatch is the fastest (no all-gather waits, fewest block runs); recompute and microbatches cost time.
    --calibrate K picks one variant per set of sizes before any second variant."""
    from megashard.advisor.calibrate import pick_layouts
    from megashard.advisor.machine import cpu_hardware
    from megashard.advisor.search import suggest
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(DEFAULT)
    hw, _ = cpu_hardware(4, "float32", flops_per_core=40e9, cores=2)
    r = suggest(job, 4, 1 << 30, 4, hw)
    assert r.ranked[0].label() == "tp=1 cp=1 pp=1 dp_outer=4 dp_shard=1 recompute=off mb=1"
    by = {c.label(): c.cost.seconds for c in r.ranked}
    assert by["tp=1 cp=1 pp=1 dp_outer=4 dp_shard=1 recompute=on mb=1"] > by[r.ranked[0].label()]
    assert by["tp=1 cp=1 pp=1 dp_outer=4 dp_shard=1 recompute=off mb=4"] > by[r.ranked[0].label()]
    assert by["tp=1 cp=1 pp=1 dp_outer=1 dp_shard=4 recompute=off mb=1"] > by[r.ranked[0].label()]
    picked = pick_layouts(r.ranked, 5)
    keys = [tuple(c.sizes[a] for a in ("tp", "cp", "pp", "vpp", "dp_outer", "dp_shard")) for c in picked]
    assert len(set(keys)) == 5 and picked[0] is r.ranked[0]
    assert len(pick_layouts(r.ranked[:3], 5)) == 3


def test_kendall_tau_and_noise_notes():
    from megashard.advisor.calibrate import Timing, kendall_tau, noise_notes

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1], [2]) is None

    class C:
        def __init__(self, label):
            self._l = label

        def label(self):
            return self._l

    a, b, c = C("a"), C("b"), C("c")
    ts = [Timing("a", [], 0.100, rounds=[0.098, 0.104]), Timing("b", [], 0.103, rounds=[0.100, 0.106]),
          Timing("c", [], 0.200, rounds=[0.199, 0.201])]
    notes = noise_notes([a, b, c], ts)
    assert len(notes) == 1 and notes[0].startswith("a and b: +3.0% apart, within the noise")


def test_schedule_orders_are_pytorchs():
    """advisor/schedule.py restates PyTorch's interleaved 1F1B and ZBV orders (which microbatches are alive when; ZBV's
    weight backwards too):
    compared with PyTorch's own ``_calculate_single_rank_operations`` for many sizes."""
    from megashard.advisor.schedule import rank_actions

    S = pytest.importorskip("torch.distributed.pipelining.schedules")

    class Fake:
        pass

    def torch_order(cls, pp, vpp, mb, r):
        o = Fake()
        o.pp_group_size, o.n_local_stages, o._n_microbatches, o.num_stages = pp, vpp, mb, pp * vpp
        o.number_of_rounds = max(1, mb // pp)
        o.microbatches_per_round = mb // o.number_of_rounds
        o._stages = [None] * vpp
        out = []
        for a in cls._calculate_single_rank_operations(o, r):
            if a is None:
                continue
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B",
                    "BACKWARD_WEIGHT": "W"}.get(a.computation_type.name)
            if kind is None:
                continue
            if cls is S.ScheduleZBVZeroBubble:
                local = 0 if a.stage_index == r else 1
            else:
                local = a.stage_index // pp
            out.append((kind, local, a.microbatch_index))
        return out

    n = 0
    for pp in (2, 3, 4):
        for vpp in (2, 3):
            for mb in (pp, 2 * pp, 3 * pp, pp + 1):
                if mb % max(1, mb // pp):
                    continue
                for r in range(pp):
                    assert rank_actions("interleaved_1f1b", pp, vpp, mb, r) == torch_order(
                        S.ScheduleInterleaved1F1B, pp, vpp, mb, r), (pp, vpp, mb, r)
                    n += 1
        for mb in (pp, 2 * pp - 1, 2 * pp, 5):
            for r in range(pp):
                assert rank_actions("zbv", pp, 2, mb, r) == torch_order(S.ScheduleZBVZeroBubble, pp, 2, mb, r)
                n += 1
    assert n > 50


def test_host_memory_is_linear_in_vocab_times_branching():
    from megashard.advisor.host import RUNTIME, estimate_host
    from megashard.advisor.shape import JobShape

    s = JobShape(vocab=131072, seq=64, synthetic_sequences=4096)
    h = estimate_host(s, "cuda", 10 << 30)
    assert h.parts["data set-up"] == 131072 * 4 * 16 + 4096 * 4 * 16 and h.parts["tensors"] == 0
    assert h.peak == RUNTIME["cuda"] + 4096 * 65 * 4 + h.parts["data set-up"]  # int32 rows past 32,768 ids
    cpu = estimate_host(JobShape(synthetic_sequences=4096), "cpu", 6 << 20)  # vocab 1024: int16 rows
    assert cpu.parts["tensors"] == 6 << 20 and cpu.peak == RUNTIME["cpu"] + 4096 * 65 * 2 + (6 << 20)


def test_a_second_certify_traces_only_the_new_first_and_adds_to_the_time():
    """After ``--calibrate`` re-ranks the layouts, the measured #1 is traced if it was not: certify skips the layouts
    traced already (they count among its ``top``), notes nothing twice and adds its time to the same budget."""
    from megashard.advisor.trace import certify
    from megashard.config import yamlfile

    job, r = _suggest(4, 4 << 30)
    doc = yamlfile.load_yaml(DEFAULT)
    certify(r, doc, job.name, 2)
    assert [c.traced is not None for c in r.ranked[:3]] == [True, True, False]
    first, second, third = r.ranked[:3]
    seconds, notes, kept = r.trace_seconds, list(r.trace_notes), (first.traced, second.traced)
    r.ranked[:3] = [third, first, second]  # as a calibration that measured the third fastest would order them
    certify(r, doc, job.name, 1)
    assert third.traced is not None and third.traced.peak > 0
    assert (first.traced, second.traced) == kept and first.traced is kept[0]  # not traced again
    assert r.traced_count == 3 and r.trace_seconds > seconds and r.trace_notes == notes
