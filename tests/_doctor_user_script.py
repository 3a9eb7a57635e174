"""A user's own training script under torchrun, with the hang doctor on, that goes wrong in the way ``argv[1]`` says.

    torchrun --standalone --nproc-per-node 2 tests/_doctor_user_script.py size RUN_DIR T

Every mode runs three good steps (an all-reduce each) first, so that the fault is collective #4 of the default group
(``world``). Each rank prints ``HANG <rank> <time.time()>`` right before the call that hangs. Modes:

- ``size``: rank 0 all-reduces float32[4], rank 1 float32[8] (gloo aborts rank 0 inside the call: SIGABRT);
- ``op``: rank 0 all-reduces float32[4], rank 1 all-gathers float32[8] (both wait until gloo's timeout);
- ``deadlock``: two groups of the same two ranks, ``a`` and ``b``; rank 0 calls on ``a`` then ``b``, rank 1 on
  ``b`` then ``a``;
- ``dtensor``: a DTensor's ``full_tensor()`` (a functional all-gather) that rank 1 never joins (it sleeps in its own
  code);
- ``nonmember``: 4 ranks; every rank registers ``new_group([0, 1])`` (on ranks 2, 3 it is not theirs); rank 0
  all-reduces on it and rank 1 ends its script normally instead;
- ``sleep``: rank 1 stays in its own code for T + 3 s before all-reduce #4 (then joins);
- ``kill``: rank 1 enters all-reduce #4 and is SIGKILLed inside it 0.2 s later; rank 0 joins after 0.5 s;
- ``recv``: rank 1 receives from rank 0, which stays in its own code for T + 3 s before it sends;
- ``stopped``: rank 1 stops itself (SIGSTOP) right after all-reduce #3 returned: in its own code, not inside #3;
- ``stop_inside``: rank 1 is stopped (SIGSTOP) 0.5 s after it entered all-reduce #4, which rank 0 joins 1.5 s late;
- ``exit_after``: rank 1 ``os._exit(0)``\ s right after all-reduce #3 returned (no final record);
- ``loop``: two groups ``a``, ``b`` of ranks 0, 1, an all-reduce on each per step; rank 1 spins in a Python loop for
  T + 3 s between ``a`` #4 and ``b`` #4;
- ``dtensor_tp``: 4 ranks, a DeviceMesh of the script's own (``dp`` × ``tp``, unknown to the doctor); every step a
  DTensor all-reduce on ``tp`` (Partial → Replicate); rank 1 stays in its own code for T + 3 s before the fourth.

Stopped ranks are SIGKILLed by rank 0 once it has its finding (the launcher ends the job then).

``benchmarks/doctor_hangs.py`` runs every mode and tabulates what the doctor said and when.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import megashard.doctor as doctor


def hang(rank: int) -> None:
    sys.stderr.write(f"HANG {rank} {time.time():.3f}\n")  # one write: the ranks share torchrun's stderr
    sys.stderr.flush()


def give_up(work, t: float) -> None:
    """Wait for an asynchronous call, up to t + 2 s (the doctor reports at t): a job's own timeout, shorter than the
    default group's (which also bounds the start-up: long on a loaded machine)."""
    work.wait(timeout=timedelta(seconds=t + 2))


def _publish_pid(run_dir: str) -> None:
    """Rank 1's pid, for rank 0 to end it (a file beside the run directory: not megashard's)."""
    with open(run_dir.rstrip(os.sep) + ".pid", "w") as f:
        f.write(str(os.getpid()))


def _read_pid(run_dir: str) -> int:
    with open(run_dir.rstrip(os.sep) + ".pid") as f:
        return int(f.read())


