"""The advisor's memory model against what real jobs allocate (docs/advisor.md, "How right it is").

**Measured peak** (tests/_live_bytes.py, the same definition as ``benchmarks/advisor.py``): the bytes of live tensor
storages, counted op by op with a TorchDispatchMode, over the steps after the first (the steady state, with the
optimizer's state), a storage that gloo's thread lets go counted as freed after the program's last use of it — so
the same job measures the same bytes on every run, however loaded the machine.

The accuracy check runs small jobs of the example model for two steps on four gloo ranks (the eight jobs the model
was first tuned on, and four cheap ones of ``benchmarks/advisor.py``'s untuned set: cp's gathered keys and values,
GPipe's last stage, recompute with distributed saved inputs, the experts' backward with ep · expt_tp) and compares the largest rank's peak with
:func:`megashard.advisor.memory.estimate_memory`: never more than 3% under, at most 5% over (MoE: the stated
routing-imbalance bound). What one block, the head and a pipeline stage save is checked exactly in one process
(dense, MoE, first and last pipeline stage) and on two ranks (cp).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from tests._dist import spawn_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
ENV = "MEGASHARD_ADVISOR_TEST_DIR"
WORLD = 4
RUN = ["train.steps=2", "checkpoint.interval=0", "checkpoint.save_final=false", "train.progress=false",
       "train.plot=false", "train.resume=false", "model.dropout=0.0", "data.num_sequences=32",
       f"launch.nproc_per_node={WORLD}"]
BASE = RUN + ["model.vocab_size=512", "model.hidden=128", "model.layers=4", "model.heads=4", "train.global_batch=8"]
#: name -> overrides; every job runs on 4 ranks.
JOBS = {
    "dense dp_outer=4": ["parallel.tp=1", "parallel.dp_outer=4", "parallel.dp_shard=1"],
    "tp=4": ["parallel.tp=4", "parallel.dp_shard=1"],
    "fsdp dp_shard=4": ["parallel.tp=1", "parallel.dp_shard=4"],
    "pp=2 1f1b mb=4": ["parallel.tp=1", "parallel.pp=2", "parallel.dp_shard=2", "train.microbatches=4"],
    "pp=2 vpp=2 interleaved": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=2",
                               "train.microbatches=4", "train.pipeline_schedule=interleaved_1f1b"],
    "tp=2 recompute": ["parallel.tp=2", "parallel.dp_shard=2", "model.recompute=true"],
    "moe ep=2 top2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "model.num_experts=4",
                      "model.moe_top_k=2", "model.ffn_hidden=256"],
    # expt_dp = 1: the experts' backward is the peak (every stacked weight's gradient at full size, and one more)
    "moe ep=2 expt_tp=2": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2", "parallel.expt_tp=2",
                           "model.num_experts=8", "model.moe_top_k=2", "model.ffn_hidden=512"],
    "llama tp=2 cp=2 bf16": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1", "model.arch=llama",
                             "train.dtype=bfloat16"],
    # from benchmarks/advisor.py's untuned layouts (smaller model): the misses of issue 29
    "gpt tp=2 cp=2": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1"],
    "pp=4 gpipe mb=8 (last stage)": ["parallel.tp=1", "parallel.pp=4", "parallel.dp_shard=1", "train.microbatches=8",
                                     "train.pipeline_schedule=gpipe"],
    "tp=2 recompute distributed": ["parallel.tp=2", "parallel.dp_shard=2", "model.recompute=true",
                                   "model.distribute_saved_activations=true"],
}
#: Jobs of shapes the model was not written for (issue 41: other microbatch counts, vpp=3, MoE every 2nd block,
#: top-1 routing, bf16 with accumulation, a large hidden size with a small vocabulary, seq 512, micro_batch_size=3,
#: HSDP): each overrides BASE's model where it says so; 4 ranks each.
NEW_JOBS = {
    "gpt bf16 tp=2 fsdp=2 mb=3 h160": ["parallel.tp=2", "parallel.dp_shard=2", "train.dtype=bfloat16",
                                       "train.microbatches=3", "train.global_batch=6", "model.hidden=160",
                                       "model.layers=2"],
    "llama fsdp=4 recompute micro_batch_size=3": ["parallel.tp=1", "parallel.dp_shard=4", "model.arch=llama",
                                                  "model.recompute=true", "train.micro_batch_size=3",
                                                  "train.global_batch=24"],
    "llama hsdp 2x2 recompute micro_batch_size=3": ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2",
                                                    "model.arch=llama", "model.recompute=true",
                                                    "train.micro_batch_size=3", "train.global_batch=12"],
    "moe gpt 4 experts top-1 ep=4 seq 256": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=4",
                                             "model.num_experts=4", "model.moe_top_k=1", "model.moe_every=2",
                                             "model.seq_len=256", "model.ffn_hidden=256"],
    "llama tp=2 pp=2 vpp=3 mb=4": ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=3", "parallel.dp_shard=1",
                                   "model.arch=llama", "model.layers=6", "train.microbatches=4",
                                   "train.pipeline_schedule=interleaved_1f1b"],
    "moe top-2 ep=2 pp=2 1f1b mb=2": ["parallel.tp=1", "parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2",
                                      "model.num_experts=4", "model.moe_top_k=2", "model.ffn_hidden=256",
                                      "train.microbatches=2"],
    "gpt fsdp=4 h512 vocab 256": ["parallel.tp=1", "parallel.dp_shard=4", "model.hidden=512", "model.heads=8",
                                  "model.vocab_size=256", "model.layers=2"],
    "gpt pp=2 1f1b mb=3": ["parallel.tp=1", "parallel.pp=2", "parallel.dp_shard=2", "train.microbatches=3",
                           "train.global_batch=12"],
    "llama bf16 tp=2 cp=2 seq 512": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=1", "model.arch=llama",
                                     "train.dtype=bfloat16", "model.seq_len=512", "model.layers=2",
                                     "train.global_batch=2"],
    "llama bf16 moe top-1 every block ep=2 mb=3": ["parallel.tp=1", "parallel.dp_shard=4", "parallel.ep=2",
                                                   "model.arch=llama", "train.dtype=bfloat16", "model.num_experts=4",
                                                   "model.moe_top_k=1", "model.moe_every=1", "model.ffn_hidden=256",
                                                   "train.microbatches=3", "train.global_batch=12"],
    # held-out MoE jobs of the round that traced experts with values: experts replicated over HSDP's replicas in bf16
    # (autograd's gradients in bf16; +5.7% and +6.5% before), one expert per rank FSDP-sharded over two (its gathered
    # weights padded to two experts' rows)
    "moe hsdp 2x2 ep=2 bf16": ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2", "parallel.ep=2",
                               "model.num_experts=4", "model.moe_top_k=2", "model.ffn_hidden=256",
                               "train.dtype=bfloat16"],
    "llama moe hsdp 2x2 ep=2 bf16 top-1": ["parallel.tp=1", "parallel.dp_outer=2", "parallel.dp_shard=2",
                                           "parallel.ep=2", "model.arch=llama", "model.num_experts=4",
                                           "model.moe_top_k=1", "model.ffn_hidden=256", "train.dtype=bfloat16"],
    "moe tp=2 ep=2 one expert per rank top-1": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2",
                                                "model.num_experts=2", "model.moe_top_k=1", "model.ffn_hidden=256"],
}
ALL_JOBS = {**JOBS, **NEW_JOBS}
UNDER, OVER = -0.03, 0.05


def _job(name: str):
    from megashard.train.config import JobConfig

    out = os.environ.get(ENV, tempfile.gettempdir())
    return JobConfig.from_yaml(DEFAULT, BASE + [f"train.out_dir={out}/{name.replace(' ', '_')}"] + ALL_JOBS[name])


def check_measure_peaks(rank: int, world_size: int) -> None:
    from megashard.train.loop import train
    from tests._live_bytes import LiveBytes

    peaks = {}
    for name in ALL_JOBS:
        with LiveBytes(warmup_steps=1) as live:
            train(_job(name))
        peaks[name] = live.peak
    with open(os.path.join(os.environ[ENV], f"peaks{rank}.json"), "w") as f:
        json.dump(peaks, f)


@pytest.fixture(scope="module")
def measured():
    with tempfile.TemporaryDirectory(prefix="megashard-advisor-") as tmp:
        os.environ[ENV] = tmp
        try:
            res = spawn_checks([check_measure_peaks], WORLD, timeout=3600)  # 25 jobs; a loaded machine is slow
            res.assert_ok("check_measure_peaks")
            per_rank = [json.load(open(os.path.join(tmp, f"peaks{r}.json"))) for r in range(WORLD)]
        finally:
            os.environ.pop(ENV, None)
    return {name: max(p[name] for p in per_rank) for name in ALL_JOBS}


def _predict(name: str):
    from megashard.advisor.memory import estimate_memory
    from megashard.advisor.shape import JobShape

    job = _job(name)
    sizes = job.parallel.resolve(WORLD)
    return estimate_memory(JobShape.from_job(job), sizes, job.model.recompute, job.model.distribute_saved_activations)


#: The modelled peaks still known to miss (docs/advisor.md, "Issue 41's held-out shapes"): none. vpp=3 was 3.4% under
#: until the model counted the tensors an interleaved schedule keeps with its sends' works until the step's end (a
#: non-last stage's output after its backward, a non-first one's input gradient): nine at its peak.
MODEL_KNOWN: set[str] = set()


@pytest.mark.long
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="known model miss"))
                                  if n in MODEL_KNOWN else n for n in ALL_JOBS])
def test_predicted_peak_is_never_3_percent_under_nor_5_over(measured, name):
    est = _predict(name)
    real = measured[name]
    err = est.peak / real - 1
    print(f"{name:<30} predicted {est.peak / 2**20:8.3f} MiB  measured {real / 2**20:8.3f} MiB  {err:+.1%}  ({est.phase})")
    assert UNDER <= err <= OVER, f"{name}: predicted {est.peak:,} B ({est.phase}), measured {real:,} B: {err:+.1%}"


# ---------------------------------------------------------------------------------------------- exact parts
def _kept(model, *inputs, fn=None):
    """Bytes a forward keeps alive for backward (everything it made that is still alive after it)."""
    from tests._live_bytes import LiveBytes

    with LiveBytes() as live:
        live.adopt(list(model.parameters()) + [x for x in inputs if hasattr(x, "untyped_storage")])
        before = live.live
        out = (fn or model)(*inputs)
        # gloo's thread lets go of a collective's input just after the call returns, later on a loaded machine:
        # read the count once it has stayed the same for 0.2 s (a hang guard of 60 s, not a speed bound)
        seen, still, give_up = live.live, 0, time.monotonic() + 60.0
        while still < 10 and time.monotonic() < give_up:
            time.sleep(0.02)
            still, seen = (still + 1, seen) if live.live == seen else (0, live.live)
        kept = live.live - before
    return kept, out


@pytest.mark.parametrize("arch,tie,experts", [("gpt", False, 0), ("llama", True, 0), ("gpt", False, 4), ("llama", False, 4)])
def test_parameter_count_is_the_models(arch, tie, experts):
    from megashard.advisor.shape import JobShape, block_params, numel, root_params
    from megashard.models.gpt.model import GPT
    from megashard.train.sections import ModelConfig

    cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64, tie_embeddings=tie,
                      num_experts=experts, moe_top_k=2)
    shape = JobShape(arch=arch, vocab=512, hidden=128, layers=4, heads=4, seq=64, tie=tie, num_experts=experts,
                     ffn=512 if arch == "gpt" else 384)
    moe = [i for i in range(4) if shape.is_moe(i)]
    model = GPT(cfg, moe_layers=moe, device="meta")
    real = sum(p.numel() for p in model.parameters())
    dense = sum(numel(block_params(shape, 1, shape.is_moe(i))[0]) + numel(block_params(shape, 1, shape.is_moe(i))[1])
                for i in range(4))
    assert dense + numel(root_params(shape, 1, True, True)) == real


@pytest.mark.parametrize("arch,dtype,experts", [("gpt", "float32", 0), ("llama", "float32", 0), ("llama", "bfloat16", 0),
                                                ("gpt", "float32", 4), ("llama", "bfloat16", 4)])
def test_saved_activations_are_exact(arch, dtype, experts):
    """What one process's forward keeps for backward (4 blocks — with experts, blocks 1 and 3 MoE, top-2 — head,
    loss) against block_activation + head_activation. One process routes every (token, expert) pair locally, so the
    MoE count is exact here; across ep ranks it is the even share times the imbalance bound."""
    import torch

    from megashard.advisor.memory import block_activation, head_activation
    from megashard.advisor.shape import JobShape
    from megashard.models.gpt.model import GPT
    from megashard.train.sections import ModelConfig

    ffn = 256 if experts else None
    cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64, num_experts=experts,
                      moe_top_k=2, ffn_hidden=ffn)
    moe = [1, 3] if experts else []
    model = GPT(cfg, moe_layers=moe, dtype=getattr(torch, dtype))
    x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    kept, _ = _kept(model, x, y)
    shape = JobShape(arch=arch, vocab=512, hidden=128, layers=4, heads=4, seq=64,
                     ffn=ffn or (512 if arch == "gpt" else 384), dtype=dtype, num_experts=experts, top_k=2)
    t = 2 * 64
    predicted = (sum(block_activation(shape, t, 1, i in moe) for i in range(4)) + head_activation(shape, t, 1)[0]
                 + t * 8)
    assert abs(predicted / kept - 1) < 0.01, (predicted, kept)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_pipeline_stages_keep_what_the_model_counts(arch):
    """A first stage (embedding + 2 blocks) keeps its blocks' activations, the token ids and its output (the schedule
    holds it for backward); a last stage (2 blocks + head) its blocks', the head's and its output, the logits, which
    the schedule keeps until that microbatch's backward (return_outputs=False: not longer)."""
    import torch

    from megashard.advisor.memory import block_activation, head_activation
    from megashard.advisor.shape import JobShape
    from megashard.models.gpt.model import GPT
    from megashard.models.stages import StageSpec
    from megashard.train.sections import ModelConfig

    cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64)
    shape = JobShape(arch=arch, vocab=512, hidden=128, layers=4, heads=4, seq=64, ffn=512 if arch == "gpt" else 384)
    t, e = 2 * 64, 4
    first = GPT(cfg, stage=StageSpec(0, 2, (0, 1)))
    x = torch.randint(0, 512, (2, 64))
    kept, out = _kept(first, x)
    assert kept == pytest.approx(2 * block_activation(shape, t, 1, False) + t * 128 * e, rel=0.01)  # + output
    last = GPT(cfg, stage=StageSpec(1, 2, (2, 3)))
    h = torch.randn(2, 64, 128, requires_grad=True)
    y = torch.randint(0, 512, (2, 64))
    kept, _ = _kept(last, h, y, fn=lambda hh, yy: (lambda logits: (logits, last.loss(logits, yy)))(last(hh)))
    # the stage's input arrives from the previous stage (a receive buffer the estimate counts apart)
    predicted = 2 * block_activation(shape, t, 1, False) + head_activation(shape, t, 1, stage_output=True)[0] - t * 128 * e
    assert kept == pytest.approx(predicted, rel=0.01)
    without = 2 * block_activation(shape, t, 1, False) + head_activation(shape, t, 1)[0] - t * 128 * e
    assert kept - without == pytest.approx(2 * 64 * 512 * e, rel=0.15)  # the logits [2, 64, 512] it keeps


