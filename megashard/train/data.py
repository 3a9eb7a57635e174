"""Deterministic training data, the same for every parallel layout (docs/data.md).

Every source is a list of datasets of samples of ``seq_len + 1`` tokens (:mod:`megashard.data`):

* ``synthetic``: ``num_sequences`` rows sampled from a fixed random Markov chain, built from the seed;
* ``text``: windows over the bytes of a text file (memory-mapped, one token per byte);
* ``indexed``: windows over tokenized datasets — Megatron-LM ``.bin`` + ``.idx`` or flat token files,
  memory-mapped — one (``data.path``) or a blend (``data.blend``).

Global training sample ``i`` is ``(dataset, window)`` = :meth:`megashard.data.blend.BlendedSamples.train`:
the blend picks the dataset, a seeded split holds out ``data.valid_fraction`` of its windows for
validation and a seeded permutation per epoch orders the rest. Step ``s`` uses global samples
``[s·B, (s+1)·B)``; data-parallel rank ``r`` of ``dp`` takes ``[s·B + r·B/dp, s·B + (r+1)·B/dp)`` and
context-parallel rank ``c`` of ``cp`` the ``c``-th chunk of each sequence; validation batch ``k`` is
validation samples ``[k·B, (k+1)·B)``, sliced the same way. A rank reads only the tokens of its own
samples. The data position is a pure function of ``(seed, step)``: resuming — into any layout — needs
no loader state.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

from megashard.errors import ConfigError, DataError
from megashard.train.sections import DataConfig, ModelConfig

__all__ = ["Batches", "synthetic_sequences", "synthetic_token_dtype", "distinct_successors", "data_paths", "blend_pairs", "check_corpus", "check_samples", "ensure_corpus",
           "build_samples"]


def synthetic_token_dtype(vocab: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds token ids ``0 .. vocab-1`` (how the synthetic rows are held:
    int16 up to 32,768 ids, int32 up to 2**31, else int64; batches are int64)."""
    return torch.int16 if vocab <= 1 << 15 else torch.int32 if vocab <= 1 << 31 else torch.int64


def distinct_successors(vocab: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """``[vocab, branching]`` int64: for every token, ``branching`` distinct successors drawn uniformly from ``0 ..
    vocab-1``, in ``O(vocab · branching²)`` time and ``O(vocab · branching)`` memory (Floyd's sampling of a
    ``branching``-subset, vectorised over the tokens: for ``j = vocab - branching .. vocab - 1`` draw ``t`` in
    ``[0, j]``, take ``t`` unless this row has it already, then ``j``, which no earlier draw could be)."""
    succ = torch.empty(vocab, branching, dtype=torch.int64)
    for k, j in enumerate(range(vocab - branching, vocab)):
        t = torch.randint(0, j + 1, (vocab,), generator=generator)
        if k:
            taken = (succ[:, :k] == t.unsqueeze(1)).any(dim=1)
            t = torch.where(taken, torch.full_like(t, j), t)
        succ[:, k] = t
    return succ


def synthetic_sequences(num: int, length: int, vocab: int, branching: int, seed: int) -> torch.Tensor:
    """``[num, length]`` tokens from a random Markov chain: every token has ``branching`` likely successors.

    Deterministic in ``seed`` (a private generator; global RNG untouched). Held in :func:`synthetic_token_dtype`
    (int16 for vocabularies up to 32,768): the set-up's memory is the chain (``vocab × branching`` successors and
    probabilities) plus the tokens made, and its time linear in both — no ``vocab × vocab`` table (earlier versions took
    every token's successors from the head of a full ``randperm(vocab)``: vocab² × 8 bytes at once, 19 GiB at a
    vocabulary of 50,304; the chain, and so the sequences of a seed, changed with that fix).
    """
    g = torch.Generator().manual_seed(seed)
    succ = distinct_successors(vocab, branching, g).view(-1)  # [vocab · b]: token v's successors at v·b ..
    cum = (torch.rand(vocab, branching, generator=g) + 0.1).cumsum(dim=1)
    cum /= cum[:, -1:].clone()  # [vocab, b] float32: each row's CDF of its successors, the last column exactly 1
    out = torch.empty(num, length, dtype=synthetic_token_dtype(vocab))
    prev = torch.randint(0, vocab, (num,), generator=g)
    out[:, 0] = prev
    for t in range(1, length):  # one [num] draw per position: the column of each row's CDF it falls in
        u = torch.rand(num, 1, generator=g)
        choice = (cum.index_select(0, prev) < u).sum(dim=1).clamp_(max=branching - 1)
        prev = succ.index_select(0, prev * branching + choice)
        out[:, t] = prev
    return out


def data_paths(data: DataConfig) -> list[tuple[float, str]]:
    """``[(weight, path), ...]`` of ``data.source: indexed``: ``blend`` when given (it replaces ``path``), else
    ``path`` as one dataset of weight 1; a :class:`ConfigError` for neither or a malformed ``blend``."""
    if data.path is None and data.blend is None:
        raise ConfigError("data.source=indexed needs data.path (one dataset) or data.blend ([[weight, path], ...])")
    if data.prepare_inputs is not None and (not isinstance(data.prepare_inputs, list) or not data.prepare_inputs
                                            or not all(isinstance(x, str) for x in data.prepare_inputs)):
        raise ConfigError(f"data.prepare_inputs must be a non-empty list of files, directories or glob patterns, "
                          f"got {data.prepare_inputs!r}")
    if data.blend is None:
        return [(1.0, data.path)]
    return blend_pairs(data.blend)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def blend_pairs(blend: Any) -> list[tuple[float, str]]:
    """``data.blend`` as ``[(weight, path), ...]``; ConfigError (one line) unless it is a non-empty list of
    ``[weight, path]`` pairs with finite weights > 0 of a similar scale (:func:`megashard.data.blend.normalise_weights`)."""
    import math

    from megashard.data.blend import normalise_weights

    rule = "data.blend must be a non-empty list of [weight, path] pairs with weights > 0, e.g. [[0.7, data/a], [0.3, data/b]]"
    if not isinstance(blend, list) or not blend:
        raise ConfigError(f"{rule}; got {_short(blend)}")
    out = []
    for item in blend:
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str):
            try:  # YAML 1.1 reads 1e-3 (no dot) as a string
                item = [float(item[0]), item[1]]
            except ValueError:
                pass
        ok = isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], str) and bool(item[1])
        ok = ok and isinstance(item[0], (int, float)) and not isinstance(item[0], bool)
        if not ok:
            raise ConfigError(f"{rule}; got the entry {_short(item)}")
        if not (math.isfinite(item[0]) and item[0] > 0):
            raise ConfigError(f"data.blend weight {item[0]!r} of {item[1]} must be a finite number > 0 (weights are "
                              "relative: e.g. [[0.7, data/a], [0.3, data/b]])")
        out.append((float(item[0]), item[1]))
    try:
        normalise_weights([w for w, _ in out], names=[p for _, p in out])
    except DataError as e:
        raise ConfigError(f"data.{e}") from None
    return out


