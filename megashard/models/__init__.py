"""The example models of ``megashard run``, built on megashard's parallel state.

Modules: ``config`` (the ``model`` section), ``layers`` (Megatron-style TP layers), ``moe`` (experts over ep), one
folder per architecture (``gpt/``: the model both architectures share; ``llama/``: RMSNorm, rotary positions,
SwiGLU), ``compile`` (``train.compile``: every block's body through
``torch.compile``), ``stages`` (which blocks each pipeline stage holds), ``parallelize`` (FSDP2 + global DTensor view) and
``hf`` (the table between megashard's parameters and Hugging Face's). The models know nothing of the training job
(:mod:`megashard.train`), which builds them.
"""
