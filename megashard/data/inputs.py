"""The user's input files of ``megashard data prepare``: which files, each real file once, and how bytes become text.

**Which files.** Each INPUT is a file, a directory (every file below it, sorted; directory links are not
followed, as ``os.walk`` does) or a glob pattern (``**`` recurses, following directory links but never into a
directory it is already inside: a link back to an ancestor is a loop, skipped); ``{stdlib}`` stands for the
running Python's standard library directory.

**Each real file once.** Paths are resolved (symbolic links, hard links: the same device and inode are the same
file) and a file reached again — named twice, through a link, through a loop — is read only the first time. What
was left out is said in one line (:attr:`Inputs.note`), never silently.

**Text.** Files are text in one declared encoding (``--encoding``, default UTF-8). Bytes that are not valid in it
are an error naming the file, the byte offset and line, unless the user chooses what to do with them
(``--encoding-errors``): ``replace`` writes U+FFFD for each (counted in the summary line and the metadata),
``skip-file`` leaves every such file out (counted and named). Nothing is changed silently.
"""
from __future__ import annotations

import codecs
import fnmatch
import glob
import os
import sysconfig
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megashard.errors import DataError

__all__ = ["Inputs", "expand", "ENCODING_ERRORS", "check_encoding", "Decoder", "not_text"]

#: What ``--encoding-errors`` may say.
ENCODING_ERRORS = ("strict", "replace", "skip-file")


@dataclass
class Inputs:
    """The files of the INPUT arguments, each real file once: ``(path, named)`` pairs (``named``: the argument was
    the file itself), and what was left out."""

    files: list[tuple[str, bool]] = field(default_factory=list)
    repeats: list[tuple[str, str]] = field(default_factory=list)
    """``(path, first path)`` of every path that led to a file already taken."""
    loops: list[tuple[str, str]] = field(default_factory=list)
    """``(link, target)`` of every directory link that leads back into a directory it is inside (not followed)."""

    @property
    def note(self) -> Optional[str]:
        """One line saying what was read once only, or None when every path was a file of its own."""
        if not self.repeats and not self.loops:
            return None
        parts = []
        if self.repeats:
            path, first = self.repeats[0]
            same = f"{path}, given twice" if path == first else f"{path} is {first}"
            parts.append(f"{len(self.repeats)} path(s) led to a file already taken and were not read again "
                         f"(e.g. {same})")
        if self.loops:
            link, target = self.loops[0]
            parts.append(f"{len(self.loops)} symbolic link loop(s) not followed (e.g. {link} -> {target}, a directory "
                         "it is inside)")
        return "read each file once: " + "; ".join(parts)


def _key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _hidden_ok(name: str, pattern: str) -> bool:
    return not name.startswith(".") or pattern.startswith(".")  # as glob: * does not match a leading dot


def _glob(pattern: str, loops: list[tuple[str, str]]) -> list[str]:
    """``glob.glob(pattern, recursive=True)``, but ``**`` never descends into a directory it is already inside."""
    if "**" not in pattern:
        return glob.glob(pattern)
    parts = pattern.split(os.sep)
    i = next(k for k, p in enumerate(parts) if glob.has_magic(p))
    root = os.sep.join(parts[:i]) if i else ""
    if i and not root:
        root = os.sep  # an absolute pattern: "/..."
    found: list[str] = []

    def walk(d: str, rest: list[str], inside: frozenset) -> None:
        head, tail = rest[0], rest[1:]
        try:
            names = sorted(os.listdir(d or "."))
        except OSError:
            return
        if head == "**":
            if tail:
                walk(d, tail, inside)  # zero directories
            else:
                found.extend(os.path.join(d, n) for n in names if _hidden_ok(n, ""))
            for n in names:
                sub = os.path.join(d, n)
                if not _hidden_ok(n, "") or not os.path.isdir(sub):
                    continue
                key = _key(sub)
                if key in inside:
                    loops.append((sub, os.path.realpath(sub)))
                    continue
                walk(sub, rest, inside | {key})
            return
        for n in names:
            if not fnmatch.fnmatchcase(n, head) or not _hidden_ok(n, head):
                continue
            sub = os.path.join(d, n)
            if not tail:
                found.append(sub)
            elif os.path.isdir(sub):
                key = _key(sub)
                if key in inside:
                    loops.append((sub, os.path.realpath(sub)))
                    continue
                walk(sub, tail, inside | {key})

    start = root
    ancestors = frozenset()
    real = os.path.realpath(start or ".")
    while True:  # the directories the walk starts inside count as entered
        try:
            ancestors |= {_key(real)}
        except OSError:
            break
        if real == os.path.dirname(real):
            break
        real = os.path.dirname(real)
    walk(start, parts[i:], ancestors)
    return list(dict.fromkeys(found))


