"""Read back what W&B wrote offline (``run-<id>.wandb``): the history rows, for tests.

wandb's own Python reader of these files went away (0.2x moved it into its Go service), so this reads the format
itself: a 7-byte header (``:W&B``, a magic number, a version), then LevelDB log records (32 KiB blocks, each
record a 7-byte header — crc32c, length, type — and a piece of one protobuf ``wandb_internal_pb2.Record``).
"""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any, Iterator

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[bytes]:
    """The serialized records of one ``.wandb`` file, in order."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def history(run_dir: str) -> list[dict[str, Any]]:
    """Every history row (``wandb.log`` call) of a W&B run directory (``.../offline-run-*``), keys to values."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def run_ids(run_dir: str) -> set[str]:
    """The run ids a W&B run directory's records name."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = set()
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "run":
            out.add(rec.run.run_id)
    return out
