"""Where ``megashard data prepare`` may write a corpus: never over an input, never inside what it reads, and over an
existing file only when that file is part of a corpus megashard prepared.

``check_prepare_outputs`` runs before anything is written (for ``megashard run``'s ``data.prepare_*`` too, with
the option named as the user gave it); the corpus's ``PREFIX.meta.json`` is its marker.
"""
from __future__ import annotations

import glob
import os
from typing import Callable, Optional, Sequence

from megashard.data.corpus import FORMAT, META_SUFFIX, TOKENIZER_SUFFIX
from megashard.errors import ConfigError

__all__ = ["check_outside_inputs", "check_prepare_outputs"]


def corpus_files(out: str, suffixes: Sequence[str]) -> dict[str, dict]:
    """``{file name: {"size", "sha256"?}}`` of the files of corpus ``out`` just written (a SHA-256 for those up to
    1 MiB, such as a tokenizer): recorded in the corpus's metadata, so that a later prepare replaces only these."""
    import hashlib

    files = {}
    for suffix in suffixes:
        path = out + suffix
        entry: dict = {"size": os.path.getsize(path)}
        if entry["size"] <= 1 << 20:
            with open(path, "rb") as f:
                entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
        files[os.path.basename(path)] = entry
    return files


def _corpus_file_mine(out: str) -> "Callable[[str], Optional[str]]":
    """Whether an existing output file of prefix ``out`` may be replaced: only when ``out`` is a corpus megashard
    prepared (its metadata, the corpus's marker, says so) and the file is one that corpus wrote, unchanged since
    (the metadata's ``files``; metadata of a megashard before that list: ``.bin`` and ``.idx``, and the tokenizer
    file only when the metadata names it as the corpus's tokenizer)."""
    def mine(path: str) -> Optional[str]:
        from megashard.errors import MegashardError
        from megashard.readers import SMALL, read_json

        meta = out + META_SUFFIX
        try:
            doc = read_json(meta, "corpus metadata", limit=SMALL)
        except MegashardError:
            doc = None
        if not (isinstance(doc, dict) and doc.get("format") == FORMAT):
            return (f"exists and is not part of a corpus megashard prepared (no {os.path.basename(meta)} with "
                    f"format {FORMAT!r} next to it)")
        if path == meta:
            return None  # the corpus's own metadata
        name = os.path.basename(path)
        if not os.path.isfile(path) or os.path.islink(path):
            return "exists and is not a regular file megashard wrote"
        files = doc.get("files")
        if isinstance(files, dict):
            want = files.get(name)
            if not isinstance(want, dict):
                return f"exists and is not one of the files {os.path.basename(meta)} lists as its corpus's (yours?)"
            if os.path.getsize(path) != want.get("size") or (
                    "sha256" in want and corpus_files(path, [""])[name].get("sha256")
                    != want["sha256"]):
                return f"exists and was changed since megashard prepared it (it differs from what {os.path.basename(meta)} records)"
            return None
        # metadata of an earlier megashard (no file list): the tokenizer file is the corpus's only if it says so
        if name.endswith(TOKENIZER_SUFFIX) and doc.get("tokenizer") != name:
            return (f"exists, and {os.path.basename(meta)} names tokenizer {doc.get('tokenizer')!r}, not it: it is "
                    "not the corpus's (yours?)")
        return None

    return mine


def check_outside_inputs(out: str, inputs: Sequence[str], option: str) -> None:
    """ConfigError naming ``option`` when a file of corpus ``out`` lies inside an input directory or matches an
    input glob of ``inputs`` (the INPUT arguments): the same command run again would read its own output as text.
    Checked before anything (a writability probe included) touches that directory."""
    import fnmatch
    import sysconfig

    from megashard.outputs import check_output_file

    stdlib = sysconfig.get_paths()["stdlib"]
    given = [i.replace("{stdlib}", stdlib) for i in inputs if isinstance(i, str) and i]
    dirs = [i for i in given if os.path.isdir(i)]
    patterns = [i for i in given if not os.path.exists(i) and glob.has_magic(i)]
    for suffix in (".bin", ".idx", META_SUFFIX, TOKENIZER_SUFFIX):
        path = out + suffix
        if dirs:
            check_output_file(option, path, reads=dirs, mine=lambda p: None, create_parents=True)
        for pattern in patterns:  # fnmatch: a '*' also matches '/', so '**' and 'dir/*' are caught alike
            if fnmatch.fnmatch(os.path.abspath(path), os.path.abspath(pattern)):
                label = f"{option}{path!r}" if option.endswith("=") else f"{option} {path}"
                raise ConfigError(f"{label}: matches the input pattern {pattern}, which this command reads: the same "
                                  "command run again would read the corpus as text; write it outside the inputs")


def check_prepare_outputs(out: str, reads: Sequence[str], option: str = "--out", inputs: Sequence[str] = (),
                          tokenizer_file: bool = True) -> None:
    """The files of corpus ``out`` (``.bin``, ``.idx``, ``.meta.json``, ``.tokenizer.json``) may be written: not a
    directory, writable, none of ``reads`` (the input files), not inside an input directory nor matched by an input
    glob of ``inputs`` (the INPUT arguments), and an existing one only as a file of the corpus megashard prepared
    there (``tokenizer_file``: whether ``.tokenizer.json`` is written too).
    ConfigError naming ``option``."""
    from megashard.outputs import check_output_file

    check_outside_inputs(out, inputs, option)
    mine = _corpus_file_mine(out)
    # the tokenizer file only when this prepare writes one (a byte-level corpus leaves a file of that name alone)
    for suffix in (".bin", ".idx", META_SUFFIX) + ((TOKENIZER_SUFFIX,) if tokenizer_file else ()):
        check_output_file(option, out + suffix, reads=reads, mine=mine, create_parents=True)
