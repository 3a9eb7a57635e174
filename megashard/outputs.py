"""Where megashard writes: the one place that decides whether a command may write, replace or delete a path.

megashard never deletes or overwrites a file it did not make. Every file or directory a command writes
(``megashard run``'s ``train.out_dir`` and checkpoint directory, ``ckpt consolidate OUT``, ``ckpt export-hf
OUT``, ``data prepare --out PREFIX``, ``plan --svg FILE``) is checked here first, so that a bad one is one line
naming the option, the path and the rule, exit code 2, and nothing read, computed or written:

- an existing path of the wrong kind (a directory where a file goes, a file where a directory goes);
- a path under a regular file (``a_file/out.pt``);
- a parent directory that is missing (unless the command creates it) or not writable (a real probe:
  ``os.access`` says yes to root on read-only file systems and ``/proc``);
- a path that is, holds or lies inside what the command reads (a checkpoint consolidated into one of its own
  files would be overwritten while it is read; ``export-hf --force`` into a directory holding the checkpoint
  would delete it; a run directory holding the config file would get the resolved config written over it);
- **a place megashard did not make.** A directory megashard creates for its output carries a marker file,
  :data:`MARKER` (``{"tool": "megashard", "holds": ["run"], ...}``, see :data:`KINDS`). A command writes into a
  directory only when it is new, empty, or megashard's (:func:`claim_dir` creates and marks it), and replaces
  one (``export-hf --force``) only when it holds nothing but what megashard wrote there: the marker lists those
  files (:func:`record_files`: size, SHA-256 of small ones); anything added or changed since is named and refused
  (a marker of a megashard before file lists: judged by the names that kind holds). A marker that cannot be read
  is named as damaged; nothing is touched. An existing file
  is replaced only when the caller recognises it as megashard's own (``mine``: a corpus with megashard's
  metadata, a ``megashard plan`` picture, a ``torch.save`` archive given ``--force``).

A checkpoint directory carries no marker: every entry megashard writes there has a name of its own
(``step_<N>/`` holding ``COMPLETE.json``, ``.tmp-step_<N>``, the lock), by which it is recognised, and retention,
restarts and cleanup touch only those. Directories written before markers existed are recognised by their contents where the evidence is unambiguous
(:func:`_recognised`): *every* entry is one megashard writes there, and at least one carries megashard's own
signature (the resolved config's header line, a checkpoint's ``megashard.json`` / ``COMPLETE.json``, a
checkpoint lock). Such a directory is marked the first time megashard writes into it again, so existing runs
resume as before; a directory holding anything else is refused, naming what it holds.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from typing import Callable, Iterable, Optional

from megashard.errors import ConfigError
from megashard.newfiles import is_torch_archive, new_file_mode, temp_path, torch_archive_comment

__all__ = ["MARKER", "KINDS", "check_output_file", "check_output_dir", "check_owned", "claim_dir", "marker_kinds", "owner",
           "marker_problem", "record_files",
           "is_torch_archive", "torch_archive_comment", "temp_path", "new_file_mode",
           "is_resolved_config", "RESOLVED_CONFIG_HEADER"]

#: The marker file of a directory megashard made (hidden: it does not clutter a listing or a Hugging Face export).
MARKER = ".megashard-dir.json"

#: What a marked directory holds, by kind (the marker's ``holds`` lists the kinds, a run directory that is its
#: own checkpoint root holds two).
KINDS = {
    "run": "a run directory of `megashard run` (config.yaml, metrics.jsonl, checkpoints/)",
    "checkpoints": "a checkpoint directory of megashard (step_<N>/ checkpoints)",
    "hf-export": "a Hugging Face model directory written by `megashard ckpt export-hf`",
}

#: The first line of the resolved config `megashard run` writes to <out_dir>/config.yaml (megashard.launch.launcher).
RESOLVED_CONFIG_HEADER = "# resolved config of megashard run "

# What megashard writes in each kind of directory (names kept in step with megashard.checkpoint.safety,
# megashard.train.ckptlock, megashard.launch.launcher and megashard.train.hf_io; tests/test_trust_round3.py checks).
_CKPT_ENTRY = re.compile(r"^(step_\d+|\.tmp-step_\d+|\.trash-step_\d+.*|earlier-\d{8}-\d{6}(-\d+)?"
                         r"|\.megashard\.lock(\.takeover|\..*\.tmp)?)$")
_CKPT_FILES = ("COMPLETE.json", "megashard.json", ".metadata")
_RUN_ENTRY = re.compile(r"^(config\.yaml(\.\d+\.tmp|\.tmp.*)?|\.config\.yaml\..*\.tmp|metrics\.jsonl|loss\.png"
                        r"|world\.json(\.\d+\.tmp)?|checkpoints|doctor"
                        r"|summary\.json|wandb\.json|\.(summary|wandb)\.json\..*\.tmp|tensorboard|wandb)$")
# <out_dir>/doctor/: each rank's record (megashard.doctor.watch), and a later world's records in restart_<k>/.
_MARKER_TMP = re.compile(r"^\." + re.escape(MARKER) + r"\.[A-Za-z0-9_]+\.tmp$")  # temp_path()'s name for it
_DOCTOR_RECORD = re.compile(r"^rank_\d+\.json(\.\d+\.tmp)?$")
_DOCTOR_RESTART = re.compile(r"^restart_\d+$")
_SHARING = {"run", "checkpoints"}  # a run directory may be its own checkpoint directory (checkpoint.dir = out_dir)
_HF_ENTRY = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
                       r"|model\.safetensors\.index\.json)$")


# ---------------------------------------------------------------------------------------------- paths
def _label(option: str, path: str) -> str:
    """How an error names the output: ``OUT hf`` for a command's argument, ``train.out_dir='.'`` for a config field
    (an ``option`` ending in ``=``)."""
    return f"{option}{path!r}" if option.endswith("=") else f"{option} {path}"


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies below it (both resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _check_parent(option: str, path: str, create_parents: bool) -> None:
    full = os.path.abspath(path)
    existing = os.path.dirname(full)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{_label(option, path)}: cannot be written under {existing}, which is a file, not a directory; "
                          "choose another path")
    parent = os.path.dirname(full)
    if existing != parent and not create_parents:
        raise ConfigError(f"{_label(option, path)}: the directory {parent} does not exist; create it or write elsewhere")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megashard-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{_label(option, path)}: {existing} is not writable ({e.strerror or e}); choose a writable "
                          "directory") from None


def _check_not_input(option: str, path: str, reads: Iterable[str], kind: str) -> None:
    out = _real(path)
    for src in reads:
        if not src:
            continue
        src_real = _real(src)
        if _inside(out, src_real) or (kind == "directory" and _inside(src_real, out)):
            what = "is" if out == src_real else ("lies inside" if _inside(out, src_real) else "holds")
            raise ConfigError(f"{_label(option, path)}: {what} {src}, which this command reads; megashard never writes "
                              "over its own input: choose a path outside it")


# ---------------------------------------------------------------------------------------------- markers
#: Files up to this size get a SHA-256 in the marker's file list (config.json, the index: what a person edits);
#: larger ones (weight shards) are recorded by size.
_HASHED_UP_TO = 1 << 20


def _read_marker(path: str) -> tuple[Optional[dict], Optional[str]]:
    """``(doc, None)`` for a valid marker of directory ``path``, ``(None, None)`` when it has none, ``(None, why)``
    when one is there but damaged (not a regular file, too large, not JSON, not megashard's shape)."""
    from megashard.readers import SMALL, read_json

    full = os.path.join(path, MARKER)
    if not os.path.lexists(full):
        return None, None
    try:
        doc = read_json(full, "marker", limit=SMALL)
    except ConfigError as e:
        return None, str(e).split(f"{full}: ", 1)[-1]
    if not isinstance(doc, dict) or doc.get("tool") != "megashard":
        return None, "is not a JSON object with tool: megashard"
    holds = doc.get("holds")
    if not isinstance(holds, list) or not holds or not all(isinstance(k, str) for k in holds):
        return None, f"has no list of kinds ('holds': {holds!r})"
    files = doc.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("size"), int) for k, v in files.items())):
        return None, "has a file list ('files') that is not {name: {size, sha256}}"
    return doc, None


