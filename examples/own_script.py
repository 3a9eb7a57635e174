"""megashard in your own training script: tensor parallel + FSDP2 on megashard's meshes.

    torchrun --standalone --nproc-per-node 4 examples/own_script.py                  # 4 CPU processes (gloo)
    torchrun --standalone --nproc-per-node 4 examples/own_script.py --device cuda    # 4 GPUs (NCCL)

The 4 ranks form tp=2 × dp_shard=2: each MLP's first linear is split column-wise and its second row-wise
over ``tp`` (PyTorch's ``parallelize_module``), then FSDP2 shards every parameter over ``dp_shard``.
Each data-parallel rank trains on its half of every global batch. Rank 0 also runs the same steps on one
process without any parallelism and prints both losses: they agree to float rounding, for any layout
(try ``--tp 1`` or ``--tp 4``).
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megashard
from megashard.state import current_device

HIDDEN, BATCH, STEPS = 32, 8, 5


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def make_model() -> MLP:
    torch.manual_seed(0)  # the same initial weights on every rank (and in the reference)
    return MLP()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the global batch of a step: the same whatever the layout
    x = torch.randn(BATCH, HIDDEN, generator=g)
    return x, x.flip(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the rest is dp_shard)")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when torchrun's ranks have GPUs)")
    args = ap.parse_args()
    # torch 2.13 flags every FSDP2 module whose output is a view; a row-parallel output is one, and this model
    # never writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    # One call: torch.distributed from torchrun's environment, then every group and mesh of the layout.
    state = megashard.initialize(megashard.ParallelConfig(tp=args.tp, device=args.device, timeout=60))
    device = current_device(args.device)   # this rank's GPU (torchrun's LOCAL_RANK) or the CPU
    model = make_model().to(device)
    parallelize_module(model, state.fsdp_mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=state.fully_shard_mesh)   # dp_shard (HSDP when dp_outer > 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    dp, r = state.size("dp"), state.rank_in("dp")       # this rank's share of every global batch
    share = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x[share].to(device)), y[share].to(device))
        loss.backward()   # FSDP2 reduces gradients over dp_shard; TP's collectives run over tp
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=state.group("dp"))   # the global batch's loss, for printing
        losses.append(mean.item() / dp)

    if dist.get_rank() == 0:
        ref = make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step, got in enumerate(losses):
            x, y = batch(step)
            want = torch.nn.functional.mse_loss(ref(x), y)
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"step {step}: loss {got:.6f} on {dist.get_world_size()} ranks "
                  f"(tp={state.size('tp')}, dp_shard={state.size('dp_shard')}), {want.item():.6f} on one process")
        if abs(losses[-1] - want.item()) > 1e-4 * max(1.0, abs(want.item())):
            raise SystemExit("the parallel run and the single process disagree")
    megashard.destroy()   # every group, mesh and per-rank state megashard made


if __name__ == "__main__":
    main()
