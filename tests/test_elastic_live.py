"""Live recovery end to end (issue 36): launchers on localhost, nodes killed with SIGKILL and started again, and the
surviving workers never restart.

Each scenario runs ``launch.nnodes=1:2`` (or ``1:3``) with 2 gloo processes per launcher, ``launch.recovery: live``
(the default) and a c10d rendezvous (:mod:`tests._elastic`), and compares every step's loss and the final parameters
with an uninterrupted world-4 run of the same config (float64: equal to rounding, within 1e-5 relative). What a
restart would change is checked directly: the workers of the surviving node keep their process ids through every
change, each ``world_change`` record redoes at most one step (the step in flight) and takes its state from memory
(``state_from: memory``: no checkpoint read), and no process is left behind.

Scenarios: tensor parallel 2 with FSDP absorbing the world and a copy of every shard on the other node
(``checkpoint.memory_copies: 1``); a pipeline (pp=2) whose rank-0 node is killed (the test process hosts the
rendezvous store); HSDP (``dp_outer: auto``) with no copies — the other replica holds every shard — killed while a
checkpoint is written; an MoE layout (ep=2); a node that leaves and joins again at once (flapping); two of three
nodes lost within a second (the second while the world re-forms).
"""
from __future__ import annotations

import os
import re
import time

import pytest

from tests._elastic import ElasticRun, _saving, loss_differences, param_difference, reference, top

STEPS = 15
COMMON = [f"train.steps={STEPS}", "checkpoint.interval=3", "checkpoint.keep=0", "train.dtype=float64",
          "train.plot=false", "train.micro_batch_size=4", "train.doctor=false", "launch.recovery=live"]
SCENARIOS = {
    "tp2-fsdp": ("configs/default.yaml", ["parallel.dp_shard=auto", "checkpoint.memory_copies=1"]),
    "pp2": ("configs/pp.yaml", ["parallel.tp=1", "parallel.dp_shard=auto", "train.microbatches=null"]),
    "hsdp": ("configs/hsdp.yaml", ["parallel.dp_outer=auto", "parallel.dp_shard=2", "checkpoint.memory_copies=0"]),
    "moe": ("configs/moe-ep.yaml", ["parallel.dp_shard=auto"]),
}
TOLERANCE = 1e-5
#: launch.rdzv_node_timeout: generous, so that a loaded machine's late heartbeat is not a node lost (a join waits for
#: the killed node to count as gone in torch's rendezvous; the survivors themselves do not wait for it)
NODE_TIMEOUT = 10


def _worker_pids(out: str) -> dict:
    """``{pid: parent pid}`` of the workers of the run in ``out`` still alive (their command line names its config)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode("utf-8", "replace")
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "megashard.launch.worker" in cmd and os.path.join(out, "config.yaml") in cmd:
            found[int(pid)] = ppid
    return found


def _worker_pids_of(script: str) -> dict:
    """``{pid: parent pid}`` of the live processes running ``script``."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode("utf-8", "replace")
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if script in cmd and "megashard.launch.agent" not in cmd:
            found[int(pid)] = ppid
    return found


