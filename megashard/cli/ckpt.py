"""``megashard ckpt inspect|consolidate|export-hf``: checkpoints offline, in one process (:mod:`megashard.checkpoint`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megashard.cli.options import add_actions
from megashard.errors import error_line


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard ckpt inspect|consolidate|export-hf``."""
    cmds = add_actions(
        sub, "ckpt",
        help="inspect a checkpoint, consolidate it into one torch.save file, or export it to Hugging Face "
        "(one process, any layout)",
        description="Offline tools for checkpoints saved by megashard.checkpoint.save. See docs/checkpoint_io.md.",
        epilog=(
            "examples:\n"
            "  megashard ckpt inspect out/checkpoints                 # newest complete checkpoint\n"
            "  megashard ckpt inspect out/checkpoints/step_00000100 --format json --no-verify\n"
            "  megashard ckpt consolidate out/checkpoints full.pt    # torch.load(full.pt, weights_only=True)\n"
            "  megashard ckpt export-hf runs/default/checkpoints hf-model   # transformers: from_pretrained('hf-model')\n"
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
    c.add_argument("--force", action="store_true",
                   help="replace OUT if it exists (only a torch.save file, as consolidate writes, is replaced)")
    c.set_defaults(handler=_cmd_ckpt_consolidate, parser=c)
    e = cmds.add_parser(
        "export-hf", help="write a Hugging Face model directory (safetensors + config.json) of the model",
        description="Write the model of a `megashard run` checkpoint as a Hugging Face model directory OUT: "
        "config.json and safetensors shards that transformers loads as LlamaForCausalLM (model.arch llama) or "
        "GPT2LMHeadModel (model.arch gpt), with the same logits. Reads every byte verified, in one process, "
        "whatever layout the checkpoint was saved with. Needs pip install 'megashard[hf]'. See docs/hf.md.",
        epilog="exit codes: 0 ok, 1 damaged checkpoint (files named on stderr), 2 usage, no checkpoint or no "
        "model config",
    )
    e.add_argument("dir", metavar="CKPT", help="checkpoint directory, or a root (its newest complete checkpoint)")
    e.add_argument("out", metavar="OUT", help="output directory (written next to it, then renamed)")
    e.add_argument("--config", default=None, metavar="YAML",
                   help="the job's config, for checkpoints that record none (default: the one in the checkpoint)")
    e.add_argument("--max-shard-mb", type=int, default=2048, metavar="MB",
                   help="largest safetensors file, in MB (default 2048; several files get an index)")
    e.add_argument("--force", action="store_true",
                   help="replace OUT if it is an earlier export (a directory megashard did not make is never replaced)")
    e.set_defaults(handler=_cmd_ckpt_export_hf, parser=e)


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


def _unless_corrupted(args: argparse.Namespace, fn: Any, *fn_args: Any, **fn_kwargs: Any) -> Any:
    """``fn(...)``'s result, or None after one line on stderr naming the damaged checkpoint (the command exits 1)."""
    from megashard.errors import CheckpointCorruptedError

    try:
        return fn(*fn_args, **fn_kwargs)
    except CheckpointCorruptedError as e:
        print(error_line(args.parser.prog, e), file=sys.stderr)
        return None


def _cmd_ckpt_consolidate(args: argparse.Namespace) -> int:
    from megashard.checkpoint.consolidate import consolidate

    keys = {k.strip() for k in args.keys.split(",") if k.strip()} if args.keys else None
    summary = _unless_corrupted(args, consolidate, args.dir, args.out, verify=not args.no_verify,
                                progress=not args.quiet, keys=keys, overwrite=args.force)
    if summary is None:
        return 1
    print(f"megashard ckpt consolidate: wrote {summary['out']} ({summary['tensors']} tensors, "
          f"{summary['bytes'] / 1e6:.1f} MB) from {summary['path']}", file=sys.stderr)
    return 0


def _cmd_ckpt_export_hf(args: argparse.Namespace) -> int:
    from megashard.cli.options import check_int
    from megashard.train.hf_io import export_hf

    check_int("--max-shard-mb", args.max_shard_mb, 1)
    s = _unless_corrupted(args, export_hf, args.dir, args.out, config_path=args.config,
                          max_shard_bytes=args.max_shard_mb << 20, overwrite=args.force)
    if s is None:
        return 1
    print(f"megashard ckpt export-hf: wrote {s['out']} ({s['class']}: {s['tensors']} tensors, {s['bytes'] / 1e6:.1f} MB "
          f"in {s['shards']} safetensors file(s)) from {s['path']}", file=sys.stderr)
    return 0