def marker_kinds(path: str) -> Optional[list[str]]:
    """The kinds a marked directory holds (its marker's ``holds``), or None when ``path`` has no valid marker."""
    doc, _ = _read_marker(path)
    return None if doc is None else list(doc["holds"])


def marker_problem(path: str) -> Optional[str]:
    """Why the marker of directory ``path`` cannot be read (it is there but damaged), or None (valid or absent)."""
    return _read_marker(path)[1]


def _file_entry(full: str) -> dict:
    st = os.stat(full)
    entry: dict = {"size": st.st_size}
    if st.st_size <= _HASHED_UP_TO:
        import hashlib

        with open(full, "rb") as f:
            entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
    return entry


def record_files(path: str, names: Iterable[str]) -> None:
    """Add files ``names`` (in marked directory ``path``, just written by megashard) to its marker's file list (size,
    and a SHA-256 of small ones): what a later ``--force`` may delete, and nothing else."""
    doc, why = _read_marker(path)
    if doc is None:
        raise ConfigError(f"{path}: its marker {MARKER} " + (why or "is missing") + " (megashard writes it first)")
    files = dict(doc.get("files") or {})
    for n in names:
        files[n] = _file_entry(os.path.join(path, n))
    _write_marker(path, list(doc["holds"]), files)


