"""The doctor's files after the fact, and its pure parts, without processes.

- records belong to a run: an earlier 8-rank run's files next to the current 4-rank run's are ignored and counted
  (the earlier run's hang is not this run's); a restart directory of an earlier launch too;
- a damaged or ill-typed record is named (file, key, expected type) and skipped; when every record is damaged the
  message says so (not ``train.doctor=false``);
- ``megashard.doctor.enable`` checks its arguments as the config checks ``parallel.timeout`` (one line each);
- the call published on entry merges into a record; wait-for cycles; the straggler statistics on synthetic waits
  (a slow rank is named, the ranks that only waited for it are not, no rank is named under symmetric noise).
"""
from __future__ import annotations

import json
import math
import os
import random

import pytest

from megashard.cli import main


def _rec(rank: int, world: int, run: str, started: float, *, launch: str | None = "L1", findings=None,
         reason: str = "exit", groups=None, waits=None) -> dict:
    return {"run": run, "launch": launch, "attempt": 0, "started": started, "rank": rank, "world_size": world,
            "host": "h", "pid": 100 + rank, "beat": 5, "time": started + 10, "step": 3, "entries": 7,
            "groups": groups or {"world": {"seq": 3}}, "open": [], "last": {"group": "world", "name": "world",
                                                                            "op": "all_reduce", "seq": 3, "step": 3},
            "idle_s": 0.1, "state": "exited" if reason == "exit" else "failed", "reason": reason, "timeout": 4.0,
            "findings": findings or [], "group_ranks": {"world": {"first": 0, "stride": 1, "count": world}},
            "peers": "world", "waits": waits}


def _write(d: str, rec: dict, name: str | None = None) -> str:
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name or f"rank_{rec['rank']}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    return path


def _hang_finding(rank: int) -> dict:
    return {"rank": rank, "group": "tp:4", "name": "tp", "ranks": [4, 5], "op": "all_reduce", "seq": 9, "step": 7,
            "p2p": [], "waited_s": 4.0, "culprits": [{"rank": 5, "reached": False, "alive": True,
                                                      "doing": "waiting in barrier #2 on world", "step": 7}],
            "line": "…"}


