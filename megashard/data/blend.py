"""Blends: global sample ``i`` → (dataset, sample of that dataset), a pure function with O(1) memory per sample.

:class:`Blend` interleaves datasets by weight in blocks of ``K = 65,536`` samples. Dataset ``d`` gets
``c_d`` samples of every block (``K · w_d`` rounded by largest remainder, so ``Σ c_d = K`` and
``|c_d - K·w_d| < 1``), spread evenly over the block: its ``k``-th sample of the block sits at relative
position ``(k + ½) / c_d``, and the block is those positions in increasing order (ties by dataset) — the
most under-served dataset comes next, as in Megatron-LM's blending. Sample ``i`` is position
``r = i mod K`` of block ``b = i // K``; with the block's table ``(dataset[r], rank[r])`` it maps to
sample ``b · c_d + rank[r]`` of dataset ``d``. **Tolerance:** after any ``n`` samples, dataset ``d`` has
been drawn ``n · w_d`` times ± ``(n / K + 2)`` (± 3.6 samples at ``n = 10⁵``).

:class:`BlendedSamples` puts blends and :class:`~megashard.data.samples.Split` together: training sample
``i`` → ``(d, window)``, validation sample ``k`` → ``(d, window)``, and reads their tokens.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from megashard.data.samples import Split, WindowSource
from megashard.errors import DataError

__all__ = ["Blend", "BlendedSamples", "BLOCK", "normalise_weights"]

BLOCK = 65536


def normalise_weights(weights: Sequence[float], block: int = BLOCK, names: Sequence[str] = ()) -> list[float]:
    """Blend weights as fractions summing to 1; DataError (one line) unless every weight is a finite number > 0 and
    at least 1/``block`` of the total (a smaller one would never be drawn: a blend deals ``block`` samples at a
    time). ``names``: the datasets, for the message."""
    def who(d: int) -> str:
        return f" ({names[d]})" if d < len(names) else ""

    if not weights:
        raise DataError("a blend needs at least one dataset weight")
    for d, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not w > 0:
            raise DataError(f"blend weight {w!r}{who(d)} must be a finite positive number (weights are relative: "
                            "e.g. 0.7 and 0.3)")
    top = float(max(weights))
    scaled = [w / top for w in weights]  # no overflow for weights near the float maximum
    total = sum(scaled)
    fractions = [w / total for w in scaled]
    if len(weights) > 1:
        small = [d for d, f in enumerate(fractions) if f * block < 1]
        if small:
            d = small[0]
            raise DataError(f"blend weight {weights[d]!r}{who(d)} is {fractions[d]:.3g} of the total weight "
                            f"{sum(weights):.6g}, below 1/{block:,}: that dataset would never be drawn (a blend deals "
                            f"{block:,} samples at a time); give weights of a similar scale (e.g. 0.7 and 0.3) or "
                            "leave the dataset out")
    return fractions


def _largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    s = float(sum(weights))
    exact = [w / s * total for w in weights]
    counts = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in order[: total - sum(counts)]:
        counts[d] += 1
    return counts


class Blend:
    """Deterministic interleaving of ``len(weights)`` datasets (weights > 0, normalised here).

    ``locate(i)`` maps global sample indices (int64 tensor) to ``(dataset, local index)`` tensors.
    """

    def __init__(self, weights: Sequence[float], block: int = BLOCK) -> None:
        normalise_weights(weights, block)  # finite, > 0, none too small to be drawn
        if not math.isfinite(float(sum(weights))):  # huge weights: only their ratios matter
            weights = [w / float(max(weights)) for w in weights]
        self.block = block if len(weights) > 1 else 1
        self.weights = [w / float(sum(weights)) for w in weights]
        self.counts = _largest_remainder(weights, self.block)
        pos, ds, ranks = [], [], []
        for d, c in enumerate(self.counts):
            k = torch.arange(c, dtype=torch.float64)
            pos.append((k + 0.5) / c)
            ds.append(torch.full((c,), d, dtype=torch.int64))
            ranks.append(torch.arange(c, dtype=torch.int64))
        order = torch.sort(torch.cat(pos), stable=True).indices  # stable: ties keep dataset order
        self.dataset = torch.cat(ds)[order]
        self.rank = torch.cat(ranks)[order]
        self._counts = torch.tensor(self.counts, dtype=torch.int64)

    def locate(self, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dataset, local index)`` of global samples ``i``."""
        i = i.to(torch.int64)
        b, r = i // self.block, i % self.block
        d = self.dataset[r]
        return d, b * self._counts[d] + self.rank[r]


class BlendedSamples:
    """Global training and validation samples of a blend of window sources.

    Args:
        sources: the datasets (all with the same ``seq_len``).
        weights: blend weights (one per source).
        valid_fraction: share of each dataset held out for validation.
        seed: data seed (the split and every epoch's order derive from it).
    """

    def __init__(self, sources: Sequence[WindowSource], weights: Sequence[float], valid_fraction: float,
                 seed: int) -> None:
        if len(sources) != len(weights):
            raise DataError(f"{len(sources)} datasets but {len(weights)} weights")
        self.sources = list(sources)
        self.blend = Blend(weights)
        self.splits = []
        for d, src in enumerate(self.sources):
            if src.num_windows < 1:
                raise DataError(f"{src.name}: fewer than {src.seq_len + 1} tokens: not one sample of "
                                f"model.seq_len={src.seq_len} (+1) tokens")
            self.splits.append(Split(src.num_windows, valid_fraction, seed, key=d, name=src.name))
        self.has_valid = valid_fraction > 0

    def train(self, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dataset, window)`` of global training samples ``i``."""
        d, local = self.blend.locate(i)
        return d, self._per_dataset(d, local, "train")

    def valid(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dataset, window)`` of global validation samples ``k``."""
        d, local = self.blend.locate(k)
        return d, self._per_dataset(d, local, "valid")

    def _per_dataset(self, d: torch.Tensor, local: torch.Tensor, which: str) -> torch.Tensor:
        groups = torch.unique(d).tolist()
        if len(groups) == 1:  # the common case; index_copy_ below (boolean-mask writes are slow on CPU)
            return getattr(self.splits[groups[0]], which)(local)
        out = torch.empty_like(local)
        for ds in groups:
            pos = torch.nonzero(d == ds).squeeze(1)
            out.index_copy_(0, pos, getattr(self.splits[ds], which)(local[pos]))
        return out

    def tokens(self, d: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """``[n, seq_len + 1]`` tokens of windows ``window`` of datasets ``d``, in order."""
        groups = torch.unique(d).tolist()
        if len(groups) == 1:
            return self.sources[groups[0]].windows(window)
        out = torch.empty(len(d), self.sources[groups[0]].seq_len + 1, dtype=torch.int64)
        for ds in groups:
            pos = torch.nonzero(d == ds).squeeze(1)
            out.index_copy_(0, pos, self.sources[ds].windows(window[pos]))
        return out
