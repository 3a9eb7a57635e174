"""Everything that starts, watches and stops the processes of ``megashard run``.

Modules: ``launcher`` (torchrun command line, Slurm), ``preflight`` (the job checked against this machine),
``agent`` (torchrun with one-line failure reports), ``worker`` (the per-process entry point), ``lifeline``
(processes die with their parent). The checkpoint-directory lock the launcher takes is
:mod:`megashard.train.ckptlock` (rank 0 of the job takes the same lock when no launcher holds it).
"""
