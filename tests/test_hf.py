"""Hugging Face interop: ``megashard ckpt export-hf`` and ``model.init_from``, both architectures.

One spawn of 4 gloo ranks (tp=2 · dp_shard=2) runs four short jobs:

* ``gpt`` / ``llama``: 2 steps, checkpoint saved at the end; in this process ``megashard ckpt export-hf`` writes a
  Hugging Face directory (several safetensors shards + index), ``transformers`` loads it as GPT2LMHeadModel /
  LlamaForCausalLM, and its logits on a fixed batch equal megashard's (the same checkpoint in a single-process
  megashard model) within 1e-5;
* ``init_gpt`` / ``init_llama``: ``model.init_from`` a directory written by ``transformers`` (``save_pretrained``,
  random weights, split into several shards): the job's loss at step 0 equals the Hugging Face model's loss on the
  same batch.

Bad inputs (missing directory, mismatching config.json, wrong architecture, no safetensors, a checkpoint without a
job config) give one-line errors, ``megashard run`` before any process starts.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("safetensors", reason="Hugging Face interop needs the 'safetensors' extra (pip install 'megashard[hf]')")
transformers = pytest.importorskip(
    "transformers", reason="the round-trip tests need 'transformers' (pip install 'megashard[hf-test]')")

from megashard.cli import main  # noqa: E402
from megashard.errors import CheckpointError, ConfigError, MissingExtraError  # noqa: E402
from tests._dist import spawn_checks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")
ENV = "MEGASHARD_TEST_HF_DIR"
MODEL = ["model.hidden=32", "model.heads=4", "model.layers=2", "model.vocab_size=96", "model.seq_len=16",
         "data.branching=4"]
BASE = MODEL + ["train.steps=2", "checkpoint.interval=0", "train.progress=false", "train.plot=false",
                "parallel.tp=2", "parallel.dp_shard=2", "launch.nproc_per_node=4", "train.global_batch=8",
                "optim.warmup_steps=1", "train.log_interval=100"]
ARCH = {"gpt": ["model.arch=gpt"], "llama": ["model.arch=llama", "model.tie_embeddings=true"]}


def _dir() -> str:
    return os.environ[ENV]


def _job(tag: str, arch: str, extra: list = ()):
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(DEFAULT, BASE + ARCH[arch] + [f"train.out_dir={_dir()}/{tag}"] + list(extra))


def _run(tag: str, arch: str, extra: list = ()) -> None:
    import torch.distributed as dist

    from megashard.train.loop import train

    with contextlib.redirect_stderr(io.StringIO()):
        result = train(_job(tag, arch, extra))
    if dist.get_rank() == 0:
        with open(os.path.join(_dir(), f"{tag}.json"), "w") as f:
            json.dump({"losses": result.losses}, f)
    dist.barrier()


def check_train_gpt(rank, world_size):
    _run("gpt", "gpt")


def check_train_llama(rank, world_size):
    _run("llama", "llama")


def check_init_gpt(rank, world_size):
    _run("init_gpt", "gpt", [f"model.init_from={_dir()}/hf_gpt", "train.steps=1", "checkpoint.save_final=false"])


def check_init_llama(rank, world_size):
    _run("init_llama", "llama", [f"model.init_from={_dir()}/hf_llama", "train.steps=1", "checkpoint.save_final=false"])


def _hf_model(arch: str, seed: int):
    """A random Hugging Face model of the test's size (every weight, norms included, random)."""
    from megashard.train.config import JobConfig
    from megashard.models.hf import hf_config

    job = JobConfig.from_yaml(DEFAULT, BASE + ARCH[arch])
    conf = hf_config(job.model, job.ffn_hidden)
    conf.pop("architectures")
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel)(
        transformers.AutoConfig.for_model(**conf))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    os.environ[ENV] = root
    for i, arch in enumerate(("gpt", "llama")):  # the Hugging Face checkpoints init_from starts from
        _hf_model(arch, 10 + i).save_pretrained(os.path.join(root, f"hf_{arch}"), safe_serialization=True,
                                                max_shard_size="40KB")
    res = spawn_checks([check_train_gpt, check_train_llama, check_init_gpt, check_init_llama], world_size=4,
                       timeout=400)
    return root, res


