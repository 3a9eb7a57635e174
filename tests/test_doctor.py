"""The hang doctor on real gloo processes: each waiting rank names the group, the operation and the missing ranks.

Three spawns, each a real hang with a short ``parallel.timeout`` (T = 4 s): rank 2 skips an all-reduce on ``tp``
(4 ranks); a pipeline stage of torch.distributed.pipelining stalls in user code (8 ranks, tp=2 · pp=4); a rank is
killed with SIGKILL inside an all-reduce (4 ranks). Every waiting rank must report, once, not before T (its own
``waited_s``; when the report comes is not timed: a hang guard of minutes), naming exactly the right ranks; ``megashard doctor RUN_DIR`` must print the same from the files they left. A fourth (2 ranks)
checks that an asynchronous call closes at its ``Work.wait()`` and the doctor keeps no reference to its tensors.
"""
from __future__ import annotations

import io
import json
from datetime import timedelta
import os
import time

import pytest

from tests._dist import spawn_checks

T = 4.0  # parallel.timeout of these jobs, seconds
DIR_ENV = "MEGASHARD_TEST_DOCTOR_DIR"


def _start(**sizes):
    import torch.distributed as dist

    import megashard.doctor as doctor
    import megashard.state as ms
    from megashard.config import ParallelConfig

    # The default group has a long timeout (processes start seconds apart on a loaded machine): line up first, so
    # megashard's set-up (its config check and groups, with the short timeout T) is not what times out.
    dist.barrier()
    state = ms.initialize(ParallelConfig(timeout=T, **sizes))
    buf = io.StringIO()
    d = doctor.enable(state, out_dir=os.environ[DIR_ENV], stream=buf)
    return state, d, buf


def _wait_finding(d, since: float) -> dict:
    """The doctor's first finding, waited for (a hang guard of T + 120 s after ``since``, not a speed bound: when it
    comes is the doctor's ``waited_s``, checked to be at least T by the callers)."""
    while not d.findings and time.monotonic() < since + T + 120:
        time.sleep(0.05)
    assert d.findings, f"no report within T + 120 s = {T + 120} s"
    return d.findings[0]


def _say_reported(rank: int) -> None:
    """This rank has its finding and checked it (a file the stalled ranks wait for)."""
    open(os.path.join(os.environ[DIR_ENV], f"reported_{rank}"), "w").close()


def _wait_reported(ranks: set[int]) -> None:
    """Until every rank of ``ranks`` said it reported (a hang guard of T + 120 s): the stall lasts exactly as long
    as the others need to see it, however loaded the machine."""
    give_up = time.monotonic() + T + 120
    while not all(os.path.exists(os.path.join(os.environ[DIR_ENV], f"reported_{r}")) for r in ranks):
        assert time.monotonic() < give_up, f"ranks {sorted(ranks)} did not all report within T + 120 s"
        time.sleep(0.05)


def _finish(d, buf, state) -> None:
    import megashard.doctor as doctor
    import megashard.state as ms

    lines = [x for x in buf.getvalue().splitlines() if x.startswith("megashard doctor: rank")]
    assert len(lines) <= 1, lines  # once
    doctor.disable("failure")
    ms.destroy()