def _left_behind(run: ElasticRun) -> list:
    """Processes of the run still alive after every launcher ended (a second to let them go)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _worker_pids(run.out):
        time.sleep(0.2)
    return sorted(_worker_pids(run.out))


def _worlds(records):
    out = []
    for r in records:
        if not out or out[-1] != r["world_size"]:
            out.append(r["world_size"])
    return out


def _check_parity(tmp, run, name, worlds=(4, 2, 4)):
    from megashard.train.metrics import read_metrics

    want = read_metrics(os.path.join(tmp, "ref", "metrics.jsonl"))
    got = run.metrics()
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), [r["step"] for r in got]
    assert _worlds(got) == list(worlds), [(r["step"], r["world_size"]) for r in got]
    diff = loss_differences(want, got)
    worst = max(diff, key=diff.get)
    params = param_difference(os.path.join(tmp, "ref", "checkpoints"), os.path.join(run.out, "checkpoints"))
    print(f"\n{name}: largest relative loss difference {diff[worst]:.2e} (step {worst}), final parameters "
          f"{params:.2e}; worlds {[(r['step'], r['world_size']) for r in got]}")
    assert diff[worst] <= TOLERANCE, (name, worst, diff[worst])
    assert params <= TOLERANCE, (name, params)


def _check_changes(run, n):
    """``n`` world changes after the first step (a node that started late may join the first world before it), each
    from memory with at most the step in flight redone."""
    changes = [r["world_change"] for r in run.metrics() if "world_change" in r and r["step"] > 1]
    assert len(changes) == n, changes
    for c in changes:
        assert c["state_from"] == "memory", c
        assert c["steps_redone"] <= 1, c
    return changes


def _live_scenario(tmp_path_factory, name, *, kill=1, during_save=False, check=None):
    """Nodes A and B at world 4; node ``kill`` SIGKILLed after step 5 (``during_save``: while the next checkpoint is
    written); the survivor trains 3 steps at world 2 (held there); B2 joins; the job finishes at world 4. The
    survivor's worker pids are noted at world 4, at world 2 and at the end."""
    config, extra = SCENARIOS[name]
    tmp = str(tmp_path_factory.mktemp(f"live-{name}"))
    ref = reference(os.path.join(tmp, "ref"), config, COMMON + extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = ElasticRun(os.path.join(tmp, "el"), config, COMMON + extra, host_store=kill == 0, node_timeout=NODE_TIMEOUT,
                     check=check)
    out: dict = {"pids": []}
    try:
        _start_at_world(run, 4)
        run.wait_for(lambda m: top(m, world=4) >= 5, "step 5 at world 4")
        survivor = run.nodes[1 - kill]
        mine = lambda: {p for p, pp in _worker_pids(run.out).items() if _agent_of(pp) == survivor.proc.pid}  # noqa: E731
        out["pids"].append(mine())
        saving: list = []
        if during_save:
            deadline = time.monotonic() + run.timeout
            while not saving and time.monotonic() < deadline:
                saving = _saving(os.path.join(run.out, "checkpoints"))
                time.sleep(0.001)
        out["saving_at_kill"] = saving
        t_kill = run.nodes[kill].kill()
        run.wait_for(lambda m: run.world().get("world_size") == 2 and run.world().get("time", 0) > t_kill,
                     "the world of 2 after the kill", metrics=False)
        s2 = run.world()["start_step"]
        run.wait_for(lambda m: top(m, world=2, after=s2) >= s2 + 3, "3 steps at world 2")
        run.pause()
        out["pids"].append(mine())
        t_join = time.time()
        b2 = run.node("B2")
        run.wait_for(lambda m: run.world().get("world_size") == 4 and run.world().get("time", 0) > t_join,
                     "the world of 4 after B2 joined", metrics=False)
        out["pids"].append(mine())
        run.go_on()
        out["codes"] = {survivor.name: survivor.wait(run.timeout), "B2": b2.wait(run.timeout)}
    finally:
        run.stop_all()
    out["left_behind"] = _left_behind(run)
    return tmp, run, out


def _start_at_world(run: ElasticRun, world: int) -> None:
    """Nodes A, B (, C) started, held before the first step until the world has ``world`` processes (a node that
    starts late joins the one before it at a step boundary)."""
    run.pause()
    run.node("A")
    run.wait_store()
    for name in ("B", "C")[: world // 2 - 1]:
        run.node(name)
    run.wait_for(lambda m: run.world().get("world_size") == world, f"the world of {world}", metrics=False)
    run.go_on()


def _agent_of(ppid: int) -> int:
    """The launcher (megashard run) above a worker's parent (torchrun's agent)."""
    try:
        with open(f"/proc/{ppid}/stat", encoding="utf-8") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    yield _live_scenario(tmp_path_factory, "tp2-fsdp", check=True)  # the first launcher checks, a joining one not


def test_a_node_killed_and_one_joining_leave_the_survivors_running_and_the_loss_of_an_uninterrupted_run(tp2):
    tmp, run, out = tp2
    assert out["codes"] == {"A": 0, "B2": 0}, run.nodes[0].log()
    assert out["left_behind"] == [], out
    first, at_2, at_4 = out["pids"]
    assert len(first) == 2 and first == at_2 == at_4, out["pids"]  # the same two processes throughout
    _check_parity(tmp, run, "tp=2, dp_shard absorbing, memory_copies=1")
    left, joined = _check_changes(run, 2)
    assert left["world_size_before"] == 4 and joined["world_size_before"] == 2


def test_each_live_change_is_told_in_one_line_each(tp2):
    tmp, run, out = tp2
    log = run.nodes[0].log()
    b, b2 = run.nodes[1].proc.pid, run.nodes[2].proc.pid
    host = os.uname().nodename
    assert "Traceback" not in log and "torchrun:" not in log and "frame #" not in log, log
    assert "restarts the job" not in log and "the workers here lost their peers" not in log, log
    assert ("megashard run: 1 node joined the rendezvous; the running workers take it in at their next step (no "
            "restart)\n") in log, log
    assert f"megashard run: node {host} (launcher pid {b}) left (world 4 → 2)\n" in log, log
    assert f"megashard run: node {host} (launcher pid {b2}) joined (world 2 → 4)\n" in log, log
    lines = re.findall(r"megashard run: re-formed in place \(no restart\): state of step (\d+) from the memory of "
                       r"the surviving ranks; (no step redone|1 step redone \(step \d+ of the previous start\))\n", log)
    assert len(lines) == 2, log
    assert "resumed from" not in log, log  # no checkpoint was read
    # the check before launch: the first launcher ran it; B found the store answering (A's) and did not run it again
    assert "megashard run: collectives: OK: " in log, log
    for node in run.nodes[1:]:
        assert "megashard run: collectives: not checked again: this node joins a running job\n" in node.log(), node.log()
        assert "collectives: OK" not in node.log(), node.log()


@pytest.mark.long
@pytest.mark.parametrize("name", ["pp2", "hsdp", "moe"])
def test_the_same_with_a_pipeline_hsdp_replicas_and_experts(tmp_path_factory, name):
    """pp2: the node of rank 0 is killed (the test process hosts the rendezvous store): rank 0's duties move to the
    survivor. HSDP without memory copies: the other replica holds every shard; the node is killed while a checkpoint
    is written, and no half-written checkpoint is ever published. MoE: experts over ep=2 re-laid out (expt_dp)."""
    from megashard.checkpoint.safety import list_checkpoints

    tmp, run, out = _live_scenario(tmp_path_factory, name, kill=0 if name == "pp2" else 1, during_save=name == "hsdp")
    survivor = "B" if name == "pp2" else "A"
    assert out["codes"] == {survivor: 0, "B2": 0}, "\n".join(n.log() for n in run.nodes)
    assert out["left_behind"] == [], out
    first, at_2, at_4 = out["pids"]
    assert len(first) == 2 and first == at_2 == at_4, out["pids"]
    _check_parity(tmp, run, name)
    _check_changes(run, 2)
    log = "".join(n.log() for n in run.nodes)
    assert "Traceback" not in log and "frame #" not in log, log
    ckpt = os.path.join(run.out, "checkpoints")
    assert all(e.complete for e in list_checkpoints(ckpt)), list_checkpoints(ckpt)
    if name == "hsdp":
        assert len(out["saving_at_kill"]) == 1, out


@pytest.mark.long
def test_a_flapping_node_and_a_double_fault(tmp_path_factory):
    """B leaves and a new node joins at once (within the survivors' re-formation); then, with three nodes, two are
    killed half a second apart (the second while the world re-forms without the first): the survivor ends alone,
    with the uninterrupted run's loss, and nothing is left running."""
    config, extra = SCENARIOS["tp2-fsdp"]
    tmp = str(tmp_path_factory.mktemp("live-faults"))
    common = COMMON + ["train.global_batch=24", "parallel.timeout=60"]
    ref = reference(os.path.join(tmp, "ref"), config, common + extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = ElasticRun(os.path.join(tmp, "el"), config, common + extra, nnodes="1:3", node_timeout=NODE_TIMEOUT)
    try:
        _start_at_world(run, 4)
        a = run.nodes[0]
        run.wait_for(lambda m: top(m, world=4) >= 3, "step 3 at world 4")
        run.pause()
        run.nodes[1].kill()
        run.node("B2")  # flapping: a node back at once, while the survivor re-forms without B
        run.node("C")
        run.wait_for(lambda m: run.world().get("world_size") == 6, "the world of 6", metrics=False)
        s6 = run.world()["start_step"]
        run.go_on()
        run.wait_for(lambda m: top(m, world=6, after=s6) >= s6 + 2, "2 steps at world 6")
        run.nodes[2].kill()
        time.sleep(0.5)
        run.nodes[3].kill()  # while the survivors re-form without B2
        assert a.wait(run.timeout) == 0, a.log()
    finally:
        run.stop_all()
    assert _left_behind(run) == []
    got = run.metrics()
    assert got[-1]["world_size"] == 2, _worlds(got)
    log = a.log()
    assert "joined (world 2 → 6)\n" in log and "left (world 6 → 2)\n" in log, log
    from megashard.train.metrics import read_metrics

    diff = loss_differences(read_metrics(os.path.join(tmp, "ref", "metrics.jsonl")), got)
    assert max(diff.values()) <= TOLERANCE, diff
    changes = [r["world_change"] for r in got if "world_change" in r and r["world_change"]["nodes_left"]]
    for c in changes[:-1]:  # the flapping node: from memory, the step in flight redone at most
        assert c["state_from"] == "memory" and c["steps_redone"] <= 1, changes
    # two of three nodes lost: the shards of one of them were copied only to the other (checkpoint.memory_copies=1),
    # so the survivor reads the newest checkpoint — in the same processes (none yet: from step 0; metrics.jsonl then
    # holds the survivor's steps only)
    assert changes[-1]["world_size_before"] in (4, 6) and changes[-1]["state_from"] in ("memory", "checkpoint",
                                                                                         "none"), changes
    assert "Traceback" not in log and "frame #" not in log, log


@pytest.mark.long
def test_a_users_own_loop_under_live_loop_survives_a_kill_and_a_join(tmp_path):
    """megashard.live.LiveLoop around a loop of the user's own (tests/_live_loop_script.py: FSDP2 over dp, AdamW),
    two launchers of megashard's agent with MEGASHARD_RECOVERY=live: one killed, one joining; the losses and the final
    parameters equal an uninterrupted world-4 run of the same script (float64), from memory, processes kept."""
    import json
    import signal
    import subprocess
    import sys

    import torch

    from tests._elastic import ROOT, Node, _listening, free_port

    script = os.path.join(ROOT, "tests", "_live_loop_script.py")
    steps = 14
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    ref.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           script, str(steps)], cwd=ROOT, env={**env, "LIVE_LOOP_OUT": str(ref)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    live = tmp_path / "live"
    live.mkdir()
    pause = str(tmp_path / "pause")
    port = free_port()
    argv = [sys.executable, "-m", "megashard.launch.agent", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"loop-{port}",
            "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=4,keep_alive_max_attempt=3", "--max-restarts", "0",
            script, str(steps)]
    # every step at least 0.3 s: seeing a step and holding the world (the pause file) must come before the world
    # could run to the end (at full speed it once did, between the poll and the pause: the job ended, the joining
    # node found the rendezvous closed)
    lenv = {**env, "LIVE_LOOP_OUT": str(live), "MEGASHARD_PAUSE_FILE": pause, "MEGASHARD_RECOVERY": "live",
            "LIVE_LOOP_STEP_S": "0.3"}

    def records():
        try:
            with open(live / "losses.jsonl", encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def world_size():
        try:
            with open(live / "world.json", encoding="utf-8") as f:
                return json.load(f)["world_size"]
        except (OSError, ValueError):
            return 0

    def wait(cond, what, timeout=300):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, (what, [n.log()[-3000:] for n in nodes])
            time.sleep(0.1)

    nodes = []
    try:
        open(pause, "w").close()  # both nodes in the first world
        nodes.append(Node("A", argv, lenv, str(tmp_path / "A.log")))
        wait(lambda: _listening(port), "A hosting the rendezvous store")  # the node killed below must not host it
        nodes.append(Node("B", argv, lenv, str(tmp_path / "B.log")))
        wait(lambda: world_size() == 4, "world 4")
        pids = {p for p, pp in _worker_pids_of(script).items() if pp == nodes[0].proc.pid}
        os.remove(pause)
        wait(lambda: any(r["world_size"] == 4 and r["step"] >= 4 for r in records()), "step 4 at world 4")
        open(pause, "w").close()
        t_kill = nodes[1].kill()
        wait(lambda: world_size() == 2, "world 2")
        os.remove(pause)
        wait(lambda: any(r["world_size"] == 2 and r["time"] > t_kill for r in records()), "steps at world 2")
        open(pause, "w").close()
        nodes.append(Node("B2", argv, lenv, str(tmp_path / "B2.log")))
        wait(lambda: world_size() == 4, "world 4 again")
        kept = {p for p, pp in _worker_pids_of(script).items() if pp == nodes[0].proc.pid}
        os.remove(pause)
        assert nodes[0].wait(600) == 0, nodes[0].log()
        assert nodes[2].wait(600) == 0, nodes[2].log()
    finally:
        for n in nodes:
            if n.alive():
                os.killpg(n.proc.pid, signal.SIGKILL)
    assert len(pids) == 2 and kept == pids, (pids, kept)
    with open(ref / "losses.jsonl", encoding="utf-8") as f:
        want = {json.loads(line)["step"]: json.loads(line)["loss"] for line in f}
    got: dict = {}
    for r in records():
        got[r["step"]] = r["loss"]  # a step trained again after a loss replaces the first
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    a, b = torch.load(ref / "params.pt"), torch.load(live / "params.pt")
    pworst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"\nLiveLoop: largest relative loss difference {worst:.2e}, parameters {pworst:.2e}")
    assert worst <= TOLERANCE and pworst <= 1e-9, (worst, pworst)
    worlds = json.load(open(live / "worlds.json", encoding="utf-8"))
    later = [w for w in worlds if w["start"] > 0]  # a node that started late joined the first world at step 0
    assert later and all(w["state_from"] == "memory" for w in later), worlds
    assert any(w["world_size"] == 2 for w in worlds), worlds
    log = nodes[0].log()
    assert "Traceback" not in log and "frame #" not in log, log


@pytest.mark.parametrize("override, field", [("launch.recovery=inplace", "launch.recovery='inplace'"),
                                             ("checkpoint.memory_copies=2", "checkpoint.memory_copies=2")])
def test_a_bad_recovery_setting_is_one_line_naming_the_field_and_the_choices(override, field):
    from megashard.errors import ConfigError
    from megashard.train.config import JobConfig

    with pytest.raises(ConfigError) as e:
        JobConfig.from_yaml("configs/default.yaml", [override, "launch.nnodes=1:2", "launch.nproc_per_node=2",
                                                     "launch.rdzv_endpoint=localhost:29500"]).validate()
    text = str(e.value)
    assert field in text and "\n" not in text, text
    assert ("live" in text and "restart" in text) if "recovery" in field else "0 or 1" in text, text


def test_a_survivor_without_a_decision_in_time_fails_over_in_one_line(monkeypatch):
    """The survivors' leader was lost while it decided (it registered as leader, no decision follows): a survivor
    waits ``parallel.timeout`` (2 s here) for the decision, then gives up re-forming in place with the reason, and
    says so in one line that names the restart path. A real store; no processes."""
    from datetime import timedelta

    import torch.distributed as dist

    from megashard.train.live_world import LiveWorld, ReformTimeout, failover_line
    from tests._elastic import free_port

    port = free_port()
    server = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"t{port}")
    world = LiveWorld(f"localhost:{port}", f"t{port}", "gloo", timeout=2.0)
    world.root.set("r0/leader", "3")  # rank 3 took the lead, then its node went down
    with pytest.raises(ReformTimeout) as e:
        world._agree("r0", 1, ["a", "a", "b", "b"])
    assert "no decision from the survivors' leader, rank 3" in str(e.value), e.value
    line = failover_line(1, 2.0, str(e.value))
    assert "\n" not in line and "parallel.timeout=2 s" in line and "restart path" in line, line
    del server


def test_the_leader_waits_for_a_node_that_answered_the_abort_and_not_for_one_that_is_gone(monkeypatch):
    """The survivors' leader (rank 0 of nodes a, a, b, b, c, c) decides on a real store, no processes: node b's
    watcher answered the abort (``here``) but its ranks register only 1.5 s later — three grace periods — and are
    members; node c neither answered nor registered (its processes are gone): left out, and named gone (its agent's
    place in torch's rendezvous is freed; a live node left out is not named)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from megashard.train.live_world import LiveWorld
    from tests._elastic import free_port

    port = free_port()
    server = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"t{port}")
    monkeypatch.setenv("MEGASHARD_LIVE_GRACE_S", "0.5")
    world = LiveWorld(f"localhost:{port}", f"t{port}", "gloo", timeout=30.0)
    nodes = ["a", "a", "b", "b", "c", "c"]
    for r in (0, 1):
        world.root.set(f"r0/alive/{r}", "1")
    world.root.set("r0/here/2", "1")  # b's watcher saw the abort; its main thread is still leaving the collective

    def b_registers_late() -> None:
        time.sleep(1.5)
        for r in (2, 3):
            world.root.set(f"r0/alive/{r}", "1")
            world.root.add("r0/count", 1)

    late = threading.Thread(target=b_registers_late)
    late.start()
    t0 = time.monotonic()
    decision = world._decide("r0", nodes, world.root.add("r0/count", 2))
    waited = time.monotonic() - t0
    late.join()
    assert decision == {"members": [0, 1, 2, 3], "prefix": "r0.1", "gone": ["c"]}, decision
    assert waited >= 1.5, waited  # b was waited for, though silent for longer than the grace period
    # no node answered but a: the leader closes the world after the grace period, without b and c
    for r in (0, 1):
        world.root.set(f"r1/alive/{r}", "1")
    decision = world._decide("r1", nodes, world.root.add("r1/count", 2))
    assert decision["members"] == [0, 1] and decision["gone"] == ["b", "c"], decision
    del server


def test_ctrl_c_on_an_elastic_launcher_says_the_job_goes_on_without_this_node(tmp_path):
    """Issue 40: the advice after a Ctrl-C is true for an elastic job (the other nodes train on; rerunning joins
    them), and unchanged for a job of fixed size."""
    import json

    from megashard.launch.launcher import stopped_line
    from megashard.train.config import JobConfig

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0, "time": 100.0}) + "\n")
    elastic = JobConfig.from_yaml("configs/default.yaml", [f"train.out_dir={out}", "launch.nnodes=1:2"])
    assert stopped_line(elastic, 50.0) == (
        "this node left the job at step 7; the other nodes, if any, train on without it: rerun the same command to "
        "join them again (or, once the job has ended, to resume it from the start)")
    fixed = JobConfig.from_yaml("configs/default.yaml", [f"train.out_dir={out}"])
    assert stopped_line(fixed, 50.0) == "stopped at step 7; no checkpoint was saved: rerun the same command to start again"


@pytest.mark.long
def test_the_rendezvous_host_lost_ends_the_job_in_a_few_lines(tmp_path):
    """Node A hosts the rendezvous store (launch.rdzv_endpoint). When it is killed, the survivor either re-forms
    before the store goes down (it then trains on, and its launcher fails at the end, where torchrun's agents meet in
    the store) or finds the store gone and stops with one line (its workers', or its agent's when the agent's
    heartbeat finds it first); in every case without C++ traces, with nothing left running and no half-written
    checkpoint."""
    from megashard.checkpoint.safety import list_checkpoints

    config, extra = SCENARIOS["tp2-fsdp"]
    run = ElasticRun(str(tmp_path / "el"), config, COMMON + extra, node_timeout=NODE_TIMEOUT)
    try:
        _start_at_world(run, 4)
        run.wait_for(lambda m: top(m, world=4) >= 4, "step 4 at world 4")
        run.nodes[0].kill()
        code = run.nodes[1].wait(run.timeout)
    finally:
        run.stop_all()
    log = run.nodes[1].log()
    assert code != 0, log
    gone = log.count("the rendezvous host (localhost:")
    # three outcomes: the workers find the store gone (their line), or re-formed before it went (they train on), or
    # the launcher's agent finds it gone first and stops the workers (its line)
    agent = log.count(f"the rendezvous store at localhost:{run.port} is gone")
    assert (gone == 1 and "cannot re-form without its store" in log or gone == 0 and "re-formed in place" in log
            or gone == 0 and agent == 1), log
    assert "Traceback" not in log and "frame #" not in log, log
    assert _left_behind(run) == []
    assert all(e.complete for e in list_checkpoints(os.path.join(run.out, "checkpoints")))