def test_an_earlier_runs_records_are_ignored_and_counted(tmp_path, capsys):
    """An 8-rank run hung (rank 4 waited for rank 5); a later 4-rank run ended cleanly in the same directory. Before,
    the table showed the 8-rank run's hang as this run's ('records of 8 of 8 ranks; 1 hung operation')."""
    d = str(tmp_path / "doctor")
    for r in range(8):
        _write(d, _rec(r, 8, "run-A", 1000.0, launch="A", reason="hang" if r == 4 else "failure",
                       findings=[_hang_finding(4)] if r == 4 else None))
    for r in range(4):
        _write(d, _rec(r, 4, "run-B", 2000.0, launch="B"))
    assert main(["doctor", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"megashard doctor: {tmp_path}: records of 4 of 4 ranks; 0 hung operation(s)", out
    assert out[1].startswith("no hang recorded"), out
    assert any(line.startswith("ignored 4 record(s) of 1 other run(s)") and "run-A" in line for line in out), out
    assert main(["doctor", str(tmp_path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"] == "run-B" and data["world_size"] == 4 and data["ignored_other_runs"] == {"run-A": [4, 5, 6, 7]}


def test_the_current_run_is_the_newest_even_when_it_hung(tmp_path, capsys):
    d = str(tmp_path / "doctor")
    for r in range(8):
        _write(d, _rec(r, 8, "run-A", 1000.0, launch="A"))
    for r in range(8):  # the current run: 8 ranks as well, rank 4 hung
        _write(d, _rec(r, 8, "run-B", 2000.0, launch="B", reason="hang" if r == 4 else "failure",
                       findings=[_hang_finding(4)] if r == 4 else None))
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("records of 8 of 8 ranks; 1 hung operation(s)"), out
    assert " ".join(out[2].split()).startswith("tp [4, 5] all_reduce #9 7 4 rank 5: waiting in barrier #2"), out


def test_a_restart_directory_of_an_earlier_launch_is_not_this_runs(tmp_path, capsys):
    """The earlier launch restarted once (doctor/restart_1/ holds its hang); the current launch ran once, cleanly."""
    d = str(tmp_path / "doctor")
    for r in range(2):
        _write(os.path.join(d, "restart_1"), _rec(r, 2, "run-A1", 1100.0, launch="A", reason="hang",
                                                  findings=[_hang_finding(r)] if r == 0 else None))
        _write(d, _rec(r, 2, "run-B0", 2000.0, launch="B"))
    assert main(["doctor", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 hung" not in out and "restart 1" not in out and "ignored 2 record(s)" in out, out


@pytest.mark.parametrize("damage, words", [
    (lambda r: r.update(groups=["world", 3]), "key 'groups' must be an object (group -> counters), found ['world', 3]"),
    (lambda r: r.pop("world_size"), "key 'world_size' is missing (an integer >= 1)"),
    (lambda r: r.update(rank="1"), "key 'rank' must be an integer >= 0, found '1'"),
    (lambda r: r.update(open=[{"group": "world", "op": "all_reduce", "seq": "4"}]),
     "open[0]: key 'seq' must be an integer, found '4'"),
    (lambda r: r.update(findings=[dict(_hang_finding(1), culprits=[{"rank": 5}])]),
     "findings[0].culprits[0] must be an object with rank (integer), reached (true/false), doing (string)"),
    (lambda r: r.update(groups={"world": {"seq": 3.5}}), "key 'groups.world' must be an object with an integer 'seq'"),
])
def test_a_damaged_record_is_named_and_skipped(tmp_path, capsys, damage, words):
    """Before: a ValueError or KeyError traceback (int('1'), rec['world_size'], ...)."""
    d = str(tmp_path / "doctor")
    _write(d, _rec(0, 2, "run-A", 1000.0))
    bad = _rec(1, 2, "run-A", 1000.0)
    damage(bad)
    path = _write(d, bad, "rank_1.json")
    assert main(["doctor", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == f"megashard doctor: warning: {path}: {words}: skipped", captured.err
    assert "records of 1 of 2 ranks" in captured.out
    # its file is there: rank 1 is not said to be killed before it wrote one
    assert "rank(s) 1: the record is damaged (named above), so what they did is unknown" in captured.out, captured.out
    assert "no record from rank(s) 1" not in captured.out, captured.out


def test_when_every_record_is_damaged_the_message_says_what_was_found(tmp_path, capsys):
    d = str(tmp_path / "doctor")
    os.makedirs(d)
    with open(os.path.join(d, "rank_0.json"), "w") as f:
        f.write("{not json")
    _write(d, [1, 2, 3], "rank_1.json")
    _write(d, dict(_rec(2, 4, "r", 1.0), rank=3), "rank_2.json")
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4, err
    assert "rank_0.json: is not valid JSON" in err[0]
    assert "rank_1.json: not a doctor record: a JSON object is expected, found list" in err[1]
    assert "rank_2.json: key 'rank' is 3 in the file of rank 2" in err[2]
    assert "every doctor record found (3 file(s), named above) is damaged" in err[3], err
    assert "train.doctor=false" not in err[3]


@pytest.mark.parametrize("kwargs, words", [
    ({"timeout": "10"}, "megashard.doctor.enable(timeout='10'): timeout must be a positive number of seconds, at most "
                        "1e+09 (as parallel.timeout)"),
    ({"timeout": math.nan}, "enable(timeout=nan): timeout must be a positive number of seconds"),
    ({"timeout": math.inf}, "enable(timeout=inf): timeout must be a positive number of seconds"),
    ({"timeout": -1}, "enable(timeout=-1): timeout must be a positive number"),
    ({"timeout": True}, "enable(timeout=True): timeout must be a positive number"),
    ({"timeout": 10, "interval": 0}, "enable(interval=0): interval must be a positive number of seconds, at most 1e+01"),
    ({"timeout": 10, "interval": 60}, "enable(interval=60): interval must be a positive number of seconds, at most"),
    ({"timeout": 10, "out_dir": 5}, "enable(out_dir=5): a directory path (str) is expected"),
    ({"timeout": 10, "stream": object()}, "a text stream (with write) is expected"),
    ({"state": "tp", "timeout": 10}, "enable(state='tp'): a megashard ParallelState is expected"),
])
def test_enable_checks_its_arguments_like_the_config(kwargs, words):
    import megashard.doctor as doctor
    from megashard.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        doctor.enable(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert doctor.current() is None


def test_enable_without_torch_distributed_says_so():
    import megashard.doctor as doctor
    from megashard.errors import StateError

    with pytest.raises(StateError, match=r"needs torch.distributed initialised: call megashard.initialize"):
        doctor.enable(timeout=10)


def test_the_call_published_on_entry_is_merged_into_an_older_record():
    from megashard.doctor.ledger import parse_entry, with_entry

    rec = {"entries": 6, "groups": {"tp:2": {"seq": 3}}, "open": [], "last": None}
    entry = parse_entry("7|tp:2|all_reduce|4|float32[4]|")
    merged = with_entry(rec, entry)
    assert merged["groups"]["tp:2"]["seq"] == 4 and merged["entered"]["sig"] == "float32[4]"
    assert merged["open"] == [{"group": "tp:2", "name": "tp", "op": "all_reduce", "seq": 4, "sig": "float32[4]",
                               "entered": True}]
    assert rec["groups"]["tp:2"]["seq"] == 3  # the record read is not changed
    assert with_entry(dict(rec, entries=7), entry)["groups"]["tp:2"]["seq"] == 3  # the record is newer: kept
    p2p = with_entry(rec, parse_entry("9|pp:1|isend|0|float32[2, 4]|send:5:3"))
    assert p2p["groups"]["pp:1"]["sent"] == {"5": 3}
    assert parse_entry("x|tp|all_reduce|4||") is None and parse_entry(None) is None
    assert parse_entry("3|a|b:0|all_reduce|2||")["call"]["group"] == "a|b:0"  # a user's name with '|'


def test_wait_for_cycle_and_chain():
    from megashard.doctor.waitfor import find_cycle

    def rec(rank, group, seqs, ranks):
        return {"rank": rank, "groups": seqs, "open": [{"group": group, "op": "all_reduce", "seq": 1,
                                                        "ranks": ranks}]}
    records = {  # 0 waits in a[0,1] for 1; 1 waits in b[1,2] for 2; 2 waits in c[2,0] for 0: a cycle of three
        0: rec(0, "a", {"a": {"seq": 1}, "c": {"seq": 0}}, [0, 1]),
        1: rec(1, "b", {"a": {"seq": 0}, "b": {"seq": 1}}, [1, 2]),
        2: rec(2, "c", {"b": {"seq": 0}, "c": {"seq": 1}}, [2, 0]),
    }
    cycle = find_cycle(0, records)
    assert [(h["rank"], h["call"]["group"], h["for"]) for h in cycle] == [(0, "a", 1), (1, "b", 2), (2, "c", 0)]
    records[2] = dict(records[2], open=[])  # rank 2 is in its own code: a chain, no cycle
    assert find_cycle(0, records) == []
    fetched = []
    cycle = find_cycle(0, {0: records[0]}, fetch=lambda rs: fetched.extend(rs) or {r: None for r in rs})
    assert cycle == [] and fetched == [1]


def test_wilcoxon_exact_and_calibrated():
    from megashard.doctor.stragglers import wilcoxon_greater

    assert wilcoxon_greater([1, 2, 3, 4, 5]) == 1 / 32
    assert wilcoxon_greater([-1, 2, 3, 4, 5]) == 2 / 32
    assert wilcoxon_greater([]) == 1.0
    rng = random.Random(5)
    for n in (12, 40):
        ps = [wilcoxon_greater([rng.gauss(0, 1) for _ in range(n)]) for _ in range(3000)]
        assert 0.03 < sum(p < 0.05 for p in ps) / len(ps) < 0.07  # a test of level 5% under symmetric noise


def _waits(steps, dt, w):
    return {"steps": list(steps), "dt": [round(x * 1e6) for x in dt], "w": {k: [round(x * 1e6) for x in v]
                                                                               for k, v in w.items()}}


def _synthetic_run(n_steps: int, slow: int | None, seed: int, noise: float = 0.3):
    """4 ranks, tp [0,1], [2,3] and dp [0,2], [1,3]; a step = work (40 ms, × 1.3 on the slow rank, times heavy-tailed
    noise on random ranks) then a tp all-reduce, then a dp all-reduce: each rank's waits as the ledger logs them."""
    from megashard.doctor.stragglers import Stragglers

    rng = random.Random(seed)
    tp = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    dp = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    logs = {r: ([], [], {"tp": [], "dp": []}) for r in range(4)}
    for step in range(1, n_steps + 1):
        work = {r: 0.04 * (1.3 if r == slow else 1.0) * (1 + (rng.expovariate(1) * noise if rng.random() < 0.3 else 0))
                for r in range(4)}
        arrive_tp = dict(work)
        end_tp = {r: max(arrive_tp[p] for p in tp[r]) + 0.001 for r in range(4)}
        arrive_dp = {r: end_tp[r] + 0.01 for r in range(4)}
        end_dp = {r: max(arrive_dp[p] for p in dp[r]) + 0.001 for r in range(4)}
        step_t = max(end_dp.values())
        for r in range(4):
            steps, dts, w = logs[r]
            steps.append(step)
            dts.append(step_t)
            w["tp"].append(end_tp[r] - arrive_tp[r])
            w["dp"].append(end_dp[r] - arrive_dp[r])
    s = Stragglers()
    for r in range(4):
        steps, dts, w = logs[r]
        keys = {"tp": f"tp:{tp[r][0]}", "dp": f"dp:{dp[r][0]}"}
        s.add_record(r, {"group_ranks": {keys["tp"]: list(tp[r]), keys["dp"]: list(dp[r]),
                                         "world": [0, 1, 2, 3]}, "peers": "world",
                         "waits": _waits(steps, dts, {keys[k]: v for k, v in w.items()})}, analyse=False)
    s.analyse()
    return s


def test_a_slow_rank_is_named_and_the_ranks_that_waited_for_it_are_not():
    s = _synthetic_run(20, slow=3, seed=1)
    named = s.named()
    assert [n["rank"] for n in named] == [3], named
    assert named[0]["share"] > 0.15 and named[0]["p"] < 1e-3
    rows = {r["group"]: r for r in s.group_rows()}
    assert rows["tp [2, 3]"]["rank"] == 3 and rows["dp [1, 3]"]["rank"] == 3
    assert rows["dp [0, 2]"]["rank"] == 2  # rank 2 arrives last at dp [0, 2]: it waited for rank 3 (not named)


@pytest.mark.parametrize("seed", range(5))
def test_no_rank_is_named_under_symmetric_noise(seed):
    s = _synthetic_run(200, slow=None, seed=seed, noise=1.0)
    assert s.named() == [], s.named()


def test_entry_board_survives_its_process_and_is_published_once_it_died(tmp_path, monkeypatch):
    import subprocess
    import sys

    import torch.distributed as dist

    from megashard.doctor import board as board_mod

    monkeypatch.setattr(board_mod, "_base", lambda: str(tmp_path))
    mine = board_mod.EntryBoard("run/1", 0)
    assert mine.dir == str(tmp_path / "megashard-doctor-run_1")
    mine.write("5|tp:0|all_reduce|3|float32[4]|")
    mine.write("6|tp:0|barrier|4||")  # shorter than the one before: read up to its end
    assert mine.read(0)[1] == "E6|tp:0|barrier|4||"  # the state byte first: inside
    mine.mark(board_mod.RETURNED)
    assert mine.read(0)[1] == "R6|tp:0|barrier|4||"  # it returned: one byte
    # rank 1 wrote its entry, then died (a child process that exits)
    code = ("import sys; sys.path.insert(0, %r); from megashard.doctor import board as b; b._base = lambda: %r; "
            "x = b.EntryBoard('run/1', 1); x.write('9|dp:1|all_gather|7|bfloat16[2, 8]|'); import os; os._exit(0)"
            % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), str(tmp_path)))
    subprocess.run([sys.executable, "-c", code], check=True)
    assert mine.local_ranks() == [1]
    pid, line = mine.read(1)
    assert pid is not None and line == "E9|dp:1|all_gather|7|bfloat16[2, 8]|"
    assert mine.read(0)[1] == "R6|tp:0|barrier|4||"
    store = dist.HashStore()
    assert mine.cover_dead(store, lambda p: p == pid) == [1]
    assert store.get("at/1") == b"E9|dp:1|all_gather|7|bfloat16[2, 8]|"
    assert mine.dead == {1: {"pid": pid, "entry": "E9|dp:1|all_gather|7|bfloat16[2, 8]|"}}  # for this rank's file
    assert mine.local_ranks() == [] and mine.cover_dead(store, lambda p: True) == []  # once, and its file is gone
    mine.close()
    assert not os.path.exists(mine.dir)
    stale = tmp_path / "megashard-doctor-old"
    stale.mkdir()
    (stale / "rank_3").write_bytes(b"%d\n" % (2 ** 22 + 11))  # a pid that does not exist
    os.utime(stale, (1, 1))
    assert board_mod.sweep(str(tmp_path)) == 1 and not stale.exists()


def test_the_words_for_a_rank_that_ended_crashed_or_stopped_inside_a_call():
    from megashard.doctor.diagnose import diagnose
    from megashard.doctor.ledger import parse_entry, with_entry

    call = {"group": "tp:0", "name": "tp", "op": "all_reduce", "seq": 4, "sig": "float32[4]", "step": 9}
    base = {"rank": 1, "entries": 10, "groups": {"tp:0": {"seq": 3}}, "open": [], "step": 9, "host": "h", "pid": 7,
            "last": {"group": "tp:0", "name": "tp", "op": "all_reduce", "seq": 3}}
    inside = with_entry(base, parse_entry("11|tp:0|all_reduce|4|float32[4]|"))
    f = diagnose(call, [0, 1], 0, {1: inside}, {1: False}, 4.0, gone={1})
    assert f["line"].endswith(": rank 1 reached it; its process died inside all_reduce #4 on tp (float32[4]) "
                              "(crashed, aborted or killed)"), f["line"]
    f = diagnose(call, [0, 1], 0, {1: inside}, {1: False}, 4.0)  # another host: no pid to look at
    assert ": rank 1 reached it; no heartbeat since it entered all_reduce #4 on tp (float32[4]): died or stuck inside " \
           "it" in f["line"], f["line"]
    ended = dict(base, state="exited", open=[{"group": "world", "name": "world", "op": "barrier", "seq": 2}])
    f = diagnose(call, [0, 1], 0, {1: ended}, {1: False}, 4.0)
    assert "rank 1 never reached it (its process ended inside barrier #2 on world)" in f["line"], f["line"]
    f = diagnose(call, [0, 1], 0, {1: base}, {1: False}, 4.0, gone={1})  # died in its own code, before the call
    assert "rank 1 never reached it (its process died (last: all_reduce #3 on tp, step 9))" in f["line"], f["line"]
    alive = dict(base, groups={"tp:0": {"seq": 4}}, open=[dict(call, sig="float32[4]")])
    f = diagnose(call, [0, 1], 0, {1: alive}, {1: True}, 4.0)  # same call, alive: the doctor cannot tell more
    assert f["line"].endswith("every rank of the group reached it with the same call (all_reduce float32[4]) and is "
                              "alive: mismatched arguments the doctor does not compare (reduce ops, split sizes, "
                              "peers) or a transport problem"), f["line"]


# ---------------------------------------------------------------------------------------------- issue 41/40: places
def test_the_entry_slot_says_inside_returned_or_in_flight_and_the_newest_move_wins():
    """The slot's state byte and its moves clock: a rank that returned from #3 is in its own code since (not inside
    it); an asynchronous call that returned stays open, in flight; a record newer than the slot is kept."""
    from megashard.doctor.diagnose import diagnose
    from megashard.doctor.ledger import parse_entry, with_entry

    rec = {"rank": 1, "entries": 2, "moves": 4, "groups": {"world": {"seq": 2}}, "step": 1, "inside": None,
           "open": [], "last": {"group": "world", "name": "world", "op": "all_reduce", "seq": 2, "step": 1}}
    entered = parse_entry("E3:5:2|world|all_reduce|3|float32[4]|")
    assert (entered["moves"], entered["state"], entered["call"]["step"]) == (5, "E", 2)
    returned = parse_entry("R3:5:2|world|all_reduce|3|float32[4]|")
    assert returned["moves"] == 6  # its return is one move more
    inside = with_entry(rec, entered)
    assert inside["inside"]["seq"] == 3 and inside["open"][-1]["seq"] == 3 and inside["groups"]["world"]["seq"] == 3
    back = with_entry(rec, returned)
    assert back["inside"] is None and back["open"] == [] and back["last"]["seq"] == 3 and back["step"] == 2, back
    flying = with_entry(rec, parse_entry("A3:5:2|world|all_reduce|3|float32[4]|"))
    assert flying["inside"] is None and [c["seq"] for c in flying["open"]] == [3]
    assert with_entry(dict(rec, moves=6), returned) == dict(rec, moves=6)  # the record is as new: kept
    call = {"group": "world", "name": "world", "op": "all_reduce", "seq": 4, "sig": "float32[4]", "step": 3}
    f = diagnose(call, [0, 1], 0, {1: back}, {1: False}, 10.0)  # no heartbeat, another host
    assert f["line"].endswith("rank 1 never reached it (no heartbeat, in its own code since all_reduce #3 on world "
                              "returned (step 2): stuck (a held GIL?) or dead)"), f["line"]
    assert "inside" not in f["line"]
    f = diagnose(call, [0, 1], 0, {1: back}, {1: False}, 10.0, gone={1})
    assert "its process ended without its final record (os._exit, a crash or a kill) in its own code since " \
           "all_reduce #3 on world returned (step 2)" in f["line"], f["line"]
    f = diagnose(call, [0, 1], 0, {1: dict(back, proc="stopped")}, {1: False}, 10.0)
    assert "rank 1 never reached it (its process is stopped (SIGSTOP) in its own code since all_reduce #3" in f["line"]
    f = diagnose(dict(call, seq=3), [0, 1], 0, {1: dict(inside, proc="stopped")}, {1: False}, 10.0)
    assert "rank 1 reached it; its process is stopped (SIGSTOP) inside all_reduce #3 on world (float32[4])" in \
        f["line"], f["line"]
    assert parse_entry("R3:5:x|world|all_reduce|3||") is None


def _world_rec(rank, *, reason="exit", state="exited", **extra):
    rec = {"rank": rank, "world_size": 2, "run": "r1", "world": 0, "job": "J", "launch": "L", "attempt": 0,
           "started": 100.0 + rank, "time": 200.0, "host": "elsewhere", "pid": 1000 + rank, "beat": 5, "step": 3,
           "entries": 3, "moves": 6, "groups": {"world": {"seq": 3}}, "open": [], "inside": None, "findings": [],
           "last": {"group": "world", "name": "world", "op": "all_reduce", "seq": 3, "step": 2},
           "state": state, "reason": reason, "group_ranks": {"world": [0, 1]}}
    rec.update(extra)
    return rec


def test_a_rank_killed_while_the_launcher_stopped_the_others_is_named_from_a_survivors_file():
    """Rank 1 was SIGKILLed inside all-reduce #4 (its start record only, on another host: no entry slot here); rank 0
    was stopped by SIGTERM in its own code and wrote what its host's board showed of rank 1."""
    from megashard.doctor.records import format_table, summarize

    dead = _world_rec(1, reason="start", state="running", entries=0, moves=0, groups={"world": {"seq": 0}}, last=None)
    survivor = _world_rec(0, reason="terminated", state="terminated",
                          dead_peers={"1": {"pid": 1001, "entry": "E4:7:3|world|all_reduce|4|float32[4]|"}})
    s = summarize({0: survivor, 1: dead})
    assert s["rows"] == [] and [d["rank"] for d in s["deaths"]] == [1], s
    text = [" ".join(line.split()) for line in format_table(s).splitlines()]
    assert text[1] == ("world [0, 1] all_reduce #4 3 - rank 1: reached it, its process died inside all_reduce #4 on "
                       "world (float32[4]) (crashed, aborted or killed)"), text
    assert text[2] == ("rank 0: stopped by a signal (SIGTERM) in its own code since all_reduce #3 on world returned "
                       "(step 2)"), text
    other_pid = dict(dead, pid=999)  # another process's slot (a rank of an earlier launch): not this rank's death
    assert summarize({0: survivor, 1: other_pid})["deaths"] == []
    # the same world followed by another of the job (a world change): not a hang, not a death of the job
    planned = summarize({0: survivor, 1: dead}, followed=True)
    assert planned["rows"] == [] and planned["deaths"] == [] and planned["planned"], planned
    assert format_table(planned).splitlines()[1].startswith("the world ended in a world change, not a hang: rank(s) 1 "
                                                            "lost"), format_table(planned)


def test_a_world_that_ended_in_a_world_change_has_no_hang_but_a_live_culprit_stays_one():
    from megashard.doctor.diagnose import diagnose
    from megashard.doctor.records import summarize

    call = {"group": "world", "name": "world", "op": "all_reduce", "seq": 4, "sig": "float32[4]", "step": 3}
    lost = diagnose(call, [0, 1], 0, {1: None}, {1: False}, 0.1)  # the peer's node went away
    waiting = _world_rec(0, reason="failure", state="failed", findings=[lost])
    dead = _world_rec(1, reason="start", state="running", host="elsewhere")
    assert len(summarize({0: waiting, 1: dead})["rows"]) == 1  # alone (the job's last world): a hang, as before
    s = summarize({0: waiting, 1: dead}, followed=True)
    assert s["rows"] == [] and len(s["world_end"]) == 1, s
    alive = diagnose(call, [0, 1], 0, {1: _world_rec(1, state="running", reason="hang")}, {1: True}, 10.0)
    s = summarize({0: _world_rec(0, reason="failure", state="failed", findings=[alive]),
                   1: _world_rec(1, state="running", reason="hang")}, followed=True)
    assert len(s["rows"]) == 1 and "in user code" in s["rows"][0]["culprits"][1]["doing"], s  # a real hang
    # every rank stopped by the launcher inside a call (a world change's restart, Ctrl-C): an orderly stop
    stopped = {r: _world_rec(r, reason="terminated", state="terminated", groups={"world": {"seq": 4 - r}},
                             inside=dict(call, seq=4 - r, ranks=[0, 1])) for r in (0, 1)}
    assert summarize(stopped)["rows"] == [] and summarize(stopped)["deaths"] == []
    # stopped inside a call its peer also reached, the peer's doctor ended on the lost node's error: cut short
    ended = _world_rec(1, reason="failure", state="failed", groups={"world": {"seq": 5}})
    assert summarize({0: stopped[0], 1: ended})["rows"] == []


def test_the_lag_of_the_rank_last_most_often_is_never_negative():
    """Three ranks; rank 0 is the last (waits least) at 4 of 10 steps, by 2 ms; at the others it waits 5 ms longer
    than the rest: over all steps its median lateness is negative — the lag is what it was late by when it was."""
    from megashard.doctor.stragglers import _Group

    g = _Group("dp", (0, 1, 2))
    for step in range(10):
        if step % 10 < 4:
            waits = {0: 0.010, 1: 0.012, 2: 0.012}
        elif step % 2:
            waits = {0: 0.017, 1: 0.010, 2: 0.013}
        else:
            waits = {0: 0.017, 1: 0.013, 2: 0.010}
        g.add(waits, 0.1, most=False)
    row = g.row()
    assert row["rank"] == 0 and row["last"] == 4, row
    assert row["lag_ms"] == 2.0 and row["share"] == 0.02, row
