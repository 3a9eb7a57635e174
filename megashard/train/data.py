"""Deterministic training data, the same for every parallel layout.

The dataset is a fixed tensor of ``N`` sequences of ``seq_len + 1`` tokens, built identically on every
rank from the seed: either sampled from a random Markov chain (``synthetic``: learnable, no files) or
cut from the bytes of a text file (``text``). Global sample ``i`` is row ``perm_e[i mod N]`` of epoch
``e = i // N`` (a seeded permutation per epoch). Step ``s`` uses samples ``[s·B, (s+1)·B)``; data-parallel
rank ``r`` of ``dp`` takes the contiguous slice ``[r·B/dp, (r+1)·B/dp)`` of them, and context-parallel
rank ``c`` of ``cp`` the ``c``-th chunk of the sequence. The data position is therefore a pure function
of the step: resuming (also into another layout) needs no loader state.
"""
from __future__ import annotations

from typing import Optional

import torch

from megashard.train.config import DataConfig, ModelConfig


def synthetic_sequences(num: int, length: int, vocab: int, branching: int, seed: int) -> torch.Tensor:
    """``[num, length]`` int64 tokens from a random Markov chain: every token has ``branching`` likely successors.

    Deterministic in ``seed`` (a private generator; global RNG untouched).
    """
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])  # [vocab, b]
    probs = torch.rand(vocab, branching, generator=g, dtype=torch.float64) + 0.1
    probs /= probs.sum(dim=1, keepdim=True)
    out = torch.empty(num, length, dtype=torch.int64)
    out[:, 0] = torch.randint(0, vocab, (num,), generator=g)
    for t in range(1, length):
        prev = out[:, t - 1]
        choice = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        out[:, t] = succ[prev, choice]
    return out


def text_sequences(path: str, length: int) -> torch.Tensor:
    """Non-overlapping windows of ``length`` bytes of the file at ``path``: ``[num, length]`` int64."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(torch.int64)
    num = data.numel() // length
    if num < 1:
        from megashard.errors import ConfigError

        raise ConfigError(f"data.path={path!r} has {data.numel()} bytes, fewer than one sequence of {length} tokens")
    return data[: num * length].view(num, length)


class Batches:
    """The batches of one rank: ``batch(step) -> (inputs, targets)``, each ``[B/dp, seq_len/cp]`` int64.

    Args:
        data, model: the job's sections.
        global_batch: sequences per step over all data-parallel ranks.
        seed: base seed (``parallel.seed``); the data uses ``seed + data.seed``.
        dp_rank, dp_size: this rank's data-parallel coordinate (``rank_in("dp")``, ``size("dp")``).
        cp_rank, cp_size: this rank's context-parallel coordinate.
    """

    def __init__(self, data: DataConfig, model: ModelConfig, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
                 device: Optional[torch.device] = None) -> None:
        self.seed = seed + data.seed
        length = model.seq_len + 1
        if data.source == "synthetic":
            self.sequences = synthetic_sequences(data.num_sequences, length, model.vocab_size, data.branching, self.seed)
        else:
            assert data.path is not None  # checked by JobConfig.validate
            self.sequences = text_sequences(data.path, length)
        self.global_batch, self.local_batch = global_batch, global_batch // dp_size
        self.dp_rank, self.cp_rank, self.cp_size = dp_rank, cp_rank, cp_size
        self.seq_len = model.seq_len
        self.device = device
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            p = torch.randperm(self.sequences.shape[0], generator=g)
            self._perms = {epoch: p}  # one epoch at a time is enough (steps advance monotonically)
        return p

    def sample_indices(self, step: int) -> list[int]:
        """Dataset rows of this rank's part of batch ``step`` (0-based)."""
        n = self.sequences.shape[0]
        start = step * self.global_batch + self.dp_rank * self.local_batch
        return [int(self._perm(i // n)[i % n]) for i in range(start, start + self.local_batch)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step`` for this rank, ``[B/dp, seq_len/cp]`` each."""
        rows = self.sequences[self.sample_indices(step)]
        chunk = self.seq_len // self.cp_size
        lo = self.cp_rank * chunk
        x, y = rows[:, lo: lo + chunk], rows[:, lo + 1: lo + chunk + 1]
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()
