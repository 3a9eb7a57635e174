"""The example models of ``megashard run``, built on megashard's parallel state.

Modules: ``layers`` (Megatron-style TP layers), ``moe`` (experts over ep), one folder per architecture
(``gpt/``: the model both architectures share; ``llama/``: RMSNorm, rotary positions, SwiGLU), ``stages`` and
``pipeline`` (pipeline stages and schedules), ``parallelize`` (FSDP2 + global DTensor view) and ``hf`` (the
table between megashard's parameters and Hugging Face's).
"""