def _not_ours(path: str, doc: dict, kind: str) -> list[str]:
    """The entries of marked directory ``path`` that are not megashard's output (``name`` added since, ``name
    (changed)`` edited or replaced since): judged by the marker's file list, or — a marker of a megashard before
    file lists — by the names ``kind`` writes (every entry a regular file of such a name)."""
    listed = doc.get("files")
    out = []
    for n in sorted(os.listdir(path)):
        if n == MARKER or _MARKER_TMP.match(n):
            continue
        full = os.path.join(path, n)
        if os.path.islink(full) or not os.path.isfile(full):
            out.append(n + ("/" if os.path.isdir(full) else ""))
        elif listed is None:
            if not (kind == "hf-export" and _HF_ENTRY.match(n)):
                out.append(n)
        elif n not in listed:
            out.append(n)
        else:
            want, st = listed[n], os.stat(full)
            if st.st_size != want.get("size") or ("sha256" in want and _file_entry(full).get("sha256") != want["sha256"]):
                out.append(f"{n} (changed)")
    return out


def _write_marker(path: str, kinds: list[str], files: Optional[dict] = None) -> None:
    from megashard._version import __version__

    old, _ = _read_marker(path)
    created = (old or {}).get("created")
    doc = {"tool": "megashard", "holds": kinds, "what": [KINDS.get(k, k) for k in kinds], "version": __version__,
           "created": created if isinstance(created, str) else time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if files is not None:
        doc["files"] = files
    tmp = temp_path(os.path.join(path, MARKER))
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(path, MARKER))


def is_resolved_config(path: str) -> bool:
    """``path`` is a resolved config ``megashard run`` wrote (its first line is :data:`RESOLVED_CONFIG_HEADER`)."""
    return _first_line(path).startswith(RESOLVED_CONFIG_HEADER)


def _first_line(path: str) -> str:
    from megashard.readers import check_regular

    try:
        check_regular(path, "file")  # a FIFO of that name would block open()
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline(4096)
    except (OSError, ConfigError):
        return ""


