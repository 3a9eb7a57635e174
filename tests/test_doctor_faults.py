"""The hang doctor on faults in a user's own script under torchrun (tests/_doctor_user_script.py), T = 3 s.

Each test is one real torchrun launch (TCPStore, gloo): a rank that aborts inside an all-reduce of another size (named
inside it, with both calls), mismatched operations (named rank by rank), a wait-for cycle across two groups (a
deadlock), a DTensor ``full_tensor()`` that a rank never joins (a functional collective), a group registered on every
rank while one member ends its script. Every waiting rank must print its line, not before T (its ``waited_s``) and
while the call is still open (the script gives the call up at T + 2 s, so a line at all is one from the doctor's own
timer, not from gloo's error; how soon it comes is not timed), or at once when a peer died, and ``megashard doctor
RUN_DIR`` must say the same from the files.
"""
from __future__ import annotations

import json
import os

import pytest

from tests._doctor_torchrun import doctor_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_doctor_user_script.py")
T = 3.0


def _torchrun(mode: str, nproc: int, run_dir: str) -> tuple[dict[int, str], str]:
    """Run the script; returns each waiting rank's doctor line (rank -> line) and torchrun's whole stderr."""
    return doctor_torchrun(mode, nproc, run_dir, T, limit_s=180)


def _findings(run_dir: str) -> dict[int, dict]:
    out = {}
    d = os.path.join(run_dir, "doctor")
    for name in os.listdir(d):
        with open(os.path.join(d, name), encoding="utf-8") as f:
            rec = json.load(f)
        if rec.get("findings"):
            out[rec["rank"]] = rec["findings"][0]
    return out


def _cli(run_dir: str, capsys) -> tuple[int, list[str]]:
    from megashard.cli import main

    code = main(["doctor", run_dir])
    return code, [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]


def test_rank_aborted_inside_a_mismatched_all_reduce_is_named_inside_it(tmp_path, capsys):
    """gloo aborts rank 0 (SIGABRT) within microseconds of entering an all-reduce of float32[4] against rank 1's
    float32[8]: published on entry, rank 0 is seen inside the call — not as 'never reached it'."""
    run_dir = str(tmp_path)
    lines, err = _torchrun("size", 2, run_dir)
    code, out = _cli(run_dir, capsys)
    assert code == 1 and out[0].endswith("records of 1 of 2 ranks; 1 hung operation(s)"), (out, err[-3000:])
    assert any(line.startswith("no record from rank(s) 0 after their start") for line in out), out
    if not lines:  # torchrun stopped rank 1 (within 0.1 s of rank 0's death) before it printed: its file tells
        assert out[2].startswith("world [0, 1] all_reduce #4 3 1 rank 0: reached it, its process died inside "
                                 "all_reduce #4 on world"), out  # from rank 0's entry slot, on this host
        pytest.skip("torchrun stopped rank 1 before its line (a loaded machine): checked from the files")
    assert list(lines) == [1], err[-3000:]
    assert lines[1].startswith("megashard doctor: rank 1 waits in all_reduce #4 on world [0, 1] (step 3)"), lines
    assert ("rank 0 reached it; its process died inside all_reduce #4 on world (float32[4]) (crashed, aborted or "
            "killed)") in lines[1], lines
    assert "mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_reduce float32[8]" in lines[1], lines
    assert "never reached" not in lines[1], lines
    assert out[2].startswith("world [0, 1] all_reduce #4 3 1 rank 0: reached it, its process died inside"), out
    assert "world [0, 1] all_reduce #4: mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_reduce " \
           "float32[8]" in out, out


def test_mismatched_operations_are_named_rank_by_rank(tmp_path):
    run_dir = str(tmp_path)
    lines, err = _torchrun("op", 2, run_dir)
    assert sorted(lines) == [0, 1], err[-3000:]
    for rank, op in ((0, "all_reduce"), (1, "all_gather")):
        assert lines[rank].startswith(f"megashard doctor: rank {rank} waits in {op} #4 on world [0, 1] (step 3)"), \
            lines
        assert lines[rank].endswith(": mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_gather "
                                    "float32[8]"), lines
    for f in _findings(run_dir).values():
        assert f["waited_s"] >= T - 0.3, f  # the diagnosis comes at the doctor's timeout (not before)


