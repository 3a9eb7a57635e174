"""The ``megashard`` command line.

    megashard plan CONFIG [--world-size N] [--rank R] [--ranks-per-node G] [--format table|json]
                          [--groups tp,dp] [--svg FILE] [key=value ...]
    megashard run CONFIG [key=value ...] [--dry-run]      # train the example job through torchrun (docs/train.md)
    megashard ckpt inspect|consolidate ...                # checkpoints offline (docs/checkpoint_io.md)
    megashard data prepare|inspect ...                    # tokenized training data (docs/data.md)

Each subcommand lives in a ``_add_<name>(subparsers)`` function that builds its parser and sets
``handler`` (a function ``args -> exit code``); a command with actions gets its parser from
:func:`_add_actions`. Exit codes: 0 success, 1 the command ran but found a problem (e.g. ``plan --strict``
with locality warnings, an unwritable output file, a damaged checkpoint), 2 bad usage or an invalid config:
one stderr line ``megashard <cmd>[ <action>]: error: ...`` (argparse's usage errors too), no traceback, no
process started.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NoReturn, Sequence

from megashard.errors import ConfigError, MegashardError, error_line

DEFAULT_CONFIG = "configs/default.yaml"

Handler = Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------- plan
def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show the rank layout of a config for any world size (no processes)",
        description=(
            "Resolve the parallel sizes of CONFIG's 'parallel:' section for a world size and show which ranks "
            "form every group (Megatron-LM RankGenerator order), which groups cross node boundaries, and "
            "optionally an SVG picture of the rank grid. Pure arithmetic: 131,072 ranks take well under a second."
        ),
        epilog=(
            "examples:\n"
            f"  megashard plan {DEFAULT_CONFIG}\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 16 parallel.tp=2 parallel.pp=4 parallel.dp_shard=-1 --rank 5\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 131072 parallel.tp=8 parallel.dp_shard=-1 --format json --groups tp,pp\n"
            f"  megashard plan {DEFAULT_CONFIG} --world-size 64 parallel.dp_shard=-1 parallel.ep=4 --svg layout.svg\n"
            "\nexit codes: 0 ok, 1 --strict and locality warnings (or output not writable), 2 invalid config or usage"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG", help=f"job YAML with a 'parallel:' section (e.g. {DEFAULT_CONFIG})")
    p.add_argument(
        "overrides", metavar="key=value", nargs="*",
        help="dotted overrides applied to the YAML before validation, e.g. parallel.tp=4 launch.nnodes=2",
    )
    p.add_argument(
        "--world-size", "-w", type=int, default=None, metavar="N",
        help="number of ranks (default: launch.nnodes × launch.nproc_per_node from CONFIG)",
    )
    p.add_argument("--rank", "-r", type=int, default=0, metavar="R", help="rank whose groups are shown (default 0)")
    p.add_argument(
        "--ranks-per-node", "-g", type=int, default=8, metavar="G",
        help="ranks per node for the locality report and the picture; node = rank // G (default 8)",
    )
    p.add_argument(
        "--format", "-f", choices=("table", "json"), default="table",
        help="table: sizes, the rank's groups, locality; json: the same plus every group of every name",
    )
    p.add_argument(
        "--groups", metavar="NAMES", default=None,
        help="comma-separated group names to show (default: all; for JSON of huge worlds restrict e.g. tp,dp); "
        "also the panels of --svg",
    )
    p.add_argument("--all-groups", action="store_true", help="table format: also list every group of each name")
    p.add_argument(
        "--max-members", type=int, default=16, metavar="K",
        help="table format: abbreviate groups longer than K ranks (0 = never; default 16)",
    )
    p.add_argument("--svg", metavar="FILE", default=None, help="write a picture of the rank grid coloured by group")
    p.add_argument(
        "--svg-max-ranks", type=int, default=512, metavar="M",
        help="largest number of ranks drawn; bigger worlds show their first whole nodes (default 512)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when the locality report has warnings")
    p.set_defaults(handler=_cmd_plan, parser=p, accepts_overrides=True)


def _check_int(option: str, value: int, low: int, high: int | None = None, note: str = "") -> None:
    """ConfigError naming the option unless ``low <= value <= high``."""
    if value < low or (high is not None and value > high):
        if high is None:
            rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        else:
            rule = f"in {low}..{high:,}"
        raise ConfigError(f"{option} {value}: must be {rule}{note}")


def _check_output_path(option: str, path: str) -> None:
    """ConfigError when ``path`` cannot be a new file: its directory is missing or it is a directory."""
    import os

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path}: is a directory; give a file name such as {os.path.join(path, 'layout.svg')}")
    if not os.path.isdir(parent):
        raise ConfigError(f"{option} {path}: the directory {parent} does not exist; create it or write elsewhere")


def _cmd_plan(args: argparse.Namespace) -> int:
    from megashard.layout import GROUP_NAMES, RankLayout
    from megashard.plan import (
        MAX_LISTED_RANKS, MAX_SVG_RANKS, build_plan, check_listing, format_table, load_config, locality,
        parse_group_names, plan_to_json, render_svg,
    )

    # Options first (cheap, and each names itself), then the config.
    _check_int("--max-members", args.max_members, 0, note=" (0 = never abbreviate)")
    _check_int("--ranks-per-node", args.ranks_per_node, 1)
    _check_int("--svg-max-ranks", args.svg_max_ranks, 1, MAX_SVG_RANKS)
    if args.world_size is not None:
        from megashard.config import MAX_WORLD_SIZE

        _check_int("--world-size", args.world_size, 1, MAX_WORLD_SIZE, note=" (megashard's largest world, 2^24)")
    names = parse_group_names(args.groups)
    if args.groups is not None and not names:
        raise ConfigError(f"--groups {args.groups!r} names no group; give names such as tp,dp (valid: {', '.join(GROUP_NAMES)})")
    if args.svg:
        _check_output_path("--svg", args.svg)
    config, world_size = load_config(args.config, args.overrides, args.world_size)
    layout = RankLayout(config, world_size)
    _check_int("--rank", args.rank, 0, world_size - 1, note=f" (the world has {world_size:,} ranks)")
    as_json = args.format == "json"
    shown = names or list(GROUP_NAMES)
    for n in shown:
        layout.size(n)  # an unknown name fails here, before any listing
    if as_json or args.all_groups:
        check_listing(layout, shown, rank_groups=as_json)
    elif args.max_members == 0 and sum(layout.size(n) for n in shown) > MAX_LISTED_RANKS:
        raise ConfigError(f"--max-members 0 would print {sum(layout.size(n) for n in shown):,} rank ids for rank "
                          f"{args.rank}'s groups, more than {MAX_LISTED_RANKS:,}; abbreviate (e.g. --max-members 16) "
                          "or name fewer groups with --groups")
    report = locality(layout, args.ranks_per_node)
    plan = build_plan(layout, args.rank, args.ranks_per_node, names, all_groups=as_json or args.all_groups,
                      report=report)
    svg = None
    if args.svg:
        svg = render_svg(layout, names, args.rank, args.ranks_per_node, args.svg_max_ranks, report)
    if as_json:
        plan = {"config": args.config, "overrides": list(args.overrides), **plan}
        sys.stdout.write(plan_to_json(plan) + "\n")
    else:
        source = args.config + ("".join(f" {o}" for o in args.overrides))
        sys.stdout.write(format_table(plan, args.max_members, source))
    if svg is not None:
        try:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(svg)
        except OSError as e:
            print(f"megashard plan: cannot write {args.svg}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"megashard plan: wrote {args.svg}", file=sys.stderr)
    if args.strict and plan["locality"]["warnings"]:
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- run
# `megashard run CONFIG [key=value ...]` — launch the pretraining job (owner: the train/ developer).
def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train the example GPT job of a config through torchrun (resumes from its newest checkpoint)",
        description=(
            "Validate CONFIG (all sections, for the world size launch.nnodes × launch.nproc_per_node) in this "
            "process, then start the job with PyTorch's elastic launcher (python -m megashard.train.agent: "
            "torch.distributed.run with one-line failure reports; it and the workers die with this launcher): "
            "processes per node, restarts (launch.max_restarts) and multi-node rendezvous from the config, "
            "Slurm variables when present. Rank 0 shows a progress bar; outputs go to train.out_dir "
            "(metrics.jsonl, loss.png, checkpoints/). See docs/train.md."
        ),
        epilog=(
            "examples:\n"
            f"  megashard run {DEFAULT_CONFIG}\n"
            f"  megashard run {DEFAULT_CONFIG} train.steps=50 parallel.tp=1 parallel.dp_shard=4\n"
            "  megashard run configs/hsdp.yaml launch.max_restarts=2\n"
            f"  megashard run {DEFAULT_CONFIG} --dry-run          # validate and print the torchrun command\n"
            "\nexit codes: 0 ok, 1 the job failed, 2 invalid config or usage, or a checkpoint directory another live "
            "job holds (no process started)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG", help=f"job YAML (e.g. {DEFAULT_CONFIG}); see docs/config.md")
    p.add_argument(
        "overrides", metavar="key=value", nargs="*",
        help="dotted overrides, e.g. train.steps=20 parallel.tp=1 launch.nproc_per_node=2",
    )
    p.add_argument("--dry-run", action="store_true", help="validate, print the torchrun command, start nothing")
    p.set_defaults(handler=_cmd_run, parser=p, accepts_overrides=True)


def _cmd_run(args: argparse.Namespace) -> int:
    from megashard.train.launch import run

    return run(args.config, args.overrides, dry_run=args.dry_run)


# ---------------------------------------------------------------------------------------------- ckpt, data
def _add_actions(sub: argparse._SubParsersAction, name: str, help: str, description: str,
                 epilog: str) -> argparse._SubParsersAction:
    """A command ``megashard NAME ACTION ...`` (without an ACTION it prints its help and exits 2); returns the
    subparsers to add its actions to (each with its own ``handler`` and ``parser``)."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1], parser=p)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")