def _is_checkpoint_root(path: str) -> bool:
    """Every entry is a name megashard's checkpointing writes, and one of them shows a megashard checkpoint."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if not names or not all(_CKPT_ENTRY.match(n) or n == MARKER for n in names):
        return False
    for n in names:
        if n.startswith(".megashard.lock"):
            return True
        sub = os.path.join(path, n)
        if any(os.path.isfile(os.path.join(sub, f)) for f in _CKPT_FILES) or os.path.isdir(os.path.join(sub, "rank_state")):
            return True
        if n.startswith("earlier-") and _is_checkpoint_root(sub):
            return True
    return False


def _is_doctor_dir(path: str) -> bool:
    """Every entry is a doctor record of a rank, or a ``restart_<k>/`` directory holding only such records."""
    for n in os.listdir(path):
        if _DOCTOR_RECORD.match(n):
            continue
        sub = os.path.join(path, n)
        if not (_DOCTOR_RESTART.match(n) and os.path.isdir(sub) and all(_DOCTOR_RECORD.match(x) for x in os.listdir(sub))):
            return False
    return True


def _recognised(path: str, kind: str, names: list[str]) -> bool:
    """A directory of ``kind`` written by a megashard without markers, by unambiguous evidence (module docstring)."""
    if kind == "checkpoints":
        return _is_checkpoint_root(path)
    if kind == "hf-export":
        return (all(_HF_ENTRY.match(n) for n in names) and "config.json" in names
                and any(n.endswith(".safetensors") for n in names))
    if kind == "run":
        def ok(n: str) -> bool:
            sub = os.path.join(path, n)
            if n == "checkpoints":
                return os.path.isdir(sub) and (not os.listdir(sub) or marker_kinds(sub) is not None
                                               or _is_checkpoint_root(sub))
            if n == "doctor":
                return os.path.isdir(sub) and _is_doctor_dir(sub)
            return bool(_RUN_ENTRY.match(n)) or (os.path.isdir(sub) and marker_kinds(sub) is not None)

        if not all(ok(n) for n in names):
            return False
        subs = [os.path.join(path, n) for n in names]
        if all(os.path.isdir(p) and not os.listdir(p) for p in subs):
            return True  # nothing but empty directories of megashard's names: nothing to lose
        ckpt, doctor = os.path.join(path, "checkpoints"), os.path.join(path, "doctor")
        return (is_resolved_config(os.path.join(path, "config.yaml"))
                or (os.path.isdir(doctor) and bool(os.listdir(doctor)))
                or (os.path.isdir(ckpt) and (marker_kinds(ckpt) is not None or _is_checkpoint_root(ckpt))))
    return False


def owner(path: str, kind: str) -> str:
    """Who ``path`` belongs to, for a command writing ``kind`` there: ``"absent"``, ``"empty"`` (a directory with
    nothing in it), ``"marked"`` (megashard's marker, any kind), ``"damaged"`` (a marker megashard cannot read),
    ``"recognised"`` (an older megashard directory of ``kind``, see :func:`_recognised`), or ``"foreign"``
    (anything else, a file included)."""
    if not os.path.lexists(path):
        return "absent"
    if not os.path.isdir(path):
        return "foreign"
    doc, damaged = _read_marker(path)
    if doc is not None:
        return "marked"
    if damaged is not None:
        return "damaged"
    try:
        # a marker another process is writing right now (two launchers of one elastic job start together) is not a
        # file of the user's
        names = [n for n in os.listdir(path) if not _MARKER_TMP.match(n)]
    except OSError:
        return "foreign"
    if not names:
        return "empty"
    try:
        return "recognised" if _recognised(path, kind, names) else "foreign"
    except OSError:  # a part of it cannot be read: not evidence of anything
        return "foreign"


def _listing(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"cannot be listed: {e.strerror or e}"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"holds {shown}"


def _check_owned(option: str, path: str, kind: str, replace: bool) -> None:
    """ConfigError unless megashard may write into (or, ``replace``, delete and recreate) directory ``path``."""
    who = owner(path, kind)
    if who in ("absent", "empty", "recognised"):
        return
    what = KINDS[kind].split(" (")[0]
    if who == "damaged":
        raise ConfigError(f"{_label(option, path)}: its marker {MARKER} is damaged ({marker_problem(path)}), so "
                          "megashard cannot tell which files there are its own and touches none; if the directory "
                          f"holds only megashard's output, delete {MARKER} (megashard then recognises its files by "
                          "name), else choose a new directory")
    if who == "marked":
        doc, _ = _read_marker(path)
        kinds = list(doc["holds"]) if doc else []
        if replace and kinds == [kind]:
            foreign = _not_ours(path, doc or {}, kind)
            if foreign:
                shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
                basis = ("its marker's list of the files megashard wrote" if (doc or {}).get("files") is not None
                         else f"the names megashard writes in {what}: the marker, from an earlier megashard, lists "
                              "no files")
                raise ConfigError(f"{_label(option, path)}: holds what megashard did not write there: {shown} (judged "
                                  f"by {basis}); replacing the directory would delete them: move them out of it, or "
                                  "choose another path")
            return
        if kinds == [kind] or (not replace and kind in _SHARING and set(kinds) <= _SHARING):
            return
        whose = " and ".join(KINDS.get(k, k).split(" (")[0] for k in kinds)
        harm = "replacing it would delete it" if replace else "writing there would mix two outputs"
        raise ConfigError(f"{_label(option, path)}: is {whose}, not {what}: {harm}; choose another path")
    rule = (f"megashard replaces only a directory it made itself ({what}, marked by {MARKER}), never one holding "
            "files of yours" if replace else
            f"megashard writes only into a new or empty directory, or one it made itself (marked by {MARKER}), so that "
            "it never overwrites or deletes a file of yours")
    raise ConfigError(f"{_label(option, path)}: the existing directory {_listing(path)}, not made by megashard; {rule}: "
                      "choose a new directory")


# ---------------------------------------------------------------------------------------------- checks
def check_output_file(option: str, path: str, *, reads: Iterable[str] = (), create_parents: bool = False,
                      example: str = "out.pt", mine: Optional[Callable[[str], Optional[str]]] = None) -> str:
    """ConfigError (one line naming ``option``) unless ``path`` can be written as a new or replaced regular file
    (see the module docstring); ``reads``: files or directories the command reads. An existing file is replaced
    only when ``mine(path)`` returns None (megashard's own); otherwise the text it returns says why not (the error
    adds the rule). Without ``mine`` an existing file is refused. Returns the absolute path."""
    if not path:
        raise ConfigError(f"{option.rstrip('=')} must not be empty")
    if os.path.isdir(path):
        raise ConfigError(f"{_label(option, path)}: is a directory; give a file name such as {os.path.join(path, example)}")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ConfigError(f"{_label(option, path)}: exists and is not a regular file (a device, pipe, socket or broken link)")
    _check_not_input(option, path, reads, "file")  # first: the writability probe must not touch an input
    if os.path.isfile(path):
        why = "it exists" if mine is None else mine(path)
        if why is not None:
            raise ConfigError(f"{_label(option, path)}: {why}; megashard never overwrites a file it did not make: choose "
                              "another path (or move the file away yourself)")
    _check_parent(option, path, create_parents)
    return os.path.abspath(path)


def check_output_dir(option: str, path: str, *, reads: Iterable[str] = (), create_parents: bool = True,
                     kind: Optional[str] = None, replace: bool = False) -> str:
    """ConfigError (one line naming ``option``) unless ``path`` can be written as a directory: not a file, not
    under a file, its parent writable, neither inside nor holding what the command reads, and — with ``kind`` —
    megashard's to write into (new, empty, marked or recognised), or with ``replace`` to delete and recreate (only
    its own directory of that kind). Returns the absolute path."""
    if not path:
        raise ConfigError(f"{option.rstrip('=')} must not be empty")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{_label(option, path)}: is an existing file, not a directory; choose another path (or move "
                          "the file away)")
    _check_not_input(option, path, reads, "directory")
    if kind is not None:
        _check_owned(option, path, kind, replace)
    _check_parent(option, path, create_parents)
    return os.path.abspath(path)


def check_owned(option: str, path: str, kind: str, *, reads: Iterable[str] = (), replace: bool = False) -> None:
    """The ownership part of :func:`check_output_dir` alone (no probe written): ``path`` is neither inside nor holding
    ``reads``, and megashard's to write into (or, ``replace``, to replace). ConfigError naming ``option``."""
    _check_not_input(option, path, reads, "directory")
    _check_owned(option, path, kind, replace)


def claim_dir(path: str, kind: str, option: str = "") -> str:
    """Create directory ``path`` (and its parents) if missing and mark it as megashard's ``kind``; a directory
    already marked gets ``kind`` added. Call after :func:`check_output_dir` with ``kind`` (a foreign directory is
    refused here too: ConfigError). Returns the absolute path."""
    _check_owned(option or kind, path, kind, replace=False)
    os.makedirs(path, exist_ok=True)
    doc, _ = _read_marker(path)
    kinds = list(doc["holds"]) if doc else []
    if kind not in kinds:
        _write_marker(path, kinds + [kind], (doc or {}).get("files"))
    return os.path.abspath(path)
