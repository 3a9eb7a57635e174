"""Hangs found before launch (issue 37): every rank of a script or of the training job rehearsed without peers on the
fake backend (megashard.rehearse), and their recorded calls checked against each other.

- injected bugs in a user's script (tests/_rehearse_user_script.py, 8 ranks, tp=2 × pp=2 × dp=2): each found with
  its ranks, operation and source line; the same script without a bug: OK;
- the training job's own layouts (default job: tp × FSDP, pipelines, context and expert parallel): no finding;
- the checks on hand-made traces: the words (the hang doctor's), each kind of finding, shapes that depend on data;
- ``megashard check`` usage errors: one line, exit 2.

Each rank is a forked process of this test's (no process group in this one); the ranks run two at a time.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_rehearse_user_script.py")
SCRIPT_REL = os.path.relpath(SCRIPT)


def _line(text: str) -> int:
    """The line number of the script's line holding ``text`` (the first)."""
    with open(SCRIPT, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(text)


def _check_script(mode: str, world: int = 8):
    import torch.distributed as dist

    from megashard.rehearse import Broker
    from megashard.rehearse.compare import check_traces
    from megashard.rehearse.script import ScriptRank

    assert not dist.is_initialized()  # the ranks are forks of this process
    body = ScriptRank(SCRIPT, [mode], world, log_dir=None)
    traces = Broker(body, world, jobs=2).run()
    return traces, check_traces(traces)


GRAD = "dist.all_reduce(grad, group=dp)"
SEND = "dist.send(x, dst=ranks[stage + 1]"
RECV = "dist.recv(x, src=ranks[stage - 1]"
# mode -> (kind of the first finding, fragments its line holds (the script's lines by their text))
INJECTED = {
    "skip": ("mismatch", ["mismatched calls on dp [1, 3] #1", "rank 1: all_reduce float32[16] on dp [1, 3] #1 ({GRAD})",
                          "rank 3: nothing (no collective #1 there: its step ended)"]),
    "shape": ("mismatch", ["mismatched calls on dp [0, 2] #1", "rank 0: all_reduce float32[16] on dp [0, 2] #1 ({GRAD})",
                           "rank 2: all_reduce float32[17] on dp [0, 2] #1 ({GRAD})"]),
    "swap": ("deadlock", ["deadlock: rank 0 waits in all_reduce #1 on tp [0, 1] ({TP}) for rank 1, which waits in "
                          "all_reduce #2 on world [0, 1, 2, 3, 4, 5, 6, 7] ({SWAP}) for rank 0"]),
    "microbatch": ("unmatched", ["unmatched receive on pp [0, 4]: rank 4 receives #3 from rank 0 (recv float32[4, 8], "
                                 "{RECV})", "rank 0 sends only 2 to rank 4 (its step ended)"]),
    "send": ("unmatched", ["unmatched send on pp [0, 4]: rank 0 sends #3 to rank 4 (send float32[4, 8], {EXTRA})",
                           "rank 4 receives only 2 from rank 0"]),
    "wrong_grid": ("wrong_grid", ["ranks 0, 1, 2, 3, 4, 5, 6, 7: all_reduce float32[16] on dp [0, 2, 4, 6]",
                                  "a group of layout tp2·dp_shard4 on ranks 0-7 while layout tp2·pp2·dp_shard2 on ranks "
                                  "0-7 is current ({GRAD})"]),
    "pg_collection": ("wrong_grid", ["ranks 0, 1, 2, 3, 4, 5, 6, 7: all_reduce float32[16] on dp [0, 2, 4, 6]",
                                     "a group of grid tp2·dp4 on ranks 0-7 while layout tp2·pp2·dp_shard2 on ranks "
                                     "0-7 is current ({GRAD})"]),
}


def _site(text: str, func: str) -> str:
    return f"{SCRIPT_REL}:{_line(text)} ({func})"


@pytest.mark.parametrize("mode", list(INJECTED))
def test_injected_bug_is_named_with_ranks_operation_and_line(mode):
    kind, fragments = INJECTED[mode]
    sites = {"GRAD": _site(GRAD, "main"), "RECV": _site(RECV, "pipeline_forward"),
             "TP": _site('dist.all_reduce(h, group=state.group("tp"))', "main"),
             "SWAP": _site("dist.all_reduce(loss, group=dist.group.WORLD)", "main"),
             "EXTRA": _site("dist.send(out[-1]", "pipeline_forward")}
    _, result = _check_script(mode)
    assert not result.ok, result.text()
    first = result.findings[0]
    assert first.kind == kind, result.text()
    for fragment in fragments:
        assert fragment.format(**sites) in first.line, (fragment.format(**sites), result.text())
    assert result.text().startswith("FAILED: ")


def test_the_script_without_a_bug_is_ok():
    traces, result = _check_script("ok")
    assert result.ok, result.text()
    assert sorted(traces) == list(range(8)) and all(t.status == "ok" for t in traces.values())
    # per rank and step: 2 sends or receives of the pipeline, tp, dp and world all-reduces (+ the config check)
    assert [len(t.calls) for t in traces.values()] == [6] * 8
    assert result.text().startswith("OK: 8 ranks, 13 groups, 48 calls (32 collectives, 16 point-to-point)")


@pytest.mark.parametrize("overrides,world", [
    ([], 4),                                                                   # tp 2 × FSDP 2
    (["parallel.tp=1", "parallel.pp=2"], 4),                                   # 1f1b over 2 stages × FSDP 2
    (["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "model.layers=4",
      "train.pipeline_schedule=interleaved_1f1b"], 4),                         # interleaved, 2 chunks per rank
    (["parallel.tp=1", "parallel.cp=2"], 4),                                   # context parallel × FSDP 2
    (["model.num_experts=4", "parallel.ep=2", "parallel.tp=1"], 4),             # experts: data-dependent splits
])
def test_training_job_layouts_have_no_finding(overrides, world):
    from megashard.rehearse import rehearse_job
    from megashard.rehearse.compare import check_traces
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "default.yaml"), overrides)
    traces = rehearse_job(job, world, jobs=2)
    result = check_traces(traces)
    assert result.ok, result.text()
    assert sorted(traces) == list(range(world))
    sizes = job.validate(world)
    if sizes.pp > 1:  # the pipeline's activations travel stage to stage: point-to-point calls were checked
        assert result.p2p > 0
    if job.model.num_experts:  # token routing: split sizes depend on the data, named as not checkable
        assert result.data_dependent > 0 and "all_to_all_single" in result.text()


