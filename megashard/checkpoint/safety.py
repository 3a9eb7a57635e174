"""Crash-safe checkpoint directories: write to a temporary directory, publish by an atomic rename.

A checkpoint root holds one directory per saved step::

    ROOT/
      step_00000010/            complete: visible only after everything in it was written and synced
        .metadata __0_0.distcp  DCP files
        megashard.json          config and rank layout it was saved with
        rank_state/000000.pt    per-rank RNG and data-loader state
        COMPLETE.json           the completion marker, written last: size and checksum of every file
                                (and of every DCP storage item in the data files)
      .tmp-step_00000020/       a save in progress (or killed midway): ignored, removed by the next save
      .trash-step_00000002/     being deleted by retention: ignored

Rules: a directory counts as a checkpoint only if its name is ``step_<digits>`` *and* it holds a
readable marker. The marker is written (and fsynced) inside the temporary directory, which is then
renamed to its final name in one ``os.rename`` and the root directory fsynced; so a reader sees either
nothing or the whole checkpoint. The marker records every file's size and checksum and, for data files,
the checksum of every DCP storage item in them (:mod:`megashard.checkpoint.checksums`); readers check
sizes first and checksums as they read (:mod:`megashard.checkpoint.storage`): a truncated or altered
file raises :class:`~megashard.errors.CheckpointCorruptedError` naming it, never a wrong tensor.

This module is pure file handling (no torch.distributed); :mod:`megashard.checkpoint.saving` and
:mod:`megashard.checkpoint.loading` decide which rank does what.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from megashard.checkpoint import checksums
from megashard.errors import CheckpointCorruptedError, CheckpointError, CheckpointNotFoundError

__all__ = [
    "CheckpointEntry",
    "LAYOUT_FILE",
    "MARKER_FILE",
    "Marker",
    "apply_retention",
    "checkpoint_dirname",
    "cleanup_stale",
    "commit_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "read_marker",
    "resolve_checkpoint",
    "run_of",
    "verify_files",
    "write_json_atomic",
    "write_marker",
]

MARKER_FILE = "COMPLETE.json"
LAYOUT_FILE = "megashard.json"
RANK_STATE_DIR = "rank_state"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
FORMAT = "megashard-checkpoint"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_STALE_RE = re.compile(r"^(\.tmp-step_\d+|\.trash-step_\d+-\d+-\d+)$")


def checkpoint_dirname(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (``step_00000010``); steps sort by name and number."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step:08d}"



def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file, fsync and rename (never half-written)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, what: str) -> dict:
    """Load a small JSON file with the standard (safe) loader; a broken file raises naming it."""
    from megashard.readers import LARGE, read_json as read_file

    if not os.path.lexists(path):
        raise CheckpointCorruptedError(f"{what} {path} is missing")
    # a FIFO, device or huge file in its place is named as damaged, never opened to read (it would block)
    obj = read_file(path, what, limit=LARGE, error=CheckpointCorruptedError, hint="the file is damaged")
    if not isinstance(obj, dict):
        raise CheckpointCorruptedError(f"{what} {path} must hold a JSON object, found {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------------------------------------- marker
@dataclass(frozen=True)
class Marker:
    """Contents of ``COMPLETE.json``: the step, every file's size and checksum, and per-item checksums.

    ``items[name]`` maps ``(offset, length)`` of every DCP storage item of data file ``name`` to the
    checksum of those bytes (recorded by the writer as it wrote them; absent in checkpoints of older
    megashard versions and for files whose items do not tile the file). A reader verifies each item as
    it reads it instead of hashing the whole file first.
    """

    step: int
    algorithm: str
    files: dict  # relative path -> {"size": int, "checksum": str}
    created: float
    items: dict = field(default_factory=dict)  # relative path -> {(offset, length): checksum}

    @property
    def total_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.files.values())


def write_marker(ckpt_dir: str, step: int, files: dict, algorithm: str, items: Optional[dict] = None) -> None:
    """Write the completion marker (last file of a save).

    ``files``: relative path -> :func:`file_record`; ``items``: relative path -> ``[(offset, length,
    checksum), ...]`` of the DCP storage items in that file (they must tile it: bytes 0..size, no gap).
    """
    checksums.check_algorithm(algorithm)
    records = {}
    for k in sorted(files):
        records[k] = dict(files[k])
        if items and items.get(k):
            records[k]["items"] = [[int(o), int(n), str(c)] for o, n, c in sorted(items[k])]
    write_json_atomic(os.path.join(ckpt_dir, MARKER_FILE), {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "algorithm": algorithm,
        "created": time.time(), "files": records,
    })


def spans_tile(spans: Iterable[tuple[int, int]], size: int) -> bool:
    """True if the ``(offset, length)`` spans cover bytes ``0..size`` exactly, without gaps or overlaps."""
    pos = 0
    for off, n in sorted(spans):
        if off != pos or n < 0:
            return False
        pos += n
    return pos == size


def read_marker(ckpt_dir: str) -> Marker:
    """The marker of a checkpoint directory; raises CheckpointCorruptedError if it is absent or damaged."""
    path = os.path.join(ckpt_dir, MARKER_FILE)
    obj = read_json(path, "completion marker")
    try:
        if obj.get("format") != FORMAT:
            raise ValueError(f"format is {obj.get('format')!r}, expected {FORMAT!r}")
        if int(obj.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"format version {obj['version']} is newer than this megashard reads ({FORMAT_VERSION})")
        files, items = {}, {}
        for k, v in obj["files"].items():
            name = str(k)
            if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
                raise ValueError(f"file entry {name!r} points outside the checkpoint directory")
            files[name] = {"size": int(v["size"]), "checksum": str(v["checksum"])}
            if v.get("items"):
                table = {(int(o), int(n)): str(c) for o, n, c in v["items"]}
                if not spans_tile(table, files[name]["size"]):
                    raise ValueError(f"the items of {name!r} do not cover its {files[name]['size']} bytes")
                items[name] = table
        algorithm = str(obj["algorithm"])
        checksums.check_algorithm(algorithm)
        return Marker(int(obj["step"]), algorithm, files, float(obj.get("created", 0.0)), items)
    except (KeyError, TypeError, ValueError, CheckpointError) as e:
        raise CheckpointCorruptedError(f"completion marker {path} is malformed: {e}") from None


def _check_one(ckpt_dir: str, name: str, record: dict, algorithm: str, checksum: bool) -> Optional[str]:
    path = os.path.join(ckpt_dir, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path}: file is missing (the marker lists it with {record['size']} bytes)"
    except OSError as e:
        return f"{path}: cannot be read ({e})"
    if size != record["size"]:
        kind = "truncated" if size < record["size"] else "longer than written"
        return f"{path}: {kind}: {size} bytes on disk, {record['size']} bytes when the checkpoint was completed"
    if checksum:
        try:
            actual = checksums.file_checksum(path, algorithm)
        except OSError as e:
            return f"{path}: cannot be read ({e})"
        if actual != record["checksum"]:
            return (f"{path}: {algorithm} checksum {actual} does not match {record['checksum']} recorded when the "
                    "checkpoint was completed (the file was altered or corrupted)")
    return None


def item_problem(path: str, what: str, offset: int, length: int, algorithm: str, actual: str, expected: str) -> str:
    """The problem line of a DCP storage item whose bytes do not match the marker."""
    return (f"{path}: {algorithm} checksum {actual} of {what} (bytes {offset}..{offset + length}) does not match "
            f"{expected} recorded when the checkpoint was completed (the file was altered or corrupted)")


def verify_files(
    ckpt_dir: str,
    marker: Marker,
    names: Optional[Iterable[str]] = None,
    *,
    checksum: bool = True,
    defer_items: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> list[str]:
    """Check files of a checkpoint against its marker; returns one problem description per bad file.

    Args:
        names: relative paths to check (default: every file in the marker); names the marker does not
            list are reported as problems.
        checksum: also recompute checksums (reads the files); False checks sizes only.
        defer_items: files with per-item checksums (``marker.items``) get only their size checked here:
            their items are verified as they are read (:class:`megashard.checkpoint.storage.SafeFileSystemReader`).
        progress: called with the bytes of each file once it is checked.
    """
    problems = []
    for name in (sorted(marker.files) if names is None else names):
        record = marker.files.get(name)
        if record is None:
            problems.append(f"{os.path.join(ckpt_dir, name)}: not listed in the completion marker")
            continue
        p = _check_one(ckpt_dir, name, record, marker.algorithm, checksum and not (defer_items and name in marker.items))
        if p:
            problems.append(p)
        if progress is not None:
            progress(record["size"])
    return problems


def raise_problems(ckpt_dir: str, problems: Sequence[str]) -> None:
    """Raise one CheckpointCorruptedError listing ``problems`` (no-op if empty).

    The error's ``problems`` attribute holds the list (one line per damaged file or item).
    """
    if not problems:
        return
    older = [e.path for e in list_checkpoints(os.path.dirname(os.path.abspath(ckpt_dir))) if e.complete
             and os.path.abspath(e.path) != os.path.abspath(ckpt_dir)]
    hint = f" Older complete checkpoints: {older[-3:]}." if older else ""
    shown = "; ".join(problems[:8]) + (f"; ... and {len(problems) - 8} more" if len(problems) > 8 else "")
    err = CheckpointCorruptedError(
        f"checkpoint {ckpt_dir} is damaged, refusing to load it: {shown}. Restore the file(s) from a copy or "
        f"load another checkpoint.{hint}"
    )
    err.problems = list(problems)
    raise err


# ---------------------------------------------------------------------------------------------- listing
@dataclass(frozen=True)
class CheckpointEntry:
    """A ``step_N`` directory of a root; ``complete`` if it holds a marker file."""

    path: str
    step: int
    complete: bool


def list_checkpoints(root: str) -> list[CheckpointEntry]:
    """Every ``step_N`` directory of ``root`` ordered by step (temporary and trash directories excluded)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            out.append(CheckpointEntry(path, int(m.group(1)), os.path.isfile(os.path.join(path, MARKER_FILE))))
    return sorted(out, key=lambda e: e.step)


