"""Token streams: memory-mapped files of tokens, read a range at a time, never loaded whole.

A *token stream* is what the samplers cut into windows: ``num_tokens`` tokens that ``read(start, count)``
returns as an int64 tensor (a copy of just those tokens). Implementations:

* :class:`FlatTokens` — a raw file of tokens of one dtype, nothing else (documents unknown), e.g. a text
  file's bytes (``uint8``) or a ``uint16`` dump of token ids;
* :class:`megashard.data.indexed.IndexedDataset` — Megatron-LM's ``.bin`` + ``.idx``;
* :class:`TensorTokens` — a tensor in memory (the baseline of ``benchmarks/data.py``, and tests).

Files are mapped with Python's :mod:`mmap` (copy-on-write, so the tensor views are writable for torch and
nothing ever reaches the file) and viewed with ``torch.frombuffer``: the operating system pages in only
what a rank reads, so a rank's memory does not grow with the corpus.
"""
from __future__ import annotations

import mmap
import os
import sys
from typing import Optional, Protocol

import torch

from megashard.errors import DataError

__all__ = ["DTYPES", "check_token_dtype", "dtype_name", "dtype_for_vocab", "tensor_bytes", "MappedFile", "TokenStream", "FlatTokens",
           "TensorTokens"]

#: Token dtypes by name (the names ``data.flat_dtype`` and the metadata JSON use): integers only, as token ids are
#: (a float file read as ids would be silently wrong: 1.0 is not id 1).
DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "uint16": torch.uint16,
    "int32": torch.int32, "int64": torch.int64,
}


def check_token_dtype(dtype: "torch.dtype | str", where: str) -> torch.dtype:
    """The token dtype ``dtype`` names; DataError naming ``where`` unless it is an integer dtype of :data:`DTYPES`."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    what = "token ids are integers" if str(name).startswith(("float", "bfloat", "complex")) else "not a token dtype"
    raise DataError(f"{where}={name!r}: {what}; valid: {', '.join(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.uint16`` -> ``"uint16"``."""
    return str(dtype).replace("torch.", "")


def dtype_for_vocab(vocab_size: int) -> torch.dtype:
    """The smallest token dtype for ids ``0 .. vocab_size - 1`` (as Megatron: uint8 is never chosen for
    vocabularies above 256, uint16 up to 65,536 ids, int32 above)."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.uint16 if vocab_size <= 65536 else torch.int32


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bytes of ``t`` (no numpy): a copy through a bytearray-backed tensor."""
    if sys.byteorder == "big":  # pragma: no cover - the format is little endian (x86, ARM)
        raise DataError("writing token files on a big-endian machine is not supported")
    t = t.contiguous().view(-1)
    if t.numel() == 0:
        return b""
    buf = bytearray(t.numel() * t.element_size())
    torch.frombuffer(buf, dtype=t.dtype).copy_(t)
    return bytes(buf)


class MappedFile:
    """A read-only, copy-on-write memory map of one file, viewed as tensors without copying.

    ``view(dtype, offset, count)`` is a tensor over bytes ``[offset, offset + count·itemsize)`` of the
    file; pages are read from disk when touched. An empty file maps to empty views.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.lexists(path):
            from megashard.readers import check_regular

            check_regular(path, "data file", error=DataError)  # a FIFO or device: named, never opened to read
        try:
            self._file = open(path, "rb")
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
        except OSError as e:
            raise DataError(f"{path}: cannot open: {e.strerror or e}") from None
        self.size = os.fstat(self._file.fileno()).st_size
        self._map: Optional[mmap.mmap] = None
        if self.size:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        self._file.close()  # the map keeps its own reference to the file

    def view(self, dtype: torch.dtype, offset: int = 0, count: Optional[int] = None) -> torch.Tensor:
        """``count`` items of ``dtype`` at byte ``offset`` (default: to the end of the file); no copy."""
        item = torch.empty((), dtype=dtype).element_size()
        if count is None:
            count = (self.size - offset) // item
        if offset < 0 or count < 0 or offset + count * item > self.size:
            raise DataError(f"{self.path}: bytes [{offset}, {offset + count * item}) are outside the file "
                            f"({self.size} bytes)")
        if count == 0 or self._map is None:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def __repr__(self) -> str:
        return f"MappedFile({self.path!r}, {self.size} bytes)"


class TokenStream(Protocol):
    """What the samplers read: ``num_tokens`` tokens, a range at a time."""

    name: str

    @property
    def num_tokens(self) -> int: ...

    def read(self, start: int, count: int) -> torch.Tensor:
        """Tokens ``[start, start + count)`` as a new int64 tensor of shape ``[count]``."""
        ...


def _check_range(name: str, start: int, count: int, total: int) -> None:
    if start < 0 or count < 0 or start + count > total:
        raise DataError(f"{name}: tokens [{start}, {start + count}) are outside the stream of {total} tokens")


class TensorTokens:
    """A 1-D tensor of tokens, read like a file: in memory (the baseline of the benchmark, tests), or a file's
    mapping (:class:`FlatTokens`)."""

    def __init__(self, tokens: torch.Tensor, name: str = "<tensor>") -> None:
        self.name, self._tokens = name, tokens.reshape(-1)

    @property
    def num_tokens(self) -> int:
        return self._tokens.numel()

    def read(self, start: int, count: int) -> torch.Tensor:
        _check_range(self.name, start, count, self.num_tokens)
        return self._tokens[start: start + count].to(torch.int64)


class FlatTokens(TensorTokens):
    """A raw file of tokens of one dtype (no header, no document boundaries), memory-mapped.

    Args:
        path: the file; its size must be a multiple of the dtype's size.
        dtype: token dtype (a name of :data:`DTYPES` or a torch dtype); ``uint8`` reads a text file's bytes.
    """

    def __init__(self, path: str, dtype: "torch.dtype | str" = torch.uint16) -> None:
        dtype = check_token_dtype(dtype, "token dtype")
        self.dtype = dtype
        self._file = MappedFile(path)
        item = torch.empty((), dtype=dtype).element_size()
        if self._file.size % item:
            raise DataError(f"{path}: {self._file.size} bytes is not a whole number of {dtype_name(dtype)} tokens "
                            f"({item} bytes each): truncated, or another token dtype")
        super().__init__(self._file.view(dtype), path)

    def __repr__(self) -> str:
        return f"FlatTokens({self.name!r}, {self.num_tokens} × {dtype_name(self.dtype)})"
