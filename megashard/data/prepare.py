"""``megashard data prepare``: text and JSON-lines files in, a tokenized indexed dataset out.

    prepare(["books/*.txt", "web.jsonl"], "data/corpus", tokenizer="byte", workers=2)

**Inputs.** Each INPUT is a file, a directory (every file below it, sorted) or a glob pattern
(``**`` recurses); ``{stdlib}`` stands for the running Python's standard library directory. Files ending
in ``.jsonl`` or ``.json`` are JSON lines: one document per line, its text in the ``text_key`` field
(blank lines skipped). Every other file is UTF-8 text and is **one document** (put several documents in
one file as JSON lines).

**Output** (see :mod:`megashard.data.corpus`): ``PREFIX.bin``/``.idx`` with one sequence per document —
its tokens followed by the tokenizer's end-of-document token — in input order, whatever the number of
workers; ``PREFIX.tokenizer.json`` for Hugging Face tokenizers; ``PREFIX.meta.json`` last. Nothing
is written under the final names until everything succeeded (temporary names, then renames).

**Streaming and parallelism.** Work is split into tasks — a text file, or a piece of at most 32 MB of a
JSON-lines file cut at line ends — tokenized by ``workers`` processes into temporary partial datasets,
which are then concatenated in task order. With the byte tokenizer text files are read 1 MB at a time;
a BPE tokenizer sees each text document whole up to 16 MB, and larger ones in ~1 MB pieces cut at line
ends between two non-space characters (where byte-level BPE's GPT-2-style pre-tokenization ends a token
anyway; other pre-tokenizers may merge differently across such a cut). Tokens go straight to disk, so the
corpus may be far larger than memory. The progress bar counts input bytes.
"""
from __future__ import annotations

import codecs
import glob
import json
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

from megashard.data.corpus import FORMAT, META_SUFFIX, TOKENIZER_SUFFIX, write_json_atomic
from megashard.data.indexed import IndexedDatasetBuilder
from megashard.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, train_bpe
from megashard.data.tokens import dtype_for_vocab, dtype_name
from megashard.errors import DataError
from megashard.progress import Progress

__all__ = ["prepare", "PrepareResult", "expand_inputs", "iter_documents"]

JSONL = (".jsonl", ".json")
PIECE = 32 << 20  # bytes of a JSON-lines task
CHUNK = 1 << 20  # bytes read at a time from a text file
WHOLE = 16 << 20  # a text document up to this size is tokenized in one piece by BPE tokenizers
BATCH = 256  # JSON-lines documents tokenized together
MIN_TRAINED_VOCAB, MAX_TRAINED_VOCAB = 258, 1 << 24  # --train-tokenizer: > EOD + 256 bytes; int32 ids, sane size


@dataclass
class PrepareResult:
    """What :func:`prepare` wrote."""

    prefix: str
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    tokenizer: str
    vocab_size: int
    files: list[str] = field(default_factory=list)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files of the INPUT arguments, in order (directories sorted, globs sorted); a clear error for none."""
    return [f for f, _ in _expand(inputs)]


def _expand(inputs: Sequence[str]) -> list[tuple[str, bool]]:
    """``(file, named)`` of the INPUT arguments: ``named`` when the argument was the file itself (not a directory
    or a glob)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files: list[tuple[str, bool]] = []
    for item in inputs:
        item = item.replace("{stdlib}", stdlib)
        if os.path.isfile(item):
            files.append((item, True))
        elif os.path.isdir(item):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs)
            if not found:
                raise DataError(f"{item}: the input directory has no files")
            files += [(f, False) for f in found]
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not found:
                raise DataError(f"{item}: no input file matches this pattern")
            files += [(f, False) for f in found]
        elif os.path.exists(item):
            raise DataError(f"{item}: not a regular file (a device, pipe or socket); give text or JSON-lines files")
        else:
            raise DataError(f"{item}: no such input file")
    if not files:
        raise DataError("no input files given")
    return files


