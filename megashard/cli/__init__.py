"""The last step of the flow: the ``megashard`` command (``plan``, ``run``, ``ckpt``, ``data``, ``doctor``).

:func:`main` is the console script; :mod:`megashard.cli.command` holds the top-level parser, one module per
subcommand builds its own (``plan``, ``run``, ``ckpt``, ``data``, ``doctor``), :mod:`megashard.cli.options` what they
share.
"""
from megashard.cli.command import SUBCOMMANDS, build_parser, main, quiet_numpy_warning
from megashard.cli.options import DEFAULT_CONFIG, Handler

__all__ = ["DEFAULT_CONFIG", "Handler", "SUBCOMMANDS", "build_parser", "main", "quiet_numpy_warning"]
