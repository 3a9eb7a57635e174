"""Elastic jobs end to end: two launchers on localhost, one killed with SIGKILL and started again (issue 30), on the
restart path (``launch.recovery: restart``; live recovery: tests/test_elastic_live.py).

Each scenario runs ``launch.nnodes=1:2`` with 2 processes per launcher and a c10d rendezvous
(:mod:`tests._elastic`): nodes A and B train at world 4; B is SIGKILLed mid-run; A goes on at world 2 (resumed from
the newest checkpoint, resharded) and trains; a new launcher B2 joins and the job grows back to world 4 and finishes.
``launch.max_restarts=0``: a node leaving or joining must not use up a restart. Every step's loss and the final
parameters are compared with an uninterrupted world-4 run of the same config (float64, so that rounding does not
hide a wrong batch or a lost update): within 1e-5 relative; the largest differences are printed (``-s``).

Scenarios: tensor parallel 2 with FSDP absorbing the world (and ``train.micro_batch_size``: 4 microbatches per rank at
world 2, 2 at world 4), a pipeline (pp=2 fixed, dp absorbing), HSDP (``dp_outer: auto``); and a world size the fixed
axes cannot fill (tp=4 on one node of 2): one line, nothing written, then the job stops, or waits until a node joins.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil

import pytest

from tests._elastic import ElasticRun, kill_and_rejoin, loss_differences, param_difference, reference

# a long end-to-end file: `pytest tests --long` (CI) runs it, the README's command does not
pytestmark = pytest.mark.long


STEPS = 15
COMMON = [f"train.steps={STEPS}", "checkpoint.interval=3", "checkpoint.keep=0", "train.dtype=float64",
          "train.plot=false", "train.micro_batch_size=4", "train.doctor=false", "launch.recovery=restart"]
SCENARIOS = {
    "tp2-fsdp": ("configs/default.yaml", ["parallel.dp_shard=auto", "train.doctor=true"]),  # + the doctor's worlds
    "pp2": ("configs/pp.yaml", ["parallel.tp=1", "parallel.dp_shard=auto", "train.microbatches=null"]),
    "hsdp": ("configs/hsdp.yaml", ["parallel.dp_outer=auto", "parallel.dp_shard=2"]),
}
TOLERANCE = 1e-5


def _scenario(tmp_path_factory, name, during_save=False, kill=1):
    config, extra = SCENARIOS[name]
    tmp = str(tmp_path_factory.mktemp(f"elastic-{name}"))
    ref = reference(os.path.join(tmp, "ref"), config, COMMON + extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # A hosts the rendezvous store (its ranks are 0 and 1: torch gives rank 0 to the store's host) unless A is the node
    # killed; B starts once the store answers. rdzv_last_call 10 s: the first round waits that long for B, whose
    # start-up (launcher, torchrun's agent) a loaded machine stretched past 4 s, so that A's round closed without B
    run = ElasticRun(os.path.join(tmp, "el"), config, COMMON + extra, host_store=kill == 0, last_call=10)
    try:
        out = kill_and_rejoin(run, kill_after=5, steps_at_2=3, during_save=during_save, kill=kill)
    finally:
        run.stop_all()
    return tmp, run, out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    yield _scenario(tmp_path_factory, "tp2-fsdp")


def _worlds(records):
    out = []
    for r in records:
        if not out or out[-1] != r["world_size"]:
            out.append(r["world_size"])
    return out


def _check_parity(tmp, run, name):
    from megashard.train.metrics import read_metrics

    want = read_metrics(os.path.join(tmp, "ref", "metrics.jsonl"))
    got = run.metrics()
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), [r["step"] for r in got]
    assert _worlds(got) == [4, 2, 4], [(r["step"], r["world_size"]) for r in got]
    diff = loss_differences(want, got)
    worst_step = max(diff, key=diff.get)
    params = param_difference(os.path.join(tmp, "ref", "checkpoints"), os.path.join(run.out, "checkpoints"))
    print(f"\n{name}: largest relative loss difference {diff[worst_step]:.2e} (step {worst_step}), final parameters "
          f"{params:.2e}; worlds {[(r['step'], r['world_size']) for r in got]}")
    assert diff[worst_step] <= TOLERANCE, (name, worst_step, diff[worst_step])
    assert params <= TOLERANCE, (name, params)


def test_a_node_killed_and_started_again_leaves_the_loss_curve_of_an_uninterrupted_run(tp2):
    tmp, run, out = tp2
    assert out["codes"] == {"A": 0, "B2": 0}, run.nodes[0].log()
    _check_parity(tmp, run, "tp=2, dp_shard absorbing")


def test_each_change_is_told_in_one_line_each_and_recorded_in_the_metrics(tp2):
    tmp, run, out = tp2
    log = run.nodes[0].log()
    b, b2 = run.nodes[1].proc.pid, run.nodes[2].proc.pid
    assert "Traceback" not in log and "torchrun:" not in log, log
    # the agent: membership changes, not failures (launch.max_restarts=0 and the job finished)
    assert ("megashard run: a node left: the workers here lost their peers; the rendezvous re-forms the world "
            "without it (not counted against launch.max_restarts)\n") in log, log
    assert ("megashard run: 1 node joined the rendezvous; the workers restart in the larger world (not counted "
            "against launch.max_restarts)\n") in log, log
    changes = [r for r in run.metrics() if "world_change" in r]
    assert [c["world_size"] for c in changes] == [2, 4], changes
    left, joined = changes[0]["world_change"], changes[1]["world_change"]
    assert left["world_size_before"] == 4 and left["nodes_left"] == [f"{os.uname().nodename} (launcher pid {b})"]
    assert joined["world_size_before"] == 2 and joined["nodes_joined"] == [f"{os.uname().nodename} (launcher pid {b2})"]
    assert left["nodes_joined"] == [] and joined["nodes_left"] == []
    for c, before, after in ((left, "tp=2, dp_shard=2", "tp=2, dp_shard=1"), (joined, "tp=2, dp_shard=1",
                                                                              "tp=2, dp_shard=2")):
        assert c["steps_redone"] == c["last_step_before"] - c["resumed_from"] >= 0, c
        assert c["seconds_down"] > 0 and c["seconds_redone"] >= 0, c
        assert c["resumed_from"] % 3 == 0, c  # a checkpoint step
        s, n = c["resumed_from"], c["steps_redone"]
        redone = (f"; {n} step{'s' if n != 1 else ''} redone ("
                  + (f"steps {s + 1}-{s + n}" if n > 1 else f"step {s + n}") + " of the previous start)"
                  if n else "; no step redone")
        line = (f"megashard run: resumed from step {s} ({run.out}/checkpoints/step_{s:08d}), data position restored, "
                f"resharded from {before} to {after}{redone}\n")
        assert line in log, (line, log)
    host = os.uname().nodename
    assert f"megashard run: node {host} (launcher pid {b}) left (world 4 → 2)\n" in log, log
    assert ("megashard run: new world of 2 processes on 1 node: tp=2, dp_shard=1 (16 sequences per rank in 4 "
            "microbatches)\n") in log, log
    assert f"megashard run: node {host} (launcher pid {b2}) joined (world 2 → 4)\n" in log, log
    assert ("megashard run: new world of 4 processes on 2 nodes: tp=2, dp_shard=2 (8 sequences per rank in 2 "
            "microbatches)\n") in log, log
    redone = left["steps_redone"] + joined["steps_redone"]
    assert re.search(rf"  2 restarts or world changes \(world 4 → 2 → 4\): {redone} steps redone, [0-9.]+ s lost\n",
                     log), log
    # the launcher that joined printed its header and nothing of rank 0's
    assert "resumed from" not in run.nodes[2].log() and "Traceback" not in run.nodes[2].log()
    from megashard.train.metrics import world_changes

    assert [label for _, label in world_changes(run.metrics())] == ["world 4→2", "world 2→4"]


def test_the_doctors_records_belong_to_the_world_that_wrote_them(tp2, capsys):
    """Every rank of one world (one rendezvous round) writes into one directory under one run id, though the node that
    joined and the node that stayed have different torchrun restart counts; ``megashard doctor`` diagnoses each world
    alone: the first world's hang (node B killed: its ranks 2 and 3 never came back) is not the last world's."""
    from megashard.cli import main
    from megashard.doctor import read_attempts

    tmp, run, out = tp2
    found = read_attempts(run.out)
    assert not found.damaged and not found.other_runs, (found.damaged, found.other_runs)
    kept = found.kept
    if len(kept) == 4:  # node A alone formed a first world before B joined (a slow start): its workers only started
        assert sorted(kept[0].records) == [0, 1] and {r["reason"] for r in kept[0].records.values()} <= {"start", "terminated"}
        kept = kept[1:]
    worlds = [(a.label, sorted(a.records), {r["world_size"] for r in a.records.values()}) for a in kept]
    assert [(ranks, sizes) for _, ranks, sizes in worlds] == [([0, 1, 2, 3], {4}), ([0, 1], {2}),
                                                             ([0, 1, 2, 3], {4})], worlds
    numbers = []
    for a in kept:
        recs = a.records.values()
        assert len({r["run"] for r in recs}) == 1 and len({r["world"] for r in recs}) == 1, a  # agreed by its ranks
        assert len({r["job"] for r in recs}) == 1 and len({r["launch"] for r in recs}) >= 1, a
        numbers.append(next(iter(recs))["world"])
        want = os.path.join(run.out, "doctor") if numbers[-1] == 0 else os.path.join(run.out, "doctor",
                                                                                      f"restart_{numbers[-1]}")
        assert a.directory == want, (a.directory, want)
    # rendezvous rounds: increasing (node A alone may have formed round 0 before B joined, its workers restarted then)
    assert numbers == sorted(set(numbers)), numbers
    assert len({r["run"] for a in kept for r in a.records.values()}) == 3
    assert len({r["job"] for a in found.kept for r in a.records.values()}) == 1  # A, B and B2: one job
    # The job finished: a world change (node B killed, the world re-formed without it; B2 joined, the world of 2
    # stopped by the agent to grow) is not a hang (issue 40): exit 0, and no table names a hung operation.
    assert main(["doctor", run.out]) == 0
    text = capsys.readouterr().out
    tables = text.split("megashard doctor: ")[1:][len(found.kept) - 3:]
    assert len(tables) == 3, text
    # B's workers: SIGKILLed with their launcher (no record), or stopped by their lifeline's SIGTERM (written)
    assert re.match(rf"{re.escape(run.out)} \({kept[0].label}\): records of [24] of 4 ranks; 0 hung operation\(s\); "
                    "ended in a world change\nno hang recorded", tables[0]), text
    lost = re.search(r"the world ended in a world change, not a hang: rank\(s\) ([0-9, ]+) lost", tables[0])
    assert lost, text
    # B's ranks, named by A's. On the restart path A's own workers end too (torchrun restarts them): one that ended
    # before the peer waiting for it (its own peer-loss exit, e.g. inside a checkpoint save) is named with them, as a
    # process that ended, never as a hang
    for r in set(map(int, lost.group(1).split(", "))) - {2, 3}:
        assert re.search(rf"\n  rank {r}: its process ", tables[0]), text
    assert tables[1].startswith(f"{run.out} ({kept[1].label}): records of "), text
    assert "0 hung operation(s)" in tables[1].splitlines()[0] and "no hang recorded" in tables[1], text
    if "no record from" in tables[1]:  # a rank stopped before its SIGTERM record (blocked in a call)
        assert "stopped before they could write one (the job went on in a new world" in tables[1], text
    assert tables[2].startswith(f"{run.out} (restart {numbers[2]}): records of 4 of 4 ranks; 0 hung operation(s)\n"
                                "no hang recorded"), text
    assert "no record from" not in tables[2], text
    for lag in re.findall(r"  (-?[0-9.]+) ms \((-?[0-9.]+)% of the step\)", text):  # the stragglers' lags
        assert float(lag[0]) >= 0 and float(lag[1]) >= 0, text


@pytest.mark.parametrize("name", ["pp2", "hsdp"])
def test_the_same_with_a_pipeline_and_with_hsdp(tmp_path_factory, name):
    """pp2: the node of rank 0 is killed (the test process hosts the rendezvous store): rank 0 — the metrics writer,
    the checkpoint directory's lock, the run id — moves to the other node and the job goes on as one run. HSDP: node B
    is killed while a checkpoint is being written; the world of 2 resumes from the one before (the newest complete
    one: a half-written checkpoint is never loaded). Both: the losses equal the reference's."""
    from megashard.checkpoint.safety import list_checkpoints, run_of

    tmp, run, out = _scenario(tmp_path_factory, name, during_save=name == "hsdp", kill=0 if name == "pp2" else 1)
    survivor = "B" if name == "pp2" else "A"
    assert out["codes"] == {survivor: 0, "B2": 0}, "\n".join(n.log() for n in run.nodes)
    _check_parity(tmp, run, name)
    log = "".join(n.log() for n in run.nodes)  # rank 0's lines: on whichever node holds it
    assert "Traceback" not in log and "took over the lock" not in log, log
    ckpt = os.path.join(run.out, "checkpoints")
    assert not os.path.exists(os.path.join(ckpt, ".megashard.lock"))  # released by the last rank 0
    assert len({run_of(e.path) for e in list_checkpoints(ckpt)}) == 1  # one run, whichever node saved
    if name == "pp2":
        a = run.nodes[0].proc.pid
        assert f"megashard run: node {os.uname().nodename} (launcher pid {a}) left (world 4 → 2)\n" in run.nodes[1].log()
    if name == "hsdp":
        saving = out["saving_at_kill"]
        assert len(saving) == 1 and re.fullmatch(r"\.tmp-step_\d{8}", saving[0]), out
        n = int(saving[0][-8:])
        # B died while step n was being written: the world of 2 resumed from step n - 3, the newest complete one (or,
        # had every rank's part been written and published before the kill, from a complete step n)
        assert out["resumed_at_2"] in (n - 3, n), out
        first = [r for r in run.metrics() if "world_change" in r][0]["world_change"]
        assert first["resumed_from"] == out["resumed_at_2"] and first["last_step_before"] >= n, first
    world2, world4 = {"pp2": ("pp=2, dp_shard=1 (16 sequences per rank in 4 microbatches, 1f1b)",
                              "pp=2, dp_shard=2 (8 sequences per rank in 2 microbatches, 1f1b)"),
                      "hsdp": ("dp_shard=2 (8 sequences per rank in 2 microbatches)",
                               "dp_outer=2, dp_shard=2 (4 sequences per rank in 1 microbatch)")}[name]
    assert f"megashard run: new world of 2 processes on 1 node: {world2}\n" in log, log
    assert f"megashard run: new world of 4 processes on 2 nodes: {world4}\n" in log, log


