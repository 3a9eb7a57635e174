"""The ``megashard`` command line: the top-level parser, and one subcommand module per command.

    megashard plan CONFIG [--world-size N] [--rank R] [--ranks-per-node G] [--format table|json]
                          [--groups tp,dp] [--svg FILE] [key=value ...]
    megashard run CONFIG [key=value ...] [--dry-run]      # train the example job through torchrun (docs/train.md)
    megashard ckpt inspect|consolidate ...                # checkpoints offline (docs/checkpoint_io.md)
    megashard data prepare|inspect ...                    # tokenized training data (docs/data.md)
    megashard doctor RUN_DIR [--format table|json]        # which ranks a hung collective waited for (docs/doctor.md)
    megashard check SCRIPT [ARGS...] --world-size N       # every rank's collectives checked before launch (docs/rehearse.md)

Each subcommand lives in a module (:mod:`megashard.cli.plan`, ``run``, ``ckpt``, ``data``, ``doctor``) whose
``add(subparsers)`` builds its parser and sets ``handler`` (a function ``args -> exit code``); shared pieces are in
:mod:`megashard.cli.options`. Exit codes: 0 success, 1 the command ran but found a problem (e.g. ``plan --strict``
with locality warnings, an unwritable output file, a damaged checkpoint), 2 bad usage or an invalid config:
one stderr line ``megashard <cmd>[ <action>]: error: ...`` (argparse's usage errors too), no traceback, no
process started.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Sequence

from megashard.cli import check, ckpt, data, doctor, plan, run
from megashard.cli.options import Handler
from megashard.errors import MegashardError, error_line


#: Every subcommand's parser builder, in --help order. A new subcommand: a module with `add(sub)`, appended here.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [plan.add, run.add, check.add, ckpt.add, data.add,
                                                                  doctor.add]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``megashard plan: error: ... (see 'megashard plan --help')``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of SUBCOMMANDS."""
    from megashard._version import __version__

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
