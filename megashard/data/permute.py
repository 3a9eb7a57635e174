"""Seeded permutations of ``[0, n)`` computed index by index: no table, O(1) memory for any ``n``.

A shuffle of a billion samples with ``torch.randperm`` needs 8 GB on every rank; :class:`Permutation`
instead *computes* ``π(i)`` for the indices a rank actually reads: a balanced Feistel network over the
smallest power of four ≥ ``n`` (6 rounds, a 64-bit multiply–xor-shift round function keyed by the seed),
with cycle walking to stay inside ``[0, n)`` (on average fewer than 4 walks). It is a bijection for every
key, deterministic across machines (integer arithmetic only) and vectorised over index tensors.
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = ["Permutation", "mix_seed"]

_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit key from integers (splitmix64 chained over ``parts``)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


_C1, _C2 = _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _round(x: torch.Tensor, key: int, mask: int) -> torch.Tensor:
    h = x ^ key
    h = (h ^ _shr(h, 33)) * _C1  # int64 multiplication wraps modulo 2**64, as intended
    h = (h ^ _shr(h, 29)) * _C2
    return (h ^ _shr(h, 32)) & mask


class Permutation:
    """A seeded bijection ``π`` of ``[0, n)``: ``perm(indices)`` maps an int64 tensor (or an int) elementwise.

    Args:
        n: size of the domain (≥ 0, < 2**62).
        key: any integer; different keys give unrelated permutations (use :func:`mix_seed`).
        rounds: Feistel rounds (6 is plenty for shuffling data).
    """

    def __init__(self, n: int, key: int, rounds: int = 6) -> None:
        if not 0 <= n < 2**62:
            raise ValueError(f"permutation size {n} must be in [0, 2**62)")
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_signed(mix_seed(key, r)) for r in range(rounds)]

    def _encrypt(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ _round(right, k, self.mask)
        return (left << self.half) | right

    def __call__(self, idx: Union[torch.Tensor, int]) -> Union[torch.Tensor, int]:
        scalar = not isinstance(idx, torch.Tensor)
        x = torch.as_tensor(idx, dtype=torch.int64).reshape(-1) if scalar else idx.to(torch.int64)
        if self.n <= 1:
            return int(x[0]) if scalar else x.clone()
        if bool(((x < 0) | (x >= self.n)).any()):
            raise IndexError(f"permutation index out of [0, {self.n})")
        y = self._encrypt(x)
        out = torch.nonzero(y >= self.n).squeeze(1)
        while out.numel():  # cycle walking: re-encrypt until inside [0, n)
            z = self._encrypt(y[out])
            y.index_copy_(0, out, z)
            out = out[z >= self.n]
        return int(y[0]) if scalar else y