def _megashard_logits(job, full: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits of megashard's model holding ``full``, in this process (the LM head applied to ln_f's output)."""
    from megashard.models.gpt.model import GPT

    model = GPT(job.model, ffn_hidden=job.ffn_hidden)
    model.load_state_dict(full)
    model.eval()
    seen = {}
    model.ln_f.register_forward_hook(lambda mod, inp, out: seen.update(h=out))
    with torch.no_grad():
        model(ids, ids)
        w = model.embed.weight if model.head is None else model.head.weight
        return seen["h"] @ w.t()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_export_hf_logits_equal(runs, arch):
    root, res = runs
    res.assert_ok(f"check_train_{arch}")
    from megashard.train.checkpointing import read_full_model

    ckpt = os.path.join(root, arch, "checkpoints")
    out = os.path.join(root, f"export_{arch}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["ckpt", "export-hf", ckpt, out])
    assert code == 0, err.getvalue()
    files = sorted(os.listdir(out))
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    hf = cls.from_pretrained(out).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if arch == "llama" else "GPT2LMHeadModel")
    job = _job(arch, arch)
    ids = torch.randint(0, job.model.vocab_size, (3, job.model.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = _megashard_logits(job, read_full_model(ckpt), ids)
    assert theirs.shape == ours.shape == (3, job.model.seq_len, job.model.vocab_size)
    assert (theirs - ours).abs().max().item() <= 1e-5
    assert ours.abs().max().item() > 1e-2  # not a trivially zero model
    # The tied llama has no lm_head, the untied gpt has one.
    names = set()
    from safetensors import safe_open

    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out, f), framework="pt") as h:
                names |= set(h.keys())
    assert ("lm_head.weight" in names) == (arch == "gpt")
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] == (arch == "llama")


def test_export_hf_shards_and_refuses_existing_output(runs, tmp_path):
    root, res = runs
    res.assert_ok("check_train_gpt")
    from megashard.train.hf_io import export_hf

    ckpt = os.path.join(root, "gpt", "checkpoints")
    s = export_hf(ckpt, str(tmp_path / "many"), max_shard_bytes=20_000)
    assert s["shards"] > 1
    index = json.load(open(tmp_path / "many" / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == {f"model-{i:05d}-of-{s['shards']:05d}.safetensors"
                                                for i in range(1, s["shards"] + 1)}
    assert index["metadata"]["total_size"] == s["bytes"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "many"))
    one = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(root, "export_gpt"))
    for (n, a), (_, b) in zip(hf.state_dict().items(), one.state_dict().items()):
        assert torch.equal(a, b), n
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export_hf(ckpt, str(tmp_path / "many"))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_from_loss_equals_hf_loss(runs, arch):
    root, res = runs
    res.assert_ok(f"check_init_{arch}")
    from megashard.train.data import Batches

    job = _job(f"init_{arch}", arch)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    hf = cls.from_pretrained(os.path.join(root, f"hf_{arch}")).eval()
    x, y = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, dp_rank=0, dp_size=1,
                   cp_rank=0, cp_size=1, device=torch.device("cpu")).batch(0)
    with torch.no_grad():
        logits = hf(x).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    got = json.load(open(os.path.join(root, f"init_{arch}.json")))["losses"]["1"]
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)
    # And not the seeded init's loss: the weights did come from the file.
    assert abs(want - float(torch.log(torch.tensor(float(job.model.vocab_size))))) > 1e-3


# ---------------------------------------------------------------------------------------------- bad inputs
def _hf_dir(tmp_path, arch: str = "gpt", tag: str = "", **changes) -> str:
    path = tmp_path / f"hf_{arch}{tag}"
    if not path.exists():
        _hf_model(arch, 1).save_pretrained(str(path), safe_serialization=True)
    if changes:
        doc = json.load(open(path / "config.json"))
        doc.update(changes)
        json.dump(doc, open(path / "config.json", "w"))
    return str(path)


def _run_cli(args: list) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    return code, err.getvalue()


def test_init_from_errors_before_processes_start(tmp_path):
    from megashard.train.config import JobConfig

    def check(overrides: list, pattern: str) -> None:
        job = JobConfig.from_yaml(DEFAULT, MODEL + ["model.arch=gpt"] + overrides)
        with pytest.raises(ConfigError, match=pattern) as e:
            job.validate(4)
        assert "\n" not in str(e.value)

    check([f"model.init_from={tmp_path}/nowhere"], r"model.init_from=.*nowhere' is not a directory")
    (tmp_path / "empty").mkdir()
    check([f"model.init_from={tmp_path}/empty"], "has no config.json")
    good = _hf_dir(tmp_path)
    check([f"model.init_from={good}", "model.hidden=64"], r"n_embd=32 but the model section gives 64 \(model.hidden\)")
    check([f"model.init_from={good}", "model.layers=3"], r"n_layer=2 .* \(model.layers\): set model.layers=2")
    check([f"model.init_from={good}", "model.arch=llama"], r"model_type='gpt2' but model.arch='llama'.*model.arch=gpt")
    check([f"model.init_from={good}", "model.tie_embeddings=true"], r"tie_word_embeddings=false")
    check([f"model.init_from={good}", "model.seq_len=32"], r"n_positions=16 .* model.seq_len=32")
    check([f"model.init_from={_hf_dir(tmp_path, 'gpt', '2', activation_function='gelu_new')}"],
          r"activation_function=gelu_new .*exact \(erf\) GELU")
    from safetensors.torch import load_file, save_file

    bad = _hf_dir(tmp_path, "gpt", "3")  # a tensor of another shape than config.json says
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    tensors["transformer.h.1.mlp.c_fc.bias"] = torch.zeros(5)
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    check([f"model.init_from={bad}"], r"tensor 'transformer.h.1.mlp.c_fc.bias' in .*model.safetensors has shape \[5\], "
          r"the model section needs \[128\]")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    check([f"model.init_from={bad}"], r"has no tensor 'transformer.h.1.mlp.c_fc.bias' \(model.arch=gpt")
    with open(os.path.join(bad, "model.safetensors"), "r+b") as f:  # truncated
        f.truncate(100)
    check([f"model.init_from={bad}"], r"cannot read .*model.safetensors \(SafetensorError: .*header")
    os.remove(os.path.join(good, "model.safetensors"))
    check([f"model.init_from={good}", "model.layers=2"], "holds neither model.safetensors nor")
    # megashard run: the same one line, exit 2, before any process starts (no output directory made).
    code, err = _run_cli(["run", DEFAULT, f"model.init_from={tmp_path}/nowhere", f"train.out_dir={tmp_path}/out"])
    assert code == 2 and err.strip().count("\n") == 0 and "is not a directory" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_missing_safetensors_and_missing_job_config(tmp_path, monkeypatch):
    from megashard.train.config import JobConfig
    from megashard.train.hf_io import export_hf, job_of_checkpoint

    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'megashard\[hf\]'"):
        JobConfig.from_yaml(DEFAULT, [f"model.init_from={tmp_path}"]).validate(4)
    with pytest.raises(MissingExtraError, match="export-hf needs the 'safetensors' package"):
        export_hf(str(tmp_path), str(tmp_path / "out"))
    monkeypatch.undo()
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / "megashard.json").write_text(json.dumps({"format": "megashard", "layout": {}}))
    with pytest.raises(CheckpointError, match="records no job config.*--config"):
        job_of_checkpoint(str(ckpt))
