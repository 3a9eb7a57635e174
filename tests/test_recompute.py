"""Activation recompute: bitwise-equal gradients with dropout (default stream and tracker fork), also with
the saved input split across tensor-parallel ranks on gloo."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megashard.state.recompute as mrc
from megashard.errors import StateError
from megashard.state.current import current_locals
from megashard.state.recompute import checkpoint
from megashard.state.rng import get_cuda_rng_tracker, model_parallel_manual_seed
from tests._dist import spawn_checks
from tests._helpers import assert_bitwise_equal

SEED = 77


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's row-parallel reduction: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class Block(torch.nn.Module):
    """Linear → dropout on the default stream → dropout on the model-parallel stream → Linear, residual.

    With ``tp_group`` the branch is summed over the group like a row-parallel layer, so the block's
    output is replicated across tp ranks although each drew its own model-parallel mask.
    """

    def __init__(self, width: int = 5, hidden: int = 7, tp_group=None):
        super().__init__()
        self.l1 = torch.nn.Linear(width, hidden)
        self.l2 = torch.nn.Linear(hidden, width)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.l1(x), 0.5, training=True)
        with get_cuda_rng_tracker().fork():
            h = F.dropout(h, 0.3, training=True)
        y = torch.tanh(self.l2(h))
        if self.tp_group is not None:
            y = _ReduceFromTP.apply(y, self.tp_group)
        return y + x


def make_blocks(n: int = 2, tp_group=None) -> list[Block]:
    torch.manual_seed(0)
    return [Block(tp_group=tp_group) for _ in range(n)]


def run(blocks, x0, *, ckpt: bool, distribute: bool = False, tp_rank: int = 0, group=None):
    """One forward+backward through the blocks; returns everything a recompute could get wrong."""
    model_parallel_manual_seed(SEED, tp_rank=tp_rank, ep_rank=0, expt_tp_rank=0)
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    h = x
    for b in blocks:
        h = checkpoint(b, distribute, h, group=group) if ckpt else b(h)
    upstream = torch.linspace(-1.0, 2.0, h.numel(), device=h.device).view_as(h)
    (h * upstream).sum().backward()
    grads = [p.grad.clone() for b in blocks for p in b.parameters()]
    after = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    return h.detach(), x.grad.clone(), grads, after


@pytest.fixture(autouse=True)
def _clean():
    current_locals().reset()
    yield
    current_locals().reset()


def test_checkpoint_gradients_bitwise_equal():
    blocks = make_blocks()
    x0 = torch.randn(4, 3, 5)
    assert_bitwise_equal(run(blocks, x0, ckpt=False), run(blocks, x0, ckpt=True))


def test_without_rng_replay_gradients_differ(monkeypatch):
    """Control: the test above is sensitive — a recompute that does not restore the streams fails it."""
    blocks = make_blocks()
    x0 = torch.randn(4, 3, 5)
    ref = run(blocks, x0, ckpt=False)
    monkeypatch.setattr(mrc, "_rng_restore", lambda snapshot: None)
    bad = run(blocks, x0, ckpt=True)
    assert not torch.equal(ref[1], bad[1])


def test_recompute_runs_under_forward_autocast():
    """Forward under autocast, backward outside it (as training loops do): recompute must use bf16 too."""
    (block,) = make_blocks(1)
    x0 = torch.randn(4, 5)

    def fwd_bwd(ckpt: bool, autocast: bool = True):
        model_parallel_manual_seed(SEED, tp_rank=0, ep_rank=0, expt_tp_rank=0)
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(block, False, x) if ckpt else block(x)
        y.float().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in block.parameters()]

    ref, got = fwd_bwd(False), fwd_bwd(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not torch.equal(ref[1], fwd_bwd(False, autocast=False)[1])  # bf16 really changed the numbers


def test_checkpoint_inside_a_fork_of_the_same_stream():
    """Forward inside fork(); the layer forks the same stream again; backward runs outside any fork."""
    (block,) = make_blocks(1)  # forks 'model-parallel-rng' internally
    x0 = torch.randn(4, 5)

    def fwd_bwd(ckpt: bool):
        model_parallel_manual_seed(SEED, tp_rank=0, ep_rank=0, expt_tp_rank=0)
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with get_cuda_rng_tracker().fork():
            h = F.dropout(x, 0.2, training=True)
            y = checkpoint(block, False, h) if ckpt else block(h)
            y = F.dropout(y, 0.2, training=True)
        y.sum().backward()
        with get_cuda_rng_tracker().fork():
            after = torch.rand(3)
        return [y.detach(), x.grad, after] + [p.grad for p in block.parameters()]

    ref, got = fwd_bwd(False), fwd_bwd(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_activations_are_recomputed_not_stored():
    calls = []

    def f(x):
        calls.append(torch.is_grad_enabled())
        return x.sin() * 2

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(f, False, x)
    assert calls == [False] and y.grad_fn is not None
    assert [t.shape for t in y.grad_fn.saved_tensors] == [(3,)]  # only the input
    y.sum().backward()
    assert calls == [False, True]
    assert torch.equal(x.grad, 2 * x.detach().cos())


def test_non_tensor_args_and_tuple_outputs():
    def f(x, scale, y, tag):
        return x * scale + y.exp(), tag, x.detach() * 0  # a tensor output without grad

    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    z = torch.randn(4)  # does not require grad
    a, tag, c = checkpoint(f, False, x, 3.0, y, "t")
    assert tag == "t"
    (a.sum() + c.sum()).backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))
    assert torch.equal(y.grad, y.detach().exp())
    out = checkpoint(lambda v, w: v * w, False, z, x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0) + z)


def test_autograd_grad_is_refused():
    x = torch.randn(3, requires_grad=True)
    y = checkpoint(lambda v: v * 2, False, x)
    with pytest.raises(RuntimeError, match=r"does not work with torch.autograd.grad"):
        torch.autograd.grad(y.sum(), x)


def test_distribute_without_state_is_a_clear_error():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(StateError, match=r"megashard.state.initialize.*group="):
        checkpoint(lambda v: v * 2, True, x)


# --------------------------------------------------------------------------- gloo, 4 ranks, tp=2
def check_recompute_tp2(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig

    st = ms.initialize(ParallelConfig(tp=2))
    try:
        tp_rank = st.rank_in("tp")
        assert tp_rank == rank % 2
        blocks = make_blocks(tp_group=st.group("tp"))
        # Activations are replicated across a tp group (the premise of splitting them): seed by dp rank.
        # 15 elements: uneven over tp=2.
        x0 = torch.randn(3, 5, generator=torch.Generator().manual_seed(st.rank_in("dp")))
        ref = run(blocks, x0, ckpt=False, tp_rank=tp_rank)
        assert_bitwise_equal(ref, run(blocks, x0, ckpt=True, tp_rank=tp_rank))
        assert_bitwise_equal(ref, run(blocks, x0, ckpt=True, distribute=True, tp_rank=tp_rank))
        # The tp ranks really drew different model-parallel masks: the first layer's weight gradients
        # differ across tp ranks for the same input (data-parallel peers with equal inputs agree).
        import torch.distributed as dist

        x_same = torch.randn(3, 5, generator=torch.Generator().manual_seed(123))
        g = run(blocks, x_same, ckpt=True, distribute=True, tp_rank=tp_rank)[2][0]
        parts = [torch.empty_like(g) for _ in range(world_size)]
        dist.all_gather(parts, g)
        assert torch.equal(parts[0], parts[2]) and torch.equal(parts[1], parts[3])
        assert not torch.equal(parts[0], parts[1])

        # Only this rank's slice of the input is kept: ceil(15 / 2) = 8 elements; the input is untouched.
        x = x0.clone().requires_grad_(True)
        keep = x.detach().clone()
        y = checkpoint(lambda v: v * 3, True, x)
        saved = y.grad_fn.saved_tensors[0]
        assert saved.shape == (8,)
        assert torch.equal(saved[: 8 if tp_rank == 0 else 7], keep.reshape(-1)[8 * tp_rank: 8 * tp_rank + 8])
        assert x.shape == (3, 5) and torch.equal(x.detach(), keep)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((3, 5), 3.0))
    finally:
        ms.destroy()


def check_recompute_explicit_group(rank, world_size):
    """``group=`` overrides the state's tp group: split over all 4 ranks, no ParallelState needed."""
    import torch.distributed as dist

    blocks = make_blocks(1)
    x0 = torch.randn(2, 5, generator=torch.Generator().manual_seed(5))  # replicated; 10 elements over 4 ranks
    ref = run(blocks, x0, ckpt=False)
    got = run(blocks, x0, ckpt=True, distribute=True, group=dist.group.WORLD)
    assert_bitwise_equal(ref, got)


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks([check_recompute_tp2, check_recompute_explicit_group], world_size=4)


def test_recompute_tp2_gloo(dist4):
    dist4.assert_ok("check_recompute_tp2")


def test_recompute_explicit_group_gloo(dist4):
    dist4.assert_ok("check_recompute_explicit_group")
