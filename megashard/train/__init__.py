"""The example pretraining job of ``megashard run``: a small GPT on megashard's parallel state.

Modules: ``config`` (the job's YAML sections), ``sections`` (one dataclass per section), ``data``
(deterministic batches), ``pipeline`` (the pipeline schedule), ``placement`` (stages and experts for
``megashard plan``), ``checkpointing`` (DCP save/resume), ``ckptlock`` (one job per checkpoint directory),
``build`` (the model and optimizer), ``loop`` (:func:`train`), ``metrics``, ``hf_io`` and ``hf_dir`` (Hugging
Face import/export). The models live in :mod:`megashard.models`, the processes that run the job (torchrun command
line, agent, worker, lifelines) in :mod:`megashard.launch`.
"""

# The modules that moved out of this package (issue 21) keep their old import paths, for scripts and for
# ``python -m megashard.train.agent`` / ``megashard.train.worker`` command lines: importing an old name gives the
# moved module itself (the same object), without a file at the old path.
_MOVED = {
    "launch": "megashard.launch.launcher", "agent": "megashard.launch.agent", "lifeline": "megashard.launch.lifeline",
    "preflight": "megashard.launch.preflight", "worker": "megashard.launch.worker", "layers": "megashard.models.layers",
    "moe": "megashard.models.moe", "stages": "megashard.models.stages", "parallelize": "megashard.models.parallelize",
    "hf": "megashard.models.hf", "model": "megashard.models.gpt.model", "llama": "megashard.models.llama.blocks",
}


def _install_moved_finder() -> None:
    import importlib
    import importlib.abc
    import importlib.util
    import sys

    class _Alias(importlib.abc.Loader):
        def __init__(self, target: str) -> None:
            self.target = target

        def create_module(self, spec):  # the moved module itself, not a copy
            module = importlib.import_module(self.target)
            self.spec = module.__spec__
            return module

        def exec_module(self, module) -> None:
            module.__spec__ = self.spec  # the import system set the alias's spec on it: give it back its own

        def get_code(self, fullname: str):  # python -m megashard.train.<old name> runs the moved module's code
            return importlib.util.find_spec(self.target).loader.get_code(self.target)

        def is_package(self, fullname: str) -> bool:
            return False

    class _MovedFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            package, _, name = fullname.rpartition(".")
            if package != __name__ or name not in _MOVED:
                return None
            moved = importlib.util.find_spec(_MOVED[name])
            return importlib.util.spec_from_loader(fullname, _Alias(_MOVED[name]), origin=moved.origin)

    if not any(type(f).__name__ == "_MovedFinder" for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


_install_moved_finder()