def test_wait_for_cycle_across_two_groups_is_named_a_deadlock(tmp_path, capsys):
    run_dir = str(tmp_path)
    lines, err = _torchrun("deadlock", 2, run_dir)
    assert sorted(lines) == [0, 1], err[-3000:]
    assert ("deadlock: rank 0 waits in all_reduce #1 on a for rank 1, which waits in all_reduce #1 on b for rank 0; "
            "rank 1 never reached it (waiting in all_reduce #1 on b") in lines[0], lines
    assert ("deadlock: rank 1 waits in all_reduce #1 on b for rank 0, which waits in all_reduce #1 on a for rank 1; "
            "rank 0 never reached it (waiting in all_reduce #1 on a") in lines[1], lines
    for f in _findings(run_dir).values():
        assert f["waited_s"] >= T - 0.3, f
    code, out = _cli(run_dir, capsys)
    assert code == 1
    assert [line for line in out if line.startswith("deadlock:")] == [
        "deadlock: rank 0 waits in all_reduce #1 on a for rank 1, which waits in all_reduce #1 on b for rank 0"], out


def test_dtensor_full_tensor_that_a_rank_never_joins_is_seen(tmp_path):
    """DTensor's redistribution runs functional collectives (C++ ops behind funcol's Python functions): the doctor
    counts them on the group they resolve to and names the rank that stays in its own code."""
    run_dir = str(tmp_path)
    lines, err = _torchrun("dtensor", 2, run_dir)
    assert list(lines) == [0], err[-3000:]
    head, _, why = lines[0].partition(": rank 1 never reached it (")
    assert head.startswith("megashard doctor: rank 0 waits in all_gather") and " on world [0, 1] (step 3) for " in head, \
        lines
    assert why.startswith("last: all_gather") and "in user code" in why, lines
    f = _findings(run_dir)[0]
    assert f["waited_s"] >= T - 0.3, f


def test_register_on_every_rank_and_a_member_that_ended(tmp_path, capsys):
    """``doctor.register(new_group([0, 1]), ...)`` on all 4 ranks (ranks 2, 3 are not members: today no error); rank 1
    ends its script normally instead of joining rank 0's all-reduce: 'its process ended'."""
    run_dir = str(tmp_path)
    lines, err = _torchrun("nonmember", 4, run_dir)
    assert "Traceback" not in err.split("RAISED")[0], err[-3000:]  # register raised nowhere
    assert list(lines) == [0], err[-3000:]
    assert lines[0].startswith("megashard doctor: rank 0 waits in all_reduce #1 on pair [0, 1] (step 3)"), lines
    assert ("rank 1 never reached it (its process ended in its own code since all_reduce #3 on world returned "
            "(step 2))") in lines[0], lines
    code, out = _cli(run_dir, capsys)
    assert code == 1 and out[0].endswith("records of 4 of 4 ranks; 1 hung operation(s)"), out
    assert out[2].startswith("pair [0, 1] all_reduce #1 3 0 rank 1: its process ended"), out
    records = []
    for r in range(4):  # one run: the same id on every rank (agreed through the store), each rank's own start
        with open(os.path.join(run_dir, "doctor", f"rank_{r}.json"), encoding="utf-8") as f:
            records.append(json.load(f))
    assert len({rec["run"] for rec in records}) == 1 and records[0]["run"], [rec["run"] for rec in records]
    assert all(isinstance(rec["started"], float) and rec["attempt"] == 0 for rec in records)
    assert len({rec["launch"] for rec in records}) == 1  # torchrun's run id of this launch


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    from tests._helpers import processes_with

    assert not processes_with(SCRIPT), processes_with(SCRIPT)
