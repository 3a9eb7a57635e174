"""DCP save/load across layouts: tp2·dp2 → tp2·dp2, dp4, tp4, HSDP, one process; who writes which shard.

One 4-rank gloo spawn. The model has odd shapes (uneven FSDP shards, an empty shard at dp4) and TP
dims divisible by 4. Reference full tensors are gathered at save time; every load must reproduce them
bit for bit, model and AdamW state (after 2 steps).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal, flip_bit, full_state, full_tensors

ROOT_ENV = "MEGASHARD_TEST_DCP_ROOT"
STEP = 2
CONSUMED = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(7)  # (7,): 4/3 over dp2, 2/2/2/1 over dp4
        self.up = nn.Linear(7, 12)  # colwise TP: 12 rows / tp
        self.down = nn.Linear(12, 5)  # rowwise TP: 12 cols / tp; 5 rows over dp2 = 3/2; bias replicated on tp
        self.head = nn.Linear(5, 3, bias=False)  # 3 rows over dp4: one rank holds an empty shard

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(self.norm(x))))))


def _root() -> str:
    return os.environ[ROOT_ENV]


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _build(seed: int, **sizes):
    """initialize megashard, build Net(seed), TP (if tp > 1) + FSDP2/HSDP via the megashard meshes, AdamW."""
    import megashard
    from megashard.config import ParallelConfig
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    megashard.destroy()  # a failed earlier check may have left its state: fail alone, not in cascade
    st = megashard.initialize(ParallelConfig(**sizes))
    model = _net(seed)
    if st.size("tp") > 1:
        parallelize_module(model, st.fsdp_mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=st.fully_shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return st, model, opt


def _train(model, opt, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(4, 7, generator=g)
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


RAGGED = torch.arange(39, dtype=torch.float32).view(13, 3)


def _ragged(st, lengths, empty: bool = False):
    """A (13, 3) DTensor over all ranks whose Shard(0) pieces have arbitrary lengths (not torch.chunk's)."""
    from torch.distributed.tensor import DTensor, Shard

    r = st.global_rank
    start = sum(lengths[:r])
    local = torch.zeros(lengths[r], 3) if empty else RAGGED[start:start + lengths[r]].clone()
    return DTensor.from_local(local, st.mesh("world"), [Shard(0)], run_check=False, shape=RAGGED.shape, stride=(3, 1))


def _reference() -> dict:
    return torch.load(os.path.join(_root(), "ref.pt"), weights_only=True)


def _ckpt(name: str) -> str:
    return os.path.join(_root(), name, f"step_{STEP:08d}")


def _writer_check(ckpt: str, sd_flat_local: list) -> dict:
    """Every chunk's writer is the holder megashard's distribution picks, and no byte is written twice."""
    import torch.distributed as dist

    from megashard.checkpoint.distribution import distribute_shards_to_ranks
    from megashard.checkpoint.storage import load_dcp_metadata

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sd_flat_local)
    holders: dict = {}
    sizes: dict = {}
    for r, items in enumerate(everyone):
        for fqn, off, nbytes in items:
            holders.setdefault((fqn, off), []).append(r)
            sizes[(fqn, off)] = nbytes
    expected = distribute_shards_to_ranks(holders, sizes, dist.get_world_size())
    md = load_dcp_metadata(os.path.join(ckpt, ".metadata"))
    written = {}
    for idx, info in md.storage_data.items():
        off = tuple(int(o) for o in idx.offset) if idx.offset is not None else ()
        written[(idx.fqn, off)] = int(info.relative_path.split("_")[2])  # "__<rank>_<n>.distcp"
    assert written == expected, sorted((k, written.get(k), expected.get(k)) for k in expected if written.get(k) != expected.get(k))[:5]
    data_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    # Each chunk once: the files hold the chunk bytes plus per-tensor serialization overhead only.
    chunk_bytes = sum(info.length for info in md.storage_data.values())
    assert data_bytes == chunk_bytes, (data_bytes, chunk_bytes)
    return {"holders": holders, "written": written}


