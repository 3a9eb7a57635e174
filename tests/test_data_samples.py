"""Sample order, splits and blends: pure functions of (seed, global sample index), read from real mapped files.

* the seeded permutation is a bijection for any size, deterministic in its key, different across keys;
* blends give the requested proportions within the documented tolerance (n/65536 + 2 samples) over 10⁵ samples;
* the validation split is disjoint from training, fixed by the seed; every training window once per epoch;
* the batches of a step, concatenated over data-parallel ranks, are the same in every layout (1, dp2, dp4,
  with and without cp), so a resume into another layout (tp2·dp2 -> dp4) reads exactly what an
  uninterrupted run reads, with fresh objects (no loader state);
* token ids above model.vocab_size and a too-small vocabulary are clear errors.
"""
from __future__ import annotations

import pytest
import torch

from megashard.data.blend import BLOCK, Blend, BlendedSamples
from megashard.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megashard.data.permute import Permutation
from megashard.data.samples import Split, StreamWindows
from megashard.data.tokens import TensorTokens
from megashard.errors import ConfigError, DataError


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1000, 4097, 100_003])
def test_permutation_is_a_bijection(n):
    y = Permutation(n, key=12345)(torch.arange(n))
    assert torch.equal(torch.sort(y).values, torch.arange(n))
    if n > 100:
        assert not torch.equal(y, torch.arange(n))
        assert torch.equal(y, Permutation(n, key=12345)(torch.arange(n)))  # deterministic
        assert (y != Permutation(n, key=12346)(torch.arange(n))).float().mean() > 0.9  # another key: unrelated
        assert Permutation(n, key=12345)(17) == int(y[17])  # an index alone gives the same answer


def test_permutation_of_a_huge_domain_needs_no_table():
    p = Permutation(10**12, key=1)
    idx = torch.arange(0, 10**12, 10**7)
    y = p(idx)
    assert ((y >= 0) & (y < 10**12)).all() and torch.unique(y).numel() == idx.numel()


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0.9, 0.07, 0.03], [3.0, 1e-3, 2.0]])
def test_blend_proportions_within_tolerance(weights):
    n = 100_000
    blend = Blend(weights)
    d, local = blend.locate(torch.arange(n))
    total = sum(weights)
    for checkpoint in (1000, 12_345, 65_536, n):
        counts = torch.bincount(d[:checkpoint], minlength=len(weights))
        for k, w in enumerate(weights):
            # The documented tolerance: n/K + 2 samples (3.6 at 10^5).
            assert abs(int(counts[k]) - checkpoint * w / total) <= checkpoint / BLOCK + 2, (checkpoint, k, counts)
    for k in range(len(weights)):  # each dataset's local indices are 0, 1, 2, ... in order of appearance
        mine = local[d == k]
        assert torch.equal(mine, torch.arange(mine.numel()))


def test_blend_rejects_bad_weights():
    with pytest.raises(DataError, match="positive"):
        Blend([1.0, 0.0])
    with pytest.raises(DataError, match="below 1/65,536"):
        Blend([1.0, 1e-7])


def test_split_is_disjoint_seeded_and_covers_every_window_once_per_epoch():
    n = 1000
    s = Split(n, valid_fraction=0.05, seed=3)
    assert s.num_valid == 50 and s.num_train == 950
    valid = s.valid(torch.arange(50))
    epoch0, epoch1 = s.train(torch.arange(950)), s.train(torch.arange(950, 1900))
    assert set(valid.tolist()).isdisjoint(epoch0.tolist())
    assert sorted(valid.tolist() + epoch0.tolist()) == list(range(n))
    assert sorted(epoch1.tolist()) == sorted(epoch0.tolist()) and not torch.equal(epoch0, epoch1)
    assert torch.equal(s.valid(torch.arange(50, 100)), valid)  # validation wraps around
    other = Split(n, valid_fraction=0.05, seed=4)
    assert set(other.valid(torch.arange(50)).tolist()) != set(valid.tolist())
    assert torch.equal(Split(n, 0.05, seed=3).train(torch.arange(1900)), torch.cat([epoch0, epoch1]))
    with pytest.raises(DataError, match="no training sample"):
        Split(1, 0.5, seed=0, name="tiny")


# ---------------------------------------------------------------------------------------------- on real files
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two indexed datasets with known contents: dataset k's tokens are k·1000 + position mod 1000."""
    root = tmp_path_factory.mktemp("corpora")
    prefixes = []
    for k, (docs, length) in enumerate([(40, 97), (25, 61)]):
        prefix = str(root / f"c{k}")
        with IndexedDatasetBuilder(prefix, torch.int32) as b:
            pos = 0
            for _ in range(docs):
                b.add_document([k * 1000 + (pos + i) % 1000 for i in range(length)])
                pos += length
        prefixes.append(prefix)
    return prefixes


def _job(*extra):
    from megashard.train.config import JobConfig

    return JobConfig.from_dict({"model": {"vocab_size": 2048, "seq_len": 16},
                                "data": {"source": "indexed", "valid_fraction": 0.1, **dict(extra)}})


