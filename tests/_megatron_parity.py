"""Megatron-LM's own ``parallel_state`` against megashard's facade, getter by getter, on simulated ranks.

For each config and each chosen rank, one process joins a ``fake`` world as that rank, runs Megatron's
``initialize_model_parallel`` (its module: the installed ``megatron.core.parallel_state``, or a copy of Megatron's
source file loaded from a path, e.g. ``core_v0.19.0:megatron/core/parallel_state.py``), records every getter's answer
(group -> its ranks, sizes, ranks, None, or "raises"), tears it down, then does the same through
``megashard.parallel_state`` and compares. Gloo groups are off on both sides (a ``fake`` world has no gloo).

As a script (the note's numbers): ``python -m tests._megatron_parity [path/to/parallel_state.py]``.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
import types
from typing import Any, Callable

#: (getter, kwargs): every group/size/rank getter of Megatron 0.19's parallel_state that takes no positional argument.
GETTERS: list[tuple[str, dict]] = [
    ("get_tensor_model_parallel_group", {}), ("get_pipeline_model_parallel_group", {}),
    ("get_model_parallel_group", {}), ("get_context_parallel_group", {}),
    ("get_data_parallel_group", {}), ("get_data_parallel_group", {"with_context_parallel": True}),
    ("get_data_parallel_group", {"with_gtp_remat": False}),
    ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}),
    ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True, "with_gtp_remat": False}),
    ("get_embedding_group", {"check_initialized": False}), ("get_position_embedding_group", {"check_initialized": False}),
    ("get_amax_reduction_group", {}), ("get_amax_reduction_group", {"with_context_parallel": True}),
    ("get_amax_reduction_group", {"tp_only_amax_red": True}),
    ("get_tensor_and_data_parallel_group", {}), ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("get_tensor_and_context_parallel_group", {}),
    ("get_hierarchical_context_parallel_groups", {"check_initialized": False}),
    ("get_gtp_weight_remat_group", {}), ("get_expert_gtp_weight_remat_group", {}),
    ("get_expert_model_parallel_group", {}), ("get_expert_tensor_parallel_group", {}),
    ("get_expert_tensor_and_model_parallel_group", {}), ("get_expert_tensor_model_pipeline_parallel_group", {}),
    ("get_expert_tensor_model_pipeline_parallel_group", {"with_egtp_remat": True}),
    ("get_expert_data_parallel_group", {}), ("get_expert_data_parallel_group", {"with_gtp_remat": False}),
    ("get_expert_data_parallel_group", {"partial_expert_data_parallel": True, "with_gtp_remat": False}),
    ("get_intra_distributed_optimizer_instance_group", {}),
    ("get_inter_distributed_optimizer_instance_group", {"check_initialized": False}),
    ("get_tensor_model_parallel_world_size", {}), ("get_tensor_model_parallel_rank", {}),
    ("get_pipeline_model_parallel_world_size", {}), ("get_pipeline_model_parallel_rank", {}),
    ("get_data_parallel_world_size", {}), ("get_data_parallel_rank", {}),
    ("get_data_parallel_world_size", {"with_gtp_remat": False}), ("get_data_parallel_rank", {"with_gtp_remat": False}),
    ("get_data_parallel_world_size", {"with_context_parallel": True}),
    ("get_data_parallel_rank", {"with_context_parallel": True}),
    ("get_context_parallel_world_size", {}), ("get_context_parallel_rank", {}),
    ("get_context_parallel_global_ranks", {}),
    ("get_tensor_and_context_parallel_world_size", {}), ("get_tensor_and_context_parallel_rank", {}),
    ("get_gtp_weight_remat_world_size", {}), ("get_gtp_weight_remat_rank", {}),
    ("get_gtp_weight_remat_global_ranks", {}),
    ("get_expert_gtp_weight_remat_world_size", {}), ("get_expert_gtp_weight_remat_rank", {}),
    ("get_expert_gtp_weight_remat_global_ranks", {}),
    ("get_expert_model_parallel_world_size", {}), ("get_expert_model_parallel_rank", {}),
    ("get_expert_tensor_parallel_world_size", {}), ("get_expert_tensor_parallel_rank", {}),
    ("get_expert_tensor_and_model_parallel_world_size", {}), ("get_expert_tensor_and_model_parallel_rank", {}),
    ("get_expert_data_parallel_world_size", {}), ("get_expert_data_parallel_rank", {}),
    ("get_expert_data_parallel_world_size", {"with_gtp_remat": False}),
    ("get_expert_data_parallel_rank", {"with_gtp_remat": False}),
    ("get_tensor_model_parallel_src_rank", {}), ("get_model_parallel_src_rank", {}),
    ("get_data_parallel_src_rank", {}), ("get_data_parallel_src_rank", {"with_context_parallel": True}),
    ("get_expert_model_parallel_src_rank", {}),
    ("get_pipeline_model_parallel_first_rank", {}), ("get_pipeline_model_parallel_last_rank", {}),
    ("get_pipeline_model_parallel_next_rank", {}), ("get_pipeline_model_parallel_prev_rank", {}),
    ("is_pipeline_first_stage", {}), ("is_pipeline_last_stage", {}),
    ("is_rank_in_embedding_group", {}), ("is_rank_in_position_embedding_group", {}),
    ("get_virtual_pipeline_model_parallel_world_size", {}), ("get_all_ranks", {}),
    ("get_hybrid_data_context_parallel_groups", {"group_size": 2}),
    ("get_hybrid_data_context_parallel_groups", {"group_size": 4}),
    ("get_hybrid_data_context_parallel_groups", {"group_size": 8}),
]

#: configs: Megatron initialize_model_parallel keyword arguments, world size, ranks to check
CONFIGS: list[tuple[dict, int, list[int]]] = [
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, gtp_remat_size=2), 64, [0, 1, 3, 17, 33, 63]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1, expert_gtp_remat_size=2), 64, [0, 5, 22, 41, 63]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2, gtp_remat_size=4, expert_model_parallel_size=4),
     32, [0, 7, 18, 31]),
    (dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4, gtp_remat_size=2, expert_gtp_remat_size=2,
          expert_model_parallel_size=2, order="tp-cp-ep-dp-pp"), 32, [0, 9, 30]),
    (dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, gtp_remat_size=2, order="tp-ep-cp-dp-pp"), 32,
     [0, 5, 31]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2,
          expert_model_parallel_size=2), 16, [0, 5, 15]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          num_distributed_optimizer_instances=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1), 32,
     [0, 13, 31]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]), 16,
     [0, 3, 14]),
    # hybrid context parallelism: slices that are blocks of the grid, ones that are not (cp=3 cut in twos), and
    # Megatron's short last slice (dp·cp = 10 in fours)
    (dict(context_parallel_size=2, hybrid_context_parallel=True), 16, [0, 5, 15]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
          hybrid_context_parallel=True), 32, [0, 7, 30]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=3, hybrid_context_parallel=True, order="cp-tp-dp-pp"),
     12, [0, 4, 11]),
    (dict(context_parallel_size=2, hybrid_context_parallel=True), 10, [0, 9]),
    # rank_offset: the layout on ranks 8..23 of 32 (ranks outside it: nothing), with and without experts/hybrid
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, rank_offset=8, local_world_size=16), 32,
     [0, 8, 13, 23, 31]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
          hybrid_context_parallel=True, rank_offset=4, local_world_size=16), 24, [3, 4, 11, 19]),
]


#: id(module) -> its module-level state (``_UPPER_CASE`` globals) before its first initialisation
_INITIAL: dict[int, dict[str, Any]] = {}


def load_megatron(path: str | None = None) -> types.ModuleType:
    """Megatron's parallel_state: the installed one, or the source file at ``path`` loaded as a submodule of the
    installed megatron.core (its relative imports resolve there; a missing ``inference.symmetric_memory`` — newer
    than the installed version — is stubbed, as it only matters on CUDA)."""
    if path is None:
        from megatron.core import parallel_state

        return parallel_state
    name = "megatron.core.symmetric_memory_stub"
    try:
        import megatron.core.inference.symmetric_memory  # noqa: F401
    except ImportError:
        stub = types.ModuleType("megatron.core.inference.symmetric_memory")

        class SymmetricMemoryManager:  # noqa: D401 - stand-in, CUDA only in Megatron
            @staticmethod
            def destroy() -> None:
                return None

        stub.SymmetricMemoryManager = SymmetricMemoryManager
        sys.modules["megatron.core.inference.symmetric_memory"] = stub
    del name
    spec = importlib.util.spec_from_file_location("megatron.core._parallel_state_src", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _norm(value: Any) -> Any:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dist.ProcessGroup):
        return tuple(_norm(v) for v in value)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def record(mod: Any, kw: dict) -> dict[str, Any]:
    """Every getter's normalised answer after ``mod.initialize_model_parallel(**kw)``."""
    _initial = _INITIAL.setdefault(id(mod), {k: copy.copy(v) for k, v in vars(mod).items() if k[:1] == "_"
                                             and k[1:2].isupper() and isinstance(v, (type(None), bool, int, dict, list))})
    mod.initialize_model_parallel(**kw, create_gloo_process_groups=False)
    out = {}
    try:
        for name, args in GETTERS:
            key = f"{name}({', '.join(f'{k}={v}' for k, v in args.items())})"
            fn: Callable | None = getattr(mod, name, None)
            if fn is None or not set(args) <= set(inspect.signature(fn).parameters) or (
                    name == "get_all_ranks" and not hasattr(mod, "get_gtp_weight_remat_rank")):
                out[key] = "absent"  # a getter (or argument, or 0.19's get_all_ranks format) this version lacks
                continue
            try:
                out[key] = _norm(fn(**args))
            except Exception:  # noqa: BLE001 - an assertion in Megatron, a StateError in megashard: both "raises"
                out[key] = "raises"
    finally:
        mod.destroy_model_parallel()
        # Megatron 0.19's destroy_model_parallel leaves some globals set (the hierarchical cp and hybrid dp-cp groups,
        # several global-rank lists): put back what the module held before its first initialisation, so that the
        # next config starts from nothing, as megashard's does
        for name, value in _initial.items():
            setattr(mod, name, copy.copy(value))
    return out


