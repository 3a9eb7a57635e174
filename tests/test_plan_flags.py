"""`megashard plan` with sizes as flags (no YAML; with a YAML the flags win) and with a multi-module YAML."""
from __future__ import annotations

import json
import os

import pytest

from megashard.cli import main
from megashard.config import ParallelConfig
from megashard.layout import RankLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_flags_without_yaml(capsys):
    p = plan_json(capsys, "--tp", "8", "--pp", "4", "--world-size", "64", "--rank", "9")
    assert p["config"] is None and p["flags"] == {"tp": 8, "pp": 4}
    assert p["sizes"] == {"world_size": 64, "tp": 8, "cp": 1, "pp": 4, "vpp": None, "dp": 2, "dp_outer": 1,
                          "dp_shard": 2, "ep": 1, "expt_tp": 1, "expt_dp": 16, "order": "tp-cp-ep-dp-pp"}
    lay = RankLayout(ParallelConfig(tp=8, pp=4).resolve(64))
    assert p["rank_groups"]["pp"]["ranks"] == lay.group_of("pp", 9) == [9, 25, 41, 57]
    code, out, _ = run(capsys, "--tp", "8", "--pp", "4", "--world-size", "64")
    assert code == 0 and out.startswith("megashard plan: --tp 8 --pp 4 — 64 ranks")


def test_every_size_flag(capsys):
    p = plan_json(capsys, "--tp", "2", "--cp", "2", "--pp", "2", "--vpp", "2", "--dp", "4", "--dp-outer", "2",
                  "--dp-shard", "-1", "--ep", "2", "--expt-tp", "2", "--expt_dp", "-1", "--order", "tp-cp-ep-dp-pp",
                  "-w", "32")
    s = p["sizes"]
    assert (s["tp"], s["cp"], s["pp"], s["vpp"], s["dp"], s["dp_outer"], s["dp_shard"], s["ep"], s["expt_tp"],
            s["expt_dp"]) == (2, 2, 2, 2, 4, 2, 2, 2, 2, 4)
    p = plan_json(capsys, "--tp", "2", "--order", "tp-pp-dp", "--pp", "2", "-w", "8", "--groups", "pp")
    assert p["groups"]["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_flags_win_over_the_yaml(capsys):
    # default.yaml: tp=2, dp_shard=2 (-1 via the override), pp from the override; --tp 4 replaces the YAML's tp
    p = plan_json(capsys, DEFAULT, "--world-size", "32", "--tp", "4", "parallel.pp=2", "parallel.dp_shard=-1")
    assert (p["sizes"]["tp"], p["sizes"]["pp"], p["sizes"]["dp_shard"]) == (4, 2, 4)
    assert p["config"] == DEFAULT and p["flags"] == {"tp": 4}


@pytest.mark.parametrize("argv,needle", [
    (["--tp", "0", "-w", "4"], "tp=0 is not a valid size"),
    (["--tp", "3", "-w", "4"], "world size 4"),
    (["--tp", "2"], "no world size: pass --world-size N"),
    ([], "no config: give a CONFIG file or the sizes as flags"),
    (["parallel.tp=2", "-w", "4"], "need a CONFIG file"),
    (["--tp", "x", "-w", "4"], "argument --tp: invalid int value: 'x'"),
    (["--order", "tp-xx", "-w", "4", "--tp", "2"], "unknown token(s) 'xx'"),
    ([DEFAULT, "-w", "6", "--tp", "4"], "tp"),
])
def test_flag_errors_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("megashard plan: error:") and err.count("\n") == 1 and needle in err, err


MODULES = """
modules:
  - name: encoder
    ranks: 0-3
    parallel: {tp: 1}
  - name: llm
    ranks: 4-11
    parallel: {tp: 2, pp: 2}
"""


@pytest.fixture
def modules_yaml(tmp_path):
    path = tmp_path / "modules.yaml"
    path.write_text(MODULES)
    return str(path)


def test_plan_modules_table_and_json(capsys, modules_yaml):
    code, out, err = run(capsys, modules_yaml)
    assert code == 0, err
    assert "— 12 ranks, 2 modules" in out.splitlines()[0]
    lines = out.splitlines()
    enc = next(l for l in lines if l.startswith("  encoder  0-3"))
    assert enc.split()[:4] == ["encoder", "0-3", "1", "1"]
    assert "  tp       2     [4, 5], [6, 7], [8, 9], [10, 11]" in lines
    i = lines.index(next(l for l in lines if l.startswith("seam encoder -> llm")))
    assert [l.split() for l in lines[i + 2:i + 6]] == [
        ["0", "4", "0/1", "0/2"], ["1", "4", "0/1", "1/2"], ["2", "6", "0/1", "0/2"], ["3", "6", "0/1", "1/2"]]
    p = plan_json(capsys, modules_yaml, "--groups", "tp,pp", "-w", "16")
    assert p["world_size"] == 16 and p["idle_ranks"] == 4
    llm = p["modules"][1]
    assert llm["ranks"] == [4, 11] and llm["sizes"]["dp"] == 2
    assert llm["groups"] == {"tp": [[4, 5], [6, 7], [8, 9], [10, 11]], "pp": [[4, 8], [5, 9], [6, 10], [7, 11]]}
    assert p["seams"][0]["links"][1] == {"src": 1, "dst": 4, "src_part": "0/1", "dst_part": "1/2"}


@pytest.mark.parametrize("extra,needle", [
    (["--tp", "2"], "size flags describe one layout"),
    (["-w", "8"], "module 'llm' uses ranks up to 11, but the world has 8"),
    (["--groups", "tq"], "unknown group 'tq'"),
    (["x.y=1"], "not supported for a multi-module config"),
])
def test_plan_modules_errors(capsys, modules_yaml, extra, needle):
    code, out, err = run(capsys, modules_yaml, *extra)
    assert code == 2 and err.count("\n") == 1 and needle in err, err
