"""A user's own training loop under megashard.live.LiveLoop (tests/test_elastic_live.py): two linear layers sharded
with FSDP2 over the data-parallel axis, AdamW, the batch a function of the step. Every step rank 0 appends
``{"step", "loss", "world_size"}`` to ``$LIVE_LOOP_OUT/losses.jsonl`` and, per world, its size to ``world.json``; at
the end it writes the full parameters to ``params.pt`` (``MEGASHARD_PAUSE_FILE`` holds the world between steps)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import megashard
from megashard.live import LiveLoop

OUT = os.environ["LIVE_LOOP_OUT"]
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
GLOBAL_BATCH = 8
#: Seconds each step lasts at least (``LIVE_LOOP_STEP_S``): a test that watches the losses and then holds the world
#: between steps has that long to do it; at full speed the world could run to the end first (the job then ends and a
#: node that comes to join finds the rendezvous closed).
STEP_S = float(os.environ.get("LIVE_LOOP_STEP_S", "0"))


def build(state):
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "world.json.tmp"), "w", encoding="utf-8") as f:
            json.dump({"world_size": dist.get_world_size(), "time": time.time()}, f)
        os.replace(os.path.join(OUT, "world.json.tmp"), os.path.join(OUT, "world.json"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=state.fully_shard_mesh)
    fully_shard(model, mesh=state.fully_shard_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, state, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64)
    dp, r = state.size("dp"), state.rank_in("dp")
    n = GLOBAL_BATCH // dp
    loss = torch.nn.functional.mse_loss(model(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    time.sleep(STEP_S)  # the test's window: it holds the world within a step of seeing one (a race at full speed)
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "losses.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step + 1, "loss": float(total) / dp, "world_size": dist.get_world_size(),
                                "time": time.time()}) + "\n")
    return float(total)


loop = LiveLoop(megashard.ParallelConfig(tp=1, dp_shard=-1), build, train_step, memory_copies=1)
loop.run(STEPS)
full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in loop.model.named_parameters()}
if dist.get_rank() == 0:
    torch.save(full, os.path.join(OUT, "params.pt"))
    with open(os.path.join(OUT, "worlds.json"), "w", encoding="utf-8") as f:
        json.dump(loop.worlds, f)
dist.barrier()
megashard.destroy()
dist.destroy_process_group()