# ---------------------------------------------------------------------------------------------- rank 2 skips
def check_skip_allreduce(rank, world_size):
    """tp=2 (tp [0,1], [2,3]; dp [0,2], [1,3]): every step an all-reduce on tp then on dp; in step 2 rank 2 skips
    the tp one and goes to the final barrier (asynchronous, waited for T). Rank 3 waits in tp #3 for rank 2; rank 1 in dp #3 for rank 3 (stuck in
    tp); ranks 0 and 2 in the barrier for ranks 1 and 3."""
    import torch
    import torch.distributed as dist

    import megashard.doctor as doctor

    state, d, buf = _start(tp=2)
    t = torch.ones(4)
    since = None
    try:
        for step in range(3):
            doctor.set_step(step)
            if step == 2:
                since = time.monotonic()
            if not (rank == 2 and step == 2):
                dist.all_reduce(t, group=state.group("tp"))
            dist.all_reduce(t, group=state.group("dp"))
        # the default group's timeout is long here: wait T, as megashard's final barrier does (an async call)
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=T))
        raise AssertionError("the barrier finished although rank 2 skipped an all-reduce")
    except RuntimeError:
        pass
    f = _wait_finding(d, since)
    culprits = {c["rank"]: c for c in f["culprits"]}
    expect = {  # rank -> (group key, op, seq, {missing rank: what its description must mention})
        0: ("world", "barrier", 1, {1: "all_reduce #3 on dp", 3: "all_reduce #3 on tp"}),
        1: ("dp:1", "all_reduce", 3, {3: "all_reduce #3 on tp"}),
        2: ("world", "barrier", 1, {1: "all_reduce #3 on dp", 3: "all_reduce #3 on tp"}),
        3: ("tp:2", "all_reduce", 3, {2: "barrier #1 on world"}),
    }[rank]
    assert (f["group"], f["op"], f["seq"], f["step"]) == (*expect[:3], 2), f
    assert sorted(culprits) == sorted(expect[3]), f["line"]
    for r, words in expect[3].items():
        assert not culprits[r]["reached"] and words in culprits[r]["doing"], f["line"]
    assert f["line"].startswith(f"megashard doctor: rank {rank} waits in {expect[1]} #{expect[2]} on "), f["line"]
    if rank == 3:
        assert "all_reduce #3 on tp [2, 3] (step 2)" in f["line"], f["line"]
        assert "rank 2 never reached it (" in f["line"], f["line"]
    assert f["waited_s"] >= T - 0.5, f["waited_s"]  # not before its timeout
    time.sleep(2.0)  # peers still report: stay published while they read
    _finish(d, buf, state)
    with open(os.path.join(os.environ[DIR_ENV], "doctor", f"rank_{rank}.json"), encoding="utf-8") as fh:
        rec = json.load(fh)
    assert rec["reason"] == "failure" and rec["findings"][0]["seq"] == expect[2], rec


