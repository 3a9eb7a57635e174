"""The hang doctor places every rank where it is (issue 41): real torchrun launches of tests/_doctor_user_script.py,
T = 10 s (the doctor's timeout; the default group's is 60 s), no wall-clock bound.

- a rank stopped (SIGSTOP) after all-reduce #3 *returned* is in its own code since #3, not inside it; one that
  ``os._exit``\\ s there ended in its own code;
- a DTensor all-reduce on the ``tp`` axis of a DeviceMesh the script made itself (unknown to the doctor): the waiting
  rank names the rank that stays in its own code, and ``megashard doctor`` has the ``tp`` row;
- a rank SIGKILLed inside an all-reduce under plain torchrun (its default monitor interval: the survivor is stopped
  within a second, before any timeout): ``megashard doctor RUN_DIR`` names it, inside that all-reduce, from its entry
  slot and what the survivor wrote on SIGTERM.
"""
from __future__ import annotations

import os

import pytest

from tests._doctor_torchrun import doctor_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_doctor_user_script.py")
T = 10.0


def _torchrun(mode: str, nproc: int, run_dir: str, *torchrun_args: str) -> tuple[dict[int, str], str]:
    """Run the script; returns each rank's doctor line (rank -> line) and torchrun's whole stderr."""
    return doctor_torchrun(mode, nproc, run_dir, T, *torchrun_args)


def _cli(run_dir: str, capsys) -> tuple[int, list[str]]:
    from megashard.cli import main

    code = main(["doctor", run_dir])
    return code, [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.long
def test_a_rank_stopped_after_a_call_returned_is_in_its_own_code_not_inside_it(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    lines, err = _torchrun("stopped", 2, run_dir)
    assert 0 in lines, err[-3000:]
    assert lines[0].startswith("megashard doctor: rank 0 waits in all_reduce #4 on world [0, 1] (step 3)"), lines
    assert lines[0].endswith(": rank 1 never reached it (its process is stopped (SIGSTOP) in its own code since "
                             "all_reduce #3 on world returned (step 2))"), lines
    assert "inside" not in lines[0], lines
    code, out = _cli(run_dir, capsys)
    assert code == 1 and out[2].startswith("world [0, 1] all_reduce #4 3 0 rank 1: its process is stopped (SIGSTOP) "
                                           "in its own code since all_reduce #3 on world returned"), out


def test_a_rank_that_exits_after_a_call_returned_ended_in_its_own_code(tmp_path):
    run_dir = str(tmp_path / "run")
    lines, err = _torchrun("exit_after", 2, run_dir)
    assert list(lines) == [0], err[-3000:]
    assert lines[0].startswith("megashard doctor: rank 0 waits in all_reduce #4 on world [0, 1] (step 3)"), lines
    assert lines[0].endswith(": rank 1 never reached it (its process ended without its final record (os._exit, a "
                             "crash or a kill) in its own code since all_reduce #3 on world returned (step 2))"), lines


@pytest.mark.long
def test_a_dtensor_waiter_on_a_meshs_tp_axis_is_diagnosed(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    lines, err = _torchrun("dtensor_tp", 4, run_dir)
    assert list(lines) == [0], err[-3000:]
    head, _, why = lines[0].partition(": rank 1 never reached it (")
    assert head.startswith("megashard doctor: rank 0 waits in all_reduce #4 on tp [0, 1] (step 3) for "), lines
    assert why.startswith("last: ") and "in user code" in why, lines
    code, out = _cli(run_dir, capsys)
    assert code == 1 and out[0].endswith("records of 4 of 4 ranks; 1 hung operation(s)"), out
    assert out[2].startswith("tp [0, 1] all_reduce #4 3 0 rank 1: last: "), out


def test_a_rank_killed_inside_a_call_under_plain_torchrun_is_named_after_the_fact(tmp_path, capsys):
    """torchrun's default monitor interval: it stops rank 0 (SIGTERM) within a second of rank 1's death, usually
    before rank 0 joins the call; rank 0's doctor writes its record first (with rank 1's entry slot)."""
    run_dir = str(tmp_path / "run")
    lines, err = _torchrun("kill", 2, run_dir)
    assert "exitcode  : -9" in err, err[-3000:]
    for line in lines.values():  # rank 0 may have joined the call before torchrun stopped it: then it said so
        assert line.startswith("megashard doctor: rank 0 waits in all_reduce #4 on world [0, 1] (step 3)"), lines
        assert "rank 1 reached it; its process died inside all_reduce #4 on world (float32[4])" in line, lines
    code, out = _cli(run_dir, capsys)
    assert code == 1, out
    rows = [line for line in out if line.startswith("world [0, 1] all_reduce #4 3 ")]
    assert len(rows) == 1 and ("rank 1: reached it, its process died inside all_reduce #4 on world (float32[4]) "
                               "(crashed, aborted or killed)") in rows[0], out
    assert "no hang recorded" not in " ".join(out), out


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    from tests._helpers import processes_with

    assert not processes_with(SCRIPT), processes_with(SCRIPT)
