"""The numbers of a run (issue 40): model FLOPs per token, the stated peak of a device, a rank's peak RSS growth, the
progress line."""
from __future__ import annotations

import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")


def _job(*overrides: str):
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(DEFAULT, list(overrides))


def _params(job) -> dict:
    from megashard.models.gpt.model import GPT
    from megashard.train.usage import _stage_params

    return _stage_params(GPT(job.model, ffn_hidden=job.ffn_hidden, moe_layers=job.moe_layers()))


def test_model_flops_per_token_count_matmuls_attention_experts_and_a_tied_head():
    from megashard.train.usage import model_flops_per_token, parameter_count

    h, v, s, layers = 64, 256, 64, 2
    attn = 12 * layers * s * h
    gpt = _job()
    # per block: qkv 3h·h, proj h·h, fc1 4h·h, fc2 4h·h; the untied head v·h; embeddings (tokens, positions) excluded
    assert model_flops_per_token(_params(gpt), gpt) == 6 * (layers * 12 * h * h + v * h) + attn
    assert parameter_count(_params(gpt)) == 136_960
    tied = _job("model.arch=llama", "model.tie_embeddings=true")
    f = tied.ffn_hidden  # SwiGLU: gate, up, down
    assert model_flops_per_token(_params(tied), tied) == 6 * (layers * (4 * h * h + 3 * h * f) + v * h) + attn
    moe = _job("model.num_experts=4", "model.moe_top_k=2")
    p = _params(moe)
    experts = sum(mm for _, mm, expert in p.values() if expert)
    dense = sum(mm for _, mm, expert in p.values() if not expert)
    assert experts > 0 and model_flops_per_token(p, moe) == 6 * (dense + experts * 2 / 4) + attn


def test_peaks_are_stated_per_device_and_dtype():
    from megashard.train.usage import device_peak, gpu_peak

    assert gpu_peak("NVIDIA H100 80GB HBM3", "bfloat16").tflops == 989.4
    assert gpu_peak("NVIDIA H100 PCIe", "bfloat16").tflops == 756.0
    assert gpu_peak("NVIDIA H200", "bfloat16").tflops == 989.4
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "bfloat16").tflops == 312.0
    assert gpu_peak("NVIDIA H100 80GB HBM3", "float32").tflops == 66.9
    assert gpu_peak("NVIDIA H100 80GB HBM3", "float32").source.endswith("fp32 peak without TF32 (table)")
    unknown = gpu_peak("NVIDIA GeForce GTX 1080", "bfloat16")
    assert unknown.tflops is None and "set train.peak_tflops" in unknown.source
    given = device_peak(_job("train.peak_tflops=1.5"), torch.device("cpu"))
    assert given.tflops == 1.5 and given.source == "train.peak_tflops=1.5"
    measured = device_peak(_job(), torch.device("cpu"))
    assert measured.tflops > 0 and measured.source.startswith("CPU, float32 matmul measured at the start")


def test_host_memory_counts_the_peak_growth_after_its_start():
    from megashard.train.usage import HostMemory

    host = HostMemory.start()
    x = torch.ones(200 << 20, dtype=torch.uint8)  # 200 MiB touched, then freed
    del x
    growth = host.peak_growth()
    assert 190 << 20 <= growth < 400 << 20, growth
    assert HostMemory.start().peak_growth() < 100 << 20  # a new start: the freed 200 MiB are not counted again


def test_progress_line_shows_lr_grad_norm_and_step_time():
    from megashard.progress import ProgressBar

    bar = ProgressBar(200, log_interval=10, width=10)
    assert bar.render(50, 3.14159, 12345.0, 30.0, lr=2.5e-3, grad_norm=0.9312, step_time=0.0954) == (
        "step  50/200 [##........] loss 3.1416 | lr 2.50e-03 | grad norm 0.931 | 12.3k tok/s | 95 ms/step | 0:30 "
        "elapsed, 1:30 left")


def test_loggers_get_every_number_of_a_record():
    from megashard.train.loggers import scalars_of

    record = {"step": 9, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens": 1024, "tokens_per_s": 4096.0,
              "step_time_s": 0.25, "time": 1.7e9, "world_size": 2, "tokens_per_s_per_device": 2048.0,
              "model_tflops_per_device": 0.001, "mfu": 0.01, "valid_loss": 2.6,
              "world_change": {"world_size_before": 4, "steps_redone": 2, "seconds_down": 3.0, "seconds_redone": 0.5},
              "stragglers": {"step": 8, "last": {"step": 8, "rank": 1, "lag_ms": 21.4, "share": 0.2}, "named": []}}
    assert scalars_of(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/step_time_s": 0.25,
        "train/tokens_per_s": 4096.0, "train/tokens_per_s_per_device": 2048.0, "train/model_tflops_per_device": 0.001,
        "train/mfu": 0.01, "world/size": 2.0, "valid/loss": 2.6, "world/steps_redone": 2.0, "world/seconds_lost": 3.5,
        "world/size_before": 4.0, "doctor/straggler_lag_ms": 21.4, "doctor/straggler_rank": 1.0}