def _not_text(path: str) -> Optional[str]:
    """Why ``path`` is no input for a corpus (``"empty"``, ``"binary ..."``, ``"unreadable ..."``), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not head:
        return "is empty (0 bytes): no document to tokenize"
    nul = head.find(bytes(1))
    if nul >= 0:  # as git and grep decide: text has no NUL bytes
        return f"is binary, not text (a NUL byte at offset {nul})"
    return None


def _text_inputs(inputs: Sequence[str], notes: Optional[list[str]] = None) -> list[str]:
    """The files to tokenize: a file named on its own must be non-empty text (DataError otherwise); empty and
    binary files found in a directory or by a glob are left out (counted in ``notes``)."""
    files, skipped = [], []
    for path, named in _expand(inputs):
        why = _not_text(path)
        if why is None:
            files.append(path)
        elif named:
            raise DataError(f"{path} {why}; give text or JSON-lines files")
        else:
            skipped.append(path)
    if not files:
        raise DataError(f"no text to tokenize: all {len(skipped)} input file(s) are empty or binary "
                        f"(e.g. {skipped[0]})")
    if skipped and notes is not None:
        notes.append(f"left out {len(skipped)} empty or binary file(s) found in the inputs (e.g. {skipped[0]})")
    return files


# ---------------------------------------------------------------------------------------------- reading
def _safe_cut(chunk: bytes, byte_level: bool) -> int:
    """Where to cut ``chunk`` (0 = nowhere): after its last line end (byte tokenizer), or after its last line end
    between two non-space bytes (BPE: GPT-2-style pre-tokenization ends a token there anyway)."""
    cut = chunk.rfind(b"\n")
    while cut > 0 and not byte_level and (cut + 1 >= len(chunk) or chunk[cut - 1: cut].isspace()
                                           or chunk[cut + 1: cut + 2].isspace()):
        cut = chunk.rfind(b"\n", 0, cut)
    return cut + 1 if cut > 0 else 0


def _text_pieces(path: str, byte_level: bool = True) -> Iterator[bytes]:
    """The bytes of a text file, ~:data:`CHUNK` at a time, cut at line ends (:func:`_safe_cut`); the last piece
    is whatever remains."""
    with open(path, "rb") as f:
        rest = b""
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            chunk = rest + chunk
            cut = _safe_cut(chunk, byte_level)
            if cut == 0:
                rest = chunk
                continue
            yield chunk[:cut]
            rest = chunk[cut:]
        if rest:
            yield rest


def _jsonl_docs(path: str, start: int, end: int, key: str) -> Iterator[str]:
    """Texts of the JSON lines that *start* in bytes ``[start, end)`` of ``path``."""
    with open(path, "rb") as f:
        f.seek(start)
        if start:
            f.seek(start - 1)
            f.readline()  # skip to the first line starting at or after `start`
        pos = f.tell()
        while pos < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}: the line at byte {pos} is not JSON: {e}") from None
                text = obj.get(key) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path}: the line at byte {pos} has no string field {key!r} "
                                    f"(--text-key names the field)")
                yield text
            pos = f.tell()


def iter_documents(path: str, key: str = "text") -> Iterator[Iterator[str]]:
    """Every document of one input file, each as an iterator of text pieces (for tokenizer training)."""
    if path.endswith(JSONL):
        for text in _jsonl_docs(path, 0, os.path.getsize(path), key):
            yield iter([text])
    else:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        yield (dec.decode(p) for p in _text_pieces(path))


# ---------------------------------------------------------------------------------------------- tasks
@dataclass
class _Task:
    index: int
    path: str
    start: int
    end: int
    part: str  # output prefix of the partial dataset


def _tasks(files: list[str], tmp_prefix: str) -> list[_Task]:
    tasks: list[_Task] = []
    for path in files:
        size = os.path.getsize(path)
        bounds = [(0, size)]
        if path.endswith(JSONL) and size > PIECE:
            bounds = [(lo, min(lo + PIECE, size)) for lo in range(0, size, PIECE)]
        for lo, hi in bounds:
            tasks.append(_Task(len(tasks), path, lo, hi, f"{tmp_prefix}.part{len(tasks)}"))
    return tasks


_TOKENIZER: dict[str, Tokenizer] = {}


def _add_documents(b: IndexedDatasetBuilder, tok: Tokenizer, texts: list[str], eod: list[int]) -> None:
    """Tokenize ``texts`` (a batch: the Hugging Face library encodes it on several threads) and add each as a
    document; empties ``texts``."""
    ids = tok.encode_batch(texts) if isinstance(tok, HFTokenizer) else [tok.encode(t) for t in texts]
    for doc in ids:
        b.extend(doc)
        b.extend(eod)
        b.end_sequence()
        b.end_document()
    texts.clear()


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _run_task(args: tuple[_Task, str, str, str]) -> tuple[int, int, int]:
    """Tokenize one task into its partial dataset; returns (documents, tokens, input bytes)."""
    task, spec, key, dtype = args
    tok = _TOKENIZER.get(spec) or _TOKENIZER.setdefault(spec, load_tokenizer(spec))
    import torch

    eod = [tok.eod_id] if tok.eod_id is not None else []
    byte = tok.name == "byte"
    with IndexedDatasetBuilder(task.part, getattr(torch, dtype)) as b:
        if task.path.endswith(JSONL):
            batch: list[str] = []
            for text in _jsonl_docs(task.path, task.start, task.end, key):
                batch.append(text)
                if len(batch) == BATCH:
                    _add_documents(b, tok, batch, eod)
            _add_documents(b, tok, batch, eod)
        else:
            # A BPE tokenizer sees a document whole up to WHOLE bytes; larger ones are cut into ~CHUNK pieces at
            # line ends between non-space bytes, where byte-level BPE splits anyway (the byte tokenizer: anywhere).
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            if byte or os.path.getsize(task.path) > WHOLE:
                pieces: Iterable[bytes] = _text_pieces(task.path, byte)
            else:
                with open(task.path, "rb") as f:
                    pieces = [f.read()]
            for piece in pieces:
                b.extend(piece if byte else tok.encode(dec.decode(piece)))
            if not byte:
                tail = dec.decode(b"", final=True)
                if tail:
                    b.extend(tok.encode(tail))
            b.extend(eod)
            b.end_sequence()
            b.end_document()
        docs, tokens = b.documents, b.tokens
    return docs, tokens, task.end - task.start


# ---------------------------------------------------------------------------------------------- prepare
def _remove_prefix_files(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if os.path.exists(prefix + ext):
            os.remove(prefix + ext)


def prepare(inputs: Sequence[str], out: str, tokenizer: str = "byte", *, train_tokenizer: Optional[int] = None,
            workers: int = 1, text_key: str = "text", progress: bool = True) -> PrepareResult:
    """Tokenize ``inputs`` into the indexed dataset ``out`` (a prefix); see the module docstring.

    Args:
        inputs: files, directories or glob patterns (``{stdlib}`` = the standard library directory).
        out: output prefix; its directory must exist.
        tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (ignored with ``train_tokenizer``).
        train_tokenizer: train a byte-level BPE tokenizer of this many ids on the inputs first.
        workers: processes tokenizing in parallel (≥ 1).
        text_key: the field of a JSON line that holds the text.
        progress: draw a progress bar on stderr.

    Raises :class:`DataError` (before anything is written) for a missing input, a missing output directory,
    a tokenizer that does not exist, bad ``workers``; an error while writing leaves no output behind.
    """
    from megashard.outputs import check_output_file

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DataError(f"--workers {workers!r} must be a positive integer")
    if train_tokenizer is not None and (isinstance(train_tokenizer, bool) or not isinstance(train_tokenizer, int)
                                        or not MIN_TRAINED_VOCAB <= train_tokenizer <= MAX_TRAINED_VOCAB):
        raise DataError(f"--train-tokenizer {train_tokenizer!r}: a byte-level BPE vocabulary needs "
                        f"{MIN_TRAINED_VOCAB:,}..{MAX_TRAINED_VOCAB:,} ids (more than the end-of-document token and "
                        "256 bytes), e.g. 8000; leave the option out for the byte tokenizer")
    if not os.path.basename(out):
        raise DataError(f"--out {out!r} must be a file prefix (e.g. data/corpus), not a directory")
    out_dir = os.path.dirname(os.path.abspath(out))
    check_output_file("--out", out, create_parents=True)  # not under a file, writable
    if not os.path.isdir(out_dir):
        raise DataError(f"output directory {os.path.dirname(out) or '.'!r} does not exist (--out {out}); create it first")
    notes: list[str] = []
    files = _text_inputs(inputs, notes)
    for suffix in (".bin", ".idx", META_SUFFIX, TOKENIZER_SUFFIX):  # not a directory, writable, no input
        check_output_file("--out", out + suffix, reads=files)
    for note in notes:
        print(f"megashard data prepare: note: {note}", file=sys.stderr)
    tok = None if train_tokenizer is not None else load_tokenizer(tokenizer)
    t0 = time.perf_counter()
    tmp_prefix = f"{out}.tmp{os.getpid()}"
    tmp_tok = tmp_prefix + TOKENIZER_SUFFIX
    tasks: list[_Task] = []
    try:
        if train_tokenizer is not None:
            texts = (piece for f in files for doc in iter_documents(f, text_key) for piece in doc)
            if progress:
                print(f"megashard data prepare: training a byte-level BPE tokenizer of {train_tokenizer} ids on "
                      f"{len(files)} file(s)", file=sys.stderr, flush=True)
            tok = train_bpe(texts, train_tokenizer, tmp_tok)
        elif tok.name != "byte":
            shutil.copyfile(tok.spec(), tmp_tok)
        assert tok is not None
        spec = "byte" if tok.name == "byte" else tmp_tok
        dtype = dtype_name(dtype_for_vocab(tok.vocab_size))
        tasks = _tasks(files, tmp_prefix)
        total = sum(t.end - t.start for t in tasks)
        bar = Progress(total, "megashard data prepare", enabled=progress)
        args = [(t, spec, text_key, dtype) for t in tasks]
        n = min(workers, len(tasks))
        if n > 1:
            import multiprocessing as mp

            # fork on Linux: the workers inherit the imported modules (spawn would import torch in each, ~2 s).
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            if train_tokenizer is not None:  # the library's threads ran in this process: keep them off in the forked workers
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # torch.set_num_threads(1) first: a forked child using the parent's OpenMP pool would hang.
            with mp.get_context(method).Pool(n, initializer=_worker_init) as pool:
                results = []
                for r in pool.imap(_run_task, args):
                    results.append(r)
                    bar.update(r[2])
        else:
            results = []
            for a in args:
                results.append(_run_task(a))
                bar.update(results[-1][2])
        bar.close()
        import torch

        if len(tasks) == 1:
            for ext in (".bin", ".idx"):
                os.replace(tasks[0].part + ext, out + ext)
        else:
            with IndexedDatasetBuilder(out, getattr(torch, dtype)) as merged:
                for t in tasks:
                    merged.add_dataset(t.part)
                    _remove_prefix_files(t.part)
        tok_name = "byte"
        if tok.name != "byte":
            os.replace(tmp_tok, out + TOKENIZER_SUFFIX)
            tok_name = os.path.basename(out) + TOKENIZER_SUFFIX
        docs, tokens, nbytes = (sum(r[i] for r in results) for i in range(3))
        write_json_atomic(out + META_SUFFIX, {
            "format": FORMAT, "version": 1, "tokenizer": tok_name, "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id, "dtype": dtype, "documents": docs, "tokens": tokens, "input_bytes": nbytes,
            "text_key": text_key, "inputs": list(inputs),
        })
    except BaseException:
        for t in tasks:
            _remove_prefix_files(t.part)
            for p in glob.glob(glob.escape(t.part) + ".*.tmp*"):
                os.remove(p)
        if os.path.exists(tmp_tok):
            os.remove(tmp_tok)
        raise
    return PrepareResult(out, docs, tokens, nbytes, time.perf_counter() - t0, tok_name, tok.vocab_size, files)
