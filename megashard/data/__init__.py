"""Tokenized training data, memory-mapped: Megatron-LM indexed datasets, flat token files, blends and splits.

Nothing here uses torch.distributed: a rank computes which global samples it needs and reads only those
tokens from the mapped files. See docs/data.md.

==================  ==============================================================================
module              what
==================  ==============================================================================
``tokens``          token streams: memory-mapped flat token files, the in-memory baseline
``indexed``         Megatron-LM's ``.bin`` + ``.idx``: reader and streaming writer
``corpus``          a prepared corpus on disk: metadata naming its tokenizer, opening any dataset path
``permute``         seeded permutations computed per index (no table)
``samples``         windows of ``seq_len + 1`` tokens, the validation split, the per-epoch order
``blend``           blends by weight: global sample -> (dataset, window)
``tokenizer``       the byte tokenizer, Hugging Face ``tokenizer.json``, BPE training
``prepare``         ``megashard data prepare``: text / JSON lines -> indexed dataset
==================  ==============================================================================
"""
from megashard.data.blend import Blend, BlendedSamples
from megashard.data.corpus import open_tokens, read_meta
from megashard.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megashard.data.permute import Permutation
from megashard.data.samples import RowWindows, Split, StreamWindows
from megashard.data.tokens import FlatTokens, TensorTokens

__all__ = ["Blend", "BlendedSamples", "FlatTokens", "IndexedDataset", "IndexedDatasetBuilder", "Permutation",
           "RowWindows", "Split", "StreamWindows", "TensorTokens", "open_tokens", "read_meta"]