def _digest(root):
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.startswith(".megashard.lock"):
                continue
            p = os.path.join(d, f)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_a_world_the_fixed_axes_cannot_fill_stops_or_waits_in_one_line_and_loses_nothing(tp2, tmp_path):
    tmp, _, _ = tp2
    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(tmp, "ref", "checkpoints"), ckpt)  # the tp=2 reference's: where the job resumes
    before = _digest(ckpt)
    # tp=4 cannot run on one node of 2 processes
    extra = COMMON[1:] + [f"train.steps={STEPS + 2}", "parallel.tp=4", f"checkpoint.dir={ckpt}"]
    stop = ElasticRun(str(tmp_path / "stop"), "configs/default.yaml", extra + ["launch.unfillable_world=stop"],
                      last_call=1)
    try:
        assert stop.node("A").wait(stop.timeout) == 2
    finally:
        stop.stop_all()
    log = stop.nodes[0].log()
    line = ("megashard run: the rendezvous formed a world of 2 processes (1 node), which this job cannot fill: world "
            "size 2 is not divisible by tp=4·cp=1·pp=1·dp_outer=1 = 4; valid products for this world: 1, 2; world "
            "sizes that run: 4 (2 nodes); stopping (launch.unfillable_world=stop)\n")
    assert line in log and log.count("cannot fill") == 1, log
    assert log.endswith("megashard run: the job stopped on the error above; not restarted: a restart cannot fix "
                        "it\n"), log
    assert _digest(ckpt) == before and sorted(os.listdir(ckpt)) == [f"step_{s:08d}" for s in range(3, STEPS + 1, 3)]
    # wait: the lone node says so and waits; a second node joins and the job runs at world 4, resharded tp=2 -> tp=4
    wait = ElasticRun(str(tmp_path / "wait"), "configs/default.yaml", extra, last_call=1)
    try:
        a = wait.node("A")
        wait.wait_for(lambda m: "cannot fill" in a.log(), "the unfillable line", metrics=False)
        assert _digest(ckpt) == before
        b = wait.node("B")
        assert a.wait(wait.timeout) == 0 and b.wait(wait.timeout) == 0, a.log()
    finally:
        wait.stop_all()
    log = a.log()
    assert "waiting for a node to join or leave (launch.unfillable_world=wait; nothing is written)\n" in log, log
    assert (f"megashard run: resumed from step {STEPS} ({ckpt}/step_{STEPS:08d}), data position restored, resharded "
            "from tp=2, dp_shard=2 to tp=4, dp_shard=1") in log, log
    assert [r["world_size"] for r in wait.metrics() if r["step"] > STEPS] == [4, 4], wait.metrics()
