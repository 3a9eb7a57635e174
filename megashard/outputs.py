"""Where a command writes: one check of an output path before any work is done.

Every file or directory a command writes (``ckpt consolidate OUT``, ``ckpt export-hf OUT``, ``data prepare
--out PREFIX``, ``plan --svg FILE``) is checked here first, so that a bad one is one line naming the option and
the path, exit code 2, and nothing read, computed or written:

- an existing path of the wrong kind (a directory where a file goes, a file where a directory goes);
- a path under a regular file (``a_file/out.pt``);
- a parent directory that is missing (unless the command creates it) or not writable (a real probe:
  ``os.access`` says yes to root on read-only file systems and ``/proc``);
- a path that is, holds or lies inside what the command reads (a checkpoint consolidated into one of its own
  files would be overwritten while it is read; ``export-hf --force`` into a directory holding the checkpoint
  would delete it).
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable

from megashard.errors import ConfigError

__all__ = ["check_output_file", "check_output_dir"]


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
        raise ConfigError(f"{option} {path}: cannot be written under {existing}, which is a file, not a directory; "
                          "choose another path")
    parent = os.path.dirname(full)
    if existing != parent and not create_parents:
        raise ConfigError(f"{option} {path}: the directory {parent} does not exist; create it or write elsewhere")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megashard-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{option} {path}: {existing} is not writable ({e.strerror or e}); choose a writable "
                          "directory") from None


def _check_not_input(option: str, path: str, reads: Iterable[str], kind: str) -> None:
    out = _real(path)
    for src in reads:
        src_real = _real(src)
        if _inside(out, src_real) or (kind == "directory" and _inside(src_real, out)):
            what = "is" if out == src_real else ("lies inside" if _inside(out, src_real) else "holds")
            raise ConfigError(f"{option} {path}: {what} {src}, which this command reads; writing there would "
                              "overwrite its own input: choose a path outside it")


def check_output_file(option: str, path: str, *, reads: Iterable[str] = (), create_parents: bool = False,
                      example: str = "out.pt") -> str:
    """ConfigError (one line naming ``option``) unless ``path`` can be written as a new or replaced regular file
    (see the module docstring); ``reads``: files or directories the command reads. Returns the absolute path."""
    if not path:
        raise ConfigError(f"{option} must not be empty")
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path}: is a directory; give a file name such as {os.path.join(path, example)}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{option} {path}: exists and is not a regular file (a device, pipe or socket)")
    _check_not_input(option, path, reads, "file")  # first: the writability probe must not touch an input
    _check_parent(option, path, create_parents)
    return os.path.abspath(path)


def check_output_dir(option: str, path: str, *, reads: Iterable[str] = (), create_parents: bool = True) -> str:
    """ConfigError (one line naming ``option``) unless ``path`` can be written as a directory (new, or an existing
    one the caller may replace): not a file, not under a file, its parent writable, neither inside nor holding
    what the command reads. Returns the absolute path."""
    if not path:
        raise ConfigError(f"{option} must not be empty")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option} {path}: is an existing file, not a directory; choose another path (or move "
                          "the file away)")
    _check_not_input(option, path, reads, "directory")
    _check_parent(option, path, create_parents)
    return os.path.abspath(path)