def compare(megatron: Any, configs=CONFIGS) -> tuple[int, int, list[str]]:
    """``(equal, total, differences)`` over ``configs`` (each on its listed ranks of a fake world)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megashard.parallel_state as ms

    accepted = set(inspect.signature(megatron.initialize_model_parallel).parameters)
    equal = total = 0
    diffs: list[str] = []
    for kw, world, ranks in configs:
        if not set(kw) <= accepted:
            continue  # an option this Megatron version lacks (gtp_remat before 0.19)
        for rank in ranks:
            got = {}
            for side, mod in (("megatron", megatron), ("megashard", ms)):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
                try:
                    got[side] = record(mod, kw)
                finally:
                    dist.destroy_process_group()
            for key, want in got["megatron"].items():
                if want == "absent":
                    continue  # a getter this Megatron version lacks
                total += 1
                if got["megashard"][key] == want:
                    equal += 1
                else:
                    diffs.append(f"{kw} world={world} rank={rank} {key}: megatron {want} megashard {got['megashard'][key]}")
    return equal, total, diffs


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    mod = load_megatron(sys.argv[1] if len(sys.argv) > 1 else None)
    eq, tot, diffs = compare(mod)
    for d in diffs:
        print(d)
    print(f"{eq}/{tot} values equal (Megatron {getattr(mod, '__file__', '?')})")
