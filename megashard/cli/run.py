"""``megashard run CONFIG``: validate the example job in this process, then train it through torchrun
(:mod:`megashard.launch.launcher`)."""
from __future__ import annotations

import argparse

from megashard.cli.options import DEFAULT_CONFIG, add_command, add_config_arguments


def add(sub: argparse._SubParsersAction) -> None:
    """``megashard run``."""
    p = add_command(
        sub, "run",
        help="train the example GPT job of a config through torchrun (resumes from its newest checkpoint)",
        description=(
            "Validate CONFIG (all sections, for the world size launch.nnodes × launch.nproc_per_node, or every world "
            "size of an elastic range launch.nnodes=MIN:MAX; the launch settings as torchrun reads them) in this "
            "process, then start the job with PyTorch's elastic launcher (python -m megashard.launch.agent: "
            "torch.distributed.run with one-line failure reports; it and the workers die with this launcher): "
            "processes per node, restarts (launch.max_restarts) and multi-node rendezvous from the config, "
            "Slurm variables when present. Rank 0 shows a progress bar (loss, lr, grad norm, step time), a line per "
            "checkpoint and a summary (tokens/s per device, MFU, parameters, peak memory per rank); outputs go to "
            "train.out_dir (config.yaml, metrics.jsonl, summary.json, loss.png, checkpoints/; TensorBoard and W&B "
            "with train.tensorboard / train.wandb). A resume keeps the checkpoint's learning-rate schedule "
            "(optim.override_schedule=true takes the config's). See docs/train.md."
        ),
        epilog=(
            "examples:\n"
            f"  megashard run {DEFAULT_CONFIG}\n"
            f"  megashard run {DEFAULT_CONFIG} train.steps=50 parallel.tp=1 parallel.dp_shard=4\n"
            "  megashard run configs/hsdp.yaml launch.max_restarts=2\n"
            f"  megashard run {DEFAULT_CONFIG} launch.nnodes=1:2 launch.nproc_per_node=2 launch.rdzv_endpoint=node0:29500"
            "   # elastic, on every node (docs/elastic.md)\n"
            f"  megashard run {DEFAULT_CONFIG} --dry-run          # validate and print the torchrun command\n"
            f"  megashard run {DEFAULT_CONFIG} --dry-run --collectives   # and check every rank's collectives\n"
            "\nexit codes: 0 ok (or nothing to do: the checkpoint is at train.steps), 1 the job failed (rerun to resume), "
            "2 invalid config or usage, calls of the ranks that would hang (the check before launch; with --dry-run "
            "--collectives: 1), a checkpoint of another model, a fresh start (train.resume=false) into an "
            "earlier run's checkpoints, or a checkpoint directory another live job holds (no process started), or an "
            "error of the job that a restart cannot fix; 130 stopped by Ctrl-C"
        ),
    )
    add_config_arguments(p, f"job YAML (e.g. {DEFAULT_CONFIG}); see docs/config.md",
                         "dotted overrides, e.g. train.steps=20 parallel.tp=1 launch.nproc_per_node=2")
    p.add_argument("--dry-run", action="store_true", help="validate, print the torchrun command, start nothing")
    p.add_argument("--collectives", action="store_true",
                   help="rehearse one training step of every rank without peers and check their collectives against "
                        "each other before launch (docs/rehearse.md); by default this runs when cheap (at most 16 "
                        "ranks of a model up to 50M parameters), not with --dry-run unless asked")
    p.add_argument("--no-check", action="store_true", help="launch without the check of the collectives")
    p.set_defaults(handler=_cmd_run, parser=p, accepts_overrides=True)


def _cmd_run(args: argparse.Namespace) -> int:
    import sys

    from megashard.cli.options import check_config_first

    check_config_first("run", args.config, list(args.overrides))
    try:
        from megashard.launch.launcher import run

        if args.collectives and args.no_check:
            from megashard.errors import ConfigError

            raise ConfigError("--collectives and --no-check contradict each other: give one")
        return run(args.config, args.overrides, dry_run=args.dry_run,
                   collectives=True if args.collectives else (False if args.no_check else None))
    except KeyboardInterrupt:  # before the job started (a Ctrl-C after it is reported by run())
        print("megashard run: interrupted before the job started; nothing was started", file=sys.stderr)
        return 130