def check_cp_block_keeps_gathered_keys_and_values(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from megashard.advisor.memory import block_activation
    from megashard.advisor.shape import JobShape
    from megashard.models.gpt.model import GPT, ModelGroups
    from megashard.train.sections import ModelConfig

    group = dist.new_group(list(range(world_size)))
    for arch in ("gpt", "llama"):
        cfg = ModelConfig(arch=arch, vocab_size=512, hidden=128, layers=2, heads=4, seq_len=64)
        torch.manual_seed(0)
        model = GPT(cfg, ModelGroups(cp=group))
        block = model.blocks["0"]
        x = torch.randn(2, 64 // world_size, 128, requires_grad=True)
        kept, out = _kept(block, x)
        kept -= out.untyped_storage().nbytes()  # the block's output is the next block's input, counted there
        shape = JobShape(arch=arch, vocab=512, hidden=128, layers=2, heads=4, seq=64, ffn=512 if arch == "gpt" else 384)
        t = 2 * 64 // world_size
        x_bytes = t * 128 * 4  # the block's input, made outside the count
        predicted = block_activation(shape, t, 1, False, seq_local=64 // world_size, cp=world_size) - x_bytes
        plain = block_activation(shape, t, 1, False, seq_local=64 // world_size) - x_bytes
        assert abs(predicted / kept - 1) < 0.01, (arch, rank, predicted, kept, plain)
        assert predicted > plain  # the gathered keys and values are what cp adds


def test_cp_block_keeps_gathered_keys_and_values():
    spawn_checks([check_cp_block_keeps_gathered_keys_and_values], 2, timeout=120).assert_ok(
        "check_cp_block_keeps_gathered_keys_and_values")


# ---------------------------------------------------------------------------------------------- traced peaks
#: Jobs whose traced peak is known to miss the measured one by more than 1%: none. MoE jobs over ep > 1 ranks were
#: here (−0.4 … −16%: a rank traced alone receives no peer's tokens) until their traces rehearsed every rank with
#: values (megashard.rehearse.exact); interleaved pipelines until a rehearsed send's Work held its tensor as gloo's
#: does.
TRACE_KNOWN: set[str] = set()


@pytest.fixture(scope="module")
def traced():
    """Every job's traced peak (the largest of its pipeline ranks' first ranks; with experts over ep > 1 ranks, of
    every rank, all rehearsed together with values): one step of each on the fake backend,
    after a warm-up step, counted by the same LiveBytes as the measured runs."""
    from megashard.advisor.trace import trace_memory

    out = {}
    for name in ALL_JOBS:
        peaks = trace_memory(_job(name), WORLD)
        assert all(p.peak is not None for p in peaks), (name, [p.error for p in peaks])
        out[name] = max(peaks, key=lambda p: p.peak)
    return out


@pytest.mark.long
@pytest.mark.parametrize("name", list(ALL_JOBS))
def test_traced_peak_equals_the_measured_one(measured, traced, name):
    t, real = traced[name], measured[name]
    err = t.peak / real - 1
    print(f"{name:<45} traced {t.peak / 2**20:8.3f} MiB  measured {real / 2**20:8.3f} MiB  {err:+.2%}")
    if name in TRACE_KNOWN:
        assert abs(err) < 0.05, f"{name}: traced {t.peak:,} B, measured {real:,} B: {err:+.1%}"
        return
    assert not t.partial
    assert t.exact == any(x.startswith("parallel.ep=") and x != "parallel.ep=1" for x in ALL_JOBS[name]), name
    assert abs(err) <= 0.01, f"{name}: traced {t.peak:,} B (rank {t.rank}), measured {real:,} B: {err:+.2%}"
