"""Tokenizers for ``megashard data prepare``: a built-in byte-level one and Hugging Face ``tokenizer.json`` files.

* ``byte`` (:class:`ByteTokenizer`, no dependency): the UTF-8 bytes of the text are the ids 0-255;
  id 256 is the end-of-document token appended after every document. Vocabulary: 257 ids.
* a path to a Hugging Face ``tokenizer.json`` (:class:`HFTokenizer`, needs the optional ``tokenizers``
  package: ``pip install 'megashard[data]'``). Its end-of-document token is the first of
  ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` in its vocabulary (none: nothing is appended).
* :func:`train_bpe` trains a byte-level BPE tokenizer with that library on the input texts, offline,
  with ``<|endoftext|>`` as its end-of-document token (id 0).

``model.vocab_size`` must be at least the tokenizer's ``vocab_size`` (and divisible by ``parallel.tp``;
Megatron pads the vocabulary to a multiple of 128 · tp).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Optional, Union

from megashard.errors import DataError, require_extra

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "train_bpe", "require_tokenizers", "EOD_NAMES"]

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def require_tokenizers(what: str) -> Any:
    """Import Hugging Face ``tokenizers`` or raise :class:`MissingExtraError` saying what to install."""
    return require_extra("tokenizers", what, "data", label="Hugging Face 'tokenizers'")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, end of document 256."""

    name = "byte"
    vocab_size = 257
    eod_id: Optional[int] = 256

    def encode(self, text: str) -> bytes:
        """Ids of ``text`` (a bytes object: each byte is an id)."""
        return text.encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (the end-of-document id becomes a newline; invalid UTF-8 is replaced)."""
        return bytes(10 if i == 256 else i for i in ids).decode("utf-8", errors="replace")

    def spec(self) -> str:
        return "byte"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file."""

    def __init__(self, path: str) -> None:
        if not os.path.lexists(path):
            raise DataError(f"{path}: tokenizer file does not exist")
        from megashard.readers import LARGE, check_regular

        # a regular file of sane size (a FIFO would block the library's read, a huge file fill memory)
        check_regular(path, "tokenizer file", limit=LARGE, error=DataError, hint="give a tokenizer.json file")
        tk = require_tokenizers(f"the tokenizer {path}")
        try:
            self.tok = tk.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a plain Exception for malformed JSON
            raise DataError(f"{path}: not a Hugging Face tokenizer.json: {str(e).splitlines()[0]}") from None
        self.path, self.name = path, os.path.basename(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = next((self.tok.token_to_id(n) for n in EOD_NAMES if self.tok.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def spec(self) -> str:
        return self.path


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` or the path of a ``tokenizer.json``; a clear :class:`DataError` for anything else."""
    if not isinstance(spec, str) or not spec:
        raise DataError(f"tokenizer {spec!r}: use 'byte' (built in) or the path of a Hugging Face tokenizer.json file")
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        inside = os.path.join(spec, "tokenizer.json")
        hint = f"give {inside}" if os.path.isfile(inside) else "give the tokenizer.json file (this one holds none)"
        raise DataError(f"{spec}: is a directory, but a tokenizer is one Hugging Face tokenizer.json file: {hint}")
    if os.path.isfile(spec):
        return HFTokenizer(spec)
    if os.path.lexists(spec):
        raise DataError(f"{spec}: not a regular file (a device, pipe or broken link); give a tokenizer.json file")
    if os.sep in spec or spec.endswith(".json") or (os.altsep and os.altsep in spec):
        raise DataError(f"{spec}: tokenizer file does not exist")
    raise DataError(f"unknown tokenizer {spec!r}: use 'byte' (built in) or the path of a Hugging Face "
                    "tokenizer.json file")


def train_bpe(texts: Iterator[str], vocab_size: int, out_path: str, *, length: Optional[int] = None) -> HFTokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``texts`` (offline) and save it to ``out_path``.

    The vocabulary starts with ``<|endoftext|>`` (id 0) and the 256 byte symbols, so ``vocab_size`` must be
    more than 257. ``length``: number of texts, for the library's progress only.
    """
    tk = require_tokenizers("--train-tokenizer")
    if vocab_size <= 257:
        raise DataError(f"--train-tokenizer {vocab_size}: a byte-level BPE vocabulary needs more than 257 ids "
                        "(the end-of-document token and 256 bytes)")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_NAMES[0]], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    tok.save(out_path)
    return HFTokenizer(out_path)
