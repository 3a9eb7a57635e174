"""Megatron-LM's ``MultiModuleProcessGroupCollection`` over megashard's per-module states.

A multi-module job (an encoder and a language model, :mod:`megashard.state.modules`) gives each rank the
:class:`~megashard.state.ParallelState` of its module; Megatron's multi-module code takes a
``MultiModuleProcessGroupCollection``: ``{module name: ProcessGroupCollection}`` plus which one is the language
model. :func:`multi_module_pg_collection` builds it from the states this rank holds — megatron-core's own class when
importable (``megatron`` None) or required (True), else :class:`MultiModuleProcessGroupCollection`, a stand-in with
Megatron's behaviour (core_v0.19.0 ``process_groups_config.py``): the same errors, dict-like access,
``get_language_model_cp_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

if TYPE_CHECKING:
    from megashard.state.core import ParallelState

__all__ = ["MultiModuleProcessGroupCollection", "multi_module_pg_collection"]


@dataclass
class MultiModuleProcessGroupCollection:
    """``module_pgs``: module name -> ProcessGroupCollection; ``language_model_module_name``: the LM's key (None: no
    language model on this rank)."""

    module_pgs: dict
    language_model_module_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.module_pgs:
            raise ValueError("module_pgs dict cannot be empty")
        if self.language_model_module_name is not None and self.language_model_module_name not in self.module_pgs:
            raise ValueError(f"language_model_module_name '{self.language_model_module_name}' not found in "
                             f"module_pgs keys: {list(self.module_pgs.keys())}")

    def get_language_model_collection(self) -> Any:
        if self.language_model_module_name is None:
            raise ValueError("No language model specified for this collection")
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        return self.get_language_model_collection().cp.size()

    def has_language_model(self) -> bool:
        return self.language_model_module_name is not None

    def get_module_collection(self, module_name: str) -> Any:
        if module_name not in self.module_pgs:
            raise ValueError(f"Module '{module_name}' not found in collections. "
                             f"Available: {list(self.module_pgs.keys())}")
        return self.module_pgs[module_name]

    def __len__(self) -> int:
        return len(self.module_pgs)

    def __getitem__(self, module_name: str) -> Any:
        return self.module_pgs[module_name]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.module_pgs.values())

    def keys(self):  # noqa: ANN201 - dict view, as Megatron's
        return self.module_pgs.keys()

    def values(self):  # noqa: ANN201
        return self.module_pgs.values()

    def items(self):  # noqa: ANN201
        return self.module_pgs.items()


def multi_module_pg_collection(states: Mapping[str, "ParallelState"], language_model_module_name: Optional[str] = None,
                               megatron: Optional[bool] = None) -> Any:
    """Megatron's ``MultiModuleProcessGroupCollection`` of ``states`` (module name -> this rank's ParallelState of
    that module): each module's ``state.pg_collection(megatron)``; megatron-core's class when importable (``megatron``
    None) or required (True: MissingExtraError without it), the stand-in otherwise or with ``megatron=False``."""
    pgs = {name: st.pg_collection(megatron) for name, st in states.items()}
    cls: type = MultiModuleProcessGroupCollection
    if megatron is not False:
        try:
            from megatron.core.process_groups_config import MultiModuleProcessGroupCollection as cls  # noqa: N813
        except Exception as e:  # noqa: BLE001 - absent, or older than the class: the stand-in
            if megatron:
                from megashard.errors import MissingExtraError

                raise MissingExtraError("multi_module_pg_collection(megatron=True) needs megatron-core with "
                                        f"MultiModuleProcessGroupCollection (pip install megatron-core): {e}") from None
    return cls(module_pgs=pgs, language_model_module_name=language_model_module_name)
