"""A prepared corpus on disk: ``PREFIX.bin`` + ``PREFIX.idx``, and the metadata that names its tokenizer.

``megashard data prepare`` writes, for ``--out PREFIX``::

    PREFIX.bin, PREFIX.idx     Megatron-LM's indexed dataset (megashard.data.indexed), one sequence per document
    PREFIX.tokenizer.json      the Hugging Face tokenizer used (absent for the built-in byte tokenizer)
    PREFIX.meta.json           what the job needs to know, written last (its presence = the corpus is complete):
                               {"format": "megashard-corpus", "version": 1, "tokenizer": "byte" or
                                "PREFIX.tokenizer.json" (relative to the metadata file), "vocab_size": 257,
                                "eod_id": 256, "dtype": "uint16", "documents": ..., "tokens": ..., "inputs": [...]}

Datasets made by other tools (Megatron-LM's ``preprocess_data.py``) have no metadata: the job then trusts
``model.vocab_size`` and checks every batch's token ids against it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from megashard.data.indexed import IndexedDataset, is_indexed_dataset
from megashard.data.tokens import FlatTokens, TokenStream, check_token_dtype
from megashard.errors import DataError

__all__ = ["META_SUFFIX", "TOKENIZER_SUFFIX", "FORMAT", "read_meta", "write_json_atomic", "open_tokens",
           "dataset_prefix", "corpus_exists"]

META_SUFFIX = ".meta.json"
TOKENIZER_SUFFIX = ".tokenizer.json"
FORMAT = "megashard-corpus"


def dataset_prefix(path: str) -> str:
    """``corpus.bin`` / ``corpus.idx`` / ``corpus`` -> ``corpus`` when that is an indexed dataset, else ``path``."""
    for ext in (".bin", ".idx"):
        if path.endswith(ext) and is_indexed_dataset(path[: -len(ext)]):
            return path[: -len(ext)]
    return path


def corpus_exists(prefix: str) -> bool:
    """True when ``prefix`` is a complete prepared corpus (its metadata, written last, exists)."""
    return os.path.isfile(prefix + META_SUFFIX) and is_indexed_dataset(prefix)


def read_meta(path: str) -> Optional[dict[str, Any]]:
    """The metadata of the corpus at ``path`` (a prefix or one of its files), or ``None`` if it has none."""
    meta_path = dataset_prefix(path) + META_SUFFIX
    if not os.path.lexists(meta_path):
        return None
    from megashard.readers import SMALL, read_json

    meta = read_json(meta_path, "corpus metadata", limit=SMALL, error=DataError,
                     hint="delete it and prepare the corpus again (megashard data prepare)")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = f"format={meta.get('format')!r}" if isinstance(meta, dict) else f"a JSON {type(meta).__name__}"
        raise DataError(f"{meta_path}: not megashard corpus metadata (needs a JSON object with format={FORMAT!r}, "
                        f"got {got}): delete it and prepare the corpus again (megashard data prepare)")
    for key, kind, ok, required in _META_FIELDS:
        if key not in meta:
            if required:
                raise DataError(f"{meta_path}: corpus metadata has no {key} ({kind}); the file is damaged: prepare "
                                "the corpus again (megashard data prepare)")
            continue
        if not ok(meta[key]):
            raise DataError(f"{meta_path}: {key} must be {kind}, got {meta[key]!r} ({type(meta[key]).__name__}); "
                            "the file is damaged: prepare the corpus again (megashard data prepare)")
    return meta


def _int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


#: (key, expected, check, required) of every metadata field megashard reads.
_META_FIELDS = (
    ("tokenizer", "a string ('byte' or a tokenizer file name)", lambda v: isinstance(v, str) and bool(v), True),
    ("vocab_size", "a positive integer", lambda v: _int(v, 1), True),
    ("eod_id", "an integer >= 0 or null", lambda v: v is None or _int(v), False),
    ("dtype", "a token dtype name (uint8, uint16, int32, ...)", lambda v: isinstance(v, str), False),
    ("documents", "an integer >= 0", _int, False),
    ("tokens", "an integer >= 0", _int, False),
)


def write_json_atomic(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` through a temporary file and a rename."""
    from megashard.outputs import temp_path

    tmp = temp_path(path)  # a new name of its own: never an existing file
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def open_tokens(path: str, flat_dtype: str = "uint16") -> TokenStream:
    """The token stream at ``path``: an indexed dataset (``PREFIX`` or ``PREFIX.bin``/``.idx``) or a flat
    token file of ``flat_dtype`` (any other existing file). A :class:`DataError` names what is missing."""
    prefix = dataset_prefix(path)
    if is_indexed_dataset(prefix):
        return IndexedDataset(prefix)
    if os.path.isfile(path):
        return FlatTokens(path, check_token_dtype(flat_dtype, "data.flat_dtype"))
    if os.path.lexists(path) and not os.path.isdir(path):  # a FIFO, socket or device: said, never opened
        from megashard.readers import check_regular

        check_regular(path, "data.path", error=DataError)
    raise DataError(f"{path}: no such dataset: neither {path}.bin + {path}.idx (an indexed dataset) nor a flat "
                    "token file")
