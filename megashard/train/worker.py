"""Entry point of every process torchrun starts: ``python -m megashard.train.worker RESOLVED_CONFIG.yaml``.

``megashard run`` writes the job's fully resolved config (overrides applied) to ``<out_dir>/config.yaml``
and launches this module, so every attempt after a restart reads exactly the same job.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megashard.errors import MegashardError
    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 1:
        print("usage: python -m megashard.train.worker CONFIG.yaml [key=value ...]", file=sys.stderr)
        return 2
    name = None
    if "--name" in args:
        i = args.index("--name")
        name = args[i + 1]
        del args[i: i + 2]
    import torch.distributed as dist

    try:
        job = JobConfig.from_yaml(args[0], args[1:])
        if name:
            job.name = name
        train(job)
    except MegashardError as e:
        print(f"megashard run: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