def _pad(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def check_corpus(data: DataConfig, model: ModelConfig, seed: int, tp: int) -> None:
    """``data.source: indexed``: every dataset opens (headers and sizes checked) and ``model.vocab_size`` covers
    its tokenizer's vocabulary (from the corpus metadata), then :func:`check_samples`. A corpus that
    ``megashard run`` will prepare (``data.prepare_inputs``) may still be missing. ``seed``: the job's
    ``parallel.seed``; ``tp``: its tensor-parallel size (the vocabulary pads to a multiple of it)."""
    from megashard.data.corpus import corpus_exists, open_tokens, read_meta

    d, m = data, model
    seen: dict[str, Any] = {}
    missing = False
    for _, path in data_paths(d):
        if d.prepare_inputs and d.blend is None and path == d.path and not corpus_exists(path):
            missing = True
            check_prepare(data, model, tp)  # what the launcher will prepare: inputs, tokenizer, output, vocabulary
            continue  # prepared by the launcher before the workers start, then checked again
        try:
            stream = open_tokens(path, d.flat_dtype)
        except DataError as e:  # name the setting that points there
            raise DataError(f"{'data.path' if d.blend is None else 'data.blend'}: {e}") from None
        if stream.num_tokens <= m.seq_len:
            raise DataError(f"{path}: {stream.num_tokens} tokens, not one sample of model.seq_len={m.seq_len} (+1) tokens")
        meta = read_meta(path)
        if meta is None:
            continue
        v = meta["vocab_size"]
        if m.vocab_size < v:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of {path} ({v} ids, tokenizer "
                f"{meta.get('tokenizer')}): use model.vocab_size={_pad(v, tp)} (a multiple of tp={tp}; "
                f"Megatron pads to a multiple of 128·tp: {_pad(v, 128 * tp)})")
        key = (v, meta.get("eod_id"))
        if seen and key not in seen.values():
            other = next(iter(seen))
            raise ConfigError(f"data.blend mixes tokenizers: {path} has vocabulary {v} (end of document "
                              f"{meta.get('eod_id')}), {other} has {seen[other][0]} ({seen[other][1]})")
        seen[path] = key
    if not missing:
        check_samples(d, m, seed)


def check_prepare(data: DataConfig, model: ModelConfig, tp: int = 1) -> None:
    """What :func:`ensure_corpus` will do, checked before anything is written (a dry run sees it too): every
    ``data.prepare_inputs`` entry names text files (a glob that matches nothing, an empty or binary file is an
    error), ``data.prepare_tokenizer`` loads, ``model.vocab_size`` covers its vocabulary, and the corpus files of
    ``data.path`` may be written (not an input, not a file megashard did not make). DataError / ConfigError."""
    from megashard.data.inputs import check_encoding
    from megashard.data.prepare import RUN_OPTIONS, check_prepare_outputs, iter_documents, text_inputs
    from megashard.data.tokenizer import load_tokenizer

    d, m = data, model
    why = f"data.path={d.path} has no corpus yet, so megashard run would prepare it"
    check_encoding(d.prepare_encoding, d.prepare_encoding_errors, RUN_OPTIONS)
    try:
        files = text_inputs(d.prepare_inputs)
        if d.prepare_encoding_errors == "strict" and sum(os.path.getsize(f) for f in files) <= SCAN_BYTES:
            for f in files:  # small enough to read here: every byte valid in the encoding (as prepare will read it)
                for doc in iter_documents(f, "text", d.prepare_encoding, "strict", RUN_OPTIONS):
                    for _ in doc:
                        pass
    except DataError as e:
        raise ConfigError(f"data.prepare_inputs ({why}): {e}") from None
    try:
        tok = load_tokenizer(d.prepare_tokenizer)
    except DataError as e:
        raise ConfigError(f"data.prepare_tokenizer={d.prepare_tokenizer!r} ({why}): {e}") from None
    if m.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of data.prepare_tokenizer="
                          f"{d.prepare_tokenizer} ({tok.vocab_size} ids): use model.vocab_size={_pad(tok.vocab_size, tp)}"
                          f" (a multiple of tp={tp})")
    check_prepare_outputs(d.path, files + ([d.prepare_tokenizer] if d.prepare_tokenizer != "byte" else []),
                          option="data.path=", inputs=d.prepare_inputs, tokenizer_file=d.prepare_tokenizer != "byte")