def expand(inputs: Sequence[str]) -> Inputs:
    """The files of the INPUT arguments, in order (directories and globs sorted), each real file once; a clear
    :class:`DataError` for an input that is missing, matches nothing or is not a file."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out = Inputs()
    seen: dict[tuple[int, int], str] = {}
    for item in inputs:
        if not isinstance(item, str) or not item:
            raise DataError(f"input {item!r}: give a file, a directory or a glob pattern")
        item = item.replace("{stdlib}", stdlib)
        if os.path.isfile(item):
            paths, named = [item], True
        elif os.path.isdir(item):
            paths, named = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs), False
            if not paths:
                raise DataError(f"{item}: the input directory has no files")
        elif glob.has_magic(item):
            paths, named = sorted(p for p in _glob(item, out.loops) if os.path.isfile(p)), False
            if not paths:
                raise DataError(f"{item}: no input file matches this pattern")
        elif os.path.lexists(item):
            raise DataError(f"{item}: not a regular file (a device, pipe, socket or broken link); give text or "
                            "JSON-lines files")
        else:
            raise DataError(f"{item}: no such input file")
        for p in paths:
            try:
                key = _key(p)
            except OSError:
                continue  # a broken link found in a directory: not a file
            if key in seen:
                out.repeats.append((p, seen[key]))
                continue
            seen[key] = p
            out.files.append((p, named))
    if not out.files:
        raise DataError("no input files given")
    return out


def not_text(path: str) -> Optional[str]:
    """Why ``path`` is no input for a corpus (``"is empty ..."``, ``"is binary ..."``, ``"cannot be read ..."``),
    or None."""
    from megashard.readers import check_regular

    try:
        check_regular(path, "input", error=DataError)  # opened without blocking: a FIFO in a directory is named
        with open(path, "rb") as f:
            head = f.read(8192)
    except DataError as e:
        return str(e).split(f"{path}: ", 1)[-1]
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not head:
        return "is empty (0 bytes): no document to tokenize"
    nul = head.find(bytes(1))
    if nul >= 0:  # as git and grep decide: text has no NUL bytes
        return f"is binary, not text (a NUL byte at offset {nul})"
    return None


# ---------------------------------------------------------------------------------------------- decoding
def check_encoding(encoding: str, errors: str, options: tuple[str, str] = ("--encoding ", "--encoding-errors ")) -> str:
    """The codec name of ``encoding``; DataError for an unknown one, one that does not write a line end as the byte
    ``\\n`` (UTF-16/32: files are cut at line ends), or an unknown ``errors`` choice."""
    if errors not in ENCODING_ERRORS:
        raise DataError(f"{options[1]}{errors!r}: choose one of {', '.join(ENCODING_ERRORS)}")
    try:
        info = codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise DataError(f"{options[0]}{encoding!r}: not an encoding Python knows (e.g. utf-8, latin-1, cp1252)") from None
    try:
        ok = "\n".encode(info.name) == b"\n" and "a".encode(info.name) == b"a"
    except (UnicodeError, LookupError):
        ok = False
    if not ok:
        raise DataError(f"{options[0]}{encoding}: files are read line by line, which {info.name} (several bytes per "
                        "character) does not allow; convert them to UTF-8 first (iconv -t utf-8)")
    return info.name


class _SkipFile(Exception):
    """A byte not valid in the encoding under ``--encoding-errors skip-file``: the file is left out."""


_REPLACED = [0]  # bytes replaced by the handler below, in this process (prepare decodes on one thread)


def _replace_counting(e: UnicodeError) -> tuple[str, int]:
    _REPLACED[0] += e.end - e.start  # type: ignore[attr-defined]
    return "\ufffd", e.end  # type: ignore[attr-defined]


codecs.register_error("megashard-replace", _replace_counting)


class Decoder:
    """Bytes of one file -> text, piece by piece, under the declared encoding and ``errors`` choice.

    ``decode(piece)`` raises DataError (``strict``: the file, byte offset, line and the ways out) or
    :class:`_SkipFile` (``skip-file``); ``replace`` writes U+FFFD and counts every replaced byte in
    :attr:`replaced`.
    """

    SkipFile = _SkipFile

    def __init__(self, path: str, encoding: str = "utf-8", errors: str = "strict",
                 options: tuple[str, str] = ("--encoding ", "--encoding-errors ")) -> None:
        self.path, self.encoding, self.errors, self.options = path, encoding, errors, options
        self.replaced = 0
        self._dec = codecs.getincrementaldecoder(encoding)(errors="megashard-replace" if errors == "replace" else "strict")
        self._offset = 0  # bytes consumed before the current piece
        self._lines: Optional[int] = 0  # line ends before it

    def decode(self, piece: bytes, final: bool = False, offset: Optional[int] = None) -> str:
        """Text of ``piece``, the next bytes of the file (``offset``: where it starts when it does not follow the
        previous piece, e.g. a JSON line; the decoder starts afresh there)."""
        if offset is not None:
            self._dec.reset()
            self._offset, self._lines = offset, None  # a piece of its own (a JSON line): its line is not counted
        before = _REPLACED[0]
        try:
            text = self._dec.decode(piece, final)
        except UnicodeDecodeError as e:
            if self.errors == "skip-file":
                raise _SkipFile(self.path) from None
            at = self._offset + e.start
            nl = b"\n"
            line = "" if self._lines is None else f" (line {self._lines + piece.count(nl, 0, e.start) + 1:,})"
            byte = piece[e.start: e.start + 1].hex() or "??"
            raise DataError(
                f"{self.path}: byte 0x{byte} at offset {at:,}{line} is not valid {self.encoding}: the text "
                f"would be changed; give the file's encoding ({self.options[0]}latin-1, cp1252, ...), or choose "
                f"{self.options[1]}replace (U+FFFD, counted) or skip-file (leave such files out, counted)"
            ) from None
        self.replaced += _REPLACED[0] - before
        self._offset += len(piece)
        if self._lines is not None:
            self._lines += piece.count(b"\n")
        return text