def main() -> None:
    mode, run_dir, t = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    d = doctor.enable(timeout=t, out_dir=run_dir)
    groups = {}
    if mode == "deadlock":
        groups = {"a": dist.new_group([0, 1]), "b": dist.new_group([0, 1])}
        for name, pg in groups.items():
            doctor.register(pg, name)
    if mode == "loop":
        groups = {"a": dist.new_group([0, 1]), "b": dist.new_group([0, 1])}
        for name, pg in groups.items():
            doctor.register(pg, name)
    mesh = None
    if mode == "dtensor_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]

        def tp_all_reduce() -> float:  # DTensor's redistribution: a functional all-reduce on the mesh's tp group
            x = DTensor.from_local(torch.ones(4), mesh, [Partial()])
            return x.redistribute(mesh, [Replicate()]).to_local().sum().item()
    if mode == "nonmember":
        mine = dist.new_group([0, 1])
        doctor.register(mine, "pair")  # on ranks 2 and 3: nothing to watch, and no error
        assert ("pair:0" in d.ledger.by_key) == (rank < 2), sorted(d.ledger.by_key)
    for step in range(3):
        doctor.set_step(step)
        dist.all_reduce(torch.ones(4))
        if mode == "loop":
            dist.all_reduce(torch.ones(2), group=groups["a"])
            dist.all_reduce(torch.ones(2), group=groups["b"])
        if mode == "dtensor_tp":
            assert tp_all_reduce() == 8.0
    doctor.set_step(3)
    try:
        if mode == "size":
            hang(rank)
            give_up(dist.all_reduce(torch.ones(4 if rank == 0 else 8), async_op=True), t)
        elif mode == "op":
            hang(rank)
            if rank == 0:
                give_up(dist.all_reduce(torch.ones(4), async_op=True), t)
            else:
                give_up(dist.all_gather([torch.ones(8) for _ in range(world)], torch.ones(8), async_op=True), t)
        elif mode == "deadlock":
            first, second = ("a", "b") if rank == 0 else ("b", "a")
            hang(rank)
            give_up(dist.all_reduce(torch.ones(2), group=groups[first], async_op=True), t)
            give_up(dist.all_reduce(torch.ones(2), group=groups[second], async_op=True), t)
        elif mode == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
            assert dt.full_tensor().tolist() == list(map(float, range(8)))  # one full_tensor every rank joins
            hang(rank)
            if rank == 1:
                time.sleep(t + 3)  # in its own code; then it joins, and the job goes on
            dt.full_tensor().sum().item()
        elif mode == "nonmember":
            if rank == 0:
                hang(rank)
                give_up(dist.all_reduce(torch.ones(2), group=mine, async_op=True), t)
            elif rank == 1:
                sys.exit(0)  # ends: its doctor says so at exit
            else:
                time.sleep(t + 4)
        elif mode == "sleep":
            hang(rank)
            if rank == 1:
                time.sleep(t + 3)
            give_up(dist.all_reduce(torch.ones(4), async_op=True), t + 4)
        elif mode == "kill":
            hang(rank)
            if rank == 1:
                threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
            else:
                time.sleep(0.5)
            give_up(dist.all_reduce(torch.ones(4), async_op=True), t)
        elif mode == "recv":
            hang(rank)
            if rank == 0:
                time.sleep(t + 3)
                dist.send(torch.ones(4), dst=1)
            else:
                dist.recv(torch.ones(4), src=0)
        elif mode in ("stopped", "exit_after"):
            hang(rank)
            if rank == 1:
                _publish_pid(run_dir)
                if mode == "exit_after":
                    os._exit(0)  # after all-reduce #3 returned, without the doctor's final record
                os.kill(os.getpid(), signal.SIGSTOP)  # in its own code; rank 0 kills it once it has its finding
            give_up(dist.all_reduce(torch.ones(4), async_op=True), t)
        elif mode == "stop_inside":
            hang(rank)
            if rank == 1:
                _publish_pid(run_dir)
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
            else:
                time.sleep(1.5)
            give_up(dist.all_reduce(torch.ones(4), async_op=True), t)
        elif mode == "loop":
            dist.all_reduce(torch.ones(2), group=groups["a"])
            hang(rank)
            if rank == 1:
                end = time.monotonic() + t + 3
                while time.monotonic() < end:  # a Python loop between a #4 and b #4 (it lets the GIL go)
                    pass
            give_up(dist.all_reduce(torch.ones(2), group=groups["b"], async_op=True), t + 4)
        elif mode == "dtensor_tp":
            hang(rank)
            if rank == 1:
                time.sleep(t + 3)  # in its own code; then it joins, and the job goes on
            tp_all_reduce()
    except RuntimeError as e:
        print(f"RAISED {rank} {str(e)[:60]}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + t + 120  # a hang guard: how soon the finding comes is not timed
    expect = {"dtensor": rank == 0, "nonmember": rank == 0, "sleep": rank == 0, "kill": rank == 0,
              "recv": rank == 1, "stopped": rank == 0, "exit_after": rank == 0, "stop_inside": rank == 0,
              "loop": rank == 0, "dtensor_tp": rank == 0}.get(mode, True)
    while expect and not d.findings and time.monotonic() < deadline:
        time.sleep(0.1)
    if mode in ("stopped", "stop_inside") and rank == 0:
        time.sleep(1.0)  # the peers' reads
        os.kill(_read_pid(run_dir), signal.SIGKILL)  # the stopped rank: the launcher then ends the job
    time.sleep(2.0)  # stay published while the peers read
    doctor.disable()
    sys.stderr.flush()
    os._exit(0)  # a gloo call of the fault may still be pending until the default group's timeout: no teardown


if __name__ == "__main__":
    main()