#: Datasets without a recorded vocabulary (flat token files, corpora without metadata) up to this size are scanned
#: for their largest token id before any process starts; larger ones are checked as batches are read.
SCAN_BYTES = 256 << 20


def check_samples(data: DataConfig, model: ModelConfig, seed: int) -> None:
    """What every worker would otherwise find on its own, and print once per rank and per restart: build the job's
    samples as the workers do (files are mapped, no token is read) — every dataset holds a sample of
    ``model.seq_len + 1`` tokens and a training sample after the validation split, every blend weight can be
    drawn — and check the token ids of a dataset without a recorded vocabulary against ``model.vocab_size``.
    Synthetic data is checked by arithmetic (building it takes a while). ``seed``: the job's ``parallel.seed`` (as
    :class:`Batches` takes it). DataError / ConfigError, one line."""
    from megashard.data.corpus import read_meta
    from megashard.data.samples import Split

    d, m = data, model
    if d.source == "synthetic":
        Split(d.num_sequences, d.valid_fraction, 0, name=f"synthetic data (data.num_sequences={d.num_sequences})")
        return
    samples = build_samples(d, m, seed + d.seed)
    for src in samples.sources:
        stream = src.stream
        dtype = getattr(stream, "dtype", None)
        if dtype is None or read_meta(src.name) is not None or stream.num_tokens == 0:
            continue
        item = torch.empty((), dtype=dtype).element_size()
        info = torch.iinfo(dtype)  # token dtypes are integers (megashard.data.tokens.DTYPES)
        if (info.min >= 0 and info.max < m.vocab_size) or stream.num_tokens * item > SCAN_BYTES:
            continue  # every id fits (unsigned, below the vocabulary), or too large to scan here (checked as read)
        step = 1 << 22
        for start in range(0, stream.num_tokens, step):
            part = stream.read(start, min(step, stream.num_tokens - start))
            hi = int(part.max())
            if hi >= m.vocab_size or int(part.min()) < 0:
                at = start + int(torch.nonzero((part >= m.vocab_size) | (part < 0))[0])
                raise ConfigError(f"{src.name}: token id {int(stream.read(at, 1))} at token {at:,} is outside "
                                  f"model.vocab_size={m.vocab_size} (the dataset records no vocabulary); raise "
                                  "model.vocab_size to the tokenizer's vocabulary, or check data.flat_dtype="
                                  f"{d.flat_dtype}")


