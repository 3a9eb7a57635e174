"""Megatron-LM indexed datasets and flat token files on real memory-mapped files.

* write -> read round trip of documents of random lengths (empty ones included), bit-exact, several dtypes;
* a file built byte by byte with ``struct`` from Megatron-LM's documented layout (not with megashard's
  writer) is read correctly — multi-sequence documents and sequence modes included;
* damaged files (bad magic, wrong version, unknown dtype, truncated index, ``.bin`` shorter or longer than
  the index says, inconsistent pointers) give one clear DataError naming the file and the problem.
"""
from __future__ import annotations

import os
import struct

import pytest
import torch

from megashard.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megashard.data.tokens import FlatTokens
from megashard.errors import DataError

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64]


def _random_docs(dtype: torch.dtype, n: int = 60, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    docs = []
    for i in range(n):
        length = 0 if i % 7 == 3 else int(torch.randint(0, 300, (1,), generator=g))
        docs.append(torch.randint(lo, hi, (length,), generator=g, dtype=torch.int64))
    docs[0] = torch.tensor([lo, hi, 0], dtype=torch.int64)  # the extremes of the dtype survive
    return docs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_round_trip_is_bit_exact(tmp_path, dtype):
    docs = _random_docs(dtype)
    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for i, d in enumerate(docs):
            if i % 3 == 0:
                b.add_document(d.tolist())  # lists, tensors and (for uint8) bytes are all accepted
            else:
                b.add_document(d)
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary files left
    ds = IndexedDataset(prefix)
    ds.verify()
    assert ds.dtype == dtype and ds.num_documents == len(docs) and ds.num_sequences == len(docs)
    assert ds.num_tokens == sum(d.numel() for d in docs)
    assert os.path.getsize(prefix + ".bin") == ds.num_tokens * torch.empty((), dtype=dtype).element_size()
    for i, d in enumerate(docs):
        assert torch.equal(ds.document(i), d), i
        assert torch.equal(ds[i], d)
    stream = torch.cat(docs)
    assert torch.equal(ds.read(0, ds.num_tokens), stream)
    assert torch.equal(ds.read(17, 400), stream[17:417])
    with pytest.raises(DataError, match="outside"):
        ds.read(ds.num_tokens - 2, 3)


def test_builder_streams_long_documents_and_merges_datasets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with IndexedDatasetBuilder(a, torch.uint16) as w:
        for piece in (b"hello ", b"world"):  # one document arriving in pieces
            w.extend(piece)
        w.extend([256])
        w.end_sequence()
        w.end_document()
        w.add_sequence([1, 2])  # a document of two sequences
        w.add_sequence([3])
        w.end_document()
    with IndexedDatasetBuilder(b, torch.uint16) as w:
        w.add_dataset(a)
        w.add_document([])
        w.add_dataset(a)
    ds = IndexedDataset(b)
    ds.verify()
    first = list(b"hello world") + [256]
    assert ds.num_documents == 5 and ds.num_sequences == 7
    assert ds.document(0).tolist() == first and ds.document(1).tolist() == [1, 2, 3]
    assert ds.document(2).tolist() == [] and ds.document(4).tolist() == [1, 2, 3]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5, 7]


def test_failed_build_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(DataError, match="do not fit uint8"):
        with IndexedDatasetBuilder(prefix, torch.uint8) as b:
            b.add_document([1, 2])
            b.add_document([300])
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- Megatron's layout
def _megatron_files(prefix: str, sequences: list[list[int]], doc_starts: list[int], code: int = 8, fmt: str = "H",
                    modes: bool = False) -> None:
    """Write PREFIX.idx/.bin exactly as Megatron-LM's _IndexWriter documents it, with struct only."""
    item = struct.calcsize("<" + fmt)
    with open(prefix + ".bin", "wb") as f:
        for seq in sequences:
            f.write(struct.pack(f"<{len(seq)}{fmt}", *seq))
    lengths = [len(s) for s in sequences]
    pointers, acc = [], 0
    for n in lengths:
        pointers.append(acc)
        acc += n * item
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")                     # magic
        f.write(struct.pack("<Q", 1))                    # version
        f.write(struct.pack("<B", code))                 # dtype code (8 = uint16, 4 = int32)
        f.write(struct.pack("<Q", len(sequences)))       # sequence count
        f.write(struct.pack("<Q", len(doc_starts)))      # document-index entries
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_starts)}q", *doc_starts))
        if modes:
            f.write(struct.pack(f"<{len(sequences)}b", *range(len(sequences))))


