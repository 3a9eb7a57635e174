"""Where ``megashard data prepare`` may write a corpus: never over an input, never inside what it reads, and over an
existing file only when that file is part of a corpus megashard prepared.

``check_prepare_outputs`` runs before anything is written (for ``megashard run``'s ``data.prepare_*`` too, with
the option named as the user gave it); the corpus's ``PREFIX.meta.json`` is its marker.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, Optional, Sequence

from megashard.data.corpus import FORMAT, META_SUFFIX, TOKENIZER_SUFFIX
from megashard.errors import ConfigError

__all__ = ["check_outside_inputs", "check_prepare_outputs"]


def _corpus_file_mine(out: str) -> "Callable[[str], Optional[str]]":
    """Whether an existing output file of prefix ``out`` may be replaced: only when ``out`` is a corpus megashard
    prepared (its metadata, the corpus's marker, says so)."""
    def mine(path: str) -> Optional[str]:
        meta = out + META_SUFFIX
        try:
            with open(meta, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and doc.get("format") == FORMAT:
            return None
        return (f"exists and is not part of a corpus megashard prepared (no {os.path.basename(meta)} with "
                f"format {FORMAT!r} next to it)")

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


def check_prepare_outputs(out: str, reads: Sequence[str], option: str = "--out", inputs: Sequence[str] = ()) -> None:
    """The files of corpus ``out`` (``.bin``, ``.idx``, ``.meta.json``, ``.tokenizer.json``) may be written: not a
    directory, writable, none of ``reads`` (the input files), not inside an input directory nor matched by an input
    glob of ``inputs`` (the INPUT arguments), and an existing one only as part of a corpus megashard prepared.
    ConfigError naming ``option``."""
    from megashard.outputs import check_output_file

    check_outside_inputs(out, inputs, option)
    mine = _corpus_file_mine(out)
    for suffix in (".bin", ".idx", META_SUFFIX, TOKENIZER_SUFFIX):
        check_output_file(option, out + suffix, reads=reads, mine=mine, create_parents=True)
