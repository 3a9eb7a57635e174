"""Everything that starts, watches and stops the processes of ``megashard run``.

Modules: ``launcher`` (torchrun command line, Slurm), ``preflight`` (the job checked against this machine),
``agent`` (torchrun with one-line failure reports), ``worker`` (the per-process entry point), ``lifeline``
(processes die with their parent) and ``ckptlock`` (one job per checkpoint directory).
"""
