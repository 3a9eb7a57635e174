"""Throughput of a 0.95 B Llama on one GPU: megashard's job (``train.compile``) against a compiled plain loop.

Both sides train the same model from the same initial weights (megashard's seeded init, converted with
:mod:`megashard.models.hf` into the Hugging Face model) on the same batches, bf16 compute with fp32 master weights:

* **megashard**: :func:`megashard.train.loop.build` of a ``model.arch: llama`` job (tp=1, dp_shard=1, one process)
  with ``train.compile: true`` and ``train.dtype: bfloat16`` (FSDP2's bf16 parameters, fp32 gradient reduction),
  its step as ``megashard run`` takes it: forward + backward, :func:`~megashard.train.clip.clip_grad_norm`,
  :class:`~megashard.train.optim.LocalShardAdamW`;
* **hf-compiled**: Hugging Face ``LlamaForCausalLM`` (sdpa attention) in fp32 with every decoder layer
  ``torch.compile``'d, ``torch.autocast(bfloat16)``, ``clip_grad_norm_(foreach=True)`` and ``AdamW(fused=True)``.

The sides run one after the other (each alone on the GPU; its peak memory measured alone): compile/warm-up steps,
then timed steps, CUDA-synchronised. Model FLOPs per step = ``6 · N · T + 12 · layers · hidden · seq · T``
(``N`` every parameter, ``T`` tokens per step: the usual dense count, attention not halved for causality); MFU =
model FLOP/s over the GPU's dense bf16 peak (looked up by device name). Goals (issue 20): megashard ≥ 1.0× the
compiled plain loop, ≥ 45 % MFU on an H100.

    python benchmarks/gpu.py --model llama-1b [--steps 10] [--smoke] [--backend inductor]

``--smoke``: a scaled-down model (2 layers, hidden 64, seq 64, batch 2) that runs on the CPU too (backend
``aot_eager`` there unless given), to check the benchmark itself. Writes ``benchmarks/results/llama_1b.json``.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
RESULTS = os.path.join(HERE, "results", "llama_1b.json")

#: the model of issue 20: hidden 2048, 16 layers, 16 heads, ffn 5632, vocab 32000, seq 2048, global batch 8.
LLAMA_1B = {"hidden": 2048, "layers": 16, "heads": 16, "ffn_hidden": 5632, "vocab_size": 32000, "seq_len": 2048,
            "global_batch": 8}
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 176, "vocab_size": 256, "seq_len": 64, "global_batch": 2}

#: dense bf16 peak TFLOP/s by device-name fragment (first match; NVIDIA data sheets, without sparsity).
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0),
                    ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0), ("B200", 2250.0))


def peak_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name``), None if unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key in device_name:
            return peak
    return None


def param_count(size: dict) -> int:
    """Parameters of the Llama of ``size`` (untied embeddings, no biases): embedding, head, blocks, final norm."""
    h, f, v, layers = size["hidden"], size["ffn_hidden"], size["vocab_size"], size["layers"]
    return 2 * v * h + layers * (4 * h * h + 3 * h * f + 2 * h) + h


def flops_per_step(size: dict) -> float:
    """Model FLOPs of one training step: ``6 · N · T + 12 · layers · hidden · seq · T``."""
    tokens = size["global_batch"] * size["seq_len"]
    return 6.0 * param_count(size) * tokens + 12.0 * size["layers"] * size["hidden"] * size["seq_len"] * tokens


def job_overrides(size: dict, device: str, backend: str) -> list[str]:
    return ["launch.nproc_per_node=1", "parallel.tp=1", "parallel.dp_shard=1", f"parallel.device={device}",
            "model.arch=llama", f"model.hidden={size['hidden']}", f"model.layers={size['layers']}",
            f"model.heads={size['heads']}", f"model.ffn_hidden={size['ffn_hidden']}",
            f"model.vocab_size={size['vocab_size']}", f"model.seq_len={size['seq_len']}", "model.dropout=0.0",
            f"train.global_batch={size['global_batch']}", "train.dtype=bfloat16", "train.compile=true",
            f"train.compile_backend={backend}", "data.num_sequences=64", "optim.warmup_steps=2", "optim.grad_clip=1.0"]


def _megashard_side(job, state) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.nn.Module]:
    from megashard.train.clip import clip_grad_norm
    from megashard.train.loop import build

    model, opt = build(job, state)
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        clip_grad_norm(params, job.optim.grad_clip, state)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model


def _hf_side(job, full: dict, device: torch.device, backend: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from megashard.models.hf import hf_config, mapping, to_hf

    cfg = {k: v for k, v in hf_config(job.model, job.ffn_hidden).items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.load_state_dict(to_hf({k: v.float() for k, v in full.items()}, mapping(job.model, job.ffn_hidden)),
                          strict=False)  # rotary buffers are not parameters
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend=backend)
    o = job.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    vocab = job.model.vocab_size

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _time(step: Callable, data: Any, device: torch.device, warmup: int, steps: int) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        x, y = data.batch(i)
        sync()
        t = time.perf_counter()
        losses.append(float(step(x, y)))  # float(): the step's end on the device
        times.append(time.perf_counter() - t)
    out = {"ms_per_step": statistics.median(times[warmup:]) * 1e3, "first_losses": losses[:3],
           "warmup_s": sum(times[:warmup]), "total_s": time.perf_counter() - t0}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def run(steps: int = 10, warmup: int = 3, smoke: bool = False, backend: Optional[str] = None,
        device: Optional[str] = None) -> dict:
    """Both sides in this process (a world of one is initialised here if none is); returns the result dict."""
    import torch.distributed as dist

    import megashard.state as ms
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches
    from megashard.train.loop import full_parameters

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = backend or ("inductor" if dev.type == "cuda" else "aot_eager")
    size = SMOKE if smoke else LLAMA_1B
    own = not dist.is_initialized()
    if own:
        if dev.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = JobConfig.from_yaml(DEFAULT, job_overrides(size, dev.type, backend))
        state = ms.initialize(job.parallel)
        job.validate(sizes=state.sizes)
        data = Batches(job.data, job.model, job.train.global_batch, job.parallel.seed, device=dev)
        res: dict = {}
        ours, model = _megashard_side(job, state)
        # The initial weights for the HF side: copies (at one rank full_tensor() may return the parameter itself).
        full = {k: v.detach().to("cpu", copy=True) for k, v in full_parameters(model, state).items()}
        res["megashard"] = _time(ours, data, dev, warmup, steps)
        del ours, model
        ms.destroy()
        torch._dynamo.reset()  # drop megashard's compiled blocks (and what they hold) before the other side
        import gc

        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        plain = _hf_side(job, full, dev, backend)
        del full
        res["hf-compiled"] = _time(plain, data, dev, warmup, steps)
    finally:
        if own:
            from megashard.state import end_distributed

            end_distributed()
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else (platform.processor() or platform.machine())
    peak = peak_tflops(name) if dev.type == "cuda" else None
    flops, tokens = flops_per_step(size), size["global_batch"] * size["seq_len"]
    for r in res.values():
        s = r["ms_per_step"] / 1e3
        r["tokens_per_s"] = tokens / s
        r["model_tflops"] = flops / s / 1e12
        r["mfu"] = r["model_tflops"] / peak if peak else None
    return {"benchmark": "llama_1b", "device": name, "peak_bf16_tflops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "size": size, "smoke": smoke,
            "params": param_count(size), "flops_per_step": flops, "backend": backend, "steps": steps,
            "warmup": warmup, "loadavg": os.getloadavg(), "sides": res,
            "ratio_plain_over_megashard": res["hf-compiled"]["ms_per_step"] / res["megashard"]["ms_per_step"]}


def print_table(r: dict) -> None:
    print(f"Llama {r['params'] / 1e9:.2f} B ({'smoke size' if r['smoke'] else 'hidden 2048, 16 layers'}; seq "
          f"{r['size']['seq_len']}, batch {r['size']['global_batch']}, bf16/fp32 master) on {r['device']}, torch "
          f"{r['torch']}, backend {r['backend']}, load {r['loadavg'][0]:.2f}; median of {r['steps']} steps")
    print(f"| {'side':<12} | {'ms/step':>9} | {'tokens/s':>10} | {'TFLOP/s':>8} | {'MFU':>6} | {'peak mem GiB':>12} "
          f"| {'first loss':>10} | {'compile s':>9} |")
    print(f"|{'-' * 14}|{'-' * 11}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 14}|{'-' * 12}|{'-' * 11}|")
    for side, s in r["sides"].items():
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] else "-"
        mem = s.get("peak_memory_gib", s.get("peak_rss_gib", 0.0))
        print(f"| {side:<12} | {s['ms_per_step']:>9.1f} | {s['tokens_per_s']:>10,.0f} | {s['model_tflops']:>8.2f} | "
              f"{mfu:>6} | {mem:>12.2f} | {s['first_losses'][0]:>10.4f} | {s['warmup_s']:>9.1f} |")
    print(f"speed megashard / hf-compiled: {r['ratio_plain_over_megashard']:.3f}x (goal >= 1.0; MFU goal >= 45% on an H100)")


def main(args) -> int:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("benchmarks/gpu.py --model llama-1b: the plain side is Hugging Face's LlamaForCausalLM; install "
              "transformers (pip install 'megashard[hf-test]')", file=sys.stderr)
        return 2
    r = run(steps=args.steps, warmup=args.warmup, smoke=args.smoke, backend=args.backend, device=args.device)
    print_table(r)
    out = args.out or RESULTS
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(r, f, indent=1)
    print(f"wrote {out}")
    return 0
