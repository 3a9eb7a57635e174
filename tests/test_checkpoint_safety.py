"""Crash safety of megashard checkpoints: atomic publish, kills midway, damaged files, retention, no pickle.

Single process (DCP ``no_dist``); the kill test runs saves in a subprocess that SIGKILLs itself.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from megashard import checkpoint
from megashard.checkpoint import checksums, safety
from megashard.errors import CheckpointCorruptedError, CheckpointError, CheckpointNotFoundError
from tests._helpers import assert_bitwise_equal, flip_bit, params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed: int):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def _trained(seed: int = 0):
    m, o = _model(seed)
    m(torch.randn(4, 5)).sum().backward()
    o.step()
    return m, o


def test_layout_file_marker_and_roundtrip(tmp_path):
    m, o = _trained()
    path = checkpoint.save(str(tmp_path), 3, m, o, consumed_samples=12, data_state={"i": 5}, checksum="sha256")
    assert os.path.basename(path) == "step_00000003"
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]  # no temporary directory left
    marker = safety.read_marker(path)
    assert marker.algorithm == "sha256" and marker.step == 3
    on_disk = {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}
    assert set(marker.files) == on_disk - {safety.MARKER_FILE}  # every file, marker excluded
    for name, rec in marker.files.items():
        assert rec == checksums.file_record(os.path.join(path, name), "sha256")
    info = json.load(open(os.path.join(path, safety.LAYOUT_FILE)))
    assert info["step"] == 3 and info["consumed_samples"] == 12 and info["has_data_state"] is True
    assert info["layout"] == {"world_size": 1, "config": None, "sizes": None}
    m2, o2 = _model(1)
    report = checkpoint.load(str(tmp_path), m2, o2)
    assert_bitwise_equal(params(m), params(m2))
    assert report.rng == "restored" and report.data == "restored" and report.data_state == {"i": 5}


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch, torch.nn as nn
    sys.path.insert(0, {repo!r})
    from megashard import checkpoint
    from megashard.checkpoint import rank_state, safety
    root = sys.argv[1]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    checkpoint.save(root, 1, m)
    torch.save(m.state_dict(), os.path.join(root, "..", "ref1.pt"))
    # Killed when the save reaches a step: after DCP wrote the data (at the per-rank state), or with the
    # marker written but the directory not yet renamed (at the commit).
    for step, (module, step_fn) in ((2, (rank_state, "write_rank_state")), (3, (safety, "commit_checkpoint"))):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        pid = os.fork()
        if pid == 0:  # the child saves and is killed at that step: data written, marker missing / not published
            setattr(module, step_fn, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
            checkpoint.save(root, step, m)
            os._exit(3)  # not reached
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        print(step, sorted(os.listdir(root)), flush=True)
    """
)


def test_kill_midway_leaves_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpts"
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT.format(repo=REPO))
    out = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    # Killed after the data: only a temporary directory. Killed with the marker written inside it but not yet
    # renamed: still only a temporary directory (the step-2 leftover was cleaned by the step-3 save).
    assert lines == ["2 ['.tmp-step_00000002', 'step_00000001']", "3 ['.tmp-step_00000003', 'step_00000001']"], lines
    assert os.path.isfile(root / ".tmp-step_00000003" / safety.MARKER_FILE)
    assert safety.latest_checkpoint(str(root)) == str(root / "step_00000001")
    m, _ = _model(5)
    report = checkpoint.load(str(root), m)
    assert report.step == 1
    assert_bitwise_equal(params(m), torch.load(tmp_path / "ref1.pt", weights_only=True))
    # The next save removes the leftover and publishes normally.
    checkpoint.save(str(root), 4, m)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000004"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "flip_rank_state", "flip_metadata"])
def test_damaged_file_raises_naming_it_before_any_tensor_is_loaded(tmp_path, damage):
    m, o = _trained()
    path = checkpoint.save(str(tmp_path), 1, m, o, checksum="crc32")
    target = {"flip": "__0_0.distcp", "truncate": "__0_0.distcp", "delete": "__0_0.distcp",
              "flip_rank_state": "rank_state/000000.pt", "flip_metadata": ".metadata"}[damage]
    full = os.path.join(path, target)
    if damage == "truncate":
        with open(full, "r+b") as f:
            f.truncate(os.path.getsize(full) - 10)
    elif damage == "delete":
        os.remove(full)
    else:
        flip_bit(full, 40, bit=4)
    m2, o2 = _model(1)
    before = params(m2)
    expected = {"truncate": "truncated", "delete": "missing"}.get(damage, "crc32 checksum")
    with pytest.raises(CheckpointCorruptedError, match=rf"{target.replace('.', '[.]')}: .*{expected}"):
        checkpoint.load(str(tmp_path), m2, o2)
    assert_bitwise_equal(before, params(m2))  # nothing was loaded
    # The offline tools refuse it as well.
    from megashard.checkpoint.consolidate import consolidate

    with pytest.raises(CheckpointCorruptedError, match=target.replace(".", "[.]")):
        consolidate(str(tmp_path), str(tmp_path) + "-out.pt")  # outside the checkpoint it reads