# ---------------------------------------------------------------------------------------------- ckpt
# `megashard ckpt ...` — inspect / convert checkpoints between layouts (owner: the checkpoint/ developer).
def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    cmds = _add_actions(
        sub, "ckpt",
        help="inspect a checkpoint, or consolidate it into one torch.save file (one process, any layout)",
        description="Offline tools for checkpoints saved by megashard.checkpoint.save. See docs/checkpoint_io.md.",
        epilog=(
            "examples:\n"
            "  megashard ckpt inspect out/checkpoints                 # newest complete checkpoint\n"
            "  megashard ckpt inspect out/checkpoints/step_00000100 --format json --no-verify\n"
            "  megashard ckpt consolidate out/checkpoints full.pt    # torch.load(full.pt, weights_only=True)\n"
            "\nexit codes: 0 ok, 1 damaged checkpoint (files named on stderr), 2 usage or no checkpoint"
        ),
    )
    i = cmds.add_parser(
        "inspect", help="layout it was saved with, keys, shapes, dtypes, sizes, writers; verifies every file",
        description="Describe a checkpoint without loading its tensors (DIR: a checkpoint or a root of step_N "
        "checkpoints), after checking every file against the checksums recorded when it was saved.",
        epilog="exit codes: 0 ok, 1 damaged checkpoint (files named on stderr), 2 usage or no checkpoint",
    )
    i.add_argument("dir", metavar="DIR", help="checkpoint directory, or a root (its newest complete checkpoint)")
    i.add_argument("--format", "-f", choices=("table", "json"), default="table")
    i.add_argument("--no-verify", action="store_true", help="compare file sizes only, do not read the data")
    i.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)  # the default; kept for old scripts
    i.set_defaults(handler=_cmd_ckpt_inspect, parser=i)
    c = cmds.add_parser(
        "consolidate", help="write the full (unsharded) tensors into one torch.save file",
        description="Gather every shard into full tensors, in one process, and write them to OUT "
        "({'model': ..., 'optim': ...}; loadable with torch.load(OUT, weights_only=True)).",
    )
    c.add_argument("dir", metavar="DIR", help="checkpoint directory, or a root (its newest complete checkpoint)")
    c.add_argument("out", metavar="OUT", help="output file (written to OUT.tmp, then renamed)")
    c.add_argument("--keys", default=None, metavar="K1,K2", help="only these keys or prefixes (e.g. model)")
    c.add_argument("--no-verify", action="store_true", help="check file sizes only, not checksums")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    c.set_defaults(handler=_cmd_ckpt_consolidate, parser=c)


