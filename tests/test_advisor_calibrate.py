"""``megashard plan --suggest --calibrate`` / ``--calibration FILE``: layouts ranked by step times measured on this
machine (real ``megashard run``s), the report saying which numbers are measured and which modelled, and calibration
files that belong to one job and world (docs/advisor.md)."""
from __future__ import annotations

import json
import os
import time

import pytest

from megashard.cli import main
from megashard.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
TINY = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "train.global_batch=4",
        "data.num_sequences=64", "model.vocab_size=128"]


def _suggest(world=4, overrides=TINY):
    from megashard.advisor.search import suggest
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(DEFAULT, list(overrides))
    return job, suggest(job, world, "1GiB")


def _write(path, job, world, times):
    from megashard.advisor.calibrate import Timing, save_calibration
    from megashard.advisor.shape import JobShape

    timings = [Timing(c.label(), c.overrides(), s, [s] if s else [], None if s else "exit code 1") for c, s in times]
    save_calibration(str(path), timings, JobShape.from_job(job), world, "test", 5, 2, "cpu")


def test_measured_times_rank_first_and_the_report_says_so(tmp_path, capsys):
    """A file whose timings put the model's #3 first, #1 second, and #2's run failed: `--calibration FILE` ranks
    #3, #1 (measured), then #2 and the rest in the model's order, and says which numbers are measured."""
    job, r = _suggest()
    a, b, c = r.ranked[:3]
    cal = tmp_path / "cal.json"
    _write(cal, job, 4, [(a, 0.20), (b, None), (c, 0.10)])
    code = main(["plan", DEFAULT, *TINY, "--suggest", "-w", "4", "--device-memory", "1GiB", "--trace", "0", "--calibration", str(cal),
                 "--format", "json", "--top", "50"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    layouts = [t["layout"] for t in d["top"]]
    assert layouts[:2] == [c.label(), a.label()]
    assert layouts.index(b.label()) == 2  # failed: back in the model's order, after the measured ones
    assert [t["step"]["source"] for t in d["top"][:3]] == ["measured", "measured", "modelled"]
    assert d["top"][0]["step"]["measured_seconds"] == 0.10 and d["measured"] == 2
    code = main(["plan", DEFAULT, *TINY, "--suggest", "-w", "4", "--device-memory", "1GiB", "--trace", "0", "--calibration", str(cal)])
    out, _ = capsys.readouterr()
    assert "ranked by step time measured on this machine for 2 layout(s)" in out and "meas_ms" in out
    assert "calibration runs that failed" in out and "exit code 1" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("1 ", "2 ", "3 "))]
    assert rows[0][11] == "100.0" and rows[1][11] == "200.0" and rows[2][11] == "-"


def test_a_file_of_another_job_or_world_is_refused(tmp_path):
    from megashard.advisor.calibrate import load_calibration
    from megashard.advisor.shape import JobShape

    job, r = _suggest()
    cal = tmp_path / "cal.json"
    _write(cal, job, 4, [(r.ranked[0], 0.1)])
    with pytest.raises(ConfigError, match=r"measured for 4 ranks, not --world-size 8"):
        load_calibration(str(cal), JobShape.from_job(job), 8)
    other, _ = _suggest(overrides=[*TINY, "model.hidden=64"])
    with pytest.raises(ConfigError, match=r"measured for another job: hidden=32 \(this job: 64\)"):
        load_calibration(str(cal), JobShape.from_job(other), 4)
    assert len(load_calibration(str(cal), JobShape.from_job(job), 4)) == 1


def test_a_users_file_is_never_overwritten(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    code = main(["plan", DEFAULT, *TINY, "--suggest", "-w", "2", "--device-memory", "1GiB", "--trace", "0", "--calibrate", "1",
                 "--calibration", str(mine)])
    err = capsys.readouterr().err
    assert code == 2 and "not a calibration file megashard wrote" in err and len(err.strip().splitlines()) == 1
    assert mine.read_text() == '{"my": "notes"}'


@pytest.mark.parametrize("argv,message", [
    (["-w", "16", "--calibrate"], "--calibrate times the layouts on this machine, as one node: --world-size 16"),
    (["-w", "2", "--calibrate", "0"], "--calibrate 0: must be in 1..64"),
    (["-w", "2", "--calibrate", "--calibrate-steps", "2"], "--calibrate-steps 2: must be in 3..1,000"),
    (["-w", "2", "--calibrate-rounds", "3"], "--calibrate-rounds only applies with --calibrate"),
    (["-w", "2", "--calibration", "/nonexistent/cal.json"], "--calibration /nonexistent/cal.json: no such file"),
])
def test_calibration_flag_errors_are_one_line(capsys, argv, message):
    code = main(["plan", DEFAULT, "--suggest", "--device-memory", "1GiB", "--trace", "0", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_calibrate_runs_the_job_and_writes_a_file_that_ranks_again(tmp_path, capsys):
    """One real calibration (2 ranks, 1 layout, 3 steps): the layout's step time comes from its metrics, the file
    holds it, and reading the file ranks the same way without running anything."""
    cal = tmp_path / "cal.json"
    argv = ["plan", DEFAULT, *TINY, "--suggest", "-w", "2", "--device-memory", "1GiB", "--format", "json",
            "--trace", "0"]
    t0 = time.monotonic()
    code = main([*argv, "--calibrate", "1", "--calibrate-steps", "3", "--calibrate-rounds", "1",
                 "--calibration", str(cal)])
    whole = time.monotonic() - t0  # the calibration's own duration: a step of it takes less (in seconds, not ms)
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    first = d["top"][0]
    assert first["step"]["source"] == "measured" and 0 < first["step"]["measured_seconds"] < whole, err
    saved = json.loads(cal.read_text())
    assert saved["kind"] == "megashard-advisor-calibration" and saved["world_size"] == 2
    assert saved["timings"][0]["layout"] == first["layout"] and len(saved["timings"][0]["samples"]) == 1
    assert saved["timings"][0]["step_s"] == first["step"]["measured_seconds"]
    code = main([*argv, "--calibration", str(cal)])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["top"][0]["layout"] == first["layout"]
    assert again["top"][0]["step"]["measured_seconds"] == first["step"]["measured_seconds"]