def _batches(job, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, batch=8):
    from megashard.train.data import Batches

    return Batches(job.data, job.model, batch, seed=11, dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank,
                   cp_size=cp_size)


def test_windows_read_the_right_tokens(corpora):
    ds = IndexedDataset(corpora[0])
    w = StreamWindows(ds, 16)
    assert w.num_windows == (40 * 97 - 1) // 16
    rows = w.windows(torch.tensor([0, 5, w.num_windows - 1]))
    for row, j in zip(rows, [0, 5, w.num_windows - 1]):
        assert row.tolist() == [(j * 16 + i) % 1000 for i in range(17)]  # 17 tokens, sharing one with the next


def test_global_sample_sequence_is_the_same_in_every_layout(corpora):
    job = _job(("blend", [[0.6, corpora[0]], [0.4, corpora[1]]]))
    steps = range(12)  # several epochs of the smaller dataset's 81 training windows... and of the batch
    ref = [_batches(job).batch(s) for s in steps]
    ref_valid = [_batches(job).valid_batch(k) for k in range(3)]
    for dp, cp in [(2, 1), (4, 1), (2, 2), (8, 1)]:
        parts = [[_batches(job, r, dp, c, cp) for c in range(cp)] for r in range(dp)]
        for s in steps:
            x = torch.cat([torch.cat([p.batch(s)[0] for p in row], dim=1) for row in parts])
            y = torch.cat([torch.cat([p.batch(s)[1] for p in row], dim=1) for row in parts])
            assert torch.equal(x, ref[s][0]) and torch.equal(y, ref[s][1]), (dp, cp, s)
        for k in range(3):
            x = torch.cat([torch.cat([p.valid_batch(k)[0] for p in row], dim=1) for row in parts])
            assert torch.equal(x, ref_valid[k][0]), (dp, cp, k)
    # Tokens really come from both datasets, as the blend says, and inputs/targets are shifted by one.
    x, y = ref[0]
    assert torch.equal(x[:, 1:], y[:, :-1]) and set((x[:, 0] // 1000).tolist()) == {0, 1}


def test_resume_in_another_layout_reads_what_an_uninterrupted_run_reads(corpora):
    """tp2·dp2 (dp=2) for steps 0-4, then fresh dp4 readers from step 5: per step, the union of what the ranks
    read equals the uninterrupted tp2·dp2 run's, sample for sample (ids, windows and tokens)."""
    job = _job(("path", corpora[0]))
    tp2dp2 = [_batches(job, r, 2) for r in range(2)]
    dp4 = [_batches(job, r, 4) for r in range(4)]

    def step_view(ranks, s):
        ids = torch.cat([b.sample_ids(s) for b in ranks])
        windows = torch.cat([b.locate(s)[1] for b in ranks])
        tokens = torch.cat([b.batch(s)[0] for b in ranks])
        return ids, windows, tokens

    for s in range(10):
        want = step_view(tp2dp2, s)
        got = step_view(dp4 if s >= 5 else tp2dp2, s)
        for a, b in zip(got, want):
            assert torch.equal(a, b), s
        assert torch.equal(want[0], torch.arange(8 * s, 8 * s + 8))  # step s is global samples [sB, (s+1)B)
    # ranks of dp4 read disjoint quarters of the step
    assert dp4[1].sample_ids(5).tolist() == [42, 43]


def test_validation_never_reads_a_training_window(corpora):
    samples = BlendedSamples([StreamWindows(IndexedDataset(p), 16) for p in corpora], [1, 1], 0.1, seed=5)
    d_t, w_t = samples.train(torch.arange(5000))
    d_v, w_v = samples.valid(torch.arange(500))
    train = set(zip(d_t.tolist(), w_t.tolist()))
    valid = set(zip(d_v.tolist(), w_v.tolist()))
    assert train.isdisjoint(valid)
    assert len(valid) == sum(s.num_valid for s in samples.splits)  # the whole validation set, nothing else
    assert len(train) == sum(s.num_train for s in samples.splits)  # 5000 samples: every training window seen


def test_vocab_checks(corpora, tmp_path):
    from megashard.data.prepare import prepare

    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    prefix = str(tmp_path / "bytes")
    prepare([str(text)], prefix, "byte", progress=False)
    from megashard.train.config import JobConfig

    j = JobConfig.from_dict({"model": {"vocab_size": 256, "seq_len": 16},
                             "data": {"source": "indexed", "path": prefix}})
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the vocabulary of .*bytes \(257 ids, "
                                          r"tokenizer byte\): use model.vocab_size=257 \(a multiple of tp=1; Megatron "
                                          r"pads to a multiple of 128·tp: 384\)"):
        j.validate(world_size=1)
    j.model.vocab_size = 384
    j.validate(world_size=1)
    # a dataset without metadata (e.g. made by Megatron's tools): every batch is checked instead
    jj = _job(("path", corpora[1]))
    jj.model.vocab_size = 1024
    b = _batches(jj)
    with pytest.raises(DataError, match=r"c1: token id 1\d\d\d in sample \d+ is outside model.vocab_size=1024"):
        b.batch(0)
