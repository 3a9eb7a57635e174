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

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

from megashard.data.corpus import FORMAT, META_SUFFIX, TOKENIZER_SUFFIX, write_json_atomic
from megashard.data.indexed import IndexedDatasetBuilder
from megashard.data.inputs import Decoder, check_encoding, expand, not_text
from megashard.data.prepare_outputs import check_outside_inputs, check_prepare_outputs, corpus_files
from megashard.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, train_bpe
from megashard.data.tokens import dtype_for_vocab, dtype_name
from megashard.errors import DataError
from megashard.progress import Progress

__all__ = ["prepare", "PrepareResult", "expand_inputs", "text_inputs", "iter_documents", "check_prepare_outputs"]

JSONL = (".jsonl", ".json")
PIECE = 32 << 20  # bytes of a JSON-lines task
CHUNK = 1 << 20  # bytes read at a time from a text file
WHOLE = 16 << 20  # a text document up to this size is tokenized in one piece by BPE tokenizers
BATCH = 256  # JSON-lines documents tokenized together
MIN_TRAINED_VOCAB, MAX_TRAINED_VOCAB = 258, 1 << 24
CLI_OPTIONS = ("--encoding ", "--encoding-errors ")  # how errors name the encoding settings (megashard run: data.prepare_*)
RUN_OPTIONS = ("data.prepare_encoding=", "data.prepare_encoding_errors=")  # --train-tokenizer: > EOD + 256 bytes; int32 ids, sane size


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
    replaced_bytes: int = 0
    """Bytes not valid in the encoding that ``--encoding-errors replace`` wrote as U+FFFD."""
    replaced_files: int = 0
    """Files that held such bytes."""
    skipped_files: list[str] = field(default_factory=list)
    """Files ``--encoding-errors skip-file`` left out."""
    encoding: str = "utf-8"


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files of the INPUT arguments, in order (directories sorted, globs sorted), each real file once
    (:func:`megashard.data.inputs.expand`); a clear error for none."""
    return [f for f, _ in expand(inputs).files]


def text_inputs(inputs: Sequence[str], notes: Optional[list[str]] = None) -> list[str]:
    """The files to tokenize: a file named on its own must be non-empty text (DataError otherwise); empty and
    binary files found in a directory or by a glob are left out, and files reached twice are read once (both
    said in ``notes``)."""
    found = expand(inputs)
    files, skipped = [], []
    for path, named in found.files:
        why = not_text(path)
        if why is None:
            files.append(path)
        elif named:
            raise DataError(f"{path} {why}; give text or JSON-lines files")
        else:
            skipped.append(path)
    if not files:
        raise DataError(f"no text to tokenize: all {len(skipped)} input file(s) are empty or binary "
                        f"(e.g. {skipped[0]})")
    if notes is not None:
        if found.note:
            notes.append(found.note)
        if skipped:
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


def _jsonl_docs(path: str, start: int, end: int, key: str, dec: Optional[Decoder] = None) -> Iterator[str]:
    """Texts of the JSON lines that *start* in bytes ``[start, end)`` of ``path`` (decoded by ``dec``: the declared
    encoding and its error choice; default strict UTF-8)."""
    dec = dec or Decoder(path)
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
                text_line = dec.decode(line, final=True, offset=pos)
                try:
                    obj = json.loads(text_line)
                except ValueError as e:
                    raise DataError(f"{path}: the line at byte {pos} is not JSON: {e}") from None
                text = obj.get(key) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path}: the line at byte {pos} has no string field {key!r} "
                                    f"(--text-key names the field)")
                yield text
            pos = f.tell()


def iter_documents(path: str, key: str = "text", encoding: str = "utf-8", errors: str = "strict",
                   options: tuple[str, str] = CLI_OPTIONS) -> Iterator[Iterator[str]]:
    """Every document of one input file, each as an iterator of text pieces (for tokenizer training); ``options``:
    how an error names the encoding settings."""
    dec = Decoder(path, encoding, errors, options)
    if path.endswith(JSONL):
        for text in _jsonl_docs(path, 0, os.path.getsize(path), key, dec):
            yield iter([text])
    else:
        def pieces() -> Iterator[str]:
            for p in _text_pieces(path):
                yield dec.decode(p)
            tail = dec.decode(b"", final=True)
            if tail:
                yield tail

        yield pieces()


def _decodes(path: str, key: str, encoding: str) -> bool:
    """Every byte of ``path`` is valid in ``encoding`` (a pass that reads the file once)."""
    try:
        for doc in iter_documents(path, key, encoding, "skip-file"):
            for _ in doc:
                pass
    except Decoder.SkipFile:
        return False
    return True


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


def _run_task(args: tuple[_Task, str, str, str, str, str, tuple]) -> tuple[int, int, int, int, bool]:
    """Tokenize one task into its partial dataset; returns (documents, tokens, input bytes, bytes replaced by
    U+FFFD, skipped: the file has bytes not valid in the encoding under skip-file, and its partial dataset is
    dropped)."""
    task, spec, key, dtype, encoding, errors, options = args
    tok = _TOKENIZER.get(spec) or _TOKENIZER.setdefault(spec, load_tokenizer(spec))
    import torch

    eod = [tok.eod_id] if tok.eod_id is not None else []
    byte = tok.name == "byte"
    dec = Decoder(task.path, encoding, errors, options)
    try:
        with IndexedDatasetBuilder(task.part, getattr(torch, dtype)) as b:
            if task.path.endswith(JSONL):
                batch: list[str] = []
                for text in _jsonl_docs(task.path, task.start, task.end, key, dec):
                    batch.append(text)
                    if len(batch) == BATCH:
                        _add_documents(b, tok, batch, eod)
                _add_documents(b, tok, batch, eod)
            else:
                # A BPE tokenizer sees a document whole up to WHOLE bytes; larger ones are cut into ~CHUNK pieces at
                # line ends between non-space bytes, where byte-level BPE splits anyway (the byte tokenizer: anywhere).
                # Every piece is decoded (the declared encoding; what is not valid in it is an error or the user's
                # counted choice); the byte tokenizer takes the UTF-8 bytes of the text.
                if byte or os.path.getsize(task.path) > WHOLE:
                    pieces: Iterable[bytes] = _text_pieces(task.path, byte)
                else:
                    with open(task.path, "rb") as f:
                        pieces = [f.read()]
                for piece in pieces:
                    text = dec.decode(piece)
                    b.extend(text.encode("utf-8") if byte else tok.encode(text))
                tail = dec.decode(b"", final=True)
                if tail:
                    b.extend(tail.encode("utf-8") if byte else tok.encode(tail))
                b.extend(eod)
                b.end_sequence()
                b.end_document()
            docs, tokens = b.documents, b.tokens
    except Decoder.SkipFile:
        return 0, 0, task.end - task.start, 0, True
    return docs, tokens, task.end - task.start, dec.replaced, False


# ---------------------------------------------------------------------------------------------- prepare
def prepare(inputs: Sequence[str], out: str, tokenizer: str = "byte", *, train_tokenizer: Optional[int] = None,
            workers: int = 1, text_key: str = "text", progress: bool = True, encoding: str = "utf-8",
            encoding_errors: str = "strict", options: tuple[str, str] = CLI_OPTIONS) -> PrepareResult:
    """Tokenize ``inputs`` into the indexed dataset ``out`` (a prefix); see the module docstring.

    Args:
        inputs: files, directories or glob patterns (``{stdlib}`` = the standard library directory); each real file
            is read once (:mod:`megashard.data.inputs`).
        out: output prefix; its directory must exist. Existing files of the prefix are replaced only when they are
            a corpus megashard prepared (its ``PREFIX.meta.json``).
        tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (ignored with ``train_tokenizer``).
        train_tokenizer: train a byte-level BPE tokenizer of this many ids on the inputs first.
        workers: processes tokenizing in parallel (≥ 1).
        text_key: the field of a JSON line that holds the text.
        progress: draw a progress bar on stderr.
        encoding: the inputs' text encoding (default UTF-8).
        encoding_errors: bytes not valid in ``encoding``: ``strict`` (an error naming the file and offset),
            ``replace`` (U+FFFD, counted in :attr:`PrepareResult.replaced_bytes`) or ``skip-file`` (such files left
            out, listed in :attr:`PrepareResult.skipped_files`).
        options: how errors name the two encoding settings (the CLI's options, or ``megashard run``'s
            ``data.prepare_encoding`` / ``data.prepare_encoding_errors``).

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
    encoding = check_encoding(encoding, encoding_errors, options)
    if not isinstance(out, str) or not os.path.basename(out):
        raise DataError(f"--out {out!r} must be a file prefix (e.g. data/corpus), not a directory")
    out_dir = os.path.dirname(os.path.abspath(out))
    check_outside_inputs(out, inputs, "--out")  # before the probe below writes into the directory
    check_output_file("--out", out, create_parents=True, mine=lambda p: None)  # not under a file, writable
    if not os.path.isdir(out_dir):
        raise DataError(f"output directory {os.path.dirname(out) or '.'!r} does not exist (--out {out}); create it first")
    notes: list[str] = []
    files = text_inputs(inputs, notes)
    tok_input = [tokenizer] if train_tokenizer is None and tokenizer != "byte" and os.path.exists(tokenizer) else []
    check_prepare_outputs(out, files + tok_input, inputs=inputs,
                          tokenizer_file=train_tokenizer is not None or tokenizer != "byte")
    tok = None if train_tokenizer is not None else load_tokenizer(tokenizer)
    t0 = time.perf_counter()
    # Everything is written into a directory of this call's own next to the output, renamed into place at the end.
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.prepare-", dir=out_dir)
    tmp_prefix = os.path.join(work, "part")
    tmp_tok = os.path.join(work, "tokenizer.json")
    skipped: list[str] = []
    try:
        if train_tokenizer is not None:
            if encoding_errors == "skip-file":  # the tokenizer learns only from the files that are tokenized
                kept = [f for f in files if _decodes(f, text_key, encoding)]
                skipped = [f for f in files if f not in kept]
                files = kept or files  # none left: the tokenizing below says so
            texts = (piece for f in files for doc in iter_documents(f, text_key, encoding, encoding_errors, options)
                     for piece in doc)
            if progress and sys.stderr.isatty():  # in a log the summary line says it; an error stays one line
                print(f"megashard data prepare: training a byte-level BPE tokenizer of {train_tokenizer} ids on "
                      f"{len(files)} file(s)", file=sys.stderr, flush=True)
            tok = train_bpe(texts, train_tokenizer, tmp_tok)
        elif tok.name != "byte":
            shutil.copyfile(tok.spec(), tmp_tok)
        assert tok is not None
        spec = "byte" if tok.name == "byte" else tmp_tok
        dtype = dtype_name(dtype_for_vocab(tok.vocab_size))
        tasks = _tasks([f for f in files if f not in skipped], tmp_prefix)
        total = sum(t.end - t.start for t in tasks)
        bar = Progress(total, "megashard data prepare", enabled=progress)
        args = [(t, spec, text_key, dtype, encoding, encoding_errors, options) for t in tasks]
        n = min(workers, len(tasks))
        results: list = []
        if n > 1:
            import multiprocessing as mp

            # fork on Linux: the workers inherit the imported modules (spawn would import torch in each, ~2 s).
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            if train_tokenizer is not None:  # the library's threads ran in this process: keep them off in the forked workers
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # torch.set_num_threads(1) first: a forked child using the parent's OpenMP pool would hang.
            with mp.get_context(method).Pool(n, initializer=_worker_init) as pool:
                for r in pool.imap(_run_task, args):
                    results.append(r)
                    bar.update(r[2])
        else:
            for a in args:
                results.append(_run_task(a))
                bar.update(results[-1][2])
        bar.close()
        # A file with a skipped piece is left out whole (a large JSON-lines file is several tasks).
        skipped += list(dict.fromkeys(t.path for t, r in zip(tasks, results) if r[4]))
        kept = [(t, r) for t, r in zip(tasks, results) if t.path not in skipped]
        if not kept:
            raise DataError(f"no text left to tokenize: all {len(skipped)} input file(s) hold bytes that are not valid "
                            f"{encoding} and --encoding-errors skip-file left them out (e.g. {skipped[0]}); give "
                            "their --encoding")
        import torch

        if len(kept) == 1:
            for ext in (".bin", ".idx"):
                os.replace(kept[0][0].part + ext, out + ext)
        else:
            with IndexedDatasetBuilder(out, getattr(torch, dtype)) as merged:
                for t, _ in kept:
                    merged.add_dataset(t.part)
        tok_name = "byte"
        if tok.name != "byte":
            os.replace(tmp_tok, out + TOKENIZER_SUFFIX)
            tok_name = os.path.basename(out) + TOKENIZER_SUFFIX
        docs, tokens, nbytes, replaced = (sum(r[i] for _, r in kept) for i in range(4))
        replaced_files = sum(1 for _, r in kept if r[3])
        write_json_atomic(out + META_SUFFIX, {
            "format": FORMAT, "version": 1, "tokenizer": tok_name, "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id, "dtype": dtype, "documents": docs, "tokens": tokens, "input_bytes": nbytes,
            "text_key": text_key, "inputs": list(inputs), "encoding": encoding, "encoding_errors": encoding_errors,
            "replaced_bytes": replaced, "skipped_files": skipped,
            # what this corpus is made of: a later prepare replaces these files and no other (prepare_outputs)
            "files": corpus_files(out, [".bin", ".idx"] + ([TOKENIZER_SUFFIX] if tok.name != "byte" else [])),
        })
    finally:
        shutil.rmtree(work, ignore_errors=True)  # this call's own directory, nothing else
    for note in notes:  # after the work: an error stays the one line of a failed command
        print(f"megashard data prepare: note: {note}", file=sys.stderr)
    return PrepareResult(out, docs, tokens, nbytes, time.perf_counter() - t0, tok_name, tok.vocab_size,
                         [f for f in files if f not in skipped], replaced, replaced_files, skipped, encoding)
