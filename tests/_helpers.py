"""Helpers shared by the test modules: full (unsharded) state, bitwise equality, damaging a file.

    from tests._helpers import assert_bitwise_equal, full_state, full_tensors, flip_bit

``full_tensors`` gathers DTensors, so in a spawned gloo rank it is a collective over their meshes:
every rank must call it on the same state.
"""
from __future__ import annotations

import os
from typing import Any

import torch


def full_tensors(v: Any) -> Any:
    """``v`` with every DTensor replaced by its full tensor (gathered, uneven shards included) and every
    tensor by a detached copy; dicts, lists and tuples are walked, other values kept."""
    from torch.distributed.tensor import DTensor

    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor

    if isinstance(v, DTensor):
        return gather_uneven_dtensor_to_full_tensor(v, return_dtensor=False)
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: full_tensors(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(full_tensors(x) for x in v)
    return v


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full (unsharded) model and optimizer state, keyed as DCP's ``get_state_dict`` keys them (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": full_tensors(msd), "optim": full_tensors(osd)}


def params(model: torch.nn.Module) -> dict:
    """``{name: detached copy}`` of the module's state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` hold the same values bit for bit (NaN-safe, -0.0 != 0.0), walking dicts, lists and tuples.

    Tensors must have the same dtype and shape; DTensors the same placements and bitwise-equal local
    shards; anything else must compare equal. The message names the path of the first difference.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        assert isinstance(b, DTensor) and a.placements == b.placements, (where, a, b)
        assert_bitwise_equal(a.to_local(), b.to_local(), where)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (where, a, b)
        bits_a, bits_b = (t.detach().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(bits_a, bits_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a, key=str), sorted(b, key=str))
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, len(a), b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def flip_bit(path: str, offset: int, bit: int) -> None:
    """Damage a file in place: flip bit ``bit`` (0 = least significant) of the byte at ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def copy_checkpoint_step(base: str, tag: str, root: str, step: int = 5) -> str:
    """Rank 0 copies run ``base/tag``'s checkpoint of ``step`` into a new checkpoint root ``base/root``; every rank
    waits for it. Returns the new root (a place to load that one checkpoint from another layout)."""
    import os
    import shutil

    import torch.distributed as dist

    name = f"step_{step:08d}"
    dst = os.path.join(base, root)
    if dist.get_rank() == 0:
        os.makedirs(dst)
        shutil.copytree(os.path.join(base, tag, "checkpoints", name), os.path.join(dst, name))
    dist.barrier()
    return dst


def processes_with(marker: str) -> list[tuple[int, str]]:
    """Live processes (not zombies, not this one) whose command line contains ``marker``: ``(pid, command[:160])``."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker in cmd and not zombie and int(pid) != os.getpid():
            found.append((int(pid), cmd[:160]))
    return found


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a launcher a test will Ctrl-C: SIGINT at its default, as for a terminal's foreground job.
    A pytest started in the background by a shell without job control (``cmd &`` in a script, CI runners) has SIGINT
    ignored, every child inherits that, and Python then installs no KeyboardInterrupt handler: the launcher would
    never see the test's Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tree_snapshot(d: str) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``d`` (directories and files, links not followed) with its mode, size and mtime (ns): equal
    before and after a command when it wrote, touched, added or removed nothing there."""
    out = {}
    for base, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(base, n)
            st = os.lstat(p)
            out[os.path.relpath(p, d)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out
