"""The example pretraining job of ``megashard run``: a small GPT on megashard's parallel state.

Modules: ``config`` (the job's YAML sections), ``sections`` (one dataclass per section), ``data``
(deterministic batches), ``checkpointing`` (DCP save/resume), ``loop`` (:func:`train`), ``metrics`` and
``hf_io`` (Hugging Face import/export). The models live in :mod:`megashard.models`, the processes that run
the job (torchrun command line, agent, worker, lifelines, checkpoint lock) in :mod:`megashard.launch`.
"""
