"""Reading a file a user can name: the one place that opens it, so that no path can block or exhaust megashard.

Every small file megashard reads whole (configs, doctor records, calibration files, corpus metadata, directory
markers, tokenizers, checkpoint metadata, Hugging Face ``config.json``) goes through :func:`read_bytes` (or
:func:`read_text` / :func:`read_json`). It opens the path without blocking (``O_NONBLOCK``: a FIFO with no writer
would block ``open()`` forever) and checks *the opened file* (``fstat``, so nothing can swap it in between) before
reading a byte:

- it is a regular file (not a FIFO, socket, device or directory: ``/dev/zero`` never ends, ``/dev/stdin`` waits);
- it is at most ``limit`` bytes (a 40 GB file given where a config goes would be read into memory), and no more
  than ``limit`` bytes are ever read (a file that grows while it is read is cut, and refused).

A problem is one line naming ``what`` the file is, its path and what to do, raised as ``error`` (ConfigError by
default; DataError for data files). :func:`check_regular` does the same checks for a file that is then streamed or
memory-mapped by other code (corpus inputs, token files).
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, Optional, Type

from megashard.errors import ConfigError

__all__ = ["read_bytes", "read_text", "read_json", "check_regular", "kind_of", "MiB", "SMALL", "CONFIG", "LARGE"]

MiB = 1 << 20
#: A record, marker, calibration or metadata file megashard writes: a few KB; 16 MiB is far beyond any real one.
SMALL = 16 * MiB
#: A config file a person writes (YAML, NCCL options).
CONFIG = 16 * MiB
#: A tokenizer.json or other data-side JSON (large vocabularies are tens of MB).
LARGE = 1024 * MiB


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)", "a directory", ...)."""
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / MiB:,.1f} MiB" if n >= MiB else f"{n:,} bytes"


def _open(path: str, what: str, error: Type[Exception], hint: str) -> int:
    """A descriptor of regular file ``path`` opened without blocking, or ``error`` (one line)."""
    tail = f"; {hint}" if hint else ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file{tail}") from None
    except IsADirectoryError:
        raise error(f"{what} {path}: is a directory, not a file{tail}") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing elsewhere
            raise error(f"{what} {path}: is not a regular file (a socket or pipe){tail}") from None
        raise error(f"{what} {path}: cannot be read: {e.strerror or e}{tail}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:  # pragma: no cover - fstat of an open descriptor
        os.close(fd)
        raise error(f"{what} {path}: cannot be read: {e.strerror or e}{tail}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{what} {path}: is {kind_of(st.st_mode)}, not a regular file; megashard reads only regular "
                    f"files here{tail}")
    return fd


def check_regular(path: str, what: str, *, limit: Optional[int] = None, error: Type[Exception] = ConfigError,
                  hint: str = "") -> os.stat_result:
    """``error`` (one line) unless ``path`` is a regular file (of at most ``limit`` bytes); opened without blocking,
    never read. Returns its stat."""
    fd = _open(path, what, error, hint)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if limit is not None and st.st_size > limit:
        raise error(f"{what} {path}: is {_size(st.st_size)}, more than the {_size(limit)} such a file can be"
                    f"{'; ' + hint if hint else ''}")
    return st


def read_bytes(path: str, what: str, *, limit: int = SMALL, error: Type[Exception] = ConfigError,
               hint: str = "") -> bytes:
    """The bytes of regular file ``path`` (at most ``limit``); ``error`` naming ``what`` and ``path`` (one line) for a
    missing file, a directory, FIFO, socket or device, an unreadable file or one larger than ``limit``."""
    fd = _open(path, what, error, hint)
    tail = f"; {hint}" if hint else ""
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{what} {path}: is {_size(size)}, more than the {_size(limit)} such a file can be{tail}")
        chunks, got = [], 0
        while True:
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            except OSError as e:
                raise error(f"{what} {path}: cannot be read: {e.strerror or e}{tail}") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise error(f"{what} {path}: grew beyond {_size(limit)} while it was read{tail}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str, what: str, *, limit: int = SMALL, error: Type[Exception] = ConfigError,
              hint: str = "") -> str:
    """:func:`read_bytes` decoded as UTF-8 (``error`` naming the line and byte when it is not)."""
    raw = read_bytes(path, what, limit=limit, error=error, hint=hint)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise error(f"{what} {path}: is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line} (byte offset "
                    f"{e.start}) is not valid UTF-8{'; ' + hint if hint else ''}") from None


def read_json(path: str, what: str, *, limit: int = SMALL, error: Type[Exception] = ConfigError,
              hint: str = "") -> Any:
    """The JSON document of regular file ``path``; ``error`` (one line) as :func:`read_text`, or for invalid JSON
    (naming line and column)."""
    text = read_text(path, what, limit=limit, error=error, hint=hint)
    try:
        return json.loads(text)
    except ValueError as e:
        raise error(f"{what} {path}: is not valid JSON ({e}){'; ' + hint if hint else ''}") from None
    except RecursionError:
        raise error(f"{what} {path}: is not valid JSON (nested too deeply){'; ' + hint if hint else ''}") from None