def ensure_corpus(data: DataConfig, stream: Any = None) -> Optional[str]:
    """In the launcher, before any worker starts: prepare ``data.path`` from ``data.prepare_inputs`` if it has no
    complete corpus yet (with a one-line note on stderr). Returns the note, or ``None`` if nothing was done."""
    from megashard.data.corpus import corpus_exists

    d = data
    if d.source != "indexed" or not d.prepare_inputs or d.path is None or d.blend is not None or corpus_exists(d.path):
        return None
    from megashard.data.prepare import prepare

    note = (f"megashard run: data.path={d.path} has no corpus yet: preparing it from {', '.join(d.prepare_inputs)} "
            f"(tokenizer {d.prepare_tokenizer}; once)")
    out = stream or sys.stderr
    print(note, file=out, flush=True)
    os.makedirs(os.path.dirname(d.path) or ".", exist_ok=True)
    from megashard.data.prepare import RUN_OPTIONS

    prepare(d.prepare_inputs, d.path, d.prepare_tokenizer, workers=min(4, os.cpu_count() or 1), progress=False,
            encoding=d.prepare_encoding, encoding_errors=d.prepare_encoding_errors, options=RUN_OPTIONS)
    return note


def build_samples(data: DataConfig, model: ModelConfig, seed: int) -> "Any":
    """The :class:`~megashard.data.blend.BlendedSamples` of the job's data (files mapped, nothing read yet)."""
    from megashard.data.blend import BlendedSamples
    from megashard.data.corpus import open_tokens
    from megashard.data.samples import RowWindows, StreamWindows
    from megashard.data.tokens import FlatTokens

    length = model.seq_len + 1
    if data.source == "synthetic":
        rows = synthetic_sequences(data.num_sequences, length, model.vocab_size, data.branching, seed)
        sources, weights = [RowWindows(rows, "synthetic")], [1.0]
    elif data.source == "text":
        if data.path is None:
            raise ConfigError("data.source=text needs data.path (a text file)")
        sources, weights = [StreamWindows(FlatTokens(data.path, "uint8"), model.seq_len)], [1.0]
    else:
        pairs = data_paths(data)
        sources = [StreamWindows(open_tokens(p, data.flat_dtype), model.seq_len) for _, p in pairs]
        weights = [w for w, _ in pairs]
    return BlendedSamples(sources, weights, data.valid_fraction, seed)


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
        self.samples = build_samples(data, model, self.seed)
        self.global_batch, self.local_batch = global_batch, global_batch // dp_size
        self.dp_rank, self.cp_rank, self.cp_size = dp_rank, cp_rank, cp_size
        self.seq_len, self.vocab_size = model.seq_len, model.vocab_size
        self.device = device

    def sample_ids(self, step: int) -> torch.Tensor:
        """Global sample numbers of this rank's part of batch ``step`` (0-based): ``[B/dp]`` int64."""
        start = step * self.global_batch + self.dp_rank * self.local_batch
        return torch.arange(start, start + self.local_batch, dtype=torch.int64)

    def locate(self, step: int, valid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dataset, window)`` of this rank's samples of training step ``step`` (or validation batch ``step``)."""
        ids = self.sample_ids(step)
        return self.samples.valid(ids) if valid else self.samples.train(ids)

    def sample_indices(self, step: int) -> list[int]:
        """Windows (dataset-local sample indices) of this rank's part of batch ``step``."""
        return self.locate(step)[1].tolist()

    def _split(self, d: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.samples.tokens(d, w)
        if rows.numel() and (int(rows.max()) >= self.vocab_size or int(rows.min()) < 0):
            out = (rows >= self.vocab_size) | (rows < 0)
            bad = int(torch.nonzero(out.any(dim=1))[0])
            src = self.samples.sources[int(d[bad])]
            tok = int(rows[bad][out[bad]][0])
            raise DataError(f"{src.name}: token id {tok} in sample {int(w[bad])} is outside "
                            f"model.vocab_size={self.vocab_size} (ids 0..{self.vocab_size - 1}): raise model.vocab_size to the tokenizer's vocabulary, or check "
                            "the dataset's token dtype")
        chunk = self.seq_len // self.cp_size
        lo = self.cp_rank * chunk
        x, y = rows[:, lo: lo + chunk], rows[:, lo + 1: lo + chunk + 1]
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step`` for this rank, ``[B/dp, seq_len/cp]`` each."""
        return self._split(*self.locate(step))

    def valid_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of validation batch ``k`` for this rank (needs ``data.valid_fraction > 0``)."""
        return self._split(*self.locate(k, valid=True))