def _local_items(model, opt, extra=None) -> list:
    """(fqn, global offset, bytes) of every chunk this rank holds in DCP's flattened state dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from megashard._compat import dcp_flatten_state_dict
    from megashard.tensors.uneven import compute_chunk_layouts

    msd, osd = get_state_dict(model, opt)
    flat, _ = dcp_flatten_state_dict({"model": msd, "optim": osd, **({"extra": extra} if extra else {})})
    dts = [(k, v) for k, v in flat.items() if isinstance(v, DTensor)]
    layouts = compute_chunk_layouts(dts)
    out = []
    for k, v in flat.items():
        if isinstance(v, DTensor):
            lay = layouts[k]
            if lay.numel:
                out.append((k, tuple(lay.offsets), lay.numel * v.dtype.itemsize))
        elif isinstance(v, torch.Tensor):
            out.append((k, (0,) * v.dim(), v.numel() * v.dtype.itemsize))
        else:
            out.append((k, (), 1))
    return out


def _destroy() -> None:
    import megashard

    megashard.destroy()


# ------------------------------------------------------------------------------------------- checks
def check_save_tp2_dp2(rank, world_size):
    import torch.distributed as dist

    from megashard import checkpoint
    from megashard.state.rng import get_cuda_rng_tracker, model_parallel_manual_seed

    st, model, opt = _build(0, tp=2)
    _train(model, opt)
    model_parallel_manual_seed(99)
    with get_cuda_rng_tracker().fork():
        torch.rand(3)  # advance the model-parallel stream so a restore is distinguishable from a reseed
    dp_rank = st.rank_in("dp")
    ragged = _ragged(st, [5, 0, 2, 6])
    path = checkpoint.save(os.path.join(_root(), "a"), STEP, model, opt, consumed_samples=CONSUMED,
                           data_state={"dp_rank": dp_rank, "pos": torch.tensor([dp_rank, 8])}, checksum="crc32",
                           state_dict={"ragged": ragged})
    assert path == _ckpt("a")
    ref = full_state(model, opt)
    torch.save(get_cuda_rng_tracker().get_states(), os.path.join(_root(), f"rng_{rank}.pt"))
    if rank == 0:
        torch.save(ref, os.path.join(_root(), "ref.pt"))
    info = _writer_check(path, _local_items(model, opt, {"ragged": ragged}))
    replicated = [k for k, h in info["holders"].items() if len(h) > 1]
    assert any(k[0] == "model.down.bias" for k in replicated)  # TP-replicated bias: two holders
    # The balance puts some replicated chunks on a holder other than the lowest rank (DCP's naive choice).
    assert any(info["written"][k] != min(info["holders"][k]) for k in replicated)
    dist.barrier()
    _destroy()


def check_load_same_layout_restores_rng_and_data(rank, world_size):
    from megashard import checkpoint
    from megashard.state.rng import get_cuda_rng_tracker

    st, model, opt = _build(1, tp=2)
    report = checkpoint.load(os.path.join(_root(), "a"), model, opt)
    assert_bitwise_equal(full_state(model, opt), _reference())
    assert report.same_layout and report.rng == "restored" and report.data == "restored"
    assert report.step == STEP and report.consumed_samples == CONSUMED
    dp_rank = st.rank_in("dp")
    assert report.data_state["dp_rank"] == dp_rank and torch.equal(report.data_state["pos"], torch.tensor([dp_rank, 8]))
    saved = torch.load(os.path.join(_root(), f"rng_{rank}.pt"), weights_only=True)
    assert_bitwise_equal(get_cuda_rng_tracker().get_states(), saved)
    _destroy()


def _check_resharded_load(rank, seed: int, ckpt: str = "a", **sizes):
    from megashard import checkpoint
    from megashard.checkpoint.rank_state import reseed_value
    from megashard.state.rng import get_cuda_rng_tracker, model_parallel_manual_seed
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor

    st, model, opt = _build(seed, **sizes)
    extra = {"ragged": _ragged(st, [3, 3, 3, 4], empty=True)} if ckpt == "a" else None
    report = checkpoint.load(os.path.join(_root(), ckpt), model, opt, state_dict=extra)
    assert_bitwise_equal(full_state(model, opt), _reference())
    if extra is not None:  # arbitrary uneven pieces saved, read back into other arbitrary pieces
        assert torch.equal(gather_uneven_dtensor_to_full_tensor(extra["ragged"], return_dtensor=False), RAGGED)
    assert not report.same_layout
    # dp changed (2 -> 4 / 1) or the layout did: RNG re-seeded from (seed, step), data from consumed_samples.
    assert report.rng == "reseeded" and report.rng_seed == reseed_value(1234, STEP)
    assert report.data == "recomputed" and report.data_state is None and report.consumed_samples == CONSUMED
    assert any("consumed_samples=16" in n for n in report.notes), report.notes
    got = get_cuda_rng_tracker().get_states()
    model_parallel_manual_seed(report.rng_seed)
    assert_bitwise_equal(got, get_cuda_rng_tracker().get_states())
    return st, model, opt, report


def check_load_dp4(rank, world_size):
    _check_resharded_load(rank, 2)
    _destroy()


def check_load_tp4(rank, world_size):
    _check_resharded_load(rank, 3, tp=4)
    _destroy()


def check_load_cp2_keeps_data_state(rank, world_size):
    """tp2·dp2 -> cp2·dp2: the layout changed (RNG re-seeded) but dp did not, so dp rank d gets dp rank d's state."""
    from megashard import checkpoint

    st, model, opt = _build(7, cp=2)
    report = checkpoint.load(os.path.join(_root(), "a"), model, opt)
    assert_bitwise_equal(full_state(model, opt), _reference())
    dp_rank = st.rank_in("dp")
    assert dp_rank == rank // 2  # cp varies fastest here; in the saved tp2·dp2 layout dp rank d was ranks 2d, 2d+1
    assert report.rng == "reseeded" and report.data == "restored"
    assert report.data_state["dp_rank"] == dp_rank and torch.equal(report.data_state["pos"], torch.tensor([dp_rank, 8]))
    _destroy()


