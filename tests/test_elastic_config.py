"""Elastic jobs without launching (issue 30) and launch settings checked as torchrun reads them (issue 27).

The node range ``launch.nnodes: MIN:MAX`` (YAML reads ``1:2`` as text, not YAML 1.1's base-60 number 62), the axes that
absorb the world size (``dp_shard: auto``, ``dp_outer: auto``) and the ones that may not, every world size of the range
laid out or refused with the valid sizes named — by ``megashard run`` (and ``--dry-run``: the same validation, before
any process starts), ``megashard plan`` and a worker of a round that formed an unfillable world; the microbatches per
rank recomputed for each world (``train.micro_batch_size``), ``checkpoint.interval`` in seconds decided by every rank
together; the agent counting a node that left or joined as a membership change, not a restart; what a new world says
(nodes, layout, steps redone) and how the loss plot marks it. The launches themselves: tests/test_elastic.py.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from megashard.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
ELASTIC = ["launch.nnodes=1:3", "launch.nproc_per_node=2", "launch.rdzv_endpoint=node0:29500"]


def job(*overrides):
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(DEFAULT, list(overrides))


# ---------------------------------------------------------------------------------------------- the range
def test_a_node_range_is_text_in_yaml_and_on_the_command_line(tmp_path):
    from megashard.config.yamlfile import parse_yaml

    assert parse_yaml("nnodes: 1:2", "x") == {"nnodes": "1:2"}  # YAML 1.1 would read 62 (base 60)
    assert parse_yaml("[1:30, 1:30.5, 12, 1.5, 0x10]", "x") == ["1:30", "1:30.5", 12, 1.5, 16]
    path = tmp_path / "elastic.yaml"
    path.write_text(open(DEFAULT).read().replace("nnodes: 1", "nnodes: 2:4"))
    from megashard.train.config import JobConfig

    assert JobConfig.from_yaml(str(path)).launch.node_range == (2, 4)
    j = job("launch.nnodes=1:3")
    assert (j.launch.node_range, j.launch.elastic, j.launch.world_sizes()) == ((1, 3), True, [4, 8, 12])
    assert job("launch.nnodes=2:2").launch.elastic is False and job("launch.nnodes=2").launch.node_range == (2, 2)


@pytest.mark.parametrize("value,message", [
    ("3:1", "launch.nnodes='3:1' must be a positive integer (e.g. 2) or an elastic range MIN:MAX of node counts with "
            "1 <= MIN <= MAX (e.g. 1:4)"),
    ("0:2", "launch.nnodes='0:2' must be"), ("1-4", "launch.nnodes='1-4' must be"), ("0", "launch.nnodes=0 must be"),
    ("[1,2]", "launch.nnodes=[1, 2] must be an integer or a string (e.g. 2, or 1:4 for an elastic range)"),
])
def test_a_bad_node_range_is_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        job(f"launch.nnodes={value}").validate()
    assert str(e.value).startswith(message), str(e.value)


def test_auto_is_a_derived_size_and_absorbs_the_world():
    from megashard.config import ParallelConfig

    assert ParallelConfig.from_dict({"dp_shard": "auto"}).dp_shard == -1
    s = ParallelConfig.from_dict({"dp_outer": "AUTO", "dp_shard": 2}).resolve(8)
    assert (s.dp_outer, s.dp_shard) == (4, 2)
    with pytest.raises(ConfigError, match=r"tp='x' must be an integer \(or auto: derived from the world size\)"):
        ParallelConfig(tp="x")


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=-1", "parallel.dp_shard=2"],
     "launch.nnodes=1:3 is elastic: only data-parallel axes may absorb the world size, but parallel.tp=-1 would "
     "change with it; give it a fixed size and leave parallel.dp_shard (or dp_outer for HSDP) auto"),
    (["parallel.dp_shard=2"],
     "launch.nnodes=1:3 is elastic, but parallel.dp_outer=1 × dp_shard=2 fixes the data-parallel size: set "
     "parallel.dp_shard=auto (FSDP absorbs the world size) or, for HSDP, parallel.dp_outer=auto with a fixed dp_shard"),
    (["parallel.dp=2"], "launch.nnodes=1:3 is elastic, but parallel.dp=2 fixes the data-parallel size"),
    (["parallel.tp=8"], "launch.nnodes=1:3 × launch.nproc_per_node=2: no world size in range can run this job (2, 4, "
                        "6); at world size 6: world size 6 is not divisible by tp=8"),
])
def test_an_elastic_job_keeps_its_model_axes_and_needs_a_world_it_can_fill(overrides, message):
    with pytest.raises(ConfigError) as e:
        job(*ELASTIC, *overrides).validate()
    assert str(e.value).startswith(message), str(e.value)


def test_every_world_size_of_the_range_is_laid_out_or_refused():
    from megashard.train.elastic import layout_text, unfillable_line, valid_sizes_text, world_options

    j = job(*ELASTIC[1:], "launch.nnodes=1:4", "train.micro_batch_size=2")
    assert j.validate().world_size == 8  # the largest world that runs
    opts = world_options(j)
    assert [(o.world_size, o.sizes is not None) for o in opts] == [(2, True), (4, True), (6, False), (8, True)]
    assert [layout_text(j, o.sizes, per_rank=True) for o in opts if o.sizes] == [
        "tp=2, dp_shard=1 (16 sequences per rank in 8 microbatches)",
        "tp=2, dp_shard=2 (8 sequences per rank in 4 microbatches)",
        "tp=2, dp_shard=4 (4 sequences per rank in 2 microbatches)"]
    assert opts[2].refusal.startswith("train.global_batch=16 must divide by the data-parallel size dp=3")
    assert valid_sizes_text(opts) == "2 (1 node), 4 (2 nodes), 8 (4 nodes)"
    assert unfillable_line(j, 6, opts[2].refusal).endswith(
        "; world sizes that run: 2 (1 node), 4 (2 nodes), 8 (4 nodes); waiting for a node to join or leave "
        "(launch.unfillable_world=wait; nothing is written)")


def test_micro_batch_size_recomputes_the_accumulation_per_world():
    j = job("train.micro_batch_size=4")
    assert [j.microbatches(1, dp) for dp in (1, 2, 4)] == [4, 2, 1]
    assert job("train.microbatches=2").microbatches(1, 4) == 2 and job().microbatches(3) == 3
    with pytest.raises(ConfigError, match="train.microbatches=2 and train.micro_batch_size=4 are exclusive"):
        job("train.microbatches=2", "train.micro_batch_size=4").validate()
    with pytest.raises(ConfigError, match=r"train.global_batch=16 must divide by dp × train.micro_batch_size = 2 × 3"):
        job("train.micro_batch_size=3").validate()
    # a pipeline needs at least pp microbatches at every world size of the range
    with pytest.raises(ConfigError, match="no world size in range"):
        job(*ELASTIC, "parallel.pp=2", "parallel.tp=1", "model.layers=2", "train.micro_batch_size=16").validate()


@pytest.mark.parametrize("value,steps,seconds", [(50, 50, None), (0, 0, None), ("300s", 0, 300.0), ("10m", 0, 600.0),
                                                 ("1.5h", 0, 5400.0), ("2min", 0, 120.0), ("40", 40, None)])
def test_a_checkpoint_interval_is_steps_or_a_time(value, steps, seconds):
    c = job(f"checkpoint.interval={value}").checkpoint
    assert (c.interval_steps, c.interval_seconds) == (steps, seconds)


@pytest.mark.parametrize("value", ["300x", "-5", "0s", "s", "5 parsecs"])
def test_a_bad_checkpoint_interval_names_the_syntax(value):
    with pytest.raises(ConfigError) as e:
        job(f"checkpoint.interval={value}").validate()
    assert str(e.value).startswith("checkpoint.interval=") and ("'300s', '10m', '1h'" in str(e.value)
                                                                 or "must be a time > 0" in str(e.value)), str(e.value)


# ---------------------------------------------------------------------------------------------- the launcher
def test_the_elastic_torchrun_command(capsys):
    from megashard import cli
    from megashard.launch.launcher import plan_launch

    p = plan_launch(DEFAULT, ELASTIC + ["launch.rdzv_last_call=5", "launch.rdzv_node_timeout=7"], env={})
    c = p.command
    assert c[c.index("--nnodes") + 1] == "1:3" and c[c.index("--rdzv-backend") + 1] == "c10d"
    assert c[c.index("--rdzv-conf") + 1] == "last_call_timeout=5,keep_alive_interval=3,keep_alive_max_attempt=3"
    assert p.env["MEGASHARD_PEER_LOSS_GRACE_S"] == "2" and [o.world_size for o in p.options] == [2, 4, 6]
    assert "--rdzv-conf" not in plan_launch(DEFAULT, ["launch.nnodes=2", "parallel.dp_shard=4",
                                                      "launch.rdzv_endpoint=n0:1"], env={}).command
    assert cli.main(["run", DEFAULT, *ELASTIC, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[:4] == [
        "megashard run: default: elastic, 2 to 6 processes (launch.nnodes=1:3 × 2), parallel.dp_shard absorbs the "
        "world size, 200 steps → runs/default",
        "  1 node , world 2: tp=2, dp_shard=1 (16 sequences per rank in 1 microbatch)",
        "  2 nodes, world 4: tp=2, dp_shard=2 (8 sequences per rank in 1 microbatch)",
        "  3 nodes, world 6: refused (train.global_batch=16 must divide by the data-parallel size dp=3 (dp_outer=1 × "
        "dp_shard=3); valid dp: 1, 2, 4, 8, 16); the job waits there (launch.unfillable_world=wait)"]
    assert "--nnodes 1:3" in out


def test_under_slurm_an_elastic_range_is_kept():
    from megashard.launch.launcher import plan_launch

    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_STEP_ID": "0"}
    p = plan_launch(DEFAULT, ["launch.nnodes=1:3", "launch.nproc_per_node=2"], env=slurm)
    c = p.command
    assert c[c.index("--nnodes") + 1] == "1:3" and c[c.index("--rdzv-endpoint") + 1] == "gpu07:29500"
    assert p.job.launch.node_rank == 1 and "launch.nnodes=2" not in p.notes[0]


# Issue 27: what --dry-run accepts, torchrun accepts; the real start runs the same validation (plan_launch).
@pytest.mark.parametrize("overrides,message", [
    (["launch.nnodes=2", "launch.rdzv_endpoint=http://node0:29500"],
     "launch.rdzv_endpoint='http://node0:29500' must be host:port without a scheme (http://): the rendezvous is a TCP "
     "address, not a URL; use launch.rdzv_endpoint=node0:29500"),
    (["launch.rdzv_endpoint=node0:29500/x"], "launch.rdzv_endpoint='node0:29500/x' must be host:port (no path)"),
    (["launch.rdzv_endpoint=node0:99999"], "launch.rdzv_endpoint='node0:99999' must be host or host:port with a port "
                                           "in 1..65535 (e.g. node0:29500); the port is '99999'"),
    (["launch.rdzv_endpoint=no de:1"], "launch.rdzv_endpoint='no de:1': the host 'no de' must be a host name"),
    (["launch.nnodes=2", "launch.rdzv_backend=c10", "launch.rdzv_endpoint=n0:1"],
     "launch.rdzv_backend='c10' (did you mean 'c10d'?) is not a torchrun rendezvous backend; known: c10d, etcd, "
     "etcd-v2, static"),
    (["launch.nnodes=2", "launch.rdzv_backend=static", "launch.rdzv_endpoint=n0:29500"],
     "launch.rdzv_backend=static with launch.nnodes=2 needs launch.node_rank: this node's rank, 0 on the node of "
     "launch.rdzv_endpoint and 1 on the other, different on every node (under Slurm it is SLURM_NODEID); or use "
     "launch.rdzv_backend=c10d, which numbers the nodes itself"),
    (["launch.nnodes=1:2", "launch.rdzv_backend=static", "launch.rdzv_endpoint=n0:1", "launch.node_rank=0"],
     "launch.nnodes=1:2 is an elastic range, but launch.rdzv_backend=static has a fixed set of nodes"),
    (["launch.node_rank=2", "launch.nnodes=2"], "launch.node_rank=2 must be in 0..nnodes-1 = 0..1"),
    (["launch.unfillable_world=pause"], "launch.unfillable_world='pause' must be one of wait, stop"),
    (["launch.rdzv_node_timeout=1"], "launch.rdzv_node_timeout=1 must be >= 3 seconds"),
])
def test_launch_settings_fail_the_dry_run_as_they_would_fail_the_launch(overrides, message, capsys, monkeypatch):
    from megashard import cli

    def no_launch(*a, **k):  # pragma: no cover - reached only if validation let the settings through
        raise AssertionError("torchrun was started for invalid launch settings")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    for dry in (["--dry-run"], []):
        assert cli.main(["run", DEFAULT, "parallel.dp_shard=auto", *overrides, *dry]) == 2
        err = capsys.readouterr().err
        assert err == f"megashard run: error: {err[len('megashard run: error: '):]}" and err.count("\n") == 1, err
        assert err[len("megashard run: error: "):].startswith(message), err


def test_valid_launch_settings_pass():
    from megashard.launch.launcher import plan_launch
    from megashard.train.launch_checks import check_endpoint

    assert check_endpoint("[fe80::1]:29500") == ("fe80::1", 29500) and check_endpoint("node0") == ("node0", None)
    p = plan_launch(DEFAULT, ["launch.nnodes=2", "parallel.dp_shard=4", "launch.rdzv_backend=static",
                              "launch.rdzv_endpoint=10.0.0.1:29500", "launch.node_rank=1"], env={})
    assert p.command[p.command.index("--node-rank") + 1] == "1"
    assert "--standalone" in plan_launch(DEFAULT, ["launch.rdzv_backend=static"], env={}).command


# ---------------------------------------------------------------------------------------------- megashard plan
def test_plan_lists_every_world_size_of_the_range(capsys):
    import json

    from megashard import cli

    assert cli.main(["plan", DEFAULT, "launch.nnodes=1:4", "launch.nproc_per_node=2", "train.micro_batch_size=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:9] == [
        "  nodes  world  tp  pp  dp_outer  dp_shard  seq/rank  microbatches",
        "  1      2      2   1   1         1         16        8",
        "  2      4      2   1   1         2         8         4",
        "  3      6      refused (below)",
        "  4      8      2   1   1         4         4         2",
        "",
        "world 6 (3 nodes) is refused: train.global_batch=16 must divide by the data-parallel size dp=3 (dp_outer=1 × "
        "dp_shard=3); valid dp: 1, 2, 4, 8, 16"], out
    assert cli.main(["plan", os.path.join(ROOT, "configs", "hsdp.yaml"), "launch.nnodes=1:2", "launch.nproc_per_node=2",
                     "parallel.dp_outer=auto", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["absorbing_axis"] == "dp_outer"
    assert [(w["world_size"], w["sizes"]["dp_outer"], w["sizes"]["dp_shard"]) for w in plan["worlds"]] == [
        (2, 1, 2), (4, 2, 2)]
    # one world size of the range: every group, as for any config; --svg needs one
    assert cli.main(["plan", DEFAULT, "launch.nnodes=1:4", "launch.nproc_per_node=2", "--world-size", "8"]) == 0
    assert "dp_shard    4" in capsys.readouterr().out
    assert cli.main(["plan", DEFAULT, "launch.nnodes=1:4", "launch.nproc_per_node=2", "--svg", "x.svg"]) == 2
    assert "add --world-size N" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the agent
def test_a_node_that_left_is_a_membership_change_not_a_restart(capsys):
    """megashard._compat's agent: a failure of this node's workers that only lost their peers (the rest stopped by the
    agent with SIGTERM) gives the restart back; one of its own (exit 1, SIGKILL) does not. The reporter's lines."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from megashard._compat import elastic_agent_gives_up_on
    from megashard.launch.agent import EXIT_NO_RESTART, EXIT_PEER_LOST, _Reporter

    original = launcher_api.LocalElasticAgent
    reporter = _Reporter("1:2", "hostA")
    try:
        assert elastic_agent_gives_up_on(frozenset({EXIT_NO_RESTART}), membership_code=EXIT_PEER_LOST,
                                         on_membership=reporter.on_membership)
        agent_cls = launcher_api.LocalElasticAgent
        agent = agent_cls.__new__(agent_cls)
        outcomes = []

        def monitor(codes):
            failures = {i: ProcessFailure(local_rank=i, pid=10 + i, exitcode=c, error_file="<N/A>")
                        for i, c in enumerate(codes)}
            base = agent_cls.__mro__[1]
            orig = base._monitor_workers
            base._monitor_workers = lambda self, wg: RunResult(state=WorkerState.FAILED, failures=failures)
            try:
                agent._remaining_restarts = 0
                agent._monitor_workers(None)
                outcomes.append(agent._remaining_restarts)
            finally:
                base._monitor_workers = orig

        monitor([EXIT_PEER_LOST, -int(signal.SIGTERM)])  # a node left
        assert reporter.membership
        monitor([EXIT_PEER_LOST, 1])  # a worker of this node failed too
        monitor([-int(signal.SIGKILL), EXIT_PEER_LOST])  # e.g. the OOM killer here
        monitor([EXIT_NO_RESTART])
        assert outcomes == [1, 0, 0, 0]
    finally:
        launcher_api.LocalElasticAgent = original

    def log(msg, *args):
        reporter.emit(logging.LogRecord("torch.distributed.elastic", logging.INFO, __file__, 1, msg, args, None))

    log("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default", "FAILED", 1, 0)
    log("[%s] Detected %s new nodes from group_rank=%s; will restart worker group", "default", 1, 0)
    log("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 1, 12, "x")
    log("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default", "FAILED", 2, 2)
    assert capsys.readouterr().err.splitlines() == [
        "megashard run: a node left: the workers here lost their peers; the rendezvous re-forms the world without it "
        "(not counted against launch.max_restarts)",
        "megashard run: 1 node joined the rendezvous; the workers restart in the larger world (not counted against "
        "launch.max_restarts)",
        "megashard run: local rank 1 on hostA failed (exit code 1); the other ranks lost their peers; torchrun "
        "restarts the job from the newest checkpoint (restart 1 of 2)"]


# ---------------------------------------------------------------------------------------------- what a new world says
def test_a_new_world_is_told_and_recorded(tmp_path):
    from megashard.train.metrics import world_changes
    from megashard.train.world import World, WorldChange

    j = job(*ELASTIC, f"train.out_dir={tmp_path}", "train.micro_batch_size=4")
    sizes = j.validate(2)
    metrics = [{"step": s, "loss": 1.0, "step_time_s": 0.5, "time": 100.0 + s, "world_size": 4} for s in range(1, 8)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(__import__("json").dumps(r) + "\n" for r in metrics))
    before = {"job_id": "rdzv:x", "world_size": 4, "nodes": ["h:1", "h:2"]}
    change = World(["h:1"], 2, sizes).compare(j, before, start_step=5)
    assert isinstance(change, WorldChange) and change.steps_redone == 2 and change.seconds_redone == 1.0
    assert change.lines() == [
        "megashard run: node h (launcher pid 2) left (world 4 → 2)",
        "megashard run: new world of 2 processes on 1 node: tp=2, dp_shard=1 (16 sequences per rank in 4 microbatches)"]
    assert change.redone_text() == "; 2 steps redone (steps 6-7 of the previous start)"
    rec = change.record(first_step_end=120.0, first_step_s=1.5)
    assert rec == {"world_size_before": 4, "nodes_left": ["h (launcher pid 2)"], "nodes_joined": [], "resumed_from": 5,
                   "last_step_before": 7, "steps_redone": 2, "seconds_down": 11.5, "seconds_redone": 1.0}
    # a restart in the same world says nothing beyond torchrun's restart line and the steps redone
    same = World(["h:1", "h:2"], 4, j.validate(4)).compare(j, before, start_step=7)
    assert same.lines() == [] and same.redone_text() == "; no step redone"
    # the plot's marks: the first step after each change (world sizes of the records, or a world_change entry)
    recs = [{"step": 1, "world_size": 4}, {"step": 2, "world_size": 4}, {"step": 3, "world_size": 2},
            {"step": 4, "world_size": 2, "world_change": {"world_size_before": 2}}, {"step": 5, "world_size": 4}]
    assert world_changes(recs) == [(3, "world 4→2"), (4, "restart"), (5, "world 2→4")]
    # the record of a start is the job's: another job's (or an ended one) is not compared with
    os.environ["MEGASHARD_JOB_ID"] = "rdzv:x"
    try:
        World(["h:1"], 2, sizes).write(j, "run-1", 5)
        assert World.previous(j)["run_id"] == "run-1"
        World(["h:1"], 2, sizes).write(j, "run-1", 9, ended=True)
        assert World.previous(j) is None
        World(["h:1"], 2, sizes).write(j, "run-1", 9)
        os.environ["MEGASHARD_JOB_ID"] = "rdzv:y"
        assert World.previous(j) is None
    finally:
        del os.environ["MEGASHARD_JOB_ID"]


def check_time_interval_is_decided_together(rank, world_size):
    """Rank 1 started its clock 0.4 s after rank 0 (alone it would save after steps 6 and 10): every rank saves
    after the same steps, rank 0's (the largest time since the last save)."""
    import torch.distributed as dist

    import megashard
    from megashard.config import ParallelConfig
    from megashard.train import checkpointing
    from megashard.train.checkpointing import SaveSchedule

    state = megashard.initialize(ParallelConfig(tp=1))
    j = job("checkpoint.interval=1s", "train.steps=100", "checkpoint.save_final=false")
    clock = [0.4 * rank + 1000.0 * rank]  # another host's clock, and a later start
    real = checkpointing.time.monotonic
    checkpointing.time.monotonic = lambda: clock[0]
    try:
        schedule = SaveSchedule(j, state)
        clock[0] = 1000.0 * rank
        saved = []
        for step in range(1, 10):
            clock[0] += 0.25  # a step
            if schedule.due(step):
                saved.append(step)
                schedule.saved()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, saved)
        assert gathered == [[4, 8], [4, 8]], gathered
    finally:
        checkpointing.time.monotonic = real
        megashard.destroy()


def test_a_time_interval_is_one_decision_of_all_ranks():
    from tests._dist import spawn_checks

    spawn_checks([check_time_interval_is_decided_together], world_size=2).assert_ok(
        "check_time_interval_is_decided_together")