# ----------------------------------------------------------------------------------------------- hand-made traces
def _trace(rank, world, calls, groups):
    from megashard.rehearse.recorder import CallRecord, GroupInfo, RankTrace

    t = RankTrace(rank, world)
    for g, ranks in groups.items():
        t.groups[g] = GroupInfo(g, g.split(":")[0], tuple(ranks))
    for c in calls:
        t.calls.append(CallRecord(**c))
    return t


def test_words_are_the_doctors_and_data_dependent_shapes_are_not_compared():
    from megashard.rehearse.compare import check_traces

    groups = {"dp:0-3": [0, 1, 2, 3]}
    ar = dict(group="dp:0-3", op="all_reduce", sig="float32[4096]", site="a.py:3 (f)")
    ag = dict(group="dp:0-3", op="all_gather", sig="float32[8192]", site="a.py:5 (f)")
    a2a = [dict(group="dp:0-3", op="all_to_all_single", sig=f"float32[{n}]", site="m.py:9 (g)", data_dependent=True)
           for n in (4, 5, 6, 7)]
    traces = {r: _trace(r, 4, [a2a[r], ag if r == 3 else ar], groups) for r in range(4)}
    result = check_traces(traces)
    assert [f.kind for f in result.findings] == ["mismatch"]
    assert result.findings[0].line == (
        "mismatched calls on dp [0, 1, 2, 3] #2: rank 3: all_gather float32[8192] on dp [0, 1, 2, 3] #2 (a.py:5 (f)); "
        "ranks 0, 1, 2: all_reduce float32[4096] on dp [0, 1, 2, 3] #2 (a.py:3 (f))")
    assert result.data_dependent == 4
    # without the mismatch: OK, the data-dependent calls named as not checkable
    traces = {r: _trace(r, 4, [a2a[r], ar], groups) for r in range(4)}
    text = check_traces(traces).text()
    assert text.startswith("OK: 4 ranks, 1 group, 8 calls") and "4 with shapes that depend on data, not checkable " \
        "(all_to_all_single): their order and group checked" in text


def test_unmatched_send_and_receive_and_a_deadlock():
    from megashard.rehearse.compare import check_traces

    send = dict(group="pp:0-1", op="send", sig="float32[2]", kind="send", peer=1, site="s.py:1 (f)")
    recv = dict(group="pp:0-1", op="recv", sig="float32[2]", kind="recv", peer=0, site="s.py:2 (f)")
    groups = {"pp:0-1": [0, 1]}
    result = check_traces({0: _trace(0, 2, [send, send], groups), 1: _trace(1, 2, [recv], groups)})
    assert [f.kind for f in result.findings] == ["unmatched"]
    assert result.findings[0].line == ("unmatched send on pp [0, 1]: rank 0 sends #2 to rank 1 (send float32[2], "
                                       "s.py:1 (f)); rank 1 receives only 1 from rank 0 (its step ended)")
    wrong = dict(recv, sig="float32[3]")
    result = check_traces({0: _trace(0, 2, [send], groups), 1: _trace(1, 2, [wrong], groups)})
    assert "rank 0 sends #1 to rank 1: send float32[2] (s.py:1 (f)); rank 1 receives it as recv float32[3]" \
        in result.findings[0].line
    # the same calls on two groups in another order: every group agrees, the ranks wait for each other
    groups = {"a:0-1": [0, 1], "b:0-1": [0, 1]}
    a = dict(group="a:0-1", op="all_reduce", sig="float32[1]", site="d.py:1 (f)")
    b = dict(group="b:0-1", op="all_reduce", sig="float32[1]", site="d.py:2 (f)")
    result = check_traces({0: _trace(0, 2, [a, b], groups), 1: _trace(1, 2, [b, a], groups)})
    assert [f.kind for f in result.findings] == ["deadlock"]
    assert result.findings[0].line == ("deadlock: rank 0 waits in all_reduce #1 on a [0, 1] (d.py:1 (f)) for rank 1, "
                                       "which waits in all_reduce #1 on b [0, 1] (d.py:2 (f)) for rank 0")
    # asynchronous calls do not wait: the same order swap with async_op=True on one side is no deadlock
    result = check_traces({0: _trace(0, 2, [dict(a, async_op=True), b], groups), 1: _trace(1, 2, [b, a], groups)})
    assert result.ok, result.text()


