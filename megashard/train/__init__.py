"""The example pretraining job of ``megashard run``: a small GPT on megashard's parallel state.

Modules: ``config`` (the job's YAML sections), ``layers`` (Megatron-style TP layers), ``model`` (GPT),
``moe`` (experts over ep), ``data`` (deterministic batches), ``parallelize`` (FSDP2 + global DTensor
view), ``checkpointing`` (DCP save/resume), ``loop`` (:func:`train`), ``metrics``,
``launch`` (torchrun command line, Slurm), ``agent`` (torchrun with one-line failure reports),
``lifeline`` (processes die with their parent), ``ckptlock`` (one job per checkpoint directory) and
``worker`` (the per-process entry point).
"""
