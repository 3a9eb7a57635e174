"""The host-overhead fast paths of the training step (issue 20, item 6) give the values of their references.

* data order: ``Split.train`` (a cached block of windows) equals ``Split.train_direct`` (the definition) for many
  seeds, sizes, split fractions, runs across block and epoch boundaries and scattered samples; ``Batches`` of a
  blend likewise;
* clipping (four gloo ranks; tp=2·dp_shard=2 with MoE at ep=2, tp=1·ep=2·expt_tp=2, pp=2·tp=2 llama with tied
  embeddings): :func:`clip_grad_norm` and :func:`clip_grad_norm_reference` both return the true global norm of
  known random gradients (computed from the full tensors, each parameter once) and scale every local gradient by
  the same factor; a wrong grouping (a TP-replicated tensor summed over tp, a tied copy counted twice) is off by
  a whole tensor's share;
* :class:`LocalShardAdamW` after several real steps (float32 and bfloat16 with fp32 master weights): parameters and
  optimizer state bitwise equal to stock ``torch.optim.AdamW`` on the DTensors, its state still DTensors;
* FSDP's reshard choice (:func:`parallelize` default vs every module resharding): bitwise equal parameters.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


# ---------------------------------------------------------------------------------------------- data order (no dist)
@pytest.mark.long
@pytest.mark.parametrize("block", [7, 64, 4096])
def test_split_cache_equals_definition(block):
    from megashard.data.samples import Split

    g = torch.Generator().manual_seed(0)
    # a block of 4096 windows costs ~10x a small one to fill: fewer seeds there, every size and boundary still run
    for seed in range(12 if block < 1000 else 3):
        for n in (1, 2, 3, 5, 17, 100, 1000, 5000):
            for frac in (0.0, 0.1):
                if n == 1 and frac:
                    continue
                s = Split(n, frac, seed, key=seed % 3)
                s.CACHE_BLOCK = block
                ref = Split(n, frac, seed, key=seed % 3)
                runs = [torch.arange(a, a + 8) for a in (0, block - 3, 2 * block - 1, n - 2, 3 * n + 5)]
                runs.append(torch.randint(0, 4 * n + block, (9,), generator=g))  # scattered: uncached path
                for t in runs + runs[::-1]:
                    assert torch.equal(s.train(t), ref.train_direct(t)), (seed, n, frac, t)


def test_split_cache_over_consecutive_batches_and_epochs():
    from megashard.data.samples import Split

    s, ref = Split(333, 0.05, 99), Split(333, 0.05, 99)
    s.CACHE_BLOCK = 40
    got = torch.cat([s.train(torch.arange(i * 6, i * 6 + 6)) for i in range(300)])  # 5+ epochs, many blocks
    want = ref.train_direct(torch.arange(1800))
    assert torch.equal(got, want)
    assert sorted(got[:316].tolist()) == sorted(ref._sigma(torch.arange(17, 333)).tolist())  # one epoch: each once


def test_blended_batches_cached_equal_direct():
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches

    job = JobConfig.from_yaml(DEFAULT, ["launch.nproc_per_node=1", "parallel.tp=1", "parallel.dp_shard=1",
                                        "data.num_sequences=300", "data.valid_fraction=0.1"])
    fast = Batches(job.data, job.model, 12, 5, dp_rank=1, dp_size=3)
    slow = Batches(job.data, job.model, 12, 5, dp_rank=1, dp_size=3)
    for split in slow.samples.splits:
        split.train = split.train_direct
    for step in range(0, 120, 7):
        for a, b in zip(fast.batch(step), slow.batch(step)):
            assert torch.equal(a, b), step


# ---------------------------------------------------------------------------------------------- distributed checks
_BASE = ["train.progress=false", "train.plot=false", "model.dropout=0.0", "launch.nproc_per_node=4"]
MOE = ["model.num_experts=4", "model.moe_every=2", "model.moe_top_k=2", "model.ffn_hidden=128"]
CLIP_LAYOUTS = {
    "tp2_dp2_ep2": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"] + MOE,
    "ep2_expt_tp2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "parallel.expt_tp=2"] + MOE,
    "pp2_tp2_tied": ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "model.arch=llama",
                     "model.tie_embeddings=true", "model.layers=4", "train.microbatches=2"],
}


def _state_and_model(overrides: list[str]):
    import megashard.state as ms
    from megashard.train.config import JobConfig
    from megashard.train.loop import build

    job = JobConfig.from_yaml(DEFAULT, _BASE + overrides)
    if ms.is_initialized():
        ms.destroy()
    state = ms.initialize(job.parallel)
    job.validate(sizes=state.sizes)
    model, opt = build(job, state)
    return job, state, model, opt


def _random_grads(model, state, seed: int) -> dict[str, float]:
    """Set every gradient to this rank's part of a seeded random full tensor (same per name on every rank);
    returns name -> squared norm of the full tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from megashard.models.gpt.model import param_init_seed
    from megashard.models.parallelize import param_layout

    sq = {}
    for name, p in model.named_parameters():
        mesh, placements, shape = param_layout(p, state)
        g = torch.Generator().manual_seed(param_init_seed(seed, name))
        full = torch.randn(shape, generator=g, dtype=torch.float64).to(p.dtype)
        local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        assert local.shape == p.to_local().shape, (name, local.shape, p.to_local().shape)
        p.grad = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())
        sq[name] = float(full.to(torch.float64).pow(2).sum())
    return sq


