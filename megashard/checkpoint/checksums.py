"""Checksums of checkpoint files and of the DCP storage items in them (crc32 by default, or sha256).

The completion marker (:mod:`megashard.checkpoint.safety`) records one digest per file and per storage
item; the writer computes them as the bytes are written and the reader as it reads them
(:mod:`megashard.checkpoint.storage`). With crc32 a file's digest is combined from its items' digests
(:func:`crc32_combine`), so every byte is hashed once.
"""
from __future__ import annotations

import hashlib
import os
import zlib
from typing import Callable

from megashard.errors import CheckpointError

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "bytes_checksum",
    "check_algorithm",
    "crc32_combine",
    "file_checksum",
    "file_record",
    "new_digest",
]

_CHUNK = 8 << 20  # bytes read per hash update


class _Crc32:
    """zlib's CRC-32 with hashlib's ``update`` / ``hexdigest`` interface (``zlib.crc32`` releases the GIL)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


# CRC-32 of a concatenation from the CRCs of its parts (zlib's crc32_combine, which Python's zlib does not
# expose): polynomial arithmetic modulo the CRC-32 polynomial, reflected bit order as in zlib.
_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo p(x), both 32-bit reflected polynomials."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo p(x), k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))
_X8N_CACHE: dict[int, int] = {}


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``."""
    op = _X8N_CACHE.get(len2)
    if op is None:  # x^(8 * len2) modulo p(x); lengths repeat (same-shaped shards), so cache them
        op, n, k = 1 << 31, len2, 3
        while n:
            if n & 1:
                op = _multmodp(_X2N[k & 31], op)
            n >>= 1
            k += 1
        if len(_X8N_CACHE) < 4096:
            _X8N_CACHE[len2] = op
    return _multmodp(op, crc1) ^ crc2


def new_digest(algorithm: str):
    """A running digest of ``algorithm`` (``update(bytes)``, ``hexdigest()``)."""
    check_algorithm(algorithm)
    return _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)


def bytes_checksum(data, algorithm: str = "crc32") -> str:
    """Hex digest of a bytes-like object (what the marker records for a file or one DCP storage item)."""
    d = new_digest(algorithm)
    d.update(data)
    return d.hexdigest()


def _file_digest(algorithm: str) -> Callable[[str], str]:
    def digest(path: str) -> str:
        d = new_digest(algorithm)
        with open(path, "rb") as f:
            while True:
                buf = f.read(_CHUNK)
                if not buf:
                    break
                d.update(buf)
        return d.hexdigest()

    return digest


#: name -> function(path) -> hex digest. crc32 (default) is the fastest and catches truncation and bit
#: flips; sha256 is a cryptographic digest, e.g. to compare with digests kept outside the checkpoint.
CHECKSUM_ALGORITHMS: dict[str, Callable[[str], str]] = {
    "sha256": _file_digest("sha256"),
    "crc32": _file_digest("crc32"),
}


def check_algorithm(algorithm: str) -> None:
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise CheckpointError(
            f"checksum algorithm {algorithm!r} is not supported; use one of {sorted(CHECKSUM_ALGORITHMS)}"
        )



def file_checksum(path: str, algorithm: str = "crc32") -> str:
    """Hex digest of the file at ``path`` (read in 8 MB chunks)."""
    check_algorithm(algorithm)
    return CHECKSUM_ALGORITHMS[algorithm](path)


def file_record(path: str, algorithm: str = "crc32") -> dict:
    """``{"size": bytes, "checksum": hex}`` of one file, as stored in the marker."""
    return {"size": os.path.getsize(path), "checksum": file_checksum(path, algorithm)}

