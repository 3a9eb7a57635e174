"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``): a memory-mapped reader and a streaming writer.

The layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``; little endian)::

    PREFIX.idx
      offset 0          9 bytes   magic b"MMIDIDX\\x00\\x00"
      9                 u64       version, 1
      17                u8        token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                  6 float64, 7 float32, 8 uint16
      18                u64       S, the number of sequences
      26                u64       D, the number of document-index entries (documents + 1)
      34                i32[S]    sequence lengths, in tokens
      34 + 4S           i64[S]    sequence pointers: byte offset of each sequence in PREFIX.bin
      34 + 12S          i64[D]    document index: the sequence each document starts at; [0] = 0, [D-1] = S
      34 + 12S + 8D     i8[S]     (optional) sequence modes of multimodal datasets
    PREFIX.bin          the tokens of every sequence back to back, in the dtype of the code above

A GPT-style corpus has one sequence per document. The reader treats the ``.bin`` as one token stream
(the concatenation of every sequence in index order, which is what Megatron's writers produce: sequence
``i`` starts where ``i - 1`` ends). Opening checks the header, the exact ``.idx`` size, the ends of the
document index and that the ``.bin`` has exactly the bytes the index describes — O(1) work; a full
consistency check of every entry is :meth:`IndexedDataset.verify`.
"""
from __future__ import annotations

import array
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from megashard.data.tokens import MappedFile, dtype_name, tensor_bytes
from megashard.errors import DataError

__all__ = ["MAGIC", "VERSION", "DTYPE_CODES", "IndexedDataset", "IndexedDatasetBuilder", "IndexStats",
           "is_indexed_dataset"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
#: Megatron's dtype codes (its ``DType`` enum: numpy float64 = 6, float32 = 7).
DTYPE_CODES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32,
                                       5: torch.int64, 6: torch.float64, 7: torch.float32, 8: torch.uint16}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
_ARRAY_CODES = {torch.uint8: "B", torch.int8: "b", torch.int16: "h", torch.uint16: "H", torch.int32: "i",
                torch.int64: "q"}
_CHUNK = 1 << 20  # entries per block when streaming index arrays


def is_indexed_dataset(prefix: str) -> bool:
    """True when ``PREFIX.idx`` exists (the reader then requires ``PREFIX.bin`` too)."""
    return os.path.isfile(prefix + ".idx")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` + ``PREFIX.idx``; nothing is loaded whole.

    Attributes: ``dtype`` (tokens in the ``.bin``), ``sequence_lengths`` (int32 ``[S]``),
    ``sequence_pointers`` (int64 ``[S]``, bytes), ``document_indices`` (int64 ``[D]``), ``sequence_modes``
    (int8 ``[S]`` or ``None``) — tensor views of the mapped index, no copy.

    Raises :class:`DataError` naming the file for a missing file, a bad magic, an unsupported version or
    dtype, a truncated index, or a ``.bin`` whose size differs from what the index describes.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.name = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise DataError(f"{p}: no such file (an indexed dataset is PREFIX.bin + PREFIX.idx, "
                                f"here PREFIX={prefix!r})")
        self._idx = MappedFile(idx_path)
        size = self._idx.size
        if size < _HEADER.size:
            raise DataError(f"{idx_path}: truncated index: {size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, s, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{idx_path}: not a Megatron-LM indexed dataset index: it starts with {magic!r}, "
                            f"expected {MAGIC!r}")
        if version != VERSION:
            raise DataError(f"{idx_path}: index version {version} is not supported (only version {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown token dtype code {code} (valid: 1-8)")
        self.dtype = DTYPE_CODES[code]
        if self.dtype.is_floating_point:  # Megatron's enum has them; token ids are integers
            raise DataError(f"{idx_path}: its tokens are {dtype_name(self.dtype)} (dtype code {code}), but token ids "
                            "are integers (uint8, int8, int16, uint16, int32, int64): not a tokenized dataset")
        item = _itemsize(self.dtype)
        need = _HEADER.size + 12 * s + 8 * d
        if size < need:
            raise DataError(f"{idx_path}: truncated index: {size} bytes, but its header's {s} sequences and {d} "
                            f"document-index entries need {need}")
        if size not in (need, need + s):
            raise DataError(f"{idx_path}: {size} bytes, but its header's {s} sequences and {d} document-index entries "
                            f"need {need} (or {need + s} with sequence modes): not a complete index")
        if d < 1:
            raise DataError(f"{idx_path}: the document index is empty (it needs at least the leading 0)")
        off = _HEADER.size
        self.sequence_lengths = self._idx.view(torch.int32, off, s)
        self.sequence_pointers = self._idx.view(torch.int64, off + 4 * s, s)
        self.document_indices = self._idx.view(torch.int64, off + 12 * s, d)
        self.sequence_modes = self._idx.view(torch.int8, need, s) if size == need + s else None
        first, last = int(self.document_indices[0]), int(self.document_indices[-1])
        if first != 0 or last != s:
            raise DataError(f"{idx_path}: corrupt document index: it runs from {first} to {last}, "
                            f"expected 0 to the sequence count {s}")
        end = 0
        if s:
            if int(self.sequence_pointers[0]) != 0:
                raise DataError(f"{idx_path}: corrupt index: the first sequence starts at byte "
                                f"{int(self.sequence_pointers[0])} of the .bin, expected 0")
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item
        self._bin = MappedFile(bin_path)
        if self._bin.size < end:
            raise DataError(f"{bin_path}: truncated: {self._bin.size} bytes, but the index {idx_path} describes "
                            f"{end} bytes ({s} sequences of {dtype_name(self.dtype)})")
        if self._bin.size > end:
            raise DataError(f"{bin_path}: {self._bin.size} bytes, but the index {idx_path} describes {end}: "
                            f"the two files do not belong together")
        self._tokens = self._bin.view(self.dtype)

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return self.sequence_lengths.numel()

    @property
    def num_documents(self) -> int:
        return self.document_indices.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self._tokens.numel()

    def __len__(self) -> int:
        return self.num_sequences

    # ------------------------------------------------------------------ reading
    def read(self, start: int, count: int) -> torch.Tensor:
        """Tokens ``[start, start + count)`` of the concatenated sequences, as a new int64 tensor."""
        if start < 0 or count < 0 or start + count > self.num_tokens:
            raise DataError(f"{self.prefix}: tokens [{start}, {start + count}) are outside the dataset's "
                            f"{self.num_tokens} tokens")
        return self._tokens[start: start + count].to(torch.int64)

    def _span(self, first_seq: int, end_seq: int) -> tuple[int, int]:
        """Token range ``[lo, hi)`` of sequences ``[first_seq, end_seq)``."""
        if first_seq >= end_seq:
            return 0, 0
        item = _itemsize(self.dtype)
        lo = int(self.sequence_pointers[first_seq]) // item
        hi = int(self.sequence_pointers[end_seq - 1]) // item + int(self.sequence_lengths[end_seq - 1])
        return lo, hi

    def sequence(self, i: int) -> torch.Tensor:
        """The tokens of sequence ``i`` (int64)."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} of {self.num_sequences}")
        lo, hi = self._span(i, i + 1)
        return self.read(lo, hi - lo)

    __getitem__ = sequence

    def document(self, i: int) -> torch.Tensor:
        """The tokens of document ``i`` (all its sequences, int64)."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} of {self.num_documents}")
        lo, hi = self._span(int(self.document_indices[i]), int(self.document_indices[i + 1]))
        return self.read(lo, hi - lo)

    def verify(self) -> None:
        """Check every entry (streamed in blocks): lengths ≥ 0, each sequence starts where the previous one
        ends, the document index never decreases. Raises :class:`DataError` at the first bad entry."""
        item, offset, idx = _itemsize(self.dtype), 0, self.prefix + ".idx"
        for lo in range(0, self.num_sequences, _CHUNK):
            lens = self.sequence_lengths[lo: lo + _CHUNK].to(torch.int64)
            if bool((lens < 0).any()):
                bad = lo + int(torch.nonzero(lens < 0)[0])
                raise DataError(f"{idx}: sequence {bad} has a negative length {int(self.sequence_lengths[bad])}")
            want = (torch.cumsum(lens, 0) - lens + offset) * item
            got = self.sequence_pointers[lo: lo + _CHUNK]
            if not torch.equal(got, want):
                bad = lo + int(torch.nonzero(got != want)[0])
                raise DataError(f"{idx}: sequence {bad} starts at byte {int(got[bad - lo])} of the .bin, expected "
                                f"{int(want[bad - lo])} (sequences must follow each other)")
            offset += int(lens.sum())
        docs = self.document_indices
        for lo in range(0, docs.numel() - 1, _CHUNK):
            b = docs[lo + 1: lo + 1 + _CHUNK]
            a = docs[lo: lo + b.numel()]
            if bool((b < a).any()):
                bad = lo + int(torch.nonzero(b < a)[0])
                raise DataError(f"{idx}: document index decreases at entry {bad + 1}")

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {self.num_sequences} sequences, "
                f"{self.num_tokens} × {dtype_name(self.dtype)})")


# ---------------------------------------------------------------------------------------------- writing
@dataclass
class IndexStats:
    """What :meth:`IndexedDatasetBuilder.finalize` wrote."""

    prefix: str
    sequences: int
    documents: int
    tokens: int
    dtype: str


Tokens = Union[torch.Tensor, bytes, bytearray, Iterable[int]]


class IndexedDatasetBuilder:
    """Write ``PREFIX.bin`` + ``PREFIX.idx`` in one pass, holding no tokens in memory.

    Tokens go straight to ``PREFIX.bin.tmp``; sequence lengths and document boundaries are spooled to
    temporary files too, so memory stays constant however large the corpus. :meth:`finalize` writes the
    index and renames both files into place (``.bin`` first, ``.idx`` last: a reader never sees an index
    without its data). Used as a context manager, an exception deletes every temporary file.

        with IndexedDatasetBuilder("out/corpus", torch.uint16) as b:
            b.add_document([1, 2, 3])
            b.add_document([])               # empty documents are kept
        # __exit__ finalises

    Args:
        prefix: output prefix (``PREFIX.bin``, ``PREFIX.idx``).
        dtype: token dtype (uint8, int8, int16, uint16, int32 or int64); ids must fit it.
    """

    def __init__(self, prefix: str, dtype: torch.dtype = torch.uint16) -> None:
        if dtype not in _ARRAY_CODES:
            raise DataError(f"token dtype {dtype_name(dtype)} cannot be written; use one of "
                            f"{', '.join(dtype_name(d) for d in _ARRAY_CODES)}")
        self.prefix, self.dtype = prefix, dtype
        import uuid

        tag = f".tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"  # new names ("x": never an existing file of the user's)
        self._tmp = {k: f"{prefix}.{k}{tag}" for k in ("bin", "idx", "lengths", "docs")}
        self._bin = open(self._tmp["bin"], "xb")
        self._lengths = open(self._tmp["lengths"], "x+b")
        self._docs = open(self._tmp["docs"], "x+b")
        self._docs.write(struct.pack("<q", 0))
        self.sequences, self.documents, self.tokens = 0, 0, 0
        self._open = 0  # tokens of the sequence being written
        self._done = False

    def _bytes(self, tokens: Tokens) -> tuple[Union[bytes, bytearray], int]:
        if isinstance(tokens, torch.Tensor):
            t = tokens.reshape(-1)
            if t.numel() and t.dtype != self.dtype:
                info = torch.iinfo(self.dtype)
                lo, hi = int(t.min()), int(t.max())
                if lo < info.min or hi > info.max:
                    raise DataError(f"{self.prefix}: token ids {lo}..{hi} do not fit {dtype_name(self.dtype)}")
            return tensor_bytes(t.to(self.dtype)), t.numel()
        if isinstance(tokens, (bytes, bytearray)):  # byte ids (the byte tokenizer): widen without a Python loop
            if self.dtype == torch.uint8 or not tokens:
                return bytes(tokens), len(tokens)
            if self.dtype == torch.uint16:  # little endian: each byte, then a zero byte
                out = bytearray(2 * len(tokens))
                out[0::2] = tokens
                return out, len(tokens)
            return tensor_bytes(torch.frombuffer(bytearray(tokens), dtype=torch.uint8).to(self.dtype)), len(tokens)
        arr = array.array(_ARRAY_CODES[self.dtype])
        try:
            arr.extend(tokens)
        except (OverflowError, TypeError) as e:
            raise DataError(f"{self.prefix}: token ids do not fit {dtype_name(self.dtype)}: {e}") from None
        return arr.tobytes(), len(arr)

    def extend(self, tokens: Tokens) -> None:
        """Append tokens to the current sequence (a long document can arrive in pieces)."""
        data, n = self._bytes(tokens)
        self._bin.write(data)
        self._open += n

    def end_sequence(self) -> None:
        """Close the current sequence (the tokens given to :meth:`extend` since the last call)."""
        if self._open > 2**31 - 1:
            raise DataError(f"{self.prefix}: a sequence of {self._open} tokens exceeds the format's int32 length")
        self._lengths.write(struct.pack("<i", self._open))
        self.sequences += 1
        self.tokens += self._open
        self._open = 0

    def add_sequence(self, tokens: Tokens) -> None:
        """Append one sequence to the current document."""
        self.extend(tokens)
        self.end_sequence()

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self._docs.write(struct.pack("<q", self.sequences))
        self.documents += 1

    def add_document(self, tokens: Tokens) -> None:
        """Append a document of one sequence (the GPT case)."""
        self.add_sequence(tokens)
        self.end_document()

    def add_dataset(self, other: "IndexedDataset | str") -> None:
        """Append every document of another indexed dataset (same dtype), streaming its files."""
        ds = other if isinstance(other, IndexedDataset) else IndexedDataset(other)
        if ds.dtype != self.dtype:
            raise DataError(f"{ds.prefix}: tokens are {dtype_name(ds.dtype)}, this dataset writes {dtype_name(self.dtype)}")
        with open(ds.prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 22)
        for lo in range(0, ds.num_sequences, _CHUNK):
            self._lengths.write(tensor_bytes(ds.sequence_lengths[lo: lo + _CHUNK]))
        docs = ds.document_indices
        for lo in range(1, docs.numel(), _CHUNK):
            self._docs.write(tensor_bytes(docs[lo: lo + _CHUNK] + self.sequences))
        self.sequences += ds.num_sequences
        self.documents += ds.num_documents
        self.tokens += ds.num_tokens

    def finalize(self) -> IndexStats:
        """Write the index, rename ``.bin`` then ``.idx`` into place, delete the spool files."""
        if self._done:
            raise DataError(f"{self.prefix}: the dataset was already finalised")
        if self._open:
            raise DataError(f"{self.prefix}: {self._open} tokens were added after the last end_sequence()")
        self._bin.close()
        item, s, d = _itemsize(self.dtype), self.sequences, self.documents + 1
        with open(self._tmp["idx"], "xb") as out:
            out.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], s, d))
            self._lengths.seek(0)
            shutil.copyfileobj(self._lengths, out, 1 << 22)
            self._lengths.seek(0)
            offset = 0
            while True:  # pointers = exclusive prefix sums of the lengths, in bytes
                chunk = self._lengths.read(4 * _CHUNK)
                if not chunk:
                    break
                lens = torch.frombuffer(bytearray(chunk), dtype=torch.int32).to(torch.int64)
                ends = torch.cumsum(lens, 0) + offset
                out.write(tensor_bytes((ends - lens) * item))
                offset = int(ends[-1])
            self._docs.seek(0)
            shutil.copyfileobj(self._docs, out, 1 << 22)
        self._lengths.close()
        self._docs.close()
        os.replace(self._tmp["bin"], self.prefix + ".bin")
        os.replace(self._tmp["idx"], self.prefix + ".idx")
        for k in ("lengths", "docs"):
            os.remove(self._tmp[k])
        self._done = True
        return IndexStats(self.prefix, s, self.documents, self.tokens, dtype_name(self.dtype))

    def abort(self) -> None:
        """Close and delete every temporary file (the final names are not touched)."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        for p in self._tmp.values():
            if os.path.exists(p):
                os.remove(p)
        self._done = True

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> Optional[bool]:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()
        return None