def _true_norm(sq: dict[str, float]) -> float:
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sq)
    merged: dict[str, float] = {}
    for part in parts:
        merged.update(part)  # a tied copy has its first stage's name: counted once
    return sum(merged.values()) ** 0.5


def _check_clip(layout: str) -> None:
    from megashard.train.clip import clip_grad_norm, clip_grad_norm_reference

    job, state, model, _ = _state_and_model(CLIP_LAYOUTS[layout] + ["train.dtype=float64"])
    params = list(model.parameters())
    sq = _random_grads(model, state, seed=3)
    want = _true_norm(sq)
    for fn in (clip_grad_norm_reference, clip_grad_norm):
        _random_grads(model, state, seed=3)
        norm = float(fn(params, 0.0, state))  # measure only
        assert abs(norm - want) <= 1e-12 * want, (fn.__name__, norm, want)
        before = [p.grad.to_local().clone() for p in params]
        max_norm = want / 3
        norm = float(fn(params, max_norm, state))
        coef = max_norm / (norm + 1e-6)
        for p, b in zip(params, before):
            torch.testing.assert_close(p.grad.to_local(), b * coef, rtol=1e-13, atol=0)
        after = float(fn(params, 0.0, state))
        assert abs(after - norm * coef) <= 1e-12 * max_norm, (fn.__name__, after, norm * coef)
    # No clipping below the bound: the gradients keep every bit.
    _random_grads(model, state, seed=4)
    before = [p.grad.to_local().clone() for p in params]
    clip_grad_norm(params, 1e9, state)
    assert all(torch.equal(p.grad.to_local(), b) for p, b in zip(params, before))
    import megashard.state as ms

    ms.destroy()


def check_clip_tp2_dp2_ep2(rank, world):
    _check_clip("tp2_dp2_ep2")


def check_clip_ep2_expt_tp2(rank, world):
    _check_clip("ep2_expt_tp2")


def check_clip_pp2_tp2_tied(rank, world):
    _check_clip("pp2_tp2_tied")


def _train_steps(model, opt, job, state, steps: int, reshard_all: bool = False) -> None:
    from megashard.train.clip import clip_grad_norm
    from megashard.train.data import Batches
    from megashard.train.loop import lr_at

    if reshard_all:
        for m in model.modules():
            if hasattr(m, "set_reshard_after_forward"):
                m.set_reshard_after_forward(True, recurse=False)
    data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=state.rank_in("dp"),
                   dp_size=state.size("dp"))
    params = list(model.parameters())
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, job)
        model(*data.batch(step)).backward()
        clip_grad_norm(params, 0.05, state)  # clips every step
        opt.step()
        opt.zero_grad(set_to_none=True)


def _optimizer_equal(dtype: str) -> None:
    from torch.distributed.tensor import DTensor

    import megashard.state as ms
    from megashard.train.optim import LocalShardAdamW, build_optimizer

    layout = ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2", f"train.dtype={dtype}"] + MOE
    job, state, model_a, opt_a = _state_and_model(layout)
    assert isinstance(opt_a, LocalShardAdamW)
    _train_steps(model_a, opt_a, job, state, 4)
    from megashard.train.loop import build

    model_b, _ = build(job, state)
    opt_b = build_optimizer(model_b, job.optim, local_shards=False)
    assert type(opt_b) is torch.optim.AdamW
    _train_steps(model_b, opt_b, job, state, 4)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for field, v in st.items():
            assert isinstance(v, DTensor) or field == "step", (k, field, type(v))
            w = sb["state"][k][field]
            assert torch.equal(v.to_local() if isinstance(v, DTensor) else v,
                               w.to_local() if isinstance(w, DTensor) else w), (k, field)
    ms.destroy()


def check_local_adamw_float32(rank, world):
    _optimizer_equal("float32")


def check_local_adamw_bfloat16(rank, world):
    _optimizer_equal("bfloat16")


def check_reshard_choice_keeps_values(rank, world):
    import megashard.state as ms
    from megashard.train.loop import build

    job, state, model_a, opt_a = _state_and_model(["parallel.tp=2", "parallel.dp_shard=2", "model.layers=3"])
    _train_steps(model_a, opt_a, job, state, 3)
    model_b, opt_b = build(job, state)
    _train_steps(model_b, opt_b, job, state, 3, reshard_all=True)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    ms.destroy()


CHECKS = [check_clip_tp2_dp2_ep2, check_clip_ep2_expt_tp2, check_clip_pp2_tp2_tied, check_local_adamw_float32,
          check_local_adamw_bfloat16, check_reshard_choice_keeps_values]


@pytest.fixture(scope="module")
def dist4():
    return spawn_checks(CHECKS, world_size=4, timeout=600)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_on_four_ranks(dist4, name):
    dist4.assert_ok(name)
