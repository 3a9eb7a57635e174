"""What the subcommands of ``megashard`` share: the default config, option checks, the shape of a command.

A subcommand module (``plan``, ``run``, ``ckpt``, ``data``) has an ``add(subparsers)`` function that builds its
parser and sets ``handler`` (a function ``args -> exit code``); a command with actions gets its parser from
:func:`add_actions`, a command that reads a job YAML its positional arguments from :func:`add_config_arguments`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from megashard.errors import ConfigError

DEFAULT_CONFIG = "configs/default.yaml"

Handler = Callable[[argparse.Namespace], int]

#: ``megashard plan`` flags for the ParallelConfig sizes: (field, type, help).
SIZE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("tp", int, "tensor-parallel size"),
    ("cp", int, "context-parallel size"),
    ("pp", int, "pipeline-parallel size"),
    ("vpp", int, "virtual pipeline stages per rank (needs --pp > 1)"),
    ("dp", int, "data-parallel size (default: derived)"),
    ("dp_outer", int, "HSDP replica count"),
    ("dp_shard", int, "FSDP shard count inside a replica (default: derived)"),
    ("ep", int, "expert-parallel size"),
    ("expt_tp", int, "expert tensor-parallel size"),
    ("expt_dp", int, "expert data-parallel size (default: derived)"),
    ("order", str, "Megatron rank order, e.g. tp-cp-ep-dp-pp (leftmost fastest)"),
)


def size_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The ParallelConfig fields given as flags (``--tp 8`` -> ``{"tp": 8}``)."""
    return {f: getattr(args, f"size_{f}") for f, _, _ in SIZE_FLAGS if getattr(args, f"size_{f}", None) is not None}


def flags_text(flags: dict[str, Any]) -> str:
    """``--tp 8 --pp 4`` for the report's header."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())


def add_config_arguments(p: argparse.ArgumentParser, config_help: str, overrides_help: str) -> None:
    """The positional ``CONFIG`` (a job YAML) and ``key=value`` overrides of a command that reads a job."""
    p.add_argument("config", metavar="CONFIG", help=config_help)
    p.add_argument("overrides", metavar="key=value", nargs="*", help=overrides_help)


def check_config_first(command: str, config: str, overrides: list[str]) -> None:
    """ConfigError when the CONFIG argument is an override (``megashard run train.steps=2 cfg.yaml``): the config file
    comes first; the message shows the command in the right order."""
    import os

    if "=" not in config or os.path.exists(config):
        return
    files = [o for o in overrides if "=" not in o]
    if files:
        rest = [config] + [o for o in overrides if o != files[0]]
        raise ConfigError(f"the config file comes first, then the overrides: megashard {command} {files[0]} "
                          f"{' '.join(rest)} ({config!r} is an override, not a file)")
    raise ConfigError(f"{config!r} is an override, but a config file must come first: megashard {command} "
                      f"CONFIG.yaml {config} (e.g. configs/default.yaml)")


def add_command(sub: argparse._SubParsersAction, name: str, help: str, description: str,
                epilog: str) -> argparse.ArgumentParser:
    """The parser of a command ``megashard NAME``: one-line ``help``, ``description``, and an ``epilog`` of examples
    and exit codes printed as written."""
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_actions(sub: argparse._SubParsersAction, name: str, help: str, description: str,
                epilog: str) -> argparse._SubParsersAction:
    """A command ``megashard NAME ACTION ...`` (without an ACTION it prints its help and exits 2); returns the
    subparsers to add its actions to (each with its own ``handler`` and ``parser``)."""
    p = add_command(sub, name, help, description, epilog)
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
    directory, its directory is missing, lies under a file or is not writable, or it is an existing file that is not
    a picture megashard drew (those are replaced: a re-run updates its own picture)."""
    from megashard.outputs import check_output_file

    check_output_file(option, path, example="layout.svg", mine=_plan_svg)


def _plan_svg(path: str) -> str | None:
    """None when ``path`` is an SVG ``megashard plan`` drew (its title says so), else why it may not be replaced."""
    try:
        with open(path, "rb") as f:
            head = f.read(2048).decode("utf-8", "replace")
    except OSError:
        head = ""
    if head.startswith("<svg") and "<title>megashard plan" in head:
        return None
    return "exists and is not a picture megashard plan drew"


def write_svg(path: str, svg: str, note: str = "") -> bool:
    """Write the picture ``svg`` to ``path`` and say so on stderr (``note`` after the path); on an OSError one line
    naming the path and the reason, and False (the command exits 1)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg)
    except OSError as e:
        print(f"megashard plan: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return False
    print(f"megashard plan: wrote {path}{note}", file=sys.stderr)
    return True