def latest_checkpoint(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint under ``root``, or None."""
    complete = [e for e in list_checkpoints(root) if e.complete]
    return complete[-1].path if complete else None


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a complete checkpoint, else the newest complete checkpoint under it.

    Raises :class:`CheckpointNotFoundError` naming what was found (incomplete or temporary directories).
    """
    if is_checkpoint_dir(path):
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    found = sorted(os.listdir(path))
    incomplete = [os.path.basename(e.path) for e in list_checkpoints(path) if not e.complete]
    in_progress = [n for n in found if n.startswith(TMP_PREFIX)]
    detail = []
    if incomplete:
        detail.append(f"step directories without a {MARKER_FILE} marker (not finished): {incomplete}")
    if in_progress:
        detail.append(f"unfinished saves (killed or still running): {in_progress}")
    marker = os.path.join(path, MARKER_FILE)
    if os.path.lexists(marker) and not os.path.isfile(marker):  # a FIFO or directory in its place: damaged
        from megashard.readers import kind_of

        what = kind_of(os.lstat(marker).st_mode) if not os.path.islink(marker) else "a broken or special link"
        detail.append(f"{MARKER_FILE} that is {what}, not a regular file (the checkpoint is damaged)")
    elif os.path.exists(os.path.join(path, ".metadata")):
        detail.append(f"a DCP checkpoint without megashard's {MARKER_FILE} (not saved by megashard.checkpoint.save)")
    raise CheckpointNotFoundError(
        f"no complete checkpoint in {path}: it is neither a checkpoint directory (with {MARKER_FILE}) nor a root "
        f"holding step_<N> checkpoints" + (f"; found {'; '.join(detail)}" if detail else f"; it contains {found[:10]}")
    )


# ---------------------------------------------------------------------------------------------- writing
def _remove_tree(path: str) -> None:
    """Delete ``path``: first renamed to a trash name (atomic: never visible half-deleted), then removed."""
    parent, name = os.path.split(os.path.abspath(path))
    trash = os.path.join(parent, f"{TRASH_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def cleanup_stale(root: str, keep: Sequence[str] = ()) -> list[str]:
    """Remove leftovers of killed saves (``.tmp-*``) and interrupted deletions (``.trash-*``) in ``root``.

    Only one job may save into a root at a time. Returns the removed paths.
    """
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        # only the names megashard gives them (.tmp-step_<N>, .trash-step_<N>-...): a .tmp-notes of the user's stays
        if _STALE_RE.match(name) and name not in keep:
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def commit_checkpoint(tmp_dir: str, final_dir: str, *, overwrite: bool = False) -> None:
    """Publish a finished temporary directory under its final name (atomic rename, then fsync the root).

    An existing ``final_dir`` raises :class:`CheckpointError` unless ``overwrite``; then it is moved to
    the trash first, so at every moment the step has one complete checkpoint or none.
    """
    if os.path.exists(final_dir):
        if not overwrite:
            raise CheckpointError(f"checkpoint {final_dir} already exists; pass overwrite=True to replace it")
        if not _is_megashard_step(final_dir):
            raise CheckpointError(f"{final_dir} exists and is not a checkpoint megashard saved (no {MARKER_FILE} or "
                                  f"{LAYOUT_FILE}); overwrite=True replaces only megashard's own checkpoints: move it "
                                  "away or save another step")
        _remove_tree(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def _is_megashard_step(path: str) -> bool:
    """``path`` is a directory megashard's saving made (it holds the marker or the layout file)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in (MARKER_FILE, LAYOUT_FILE))


def run_of(ckpt_dir: str) -> Optional[str]:
    """The id of the run that saved checkpoint ``ckpt_dir`` (``run_id`` of its layout file; ``""`` when it records
    none, e.g. saved by an earlier megashard version), or None when the layout file is unreadable."""
    try:
        info = read_json(os.path.join(ckpt_dir, LAYOUT_FILE), "layout file")
    except CheckpointError:
        return None
    return str(info.get("run_id") or "") if isinstance(info, dict) else None


def _created(entry: CheckpointEntry) -> tuple[float, int]:
    """Recency of a complete checkpoint: when its marker says it was completed (else its marker file's mtime)."""
    path = os.path.join(entry.path, MARKER_FILE)
    try:
        created = float(read_json(path, "marker").get("created") or 0.0)
    except (CheckpointError, ValueError, TypeError, AttributeError):
        created = 0.0
    if not created:
        try:
            created = os.path.getmtime(path)
        except OSError:
            created = 0.0
    return created, entry.step


def apply_retention(root: str, keep_last: int, *, run_id: Optional[str] = None,
                    protect: Optional[str] = None) -> list[str]:
    """Delete all but the ``keep_last`` most recently completed checkpoints; returns the removed paths.

    Recency is the completion time the marker records (not the step number: a run that starts over at step 0
    next to older, higher steps keeps its own newest). ``protect``: a checkpoint never deleted (the one just
    written). ``run_id``: only checkpoints of that run are candidates (see :func:`run_of`; ``""`` = those that
    record no run); None = every complete checkpoint of ``root``, plus incomplete step directories of lower steps
    than every kept one. ``keep_last`` must be >= 1.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last must be an int >= 1 (or None to keep everything), got {keep_last!r}")
    entries = list_checkpoints(root)
    complete = [e for e in entries if e.complete and (run_id is None or run_of(e.path) == run_id)]
    if len(complete) <= keep_last:
        return []
    keep_path = os.path.abspath(protect) if protect else None
    ordered = sorted(complete, key=_created, reverse=True)  # newest first
    kept = [e for e in ordered if os.path.abspath(e.path) == keep_path]
    kept += [e for e in ordered if e not in kept][: max(0, keep_last - len(kept))]
    doomed = [e for e in complete if e not in kept]
    if run_id is None:  # incomplete step directories below every kept step (partial copies, killed old saves)
        lowest = min(e.step for e in kept)
        doomed += [e for e in entries if not e.complete and e.step < lowest]
    removed = []
    for e in sorted(doomed, key=lambda e: e.step):
        _remove_tree(e.path)
        removed.append(e.path)
    fsync_dir(root)
    return removed
