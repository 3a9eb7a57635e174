"""`megashard ckpt inspect | consolidate` on a checkpoint saved by 2 FSDP2 ranks (uneven shards)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn as nn

from megashard.cli import main
from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal, full_state

ROOT_ENV = "MEGASHARD_TEST_CLI_ROOT"


def _root() -> str:
    return os.environ[ROOT_ENV]


def check_save_fsdp2(rank, world_size):
    import megashard
    from megashard import checkpoint
    from megashard.config import ParallelConfig
    from torch.distributed.fsdp import fully_shard

    st = megashard.initialize(ParallelConfig())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))  # 7 rows: 4/3; 3 rows: 2/1
    fully_shard(model, mesh=st.fully_shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 5)).sum().backward()
    opt.step()
    checkpoint.save(_root(), 1, model, opt, consumed_samples=4, checksum="crc32")
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(os.path.dirname(_root()), "ref.pt"))
    megashard.destroy()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    os.environ[ROOT_ENV] = str(base / "ckpts")
    try:
        spawn_checks([check_save_fsdp2], world_size=2).assert_ok("check_save_fsdp2")
        yield str(base / "ckpts"), torch.load(base / "ref.pt", weights_only=True)
    finally:
        os.environ.pop(ROOT_ENV, None)


def _flat(ref: dict) -> dict:
    out = {}

    def walk(prefix, x):
        if isinstance(x, torch.Tensor):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)

    walk("", ref)
    return out


def test_inspect_json_lists_layout_keys_shapes_dtypes_sizes(ckpt, capsys):
    root, ref = ckpt
    assert main(["ckpt", "inspect", root, "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 1 and info["consumed_samples"] == 4 and info["algorithm"] == "crc32"
    sizes = info["layout"]["sizes"]
    assert (sizes["world_size"], sizes["dp"], sizes["dp_shard"], sizes["tp"]) == (2, 2, 2, 1)
    expected = {k: (list(t.shape), str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()) for k, t in _flat(ref).items()}
    got = {t["key"]: (t["shape"], t["dtype"], t["bytes"]) for t in info["tensors"]}
    assert got == expected
    by_key = {t["key"]: t for t in info["tensors"]}
    # FSDP shards: one chunk per rank (7 rows -> 4/3, 3 rows -> 2/1), written by their owners.
    assert (by_key["model.0.weight"]["chunks"], by_key["model.0.weight"]["writers"]) == (2, [0, 1])
    assert (by_key["model.2.weight"]["chunks"], by_key["model.2.weight"]["writers"]) == (2, [0, 1])
    # A replicated plain tensor (AdamW step) is stored once, by one rank.
    assert by_key["optim.state.0.weight.step"]["chunks"] == 1 and len(by_key["optim.state.0.weight.step"]["writers"]) == 1
    assert "optim.param_groups.0.lr" in info["objects"]


def test_inspect_table(ckpt, capsys):
    root, _ = ckpt
    assert main(["ckpt", "inspect", root, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks: tp=1 cp=1 pp=1 dp=2 (dp_outer=1 x dp_shard=2)" in out
    line = next(li for li in out.splitlines() if li.strip().startswith("model.0.weight "))
    assert line.split() == ["model.0.weight", "(7,", "5)", "float32", "140", "B", "2", "0,1"]


def test_inspect_sorts_keys_by_name_in_groups_model_optimizer_extra(ckpt, capsys):
    """Ranks write keys in their own order (DCP lists optim.* before model.*): the table and the JSON list them
    grouped model / optimizer / extra, each group sorted by name (numbers in numeric order)."""
    from megashard.checkpoint.consolidate import key_order

    root, ref = ckpt
    assert main(["ckpt", "inspect", root, "--no-verify"]) == 0
    out = capsys.readouterr().out
    groups, current = {}, None
    for line in out.splitlines():
        if line.split(":")[0] in ("model", "optimizer", "extra") and " tensors, " in line:
            current = line.split(":")[0]
            groups[current] = []
        elif current and line.startswith("  ") and not line.strip().startswith("key "):
            groups[current].append(line.split()[0])
        elif not line.strip():
            current = None
    keys = sorted(_flat(ref))
    assert list(groups) == ["model", "optimizer"]  # this checkpoint saved no extra tensors
    assert groups["model"] == ["model.0.bias", "model.0.weight", "model.2.weight"]
    optim = [k for k in keys if k.startswith("optim.")]
    assert groups["optimizer"] == sorted(optim) and len(optim) == 9  # exp_avg, exp_avg_sq, step of 3 parameters
    assert "model: 3 tensors, " in out and "optimizer: 9 tensors, " in out
    assert main(["ckpt", "inspect", root, "--no-verify", "-f", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    listed = [t["key"] for t in info["tensors"]]
    assert listed == groups["model"] + groups["optimizer"]
    assert [t["group"] for t in info["tensors"]] == ["model"] * 3 + ["optimizer"] * 9
    assert info["objects"] == sorted(info["objects"], key=key_order)
    # numeric parts sort as numbers, groups before names
    assert sorted(["optim.x", "model.blocks.10.w", "rng.seed", "model.blocks.2.w"], key=key_order) == [
        "model.blocks.2.w", "model.blocks.10.w", "optim.x", "rng.seed"]


def test_consolidate_refuses_an_output_inside_the_checkpoint(ckpt, tmp_path, capsys):
    """OUT inside the checkpoint being read would overwrite its own input: refused before anything is read, and
    the checkpoint still verifies."""
    root, _ = ckpt
    step = os.path.join(root, "step_00000001")
    target = os.path.join(step, sorted(f for f in os.listdir(step) if f.endswith(".distcp"))[0])
    before = open(target, "rb").read()
    assert main(["ckpt", "consolidate", root, target, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"OUT {target}: is {step}" not in err and f"lies inside {step}, which this command reads" in err, err
    assert open(target, "rb").read() == before and not os.path.exists(target + ".tmp")
    assert main(["ckpt", "inspect", root]) == 0


def test_consolidate_writes_the_full_tensors(ckpt, tmp_path, capsys):
    root, ref = ckpt
    out = tmp_path / "full.pt"
    assert main(["ckpt", "consolidate", root, str(out)]) == 0
    err = capsys.readouterr().err
    # not a terminal, a short job: no progress lines in the log, only the summary
    assert "consolidate [" not in err and err.count("\n") == 1 and "wrote" in err
    full = torch.load(out, weights_only=True)
    assert set(full) == {"model", "optim"}
    flat_ref, flat_got = _flat(ref), _flat(full)
    assert set(flat_ref) == set(flat_got)
    for k, t in flat_ref.items():
        assert_bitwise_equal(t, flat_got[k], k)
    assert full["optim"]["param_groups"] == ref["optim"]["param_groups"]
    # The model part loads into a plain module.
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))
    plain.load_state_dict(full["model"])
    # --keys restricts the output.
    assert main(["ckpt", "consolidate", root, str(tmp_path / "m.pt"), "--keys", "model", "-q"]) == 0
    assert set(torch.load(tmp_path / "m.pt", weights_only=True)) == {"model"}


def test_damaged_checkpoint_exit_1_naming_the_file(ckpt, tmp_path, capsys):
    root, _ = ckpt
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    data = copy / "step_00000001" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[50] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["ckpt", "consolidate", str(copy), str(tmp_path / "x.pt"), "-q"]) == 1
    assert "__1_0.distcp" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
    assert main(["ckpt", "inspect", str(copy), "--verify"]) == 1
    assert "__1_0.distcp: crc32 checksum" in capsys.readouterr().err
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
