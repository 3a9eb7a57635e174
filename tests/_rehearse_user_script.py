"""A user's training script with an injectable bug, for ``megashard check`` (tests/test_rehearse_check.py).

    python tests/_rehearse_user_script.py MODE [RUN_DIR T]   # under torchrun (gloo, 8 ranks), or
    megashard check tests/_rehearse_user_script.py MODE --world-size 8

With RUN_DIR and T (benchmarks/doctor_hangs.py: the bug left in, the check skipped) the hang doctor is on with
timeout T, writing to RUN_DIR, and each rank prints ``HANG <rank> <time>`` right before the call of step 0 that the
bug leaves waiting.

A layout of tp=2 × pp=2 × dp=2 on 8 ranks (megashard.initialize); one step: a "forward" over the pipeline (activations
sent stage to stage per microbatch), tp all-reduces, a gradient all-reduce over dp, a loss all-reduce over the world.
MODE injects one bug (``ok`` none): ``skip`` (rank 3 skips its dp all-reduce), ``swap`` (rank 1 enters the world
all-reduce before its tp all-reduce), ``microbatch`` (pipeline stage 1 of the first pipeline receives one microbatch
more than stage 0 sends), ``wrong_grid`` (the gradient all-reduced on the dp group of
another layout: tp=2 without pp, whose dp groups span the stages), ``pg_collection`` (the same with the dp group of
a Megatron ``HyperCommGrid`` of that shape), ``shape``
(rank 2's gradient has one element more), ``send`` (rank 0 sends its stage's output once more than anyone receives).
"""
import sys
import time

import torch
import torch.distributed as dist

import megashard
import megashard.doctor
from megashard.config import ParallelConfig

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
RUN_DIR = sys.argv[2] if len(sys.argv) > 2 else None
MICROBATCHES = 2


def hang_mark(where: str, step: int) -> None:
    """``HANG <rank> <time>`` before the call the bug of MODE leaves waiting (step 0, with the doctor on only)."""
    if RUN_DIR is not None and step == 0 and where == {"skip": "dp", "shape": "dp", "swap": "tp", "wrong_grid": "dp",
                                                       "microbatch": "recv"}.get(MODE):
        sys.stderr.write(f"HANG {dist.get_rank()} {time.time():.3f}\n")  # one write: the ranks share stderr
        sys.stderr.flush()


def pipeline_forward(state, hidden, step=0):
    """Each microbatch's activations from stage 0 to stage 1 of this rank's pipeline."""
    pp, stage = state.size("pp"), state.rank_in("pp")
    ranks = state.ranks("pp")
    extra = 1 if MODE == "microbatch" and stage == 1 and ranks[0] == 0 else 0
    out = []
    for mb in range(MICROBATCHES + extra):
        x = torch.ones(4, hidden)
        if stage > 0:
            if mb == MICROBATCHES:
                hang_mark("recv", step)
            dist.recv(x, src=ranks[stage - 1], group=state.group("pp"))
        if stage < pp - 1:
            dist.send(x, dst=ranks[stage + 1], group=state.group("pp"))
        out.append(x)
    if MODE == "send" and dist.get_rank() == 0:
        dist.send(out[-1], dst=ranks[1], group=state.group("pp"))
    return out


def main():
    state = megashard.initialize(ParallelConfig(tp=2, pp=2, backend="gloo", device="cpu", timeout=30))
    other = None
    if MODE == "wrong_grid":  # a second grid over the same ranks (a pg_collection of another module's layout)
        from megashard.state import ParallelState

        other = ParallelState(ParallelConfig(tp=2, backend="gloo", device="cpu", timeout=30))  # dp: 4 ranks
    grid_dp = None
    if MODE == "pg_collection":  # Megatron's way: a pg_collection's dp group from a HyperCommGrid of another shape
        from megashard.state import HyperCommGrid

        grid_dp = HyperCommGrid([2, 4], ["tp", "dp"]).create_pg("dp")
    if RUN_DIR is not None:
        megashard.doctor.enable(state, timeout=float(sys.argv[3]), out_dir=RUN_DIR)
    rank = dist.get_rank()
    for step in range(3):
        megashard.doctor.set_step(step)
        acts = pipeline_forward(state, 8, step)
        h = torch.stack(acts).sum(0)
        loss = h.sum().reshape(1)
        if MODE == "swap" and rank == 1:  # the loss's all-reduce over the world first, then tp's
            dist.all_reduce(loss, group=dist.group.WORLD)
        hang_mark("tp", step)
        dist.all_reduce(h, group=state.group("tp"))
        grad = torch.ones(16 + (1 if MODE == "shape" and rank == 2 else 0))
        if not (MODE == "skip" and rank == 3):
            dp = grid_dp if grid_dp is not None else (other if other is not None else state).group("dp")
            hang_mark("dp", step)
            dist.all_reduce(grad, group=dp)
        if not (MODE == "swap" and rank == 1):
            dist.all_reduce(loss, group=dist.group.WORLD)
    megashard.doctor.disable()
    megashard.destroy()


if __name__ == "__main__":
    main()