def test_reads_a_file_in_megatron_layout(tmp_path):
    seqs = [[5, 6, 7], [], [65535, 0], [9] * 1000, [1]]
    prefix = str(tmp_path / "mega")
    _megatron_files(prefix, seqs, [0, 1, 3, 5])  # documents: [s0], [s1, s2], [s3, s4]
    ds = IndexedDataset(prefix)
    ds.verify()
    assert ds.dtype == torch.uint16 and ds.num_sequences == 5 and ds.num_documents == 3 and ds.sequence_modes is None
    assert [ds[i].tolist() for i in range(5)] == seqs
    assert ds.document(1).tolist() == [65535, 0] and ds.document(2).tolist() == [9] * 1000 + [1]
    assert ds.sequence_lengths.tolist() == [3, 0, 2, 1000, 1]
    assert ds.sequence_pointers.tolist() == [0, 6, 6, 10, 2010]
    assert ds.read(0, ds.num_tokens).tolist() == sum(seqs, [])
    # int32 tokens and the optional per-sequence modes of multimodal datasets
    _megatron_files(prefix + "32", [[-3, 2**31 - 1], [7]], [0, 2], code=4, fmt="i", modes=True)
    ds = IndexedDataset(prefix + "32")
    assert ds.dtype == torch.int32 and ds.document(0).tolist() == [-3, 2**31 - 1, 7]
    assert ds.sequence_modes.tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------- damaged files
@pytest.fixture()
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _megatron_files(prefix, [[1, 2, 3], [4, 5]], [0, 1, 2])
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage, message", [
    (lambda p: _patch(p + ".idx", 0, b"NOTANIDX\x00"), r"good\.idx: not a Megatron-LM indexed dataset index: it starts with"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), r"good\.idx: index version 2 is not supported"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 42)), r"good\.idx: unknown token dtype code 42"),
    (lambda p: _truncate(p + ".idx", 20), r"good\.idx: truncated index: 20 bytes, shorter than the 34-byte header"),
    (lambda p: _truncate(p + ".idx", 60), r"good\.idx: truncated index: 60 bytes, but its header's 2 sequences and 3 "
                                          r"document-index entries need 82"),
    (lambda p: _truncate(p + ".bin", 7), r"good\.bin: truncated: 7 bytes, but the index .*good\.idx describes 10 bytes"),
    (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), r"good\.bin: 12 bytes, but the index .* describes 10"),
    (lambda p: os.remove(p + ".bin"), r"good\.bin: no such file"),
    (lambda p: _patch(p + ".idx", 34 + 8 + 16 + 16, struct.pack("<q", 1)), r"corrupt document index: it runs from 0 to 1"),
])
def test_damaged_dataset_is_named(good, damage, message):
    damage(good)
    with pytest.raises(DataError, match=message):
        IndexedDataset(good)


def test_verify_finds_a_bad_pointer(tmp_path):
    good = str(tmp_path / "good")
    _megatron_files(good, [[1, 2, 3], [4, 5], [6]], [0, 3])
    _patch(good + ".idx", 34 + 12 + 8, struct.pack("<q", 4))  # sequence 1 should start at byte 6
    ds = IndexedDataset(good)  # the O(1) checks at opening pass
    with pytest.raises(DataError, match=r"good\.idx: sequence 1 starts at byte 4 of the \.bin, expected 6"):
        ds.verify()


def test_cli_reports_damage_in_one_line(good, capsys):
    from megashard import cli

    _truncate(good + ".bin", 4)
    assert cli.main(["data", "inspect", good]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("megashard data inspect: error: ") and "good.bin: truncated" in err


# ---------------------------------------------------------------------------------------------- flat files
def test_flat_token_file(tmp_path):
    p = tmp_path / "tokens.u16"
    p.write_bytes(struct.pack("<5H", 1, 2, 65535, 4, 5))
    ft = FlatTokens(str(p), "uint16")
    assert ft.num_tokens == 5 and ft.read(1, 3).tolist() == [2, 65535, 4]
    p.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"tokens\.u16: 3 bytes is not a whole number of uint16 tokens"):
        FlatTokens(str(p), "uint16")
    with pytest.raises(DataError, match=r"nothere: no such file"):
        FlatTokens(str(tmp_path / "nothere"), "uint8")
