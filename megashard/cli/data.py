"""``megashard data prepare|inspect``: tokenized, memory-mapped training data (:mod:`megashard.data`, docs/data.md)."""
from __future__ import annotations

import argparse
import sys

from megashard.cli.options import add_actions

#: megashard.data.inputs.ENCODING_ERRORS (not imported: megashard.data imports torch, the parser must not).
ENCODING_ERRORS = ("strict", "replace", "skip-file")


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard data prepare|inspect``."""
    cmds = add_actions(
        sub, "data",
        help="tokenize text / JSON lines into a memory-mapped indexed dataset; inspect one",
        description="Training data for `megashard run` (data.source: indexed). See docs/data.md.",
        epilog=(
            "examples:\n"
            "  mkdir -p data                                      # the directory of --out must exist\n"
            "  megashard data prepare notes.txt web.jsonl --tokenizer byte --out data/corpus\n"
            "  megashard data prepare 'books/**/*.txt' --train-tokenizer 8000 --out data/books --workers 2\n"
            "  megashard data prepare '{stdlib}/*.py' --out data/stdlib     # the Python standard library\n"
            "  megashard data inspect data/corpus --verify\n"
            "\nexit codes: 0 ok, 2 bad input (missing file, unknown tokenizer, corrupt dataset) or usage"
        ),
    )
    pr = cmds.add_parser(
        "prepare", help="text / JSON-lines files -> PREFIX.bin + PREFIX.idx (+ tokenizer, metadata)",
        description="Tokenize INPUT files into Megatron-LM's indexed dataset format. A text file is one document; "
        "a .jsonl/.json file holds one document per line (its --text-key field). INPUT may be a file, a directory "
        "or a glob ({stdlib} = this Python's standard library). Output: PREFIX.bin, PREFIX.idx, PREFIX.meta.json "
        "(tokenizer and vocabulary) and PREFIX.tokenizer.json (Hugging Face tokenizers), written atomically.",
    )
    pr.add_argument("inputs", metavar="INPUT", nargs="+", help="text or JSON-lines files, directories, glob patterns")
    pr.add_argument("--out", "-o", required=True, metavar="PREFIX", help="output prefix (its directory must exist)")
    pr.add_argument("--tokenizer", "-t", default=None, metavar="T",
                    help="'byte' (built in: UTF-8 bytes + end-of-document, 257 ids) or a Hugging Face tokenizer.json "
                    "(needs pip install 'megashard[data]'); default byte")
    pr.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB",
                    help="train a byte-level BPE tokenizer of VOCAB ids on the inputs first (needs 'megashard[data]')")
    pr.add_argument("--workers", "-j", type=int, default=1, metavar="N", help="tokenizing processes (default 1)")
    pr.add_argument("--text-key", default="text", metavar="KEY", help="JSON-lines field holding the text (default text)")
    pr.add_argument("--encoding", default="utf-8", metavar="ENC",
                    help="the inputs' text encoding (default utf-8; e.g. latin-1, cp1252)")
    pr.add_argument("--encoding-errors", default="strict", choices=ENCODING_ERRORS,
                    help="bytes not valid in ENC: strict (an error naming the file and offset; default), replace "
                    "(write U+FFFD, counted in the summary) or skip-file (leave such files out, counted)")
    pr.add_argument("--quiet", "-q", action="store_true",
                    help="no progress (shown on a terminal; in a log, a line every 10 s of a long job)")
    pr.set_defaults(handler=_cmd_data_prepare, parser=pr)
    ins = cmds.add_parser("inspect", help="documents, tokens, dtype and tokenizer of a dataset",
                          description="Describe an indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx).")
    ins.add_argument("prefix", metavar="PREFIX")
    ins.add_argument("--verify", action="store_true", help="check every index entry (reads the whole index)")
    ins.set_defaults(handler=_cmd_data_inspect, parser=ins)


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from megashard.data.prepare import prepare

    if args.tokenizer is not None and args.train_tokenizer is not None:  # one would be silently unused
        from megashard.errors import ConfigError

        raise ConfigError(f"--tokenizer {args.tokenizer} and --train-tokenizer {args.train_tokenizer}: give one (an "
                          "existing tokenizer, or train a new one on the inputs), not both")
    r = prepare(args.inputs, args.out, args.tokenizer or "byte", train_tokenizer=args.train_tokenizer, workers=args.workers,
                text_key=args.text_key, progress=not args.quiet, encoding=args.encoding,
                encoding_errors=args.encoding_errors)
    changed = ""
    if r.replaced_bytes:
        changed += (f"; {r.replaced_bytes:,} byte(s) not valid {r.encoding} in {r.replaced_files} file(s) written as "
                    "U+FFFD (--encoding-errors replace)")
    if r.skipped_files:
        changed += (f"; {len(r.skipped_files)} file(s) left out for bytes not valid {r.encoding} (--encoding-errors "
                    f"skip-file), e.g. {r.skipped_files[0]}")
    print(f"megashard data prepare: wrote {r.prefix}.bin and {r.prefix}.idx: {r.documents:,} documents, {r.tokens:,} tokens "
          f"(tokenizer {r.tokenizer}, vocabulary {r.vocab_size}) from {len(r.files)} file(s), "
          f"{r.input_bytes / 1e6:.1f} MB in {r.seconds:.1f} s{changed}", file=sys.stderr)
    return 0


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    from megashard.data.corpus import dataset_prefix, read_meta
    from megashard.data.indexed import IndexedDataset

    ds = IndexedDataset(dataset_prefix(args.prefix))
    if args.verify:
        ds.verify()
    meta = read_meta(ds.prefix) or {}
    sys.stdout.write(f"{ds.prefix}: {ds.num_documents:,} documents, {ds.num_sequences:,} sequences, "
                     f"{ds.num_tokens:,} tokens of {str(ds.dtype).replace('torch.', '')}"
                     + (f", tokenizer {meta['tokenizer']} (vocabulary {meta['vocab_size']})" if meta else
                        ", no megashard metadata (vocabulary unknown)")
                     + (", verified" if args.verify else "") + "\n")
    return 0
