"""What the subcommands of ``megashard`` share: the default config, option checks, the shape of a command.

A subcommand module (``plan``, ``run``, ``ckpt``, ``data``) has an ``add(subparsers)`` function that builds its
parser and sets ``handler`` (a function ``args -> exit code``); a command with actions gets its parser from
:func:`add_actions`, a command that reads a job YAML its positional arguments from :func:`add_config_arguments`.
"""
from __future__ import annotations

import argparse
from typing import Callable

from megashard.errors import ConfigError

DEFAULT_CONFIG = "configs/default.yaml"

Handler = Callable[[argparse.Namespace], int]


def add_config_arguments(p: argparse.ArgumentParser, config_help: str, overrides_help: str) -> None:
    """The positional ``CONFIG`` (a job YAML) and ``key=value`` overrides of a command that reads a job."""
    p.add_argument("config", metavar="CONFIG", help=config_help)
    p.add_argument("overrides", metavar="key=value", nargs="*", help=overrides_help)


def add_actions(sub: argparse._SubParsersAction, name: str, help: str, description: str,
                 epilog: str) -> argparse._SubParsersAction:
    """A command ``megashard NAME ACTION ...`` (without an ACTION it prints its help and exits 2); returns the
    subparsers to add its actions to (each with its own ``handler`` and ``parser``)."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1], parser=p)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")


def check_int(option: str, value: int, low: int, high: int | None = None, note: str = "") -> None:
    """ConfigError naming the option unless ``low <= value <= high``."""
    if value < low or (high is not None and value > high):
        if high is None:
            rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        else:
            rule = f"in {low}..{high:,}"
        raise ConfigError(f"{option} {value}: must be {rule}{note}")


def check_output_path(option: str, path: str) -> None:
    """ConfigError when ``path`` cannot be a new file (:func:`megashard.outputs.check_output_file`): it is a
    directory, its directory is missing, lies under a file or is not writable."""
    from megashard.outputs import check_output_file

    check_output_file(option, path, example="layout.svg")
