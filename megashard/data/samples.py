"""Samples: fixed-length windows over a token stream, a held-out validation split and the per-epoch order.

**Windows.** A dataset of ``T`` tokens (all documents back to back, each ended by the tokenizer's
end-of-document token) gives ``(T - 1) // seq_len`` samples; sample ``j`` is the ``seq_len + 1`` tokens
starting at token ``j · seq_len`` (inputs are its first ``seq_len`` tokens, targets the last
``seq_len``). Consecutive windows share one boundary token, as in Megatron-LM's GPT dataset; windows
cross document boundaries (the end-of-document token tells the model). Megatron also shuffles the
documents of every epoch before cutting; here the *windows* are shuffled instead, which needs no
per-epoch index files.

**Split and order** (:class:`Split`): a seeded permutation ``σ`` of the ``N`` windows puts the first
``n_valid = round(valid_fraction · N)`` (at least 1 when the fraction is > 0) into the validation set
and the rest into the training set — the two are disjoint by construction, and which windows are held
out depends on the seed only. Training sample ``t`` is in epoch ``e = t // n_train`` and is window
``σ(n_valid + τ_e(t mod n_train))``, where ``τ_e`` is a fresh seeded permutation per epoch: every
training window once per epoch, in a different order each epoch. Everything is arithmetic on indices
(:class:`megashard.data.permute.Permutation`): no table, nothing to save, any sample computable on its own.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from megashard.data.permute import Permutation, mix_seed
from megashard.data.tokens import TokenStream
from megashard.errors import DataError

__all__ = ["WindowSource", "StreamWindows", "RowWindows", "Split"]


class WindowSource(Protocol):
    """``num_windows`` samples of ``seq_len + 1`` tokens; ``windows(idx)`` reads a batch of them."""

    name: str
    seq_len: int

    @property
    def num_windows(self) -> int: ...

    def windows(self, idx: torch.Tensor) -> torch.Tensor:
        """``[len(idx), seq_len + 1]`` int64 tokens of windows ``idx`` (reads only those tokens)."""
        ...


class StreamWindows:
    """Windows of ``seq_len + 1`` tokens every ``seq_len`` tokens of a :class:`TokenStream`."""

    def __init__(self, stream: TokenStream, seq_len: int) -> None:
        self.stream, self.seq_len, self.name = stream, seq_len, stream.name

    @property
    def num_windows(self) -> int:
        return max(0, (self.stream.num_tokens - 1) // self.seq_len)

    def windows(self, idx: torch.Tensor) -> torch.Tensor:
        span = self.seq_len + 1
        out = torch.empty(len(idx), span, dtype=torch.int64)
        for row, j in enumerate(idx.tolist()):
            out[row] = self.stream.read(j * self.seq_len, span)
        return out


class RowWindows:
    """Windows that are the rows of a ``[N, seq_len + 1]`` integer tensor (the synthetic data, held in a narrow
    dtype); :meth:`windows` gives int64."""

    def __init__(self, rows: torch.Tensor, name: str = "<rows>") -> None:
        self.rows, self.name, self.seq_len = rows, name, rows.shape[1] - 1

    @property
    def num_windows(self) -> int:
        return self.rows.shape[0]

    def windows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.rows[idx].to(torch.int64)


class Split:
    """Training/validation split and per-epoch order of ``num_windows`` windows, from a seed.

    Args:
        num_windows: samples of the dataset.
        valid_fraction: share held out for validation, in [0, 1).
        seed: the data seed; ``key`` distinguishes datasets of a blend (their orders are unrelated).
        name: the dataset, for error messages.
    """

    CACHE_BLOCK = 1 << 12
    """Training samples whose windows :meth:`train` computes together (8 bytes each, one block cached)."""

    def __init__(self, num_windows: int, valid_fraction: float, seed: int, key: int = 0, name: str = "") -> None:
        self.num_windows, self.seed, self.key = num_windows, seed, key
        self.num_valid = 0 if valid_fraction <= 0 else max(1, round(valid_fraction * num_windows))
        self.num_train = num_windows - self.num_valid
        if self.num_train < 1:
            raise DataError(f"{name or 'dataset'}: {num_windows} samples leave no training sample after holding out "
                            f"{self.num_valid} for validation (data.valid_fraction={valid_fraction}); "
                            "use more data, a shorter model.seq_len or a smaller valid_fraction")
        self._sigma = Permutation(num_windows, mix_seed(seed, key, 0x5B11))
        self._epoch: Optional[tuple[int, Permutation]] = None
        self._block: Optional[tuple[int, torch.Tensor]] = None  # (block, windows of its CACHE_BLOCK samples)

    def _tau(self, epoch: int) -> Permutation:
        if self._epoch is None or self._epoch[0] != epoch:  # steps advance monotonically: one epoch cached
            self._epoch = (epoch, Permutation(self.num_train, mix_seed(self.seed, self.key, 0xE70C, epoch)))
        return self._epoch[1]

    def train(self, t: torch.Tensor) -> torch.Tensor:
        """Windows of training samples ``t`` (int64 tensor, any values ≥ 0: epochs repeat the data).

        Samples are read in runs of consecutive numbers: the windows of the ``CACHE_BLOCK`` samples around them are
        computed at once (one vectorised pass, then a lookup per batch; the values of :meth:`train_direct`).
        """
        t = t.to(torch.int64)
        if t.numel():
            block = int(t.min()) // self.CACHE_BLOCK
            if int(t.max()) // self.CACHE_BLOCK == block:
                if self._block is None or self._block[0] != block:
                    start = block * self.CACHE_BLOCK
                    self._block = (block, self.train_direct(torch.arange(start, start + self.CACHE_BLOCK)))
                return self._block[1][t - block * self.CACHE_BLOCK]
        return self.train_direct(t)

    def train_direct(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`train` computed for ``t`` alone (no cache): the definition."""
        t = t.to(torch.int64)
        epoch, pos = t // self.num_train, t % self.num_train
        epochs = torch.unique(epoch).tolist()
        if len(epochs) == 1:
            out = self._tau(epochs[0])(pos)
        else:  # a batch across an epoch boundary (index_copy_: boolean-mask writes are slow on CPU)
            out = torch.empty_like(t)
            for e in epochs:
                at = torch.nonzero(epoch == e).squeeze(1)
                out.index_copy_(0, at, self._tau(e)(pos[at]))
        return self._sigma(out + self.num_valid)

    def valid(self, k: torch.Tensor) -> torch.Tensor:
        """Windows of validation samples ``k`` (wrapping around the validation set)."""
        if self.num_valid == 0:
            raise DataError("no validation samples: set data.valid_fraction > 0")
        return self._sigma(k.to(torch.int64) % self.num_valid)