@pytest.mark.parametrize("argv,needle", [
    ([], "check needs SCRIPT"),
    ([SCRIPT], "check needs --world-size N"),
    ([SCRIPT, "--world-size", "0"], "--world-size 0"),
    (["missing.py", "--world-size", "4"], "SCRIPT 'missing.py' is not a file"),
    ([SCRIPT, "--world-size", "4", "--format", "xml"], "--format 'xml': must be table or json"),
])
def test_check_usage_errors_are_one_line(argv, needle):
    p = subprocess.run([sys.executable, "-m", "megashard", "check", *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("megashard check: error:"), p.stderr


def test_broadcast_objects_reach_every_rank(tmp_path):
    """A script that broadcasts its settings from rank 0 (``broadcast_object_list``) and sizes a tensor by them: the
    other ranks get rank 0's objects in the rehearsal too (through the mailbox), so their shapes are rank 0's."""
    import torch.distributed as dist

    from megashard.rehearse import Broker
    from megashard.rehearse.compare import check_traces
    from megashard.rehearse.script import ScriptRank

    script = tmp_path / "bcast.py"
    script.write_text(
        "import torch, torch.distributed as dist, megashard\n"
        "from megashard.config import ParallelConfig\n"
        "state = megashard.initialize(ParallelConfig(tp=2, backend='gloo', device='cpu'))\n"
        "cfg = [{'hidden': 24} if dist.get_rank() == 0 else None]\n"
        "dist.broadcast_object_list(cfg, src=0)\n"
        "t = torch.ones(cfg[0]['hidden'])\n"
        "dist.all_reduce(t, group=state.group('dp'))\n", encoding="utf-8")
    assert not dist.is_initialized()
    traces = Broker(ScriptRank(str(script), [], 4, log_dir=None), 4, jobs=2).run()
    result = check_traces(traces)
    assert result.ok, result.text()
    assert [[c.sig for c in t.calls if c.op == "all_reduce" and c.group != "world"] for t in traces.values()] == \
        [["float32[24]"]] * 4


def test_a_launcher_joining_a_running_elastic_job_does_not_check_again():
    """The first launcher of an elastic c10d job checks the collectives, then its torchrun hosts the rendezvous store;
    a launcher that finds that store answering joins a running job and skips the check (its ~10 s would delay the
    join). Nothing answering, a static or non-elastic job: the check runs."""
    import socket

    from megashard.launch.preflight import joins_running_job as _joins_running_job
    from megashard.train.sections import LaunchConfig

    with socket.socket() as srv:
        srv.bind(("localhost", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert _joins_running_job(LaunchConfig(nnodes="1:2", rdzv_endpoint=f"localhost:{port}"))
        assert not _joins_running_job(LaunchConfig(nnodes="2", rdzv_endpoint=f"localhost:{port}"))  # not elastic
        assert not _joins_running_job(LaunchConfig(nnodes="1:2", rdzv_backend="static", node_rank=1,
                                                   rdzv_endpoint=f"localhost:{port}"))
    assert not _joins_running_job(LaunchConfig(nnodes="1:2", rdzv_endpoint=f"localhost:{port}"))  # closed now
    assert not _joins_running_job(LaunchConfig(nnodes="1:2", rdzv_endpoint=None))


def test_a_bad_megashard_check_setting_is_one_line_before_anything_is_read(tmp_path):
    env = {**os.environ, "MEGASHARD_CHECK": "maybe"}
    p = subprocess.run([sys.executable, "-m", "megashard", "run", "configs/default.yaml",
                        f"train.out_dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr == ("megashard run: error: MEGASHARD_CHECK='maybe' is not a setting: auto (the default: check a "
                        "cheap job before launch) or off (as --no-check)\n"), p.stderr
    assert not os.path.exists(tmp_path / "run")


def test_a_sent_tensor_lives_as_long_as_its_work():
    """A rehearsed send's Work holds the tensor it sends until the Work itself is dropped (not at ``wait()``), as gloo's
    ``SendWork`` does: the pipeline schedules wait on their sends late, and a trace counts what gloo keeps alive."""
    import gc
    import weakref

    import torch

    from megashard.rehearse.works import SentWork

    t = torch.ones(8)
    alive = weakref.ref(t)
    work = SentWork(t)
    del t
    assert work.wait() and work.is_completed()
    gc.collect()
    assert alive() is not None
    del work
    gc.collect()
    assert alive() is None
