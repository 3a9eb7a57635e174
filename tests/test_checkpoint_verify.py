"""Every byte a load reads is verified as it is read; any damage is reported naming the file, never loaded.

One spawn of 2 gloo ranks saves an FSDP2 model + AdamW checkpoint (and checks a distributed load of a
damaged copy); the tests then damage copies of it in one process: 20 single-bit flips at random offsets
spread over the data files, ``.metadata``, ``megashard.json`` and the per-rank state files — each one
reported by ``checkpoint.load``, ``megashard ckpt inspect`` (exit 1) and ``ckpt consolidate`` (exit 1).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading

import pytest
import torch
import torch.nn as nn

from megashard import checkpoint
from megashard.checkpoint import checksums, safety
from megashard.checkpoint.storage import load_dcp_metadata
from megashard.cli import main
from megashard.errors import CheckpointCorruptedError
from tests._dist import spawn_checks
from tests._helpers import flip_bit

ROOT_ENV = "MEGASHARD_TEST_VERIFY_ROOT"
STEP_DIR = "step_00000001"


def _root() -> str:
    return os.environ[ROOT_ENV]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def check_save_and_distributed_damage(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import megashard
    from megashard.config import ParallelConfig

    st = megashard.initialize(ParallelConfig())
    torch.manual_seed(0)
    model = _net()
    fully_shard(model, mesh=st.fully_shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 5)).sum().backward()
    opt.step()
    root = os.path.join(_root(), "ckpts")
    checkpoint.save(root, 1, model, opt, consumed_samples=4, data_state={"pos": rank})
    msd, _ = get_state_dict(model, opt)
    before = {k: v.to_local().clone() for k, v in msd.items()}
    # A flipped byte in the last item of rank 1's data file: every rank raises, naming the file and the item.
    bad = os.path.join(_root(), "bad")
    if rank == 0:
        shutil.copytree(root, bad)
        path = os.path.join(bad, STEP_DIR, "__1_0.distcp")
        flip_bit(path, os.path.getsize(path) - 20, bit=0)
    dist.barrier()
    with pytest.raises(CheckpointCorruptedError, match=r"__1_0\.distcp: crc32 checksum \w+ of item '"):
        checkpoint.load(bad, model, opt)
    # The intact checkpoint loads (the same values) after the failed attempt.
    checkpoint.load(root, model, opt)
    msd, _ = get_state_dict(model, opt)
    for k, v in msd.items():
        assert torch.equal(v.to_local(), before[k]), k
    megashard.destroy()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("verify")
    os.environ[ROOT_ENV] = str(base)
    try:
        res = spawn_checks([check_save_and_distributed_damage], world_size=2)
        yield str(base / "ckpts"), res
    finally:
        os.environ.pop(ROOT_ENV, None)


def test_distributed_load_of_a_damaged_item_fails_on_every_rank(ckpt):
    ckpt[1].assert_ok("check_save_and_distributed_damage")


def _copy(ckpt_root: str, dst) -> str:
    shutil.copytree(ckpt_root, dst)
    return str(dst)


def _load_one_process(root: str):
    torch.manual_seed(3)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return checkpoint.load(root, model, opt), model


def test_items_tile_every_data_file_and_match_its_bytes(ckpt):
    root, _ = ckpt
    path = os.path.join(root, STEP_DIR)
    marker = safety.read_marker(path)
    md = load_dcp_metadata(os.path.join(path, ".metadata"))
    data_files = sorted(n for n in marker.files if n.endswith(".distcp"))
    assert data_files == ["__0_0.distcp", "__1_0.distcp"] and sorted(marker.items) == data_files
    for name in data_files:
        raw = open(os.path.join(path, name), "rb").read()
        spans = sorted(marker.items[name])
        assert spans == sorted((int(i.offset), int(i.length)) for i in md.storage_data.values() if i.relative_path == name)
        assert sum(n for _, n in spans) == len(raw) == marker.files[name]["size"]
        for (off, n), digest in marker.items[name].items():
            assert checksums.bytes_checksum(raw[off:off + n]) == digest
        assert checksums.bytes_checksum(raw) == marker.files[name]["checksum"]  # whole-file checksum kept (inspect)


def _flip_cases() -> list[tuple[str, int, int]]:
    """20 (file, offset, bit): 8 in the data files, 4 in .metadata, 4 in megashard.json, 4 in per-rank state."""
    rng = random.Random(20)
    files = ["__0_0.distcp", "__1_0.distcp"] * 4 + [".metadata"] * 4 + ["megashard.json"] * 4 + \
        ["rank_state/000000.pt", "rank_state/000001.pt"] * 2
    return [(f, rng.random(), rng.randrange(8)) for f in files]


def test_bit_flips_at_20_random_offsets_are_reported_by_load_inspect_and_consolidate(ckpt, tmp_path, capsys):
    root, _ = ckpt
    cases = _flip_cases()
    assert len(cases) == 20
    for i, (name, where, bit) in enumerate(cases):
        copy = _copy(root, tmp_path / f"c{i}")
        target = os.path.join(copy, STEP_DIR, name)
        offset = int(where * os.path.getsize(target))
        flip_bit(target, offset, bit)
        what = f"case {i}: bit {bit} of byte {offset} of {name}"
        with pytest.raises(CheckpointCorruptedError) as err:
            _load_one_process(copy)
        assert f"{STEP_DIR}/{name}: " in str(err.value), (what, str(err.value))
        capsys.readouterr()
        assert main(["ckpt", "inspect", copy]) == 1, what
        out = capsys.readouterr()
        assert f"damaged: " in out.err and f"{STEP_DIR}/{name}: " in out.err, (what, out.err)
        assert main(["ckpt", "consolidate", copy, str(tmp_path / f"c{i}.pt"), "-q"]) == 1, what
        assert f"{STEP_DIR}/{name}: " in capsys.readouterr().err, what
        assert not os.path.exists(tmp_path / f"c{i}.pt")


def test_load_hashes_items_in_reader_threads_not_whole_files_first(ckpt, tmp_path, monkeypatch):
    root, _ = ckpt
    hashed_whole, item_threads = [], set()
    real_file, real_bytes = checksums.file_checksum, checksums.bytes_checksum
    monkeypatch.setattr(checksums, "file_checksum", lambda path, alg="crc32": hashed_whole.append(path) or real_file(path, alg))

    def bytes_checksum(data, alg="crc32"):
        item_threads.add(threading.current_thread().name.split("_")[0])
        return real_bytes(data, alg)

    monkeypatch.setattr(checksums, "bytes_checksum", bytes_checksum)
    report, model = _load_one_process(root)
    assert report.step == 1
    assert not [p for p in hashed_whole if p.endswith(".distcp")]  # no separate pass over the data
    assert {os.path.basename(p) for p in hashed_whole} == {".metadata", "megashard.json", "000000.pt", "000001.pt"}
    assert item_threads == {"megashard-ckpt-read"}  # hashed in the reader's pool, beside deserialisation
    # Each damaged item is caught by its own checksum.
    copy = _copy(root, tmp_path / "c")
    marker = safety.read_marker(os.path.join(copy, STEP_DIR))
    (off, n), = [k for k in marker.items["__0_0.distcp"] if k[0] > 0][:1]
    flip_bit(os.path.join(copy, STEP_DIR, "__0_0.distcp"), off + n // 2, bit=0)
    with pytest.raises(CheckpointCorruptedError, match=rf"__0_0\.distcp: crc32 checksum \w+ of item '.*' .*\(bytes {off}\.\.{off + n}\)"):
        _load_one_process(copy)


def test_checkpoint_without_item_checksums_loads_and_is_verified_whole(ckpt, tmp_path, monkeypatch):
    """Checkpoints written before per-item checksums: the data files are hashed whole before they are read."""
    root, _ = ckpt
    copy = _copy(root, tmp_path / "old")
    marker_path = os.path.join(copy, STEP_DIR, safety.MARKER_FILE)
    doc = json.load(open(marker_path))
    for rec in doc["files"].values():
        rec.pop("items", None)
    json.dump(doc, open(marker_path, "w"))
    assert safety.read_marker(os.path.join(copy, STEP_DIR)).items == {}
    ref_report, ref = _load_one_process(root)
    hashed = []
    real = checksums.file_checksum
    monkeypatch.setattr(checksums, "file_checksum", lambda path, alg="crc32": hashed.append(path) or real(path, alg))
    report, model = _load_one_process(copy)
    assert sum(p.endswith(".distcp") for p in hashed) == 2
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    flip_bit(os.path.join(copy, STEP_DIR, "__1_0.distcp"), 100, bit=0)
    with pytest.raises(CheckpointCorruptedError, match=r"__1_0\.distcp: crc32 checksum \w+ does not match"):
        _load_one_process(copy)
    assert main(["ckpt", "inspect", copy]) == 1


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


DAMAGE = {
    "flipped data file": ("__0_0.distcp", lambda p: flip_bit(p, 33, bit=0), "crc32 checksum"),
    "flipped .metadata": (".metadata", lambda p: flip_bit(p, 33, bit=0), "crc32 checksum"),
    "flipped megashard.json": ("megashard.json", lambda p: flip_bit(p, 3, bit=0), "crc32 checksum"),
    "flipped per-rank state": ("rank_state/000001.pt", lambda p: flip_bit(p, 99, bit=0), "crc32 checksum"),
    "truncated data file": ("__1_0.distcp", _truncate, "truncated"),
    "truncated .metadata": (".metadata", _truncate, "truncated"),
    "missing data file": ("__1_0.distcp", os.remove, "missing"),
    "missing .metadata": (".metadata", os.remove, "missing"),
    "missing megashard.json": ("megashard.json", os.remove, "missing"),
    "unreadable marker": ("COMPLETE.json", lambda p: open(p, "w").write("{not json"), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
@pytest.mark.parametrize("flag", [[], ["--verify"], ["--format", "json"]])
def test_inspect_exits_1_for_every_kind_of_damage(ckpt, tmp_path, capsys, case, flag):
    root, _ = ckpt
    name, damage, why = DAMAGE[case]
    copy = _copy(root, tmp_path / "c")
    damage(os.path.join(copy, STEP_DIR, name))
    assert main(["ckpt", "inspect", copy] + flag) == 1
    err = capsys.readouterr().err
    assert err.startswith("megashard ckpt inspect: damaged: ") and f"{STEP_DIR}/{name}" in err and why in err, err


def test_inspect_no_verify_compares_sizes_only(ckpt, tmp_path, capsys):
    root, _ = ckpt
    copy = _copy(root, tmp_path / "c")
    assert main(["ckpt", "inspect", copy, "--no-verify"]) == 0
    flip_bit(os.path.join(copy, STEP_DIR, "__0_0.distcp"), 40, bit=0)
    assert main(["ckpt", "inspect", copy, "--no-verify"]) == 0  # sizes intact: not read
    assert main(["ckpt", "inspect", copy]) == 1
    _truncate(os.path.join(copy, STEP_DIR, "__1_0.distcp"))
    assert main(["ckpt", "inspect", copy, "--no-verify"]) == 1
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2  # no checkpoint: usage error
    capsys.readouterr()


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    import zlib

    rng = random.Random(1)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, 3, 64, rng.randrange(0, 70000)]))
        assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_sha256_checkpoints_are_verified_per_item_too(tmp_path):
    torch.manual_seed(0)
    model = _net()
    path = checkpoint.save(str(tmp_path), 2, model, checksum="sha256")
    marker = safety.read_marker(path)
    raw = open(os.path.join(path, "__0_0.distcp"), "rb").read()
    assert marker.algorithm == "sha256" and marker.files["__0_0.distcp"]["checksum"] == checksums.bytes_checksum(raw, "sha256")
    (off, n), digest = sorted(marker.items["__0_0.distcp"].items())[-1]
    assert len(digest) == 64 and digest == checksums.bytes_checksum(raw[off:off + n], "sha256")
    flip_bit(os.path.join(path, "__0_0.distcp"), off + 1, bit=0)
    with pytest.raises(CheckpointCorruptedError, match=rf"__0_0\.distcp: sha256 checksum \w+ of item '.*' .*\(bytes {off}\.\."):
        checkpoint.load(str(tmp_path), _net())