def check_load_hsdp_then_save(rank, world_size):
    from megashard import checkpoint

    st, model, opt, _ = _check_resharded_load(rank, 4, dp_outer=2)
    assert st.fully_shard_mesh.ndim == 2  # really HSDP
    path = checkpoint.save(os.path.join(_root(), "b"), STEP, model, opt, consumed_samples=CONSUMED)
    info = _writer_check(path, _local_items(model, opt))
    writers = set(info["written"].values())
    assert writers == {0, 1, 2, 3}, writers  # the HSDP replicas share the writing
    _destroy()


def check_load_fsdp_from_hsdp(rank, world_size):
    _check_resharded_load(rank, 5, ckpt="b")
    _destroy()


def check_corrupt_file_raises_on_every_rank(rank, world_size):
    import shutil

    import torch.distributed as dist

    from megashard import checkpoint
    from megashard.errors import CheckpointCorruptedError

    src, dst = _ckpt("a"), os.path.join(_root(), "c", f"step_{STEP:08d}")
    if rank == 0:
        shutil.copytree(src, dst)
        flip_bit(os.path.join(dst, "__1_0.distcp"), 100, bit=0)
    dist.barrier()
    st, model, opt = _build(6, tp=2)
    with pytest.raises(CheckpointCorruptedError, match=r"__1_0\.distcp.*crc32 checksum"):
        checkpoint.load(os.path.join(_root(), "c"), model, opt)
    _destroy()


def check_every_rank_ends_a_step_with_the_same_error(rank, world_size):
    """collective.agree: values in rank order; the lowest failing rank's error on every rank (its own exception
    there, a copy naming it elsewhere); rank 0's result or error reaches every rank. save() refuses ranks that
    pass different steps, and an existing step, on every rank."""
    from megashard import checkpoint
    from megashard.checkpoint.collective import agree
    from megashard.errors import CheckpointCorruptedError, CheckpointError

    assert agree(rank * 10) == [0, 10, 20, 30]
    mine = CheckpointCorruptedError(f"bad file on rank {rank}") if rank in (1, 3) else None
    if mine is not None:
        mine.problems = [f"problem {rank}"]
    with pytest.raises(CheckpointCorruptedError) as err:
        agree(rank, mine)
    assert err.value is mine if rank == 1 else str(err.value) == "(raised on rank 1) bad file on rank 1"
    assert err.value.problems == ["problem 1"]
    assert agree(rank, rank0=sum) == 6
    with pytest.raises(CheckpointError) as err:  # not a megashard error: travels as a CheckpointError
        agree(rank, OSError("disk full") if rank == 2 else None, rank0=sum)
    assert str(err.value) == ("" if rank == 2 else "(raised on rank 2) ") + "OSError: disk full"
    with pytest.raises(CheckpointError, match=r"^(\(raised on rank 0\) )?ZeroDivisionError"):
        agree(rank, rank0=lambda values: 1 // 0)
    model = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="ranks disagree on the checkpoint: rank 0 saves step 5"):
        checkpoint.save(os.path.join(_root(), "d"), 5 + (rank == 3), model)
    checkpoint.save(os.path.join(_root(), "d"), 5, model)
    with pytest.raises(CheckpointError, match=r"^(\(raised on rank 0\) )?checkpoint .*step_00000005 already exists"):
        checkpoint.save(os.path.join(_root(), "d"), 5, model)


CHECKS = [
    check_every_rank_ends_a_step_with_the_same_error,
    check_save_tp2_dp2,
    check_load_same_layout_restores_rng_and_data,
    check_load_dp4,
    check_load_tp4,
    check_load_cp2_keeps_data_state,
    check_load_hsdp_then_save,
    check_load_fsdp_from_hsdp,
    check_corrupt_file_raises_on_every_rank,
]


@pytest.fixture(scope="module")
def dist4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    os.environ[ROOT_ENV] = root
    try:
        yield spawn_checks(CHECKS, world_size=4, timeout=600.0)
    finally:
        os.environ.pop(ROOT_ENV, None)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_distributed(dist4, check):
    dist4.assert_ok(check)


def test_load_into_one_process(dist4):
    """No process group: a plain Net and AdamW get the tp2·dp2 checkpoint's exact full tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from megashard import checkpoint

    model = _net(8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    extra = {"ragged": torch.zeros(13, 3)}
    report = checkpoint.load(os.path.join(_root(), "a"), model, opt, state_dict=extra)
    assert torch.equal(extra["ragged"], RAGGED)
    msd, osd = get_state_dict(model, opt)
    assert_bitwise_equal({"model": full_tensors(msd), "optim": full_tensors(osd)}, _reference())
    assert report.rng == "reseeded" and report.data == "recomputed" and report.consumed_samples == CONSUMED
    assert report.saved_layout["sizes"]["tp"] == 2 and report.current_layout["world_size"] == 1