def test_retention_keeps_exactly_k_and_newest_complete_is_loaded(tmp_path):
    m, _ = _model(0)
    for step in range(1, 6):
        with torch.no_grad():
            m[0].bias.fill_(float(step))
        checkpoint.save(str(tmp_path), step, m, keep_last=2, checksum="crc32")
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000005"]
    # A step directory without a marker (e.g. a partial copy) is not a checkpoint.
    os.makedirs(tmp_path / "step_00000009")
    m2, _ = _model(1)
    assert checkpoint.load(str(tmp_path), m2).step == 5 and float(m2[0].bias.detach()[0]) == 5.0
    checkpoint.save(str(tmp_path), 6, m, keep_last=1, checksum="crc32")
    assert sorted(os.listdir(tmp_path)) == ["step_00000006", "step_00000009"]  # newer incomplete dir untouched
    with pytest.raises(CheckpointError, match="keep_last"):
        checkpoint.save(str(tmp_path), 7, m, keep_last=0)
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.save(str(tmp_path), 6, m)
    checkpoint.save(str(tmp_path), 6, m, overwrite=True)


def test_no_checkpoint_found_lists_what_is_there(tmp_path):
    os.makedirs(tmp_path / "step_00000002")
    os.makedirs(tmp_path / ".tmp-step_00000003")
    with pytest.raises(CheckpointNotFoundError, match=r"step_00000002.*\.tmp-step_00000003"):
        checkpoint.load(str(tmp_path), _model(0)[0])
    (tmp_path / "step_00000002" / safety.MARKER_FILE).write_text("{not json")
    with pytest.raises(CheckpointCorruptedError, match="COMPLETE.json.*not valid JSON"):
        checkpoint.load(str(tmp_path), _model(0)[0])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megashard-pwned",))


def _rewrite_marker(path: str) -> None:
    """What an attacker (not a crash) would do: recompute the marker after replacing a file."""
    marker = safety.read_marker(path)
    files = {n: checksums.file_record(os.path.join(path, n), marker.algorithm) for n in marker.files}
    safety.write_marker(path, marker.step, files, marker.algorithm)


@pytest.mark.parametrize("where", [".metadata", "rank_state/000000.pt", "extra_item"])
def test_arbitrary_pickles_are_never_executed(tmp_path, where):
    if os.path.exists("/tmp/megashard-pwned"):
        os.remove("/tmp/megashard-pwned")
    m, _ = _model(0)
    path = checkpoint.save(str(tmp_path), 1, m, state_dict={"note": "ok"})
    if where == "extra_item":  # a non-tensor DCP item: patch the pickled bytes inside the data file
        import io

        from megashard.checkpoint.storage import load_dcp_metadata

        md = load_dcp_metadata(os.path.join(path, ".metadata"))
        (idx, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == "extra.note"]
        buf = io.BytesIO()
        torch.save(_Evil(), buf)
        data = bytearray(open(os.path.join(path, info.relative_path), "rb").read())
        payload = buf.getvalue()
        # Replace the item's bytes (keep the file layout: append and point the metadata at it).
        md.storage_data[idx] = type(info)(info.relative_path, len(data), len(payload))
        data += payload
        open(os.path.join(path, info.relative_path), "wb").write(bytes(data))
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        match = "weights_only"
    elif where == ".metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_Evil(), f)
        match = "posix.system|os.system|not a DCP metadata class"
    else:
        torch.save({"rng": _Evil()}, os.path.join(path, where))
        match = "weights_only"
    _rewrite_marker(path)
    with pytest.raises(CheckpointCorruptedError, match=match):
        checkpoint.load(str(tmp_path), _model(1)[0], state_dict={"note": None})
    assert not os.path.exists("/tmp/megashard-pwned")


def test_non_weights_only_state_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match="weights_only"):
        checkpoint.save(str(tmp_path), 1, _model(0)[0], data_state={"sampler": _Evil()})
    with pytest.raises(CheckpointError, match="weights_only"):
        checkpoint.save(str(tmp_path), 1, _model(0)[0], state_dict={"obj": _Evil()})
    assert not os.path.exists("/tmp/megashard-pwned")
    assert os.listdir(tmp_path) == []