def _cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from megashard.checkpoint.consolidate import format_info, info_to_dict, inspect_checkpoint
    from megashard.errors import CheckpointCorruptedError

    try:
        info = inspect_checkpoint(args.dir, verify=not args.no_verify, progress=not args.no_verify and sys.stderr.isatty())
    except CheckpointCorruptedError as e:  # marker, .metadata or megashard.json damaged: nothing to describe
        print(f"megashard ckpt inspect: damaged: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        sys.stdout.write(json.dumps(info_to_dict(info)) + "\n")
    else:
        sys.stdout.write(format_info(info))
    for problem in info.problems:
        print(f"megashard ckpt inspect: damaged: {problem}", file=sys.stderr)
    return 1 if info.problems else 0


def _cmd_ckpt_consolidate(args: argparse.Namespace) -> int:
    from megashard.checkpoint.consolidate import consolidate
    from megashard.errors import CheckpointCorruptedError

    keys = {k.strip() for k in args.keys.split(",") if k.strip()} if args.keys else None
    try:
        summary = consolidate(args.dir, args.out, verify=not args.no_verify, progress=not args.quiet, keys=keys)
    except CheckpointCorruptedError as e:
        print(error_line(args.parser.prog, e), file=sys.stderr)
        return 1
    print(f"megashard ckpt consolidate: wrote {summary['out']} ({summary['tensors']} tensors, "
          f"{summary['bytes'] / 1e6:.1f} MB) from {summary['path']}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- data
# `megashard data prepare|inspect` — tokenized, memory-mapped training data (docs/data.md).
def _add_data(sub: argparse._SubParsersAction) -> None:
    cmds = _add_actions(
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
    pr.add_argument("--tokenizer", "-t", default="byte", metavar="T",
                    help="'byte' (built in: UTF-8 bytes + end-of-document, 257 ids) or a Hugging Face tokenizer.json "
                    "(needs pip install 'megashard[data]'); default byte")
    pr.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB",
                    help="train a byte-level BPE tokenizer of VOCAB ids on the inputs first (needs 'megashard[data]')")
    pr.add_argument("--workers", "-j", type=int, default=1, metavar="N", help="tokenizing processes (default 1)")
    pr.add_argument("--text-key", default="text", metavar="KEY", help="JSON-lines field holding the text (default text)")
    pr.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    pr.set_defaults(handler=_cmd_data_prepare, parser=pr)
    ins = cmds.add_parser("inspect", help="documents, tokens, dtype and tokenizer of a dataset",
                          description="Describe an indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx).")
    ins.add_argument("prefix", metavar="PREFIX")
    ins.add_argument("--verify", action="store_true", help="check every index entry (reads the whole index)")
    ins.set_defaults(handler=_cmd_data_inspect, parser=ins)


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from megashard.data.prepare import prepare

    r = prepare(args.inputs, args.out, args.tokenizer, train_tokenizer=args.train_tokenizer, workers=args.workers,
                text_key=args.text_key, progress=not args.quiet)
    print(f"megashard data prepare: wrote {r.prefix}.bin/.idx: {r.documents:,} documents, {r.tokens:,} tokens "
          f"(tokenizer {r.tokenizer}, vocabulary {r.vocab_size}) from {len(r.files)} file(s), "
          f"{r.input_bytes / 1e6:.1f} MB in {r.seconds:.1f} s", file=sys.stderr)
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


#: Every subcommand's parser builder, in --help order. A new subcommand: write `_add_<name>(sub)` above, append it here.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan, _add_run, _add_ckpt, _add_data]


# ---------------------------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``megashard plan: error: ... (see 'megashard plan --help')``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of SUBCOMMANDS."""
    from megashard import __version__

    parser = _Parser(
        prog="megashard",
        description="megashard: parallel layouts (tp, cp, dp, pp, ep, ...) of large-model training on PyTorch.",
        epilog="run 'megashard COMMAND --help' for the options of a command",
    )
    parser.add_argument("--version", action="version", version=f"megashard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subparsers are _Parser too
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def quiet_numpy_warning() -> None:
    """Hide torch's import-time "Failed to initialize NumPy" UserWarning (megashard does not use numpy).

    Only that message, only in megashard's own entry points (the CLI; workers get it through
    PYTHONWARNINGS from ``megashard run``); call before torch is imported.
    """
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script passes it to sys.exit)."""
    quiet_numpy_warning()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # argparse stops filling a nargs="*" positional at the first option, so `plan cfg --rank 1
            # parallel.tp=2` leaves the override over; take key=value items back, reject the rest.
            sub = getattr(args, "parser", parser)
            keep = [e for e in extra if "=" in e and not e.startswith("-")]
            rest = [e for e in extra if e not in keep]
            if rest or not getattr(args, "accepts_overrides", False):
                sub.error(f"unrecognized arguments: {' '.join(rest or extra)}")
            args.overrides = list(args.overrides) + keep
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except MegashardError as e:
        print(error_line(getattr(args, "parser", parser).prog, e), file=sys.stderr)
        return 2
