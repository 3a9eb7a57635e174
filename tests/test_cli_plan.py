"""`megashard plan`: exact sizes and groups (table and JSON), locality, SVG, overrides, errors, entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from megashard.cli import main
from megashard.config import ParallelConfig
from megashard.layout import GROUP_NAMES, NODE_LOCAL_GROUPS, LocalityReport, RankLayout, locality, locality_warning
from megashard.layout.plan import format_members

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
SVG = "{http://www.w3.org/2000/svg}"
TP_WARNING = (
    "WARNING: tp groups (size 16) cross node boundaries in 1 of 1 groups with 8 ranks per node: its collectives "
    "will run over the network; make tp divide 8 and put it first in order"
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def section(out: str, title: str) -> list[str]:
    """The indented lines under a heading line starting with ``title``, up to the next blank line."""
    lines = out.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(title))
    body = []
    for l in lines[start + 1 :]:
        if not l.strip():
            break
        body.append(l)
    return body


def table_rows(lines: list[str]) -> dict[str, list[str]]:
    """Rows of an aligned table (header skipped) keyed by their first column; the members column is
    everything from the first '[' on."""
    rows = {}
    for l in lines[1:]:
        head, bracket, tail = l.partition("[")
        cols = head.split()
        rows[cols[0]] = cols[1:] + ([bracket + tail] if bracket else [])
    return rows


# ---------------------------------------------------------------------------------------------- table
def test_table_sizes_and_groups_of_a_rank(capsys):
    # default.yaml has tp=2, dp_shard=2; with pp=4 that is 16 ranks (the DESIGN.md example).
    code, out, err = run(capsys, DEFAULT, "--world-size", "16", "parallel.pp=4", "model.layers=4", "--rank", "5")
    assert code == 0, err
    sizes = dict(l.split() for l in section(out, "resolved sizes"))
    assert sizes == {
        "world_size": "16", "tp": "2", "cp": "1", "pp": "4", "vpp": "none", "dp": "2", "dp_outer": "1",
        "dp_shard": "2", "ep": "1", "expt_tp": "1", "expt_dp": "4", "order": "tp-cp-ep-dp-pp",
    }
    assert "  coords  tp=1 cp=0 dp_shard=0 dp_outer=0 pp=1 expt_tp=0 ep=0 expt_dp=1" in out
    rows = table_rows(section(out, "groups of rank 5"))
    assert list(rows) == list(GROUP_NAMES)
    # name: size, index of rank 5 in the group, group number / groups, members
    assert rows["tp"] == ["2", "1", "2/8", "[4, 5]"]
    assert rows["pp"] == ["4", "1", "1/4", "[1, 5, 9, 13]"]
    assert rows["dp"] == ["2", "0", "3/8", "[5, 7]"]
    assert rows["mp"] == ["8", "3", "0/2", "[0, 1, 4, 5, 8, 9, 12, 13]"]
    assert rows["cp"] == ["1", "0", "5/16", "[5]"]
    assert rows["world"] == ["16", "5", "0/1", "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]"]


def test_table_all_groups_lists_every_group_in_megatron_order(capsys):
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.pp=4", "model.layers=4", "--all-groups", "--groups", "tp,pp,dp")
    assert code == 0
    tp = [l.split(None, 1)[1] for l in section(out, "all tp groups (8)")]
    assert tp == [f"[{2 * i}, {2 * i + 1}]" for i in range(8)]
    pp = [l.split(None, 1)[1] for l in section(out, "all pp groups (4)")]
    assert pp == ["[0, 4, 8, 12]", "[1, 5, 9, 13]", "[2, 6, 10, 14]", "[3, 7, 11, 15]"]
    dp = [l.split(None, 1)[1] for l in section(out, "all dp groups (8)")]
    assert dp[:4] == ["[0, 2]", "[1, 3]", "[4, 6]", "[5, 7]"]
    assert list(table_rows(section(out, "groups of rank 0"))) == ["tp", "pp", "dp"]


def test_format_members_abbreviates_long_groups():
    assert format_members([4, 5]) == "[4, 5]"
    assert format_members(list(range(0, 1024, 8))) == "[0, 8, 16, …, 1016] (128 ranks, stride 8)"
    assert format_members([0, 1, 4, 5, 8, 9, 12, 13], limit=4) == "[0, 1, 4, …, 12, 13] (8 ranks)"
    assert format_members(list(range(40)), limit=0).count(",") == 39


# ---------------------------------------------------------------------------------------------- JSON
def test_json_has_every_group_equal_to_rank_layout(capsys):
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.pp=4", "model.layers=4", "parallel.dp_shard=-1", "parallel.dp_outer=2",
                       "--format", "json", "--rank", "6")
    assert code == 0
    plan = json.loads(out)
    layout = RankLayout(ParallelConfig(tp=2, pp=4, dp_outer=2), 16)
    assert plan["sizes"] == {
        "world_size": 16, "tp": 2, "cp": 1, "pp": 4, "vpp": None, "dp": 2, "dp_outer": 2, "dp_shard": 1,
        "ep": 1, "expt_tp": 1, "expt_dp": 4, "order": "tp-cp-ep-dp-pp",
    }
    assert plan["mesh"] == {"dense": {"pp": 4, "dp_outer": 2, "dp_shard": 1, "cp": 1, "tp": 2},
                            "expert": {"pp": 4, "expt_dp": 4, "ep": 1, "expt_tp": 1}}
    assert set(plan["groups"]) == set(GROUP_NAMES)
    for name in GROUP_NAMES:
        assert plan["groups"][name] == layout.groups(name), name
        g = plan["rank_groups"][name]
        assert g["ranks"] == layout.group_of(name, 6)
        assert g["rank_in_group"] == layout.rank_in(name, 6)
        assert g["group_index"] == layout.group_index(name, 6)
        assert plan["groups"][name][g["group_index"]] == g["ranks"]
    assert plan["groups"]["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert plan["groups"]["dp_outer"][:2] == [[0, 2], [1, 3]]
    assert plan["rank"] == 6 and plan["coords"] == layout.coords(6)
    assert plan["locality"]["crossing"]["pp"] == [4, 4] and plan["locality"]["warnings"] == []


def test_json_groups_option_restricts_names(capsys):
    code, out, _ = run(capsys, DEFAULT, "-w", "8", "parallel.dp_shard=-1", "parallel.cp=2", "-f", "json",
                       "--groups", "cp,dp_cp,tp-dp")
    assert code == 0
    plan = json.loads(out)
    assert plan["groups"] == {"cp": [[0, 2], [1, 3], [4, 6], [5, 7]], "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                              "tp-dp": [[0, 1, 4, 5], [2, 3, 6, 7]]}
    assert list(plan["rank_groups"]) == ["cp", "dp_cp", "tp-dp"]


# ---------------------------------------------------------------------------------------------- locality
def test_locality_warning_for_tp_across_nodes(capsys):
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.tp=16", "parallel.dp_shard=-1")
    assert code == 0
    assert TP_WARNING in out.splitlines()
    rows = table_rows(section(out, "node locality (8 ranks per node"))
    assert rows["tp"] == ["16", "1/1"]
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.tp=16", "parallel.dp_shard=-1", "--strict", "-f", "json")
    assert code == 1
    assert json.loads(out)["locality"]["warnings"] == [TP_WARNING[len("WARNING: "):]]
    # 16 ranks per node: nothing crosses, --strict passes.
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.tp=16", "parallel.dp_shard=-1", "-g", "16", "--strict")
    assert code == 0 and "WARNING" not in out and "no locality warnings" in out


def exact_locality(layout: RankLayout, G: int) -> LocalityReport:
    """The test oracle: list every group of every name and look at its members' nodes (slow, obviously right)."""
    crossing, warnings = {}, []
    for name in GROUP_NAMES:
        if name == "world":
            continue
        groups = layout.groups(name)
        n_cross = sum(1 for g in groups if len({r // G for r in g}) > 1)
        crossing[name] = (n_cross, len(groups))
        if n_cross and name in NODE_LOCAL_GROUPS:
            warnings.append(locality_warning(name, len(groups[0]), n_cross, len(groups), G))
    return LocalityReport(G, crossing, tuple(warnings))


@pytest.mark.parametrize("kw,world", [
    (dict(tp=2, pp=4), 16), (dict(tp=4, cp=2, dp_outer=2), 32), (dict(tp=2, ep=4, expt_tp=2, pp=2), 48),
    (dict(tp=2, pp=3, order="tp-pp-dp"), 24), (dict(tp=3, ep=2, pp=2), 24),
])
def test_fast_locality_equals_layout_locality(kw, world, monkeypatch):
    import megashard.layout.node_locality as plan_mod

    layout = RankLayout(ParallelConfig(**kw), world)
    for g in (1, 2, 3, 4, 5, 6, 8, 16, world - 1, world, 64):
        want = exact_locality(layout, g)
        assert layout.locality(g) == want, g
        assert locality(layout, g) == want, g
        # Both counting strategies: residues of the group bases mod G, and bases before each node boundary.
        for cost in (lambda dims, G: 0, lambda dims, G: 1 << 60):
            monkeypatch.setattr(plan_mod, "_residue_cost", cost)
            assert locality(layout, g) == want, g
        monkeypatch.undo()


def test_palette_is_distinct_for_thousands_of_groups():
    from megashard.layout.plan_svg import _palette

    assert len(set(_palette(16384))) == 16384  # beyond ~3,000 the hue circles are full: must not hang
    assert _palette(40) == _palette(16384)[:40]


# ---------------------------------------------------------------------------------------------- SVG
def test_svg_one_cell_per_rank_and_one_colour_per_group(capsys, tmp_path):
    path = tmp_path / "plan.svg"
    code, _, err = run(capsys, DEFAULT, "-w", "32", "parallel.pp=4", "model.layers=4", "parallel.dp_shard=-1", "--rank", "5",
                       "--svg", str(path))
    assert code == 0 and f"wrote {path}" in err
    root = ET.parse(path).getroot()  # well-formed XML
    assert root.tag == SVG + "svg"
    layout = RankLayout(ParallelConfig(tp=2, pp=4), 32)
    panels = {p.get("data-group-name"): p for p in root.iter(SVG + "g") if p.get("class") == "panel"}
    assert list(panels) == ["tp", "dp", "pp"]  # dp_shard = dp without HSDP: an alias, not a panel
    for name, panel in panels.items():
        cells = [c for c in panel.iter(SVG + "rect") if c.get("class") == "cell"]
        assert sorted(int(c.get("data-rank")) for c in cells) == list(range(32))
        fill_of_group = {}
        for c in cells:
            r, g = int(c.get("data-rank")), int(c.get("data-group"))
            assert g == layout.group_index(name, r)
            assert fill_of_group.setdefault(g, c.get("fill")) == c.get("fill")  # one colour per group
        assert len(fill_of_group) == 32 // layout.size(name)
        assert len(set(fill_of_group.values())) == len(fill_of_group)  # distinct groups, distinct colours
        texts = {t.text for t in panel.iter(SVG + "text")}
        assert {str(r) for r in range(32)} <= texts  # every cell labelled with its rank
        assert len([n for n in panel.iter(SVG + "rect") if n.get("class") == "node"]) == 4
    marker = [m for m in panels["tp"].iter(SVG + "rect") if m.get("class") == "marker"]
    assert len(marker) == 1
    assert "tp: size 2, 16 groups" in {t.text for t in panels["tp"].iter(SVG + "text")}
    assert "dp (= dp_shard): size 4, 8 groups" in {t.text for t in panels["dp"].iter(SVG + "text")}


# ---------------------------------------------------------------------------------------------- overrides
def test_overrides_change_the_plan(capsys):
    code, out, _ = run(capsys, DEFAULT, "-w", "16", "parallel.tp=4", "parallel.dp_shard=-1", "--rank", "5")
    assert code == 0
    assert dict(l.split() for l in section(out, "resolved sizes"))["tp"] == "4"
    assert table_rows(section(out, "groups of rank 5"))["tp"] == ["4", "1", "1/4", "[4, 5, 6, 7]"]
    # An override after an option, and the launcher's world size when --world-size is absent.
    code, out, _ = run(capsys, DEFAULT, "--rank", "1", "launch.nnodes=2", "parallel.dp_shard=-1")
    assert code == 0
    assert out.startswith("megashard plan: ") and "— 8 ranks" in out.splitlines()[0]
    assert table_rows(section(out, "groups of rank 1"))["dp"] == ["4", "0", "1/2", "[1, 3, 5, 7]"]


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("argv,message", [
    (["-w", "16", "parallel.tp=3"], "world size 16 is not divisible by tp=3·cp=1·pp=1·dp_outer=1 = 3; valid products "
                                    "for this world: 1, 2, 4, 8, 16"),
    (["-w", "131072", "parallel.tp=8", "parallel.pp=4", "parallel.dp_shard=2"],
     "tp·cp·pp·dp_outer·dp_shard = 8·1·4·1·2 = 64 must equal the world size 131072; to let FSDP take the rest, set "
     "dp_shard=-1 (parallel.dp_shard=-1 on the command line; here dp_shard=4096)"),
    (["parallel.tpp=2"], "'parallel.tpp' (did you mean 'parallel.tp'?)"),
    (["--rank", "4"], "--rank 4: must be in 0..3 (the world has 4 ranks)"),
    (["--groups", "tp,dp_shrd"], "unknown group 'dp_shrd' (did you mean 'dp_shard'?)"),
    (["launch.nproc_per_node=0"], "launch.nproc_per_node=0 must be a positive integer"),
    (["-g", "0"], "--ranks-per-node 0: must be a positive integer"),
])
def test_bad_config_exits_2_with_the_message(capsys, argv, message):
    code, out, err = run(capsys, DEFAULT, *argv)
    assert code == 2 and out == ""
    assert err.startswith("megashard plan: error: ") and message in err
    assert "Traceback" not in err


def test_missing_file_and_missing_world_size(capsys, tmp_path):
    code, _, err = run(capsys, str(tmp_path / "nope.yaml"))
    assert code == 2 and "does not exist" in err
    cfg = tmp_path / "bare.yaml"
    cfg.write_text("parallel:\n  tp: 2\n")
    code, _, err = run(capsys, str(cfg))
    assert code == 2 and "pass --world-size N" in err
    code, out, _ = run(capsys, str(cfg), "-w", "2")
    assert code == 0 and "— 2 ranks" in out


def test_help_and_usage_errors(capsys):
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert main(["plan", "--help"]) == 0
    assert "--world-size" in capsys.readouterr().out
    assert main(["plan", DEFAULT, "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- scale
def test_plan_of_one_rank_of_131072(capsys, tmp_path):
    path = tmp_path / "big.svg"
    code, out, _ = run(capsys, DEFAULT, "-w", "131072", "parallel.tp=8", "parallel.pp=4", "model.layers=4", "parallel.dp_shard=-1",
                       "--rank", "131071", "--svg", str(path), "--svg-max-ranks", "64")
    assert code == 0
    sizes = dict(l.split() for l in section(out, "resolved sizes"))
    assert (sizes["world_size"], sizes["dp"], sizes["dp_shard"]) == ("131072", "4096", "4096")
    rows = table_rows(section(out, "groups of rank 131071"))
    assert rows["tp"] == ["8", "7", "16383/16384", "[131064, 131065, 131066, 131067, 131068, 131069, 131070, 131071]"]
    assert rows["pp"] == ["4", "3", "32767/32768", "[32767, 65535, 98303, 131071]"]
    assert rows["dp"] == ["4096", "4095", "31/32", "[98311, 98319, 98327, …, 131071] (4096 ranks, stride 8)"]
    assert table_rows(section(out, "node locality"))["pp"] == ["4", "32768/32768"]
    root = ET.parse(path).getroot()
    tp = next(p for p in root.iter(SVG + "g") if p.get("data-group-name") == "tp")
    assert len([c for c in tp.iter(SVG + "rect") if c.get("class") == "cell"]) == 64
    assert "showing the first 64 of 131,072 ranks (8 nodes of 8); rank 131071 marked" in {
        t.text for t in root.iter(SVG + "text")}


def test_plan_of_one_rank_of_the_largest_world(capsys):
    """2^24 ranks: nothing of the world's size is listed (the rank's dp group alone has 2^19 members)."""
    W = 1 << 24
    code, out, err = run(capsys, DEFAULT, "-w", str(W), "parallel.tp=8", "parallel.pp=4", "model.layers=4", "--rank", str(W - 1))
    assert code == 0, err
    rows = table_rows(section(out, f"groups of rank {W - 1}"))
    assert rows["dp"] == ["524288", "524287", "31/32", "[12582919, 12582927, 12582935, …, 16777215] (524288 ranks, stride 8)"]
    assert rows["world"][-1] == "[0, 1, 2, …, 16777215] (16777216 ranks, stride 1)"
    assert rows["mp"][-1] == "[4194296, 4194297, 4194298, …, 16777214, 16777215] (32 ranks)"
    loc = table_rows(section(out, "node locality"))
    # tp=8 fills a node: no tp group crosses; every pp group (stride 2^22) and dp group does.
    assert loc["tp"] == ["8", "0/2097152"] and loc["pp"] == ["4", "4194304/4194304"] and loc["dp"] == ["524288", "32/32"]
    assert "--world-size 16777217: must be in 1..16,777,216" in (run(capsys, DEFAULT, "-w", str(W + 1))[2])


# ---------------------------------------------------------------------------------------------- entry point
def test_python_dash_m_megashard_plan():
    proc = subprocess.run(
        [sys.executable, "-m", "megashard", "plan", DEFAULT, "--format", "json", "--groups", "tp,dp_shard"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["sizes"]["world_size"] == 4  # launch.nproc_per_node of default.yaml
    assert plan["groups"] == {"tp": [[0, 1], [2, 3]], "dp_shard": [[0, 2], [1, 3]]}