# ---------------------------------------------------------------------------------------------- a pipeline stage stalls
def check_pipeline_stage_stalls(rank, world_size):
    """tp=2 · pp=4 (pp groups [0,2,4,6], [1,3,5,7]), PyTorch's GPipe over one Linear per stage; in step 1 stage 2
    (ranks 4, 5) stalls in user code. Each waiting rank names its neighbour towards the stall: stages 0, 1 the next
    stage's rank, stage 3 the stalled rank before it."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import megashard.doctor as doctor

    state, d, buf = _start(tp=2, pp=4)
    stage_index = state.rank_in("pp")
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(4, 4), stage_index, 4, torch.device("cpu"), group=state.group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: (out - target).pow(2).mean())
    x, target = torch.ones(2, 4), torch.zeros(2, 4)
    since = None
    for step in range(2):
        doctor.set_step(step)
        if step == 1:
            since = time.monotonic()
            if stage_index == 2:  # the stall: alive, in user code, no collective, until every other rank reported
                _wait_reported(set(range(world_size)) - {4, 5})  # stage 2 is ranks 4, 5
                assert not d.findings, d.findings
                _finish(d, buf, state)
                return
        try:
            if stage_index == 0:
                schedule.step(x)
            elif stage_index == 3:
                schedule.step(target=target)
            else:
                schedule.step()
        except Exception:  # noqa: BLE001 - step 1 must fail (gloo's timeout): the stall
            assert step == 1, "the pipeline failed before the stall"
            break
    else:
        raise AssertionError("the pipeline step finished although stage 2 stalled")
    f = _wait_finding(d, since)
    peer = rank - 2 if stage_index == 3 else rank + 2
    assert f["group"] == f"pp:{rank % 2}" and f["name"] == "pp" and f["step"] == 1, f
    assert f["op"] in ("isend", "irecv", "batch_isend_irecv") and any(p == peer for _, p, _ in f["p2p"]), f
    assert [c["rank"] for c in f["culprits"]] == [peer], f["line"]
    c = f["culprits"][0]
    assert not c["reached"] and c["alive"] is not False, f["line"]
    if peer in (4, 5):
        assert "in user code" in c["doing"] and "step 1" in c["doing"], f["line"]
    else:  # stage 0 waits for stage 1, which itself waits for the stalled stage
        assert f"rank {peer + 2}" in c["doing"], f["line"]
    assert f"on pp [{rank % 2}, {rank % 2 + 2}, {rank % 2 + 4}, {rank % 2 + 6}]" in f["line"], f["line"]
    _say_reported(rank)
    time.sleep(1.0)
    _finish(d, buf, state)


# ---------------------------------------------------------------------------------------------- SIGKILL
def check_rank_killed(rank, world_size):
    """tp=2 (tp [0,1], [2,3]; dp [0,2], [1,3]): every step an all-reduce on tp then on dp. In step 1 rank 3 joins
    tp late and rank 2 is killed with SIGKILL inside tp #2. Rank 3 names rank 2 (reached tp #2, then no heartbeat);
    rank 0 names rank 2 (never reached dp #2: no heartbeat); rank 1 names rank 3 (never reached dp #2: in tp #2)."""
    import signal
    import threading

    import torch
    import torch.distributed as dist

    import megashard.doctor as doctor

    state, d, buf = _start(tp=2)
    t = torch.ones(4)
    since = None
    try:
        for step in range(2):
            doctor.set_step(step)
            if step == 1:
                if rank == 2:
                    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
                if rank == 3:
                    time.sleep(2.0)
                since = time.monotonic()
            dist.all_reduce(t, group=state.group("tp"))
            dist.all_reduce(t, group=state.group("dp"))
        raise AssertionError("step 1 finished although rank 2 was killed")
    except RuntimeError:
        pass
    f = _wait_finding(d, since)
    expect = {0: ("dp:0", 2, False), 1: ("dp:1", 3, False), 3: ("tp:2", 2, True)}[rank]
    assert (f["group"], f["op"], f["seq"], f["step"]) == (expect[0], "all_reduce", 2, 1), f
    assert [c["rank"] for c in f["culprits"]] == [expect[1]], f["line"]
    c = f["culprits"][0]
    assert c["reached"] is expect[2], f["line"]
    if expect[1] == 2:  # the killed rank (same host: its pid is gone)
        assert c["alive"] is False and "its process died" in c["doing"], f
    else:  # rank 3 is alive, in tp #2
        assert "all_reduce #2 on tp" in c["doing"], f["line"]
    if rank == 3:  # it had entered tp #2 (published on entry) when it was killed
        assert "rank 2 reached it; its process died inside all_reduce #2 on tp (float32[4])" in f["line"], f["line"]
    time.sleep(1.5)
    _finish(d, buf, state)


def check_waited_work_is_let_go(rank, world_size):
    """An asynchronous call closes at its ``Work.wait()`` and the doctor keeps nothing of it: the Work holds its
    tensors (a pipeline's activations), which must be freed when the caller drops them, not at the next poll."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    state, d, buf = _start()
    peer = 1 - rank
    t = torch.full((1 << 18,), float(rank))
    ref = weakref.ref(t)
    w = dist.isend(t, peer) if rank == 0 else dist.irecv(t, peer)
    w.wait()
    assert not d.ledger.open and not d.ledger.held, (d.ledger.open, d.ledger.held)
    track = d.ledger.tracks[0]  # the default group: the doctor saw the call
    assert (track.sent if rank == 0 else track.recvd) == {peer: 1}, (track.sent, track.recvd)
    if rank == 1:
        assert t[0].item() == 0.0  # received
    del w, t
    gc.collect()
    assert ref() is None, "the doctor still holds the Work's tensor"
    ops = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, torch.zeros(4), peer)]
    works = dist.batch_isend_irecv(ops if rank == 0 else ops[::-1])
    for x in works:
        x.wait()
    assert not d.ledger.open and not d.ledger.held, (d.ledger.open, d.ledger.held)
    del works, ops
    _finish(d, buf, state)


# ---------------------------------------------------------------------------------------------- fixtures and tests
def _spawn(tmp_path_factory, check, world_size, name):
    run_dir = str(tmp_path_factory.mktemp(name))
    old = os.environ.get(DIR_ENV)
    os.environ[DIR_ENV] = run_dir  # the spawned ranks inherit it
    try:
        results = spawn_checks([check], world_size=world_size, pg_timeout=60.0, timeout=150)
    finally:
        if old is None:
            del os.environ[DIR_ENV]
        else:
            os.environ[DIR_ENV] = old
    return results, run_dir


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory):
    return _spawn(tmp_path_factory, check_skip_allreduce, 4, "skip")


def test_skipped_allreduce_names_rank_2_on_every_waiting_rank(skip_run):
    results, _ = skip_run
    results.assert_ok("check_skip_allreduce")


def test_pipeline_stage_stall_names_the_neighbour_towards_the_stall(tmp_path_factory):
    results, _ = _spawn(tmp_path_factory, check_pipeline_stage_stalls, 8, "pipe")
    results.assert_ok("check_pipeline_stage_stalls")


def test_sigkilled_rank_is_named_as_reached_without_heartbeat(tmp_path_factory):
    results, run_dir = _spawn(tmp_path_factory, check_rank_killed, 4, "kill")
    assert "exited with code -9" in results.errors.get("check_rank_killed", {}).get(2, ""), results.errors
    for r in (0, 1, 3):
        assert r not in results.errors.get("check_rank_killed", {}), results.errors["check_rank_killed"][r]
        assert r in results.passed.get("check_rank_killed", set()), (r, results.hung)
    with open(os.path.join(run_dir, "doctor", "rank_2.json"), encoding="utf-8") as fh:
        rec = json.load(fh)  # SIGKILL: only the record written at its start
    assert rec["reason"] == "start" and rec["groups"]["tp:2"]["seq"] == 0, rec


def test_cli_doctor_prints_the_table_from_the_files(skip_run, capsys):
    from megashard.cli import main

    _, run_dir = skip_run
    assert main(["doctor", run_dir]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"megashard doctor: {run_dir}: records of 4 of 4 ranks; 3 hung operation(s)", out
    assert out[1].split() == ["GROUP", "OPERATION", "STEP", "WAITING", "RANKS", "NOT", "REACHED", "BY", "(doing",
                              "instead)"], out
    rows = [" ".join(line.split()) for line in out[2:6]]
    assert rows[0].startswith("world [0, 1, 2, 3] barrier #1 2 0, 2 rank 1: "), rows
    assert rows[1].startswith("rank 3: ") and "all_reduce #3 on tp" in rows[1], rows
    assert rows[2].startswith("dp [1, 3] all_reduce #3 2 1 rank 3: ") and "all_reduce #3 on tp" in rows[2], rows
    assert rows[3].startswith("tp [2, 3] all_reduce #3 2 3 rank 2: ") and "barrier #1 on world" in rows[3], rows
    # rank 2 waits in the barrier for rank 1, which waits in dp for rank 3, which waits in tp for rank 2: a deadlock
    cycles = [line for line in out[6:] if line.startswith("deadlock: ")]
    assert cycles and all("waits in all_reduce #3 on tp for rank 2" in c for c in cycles), out
    assert not [line for line in out[6:] if not line.startswith(("deadlock: ", "stragglers: ", "GROUP ", "no straggler",
                                                                 "world ", "tp ", "dp "))], out
    assert main(["doctor", run_dir, "--format", "json"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert {(r["group"], r["seq"]): sorted(r["waiting"]) for r in s["rows"]} == {
        ("world", 1): [0, 2], ("dp:1", 3): [1], ("tp:2", 3): [3]}


def test_cli_doctor_without_records_is_one_line(tmp_path, capsys):
    from megashard.cli import main

    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no doctor records" in err[0] and "train.doctor=false" in err[0], err
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_a_waited_work_is_let_go_at_once(tmp_path_factory):
    results, _ = _spawn(tmp_path_factory, check_waited_work_is_let_go, 2, "work")
    results.assert_ok("check_waited_work_is_let_go")
