"""DCP planners of megashard checkpoints, and the weights-only rule for every non-tensor object.

Save — :class:`MegashardSavePlanner`: replicated shards (a TP-replicated bias, HSDP replicas, the
optimizer ``step``) are held by several ranks; each is written by exactly one holder, chosen by
:func:`megashard.checkpoint.distribution.distribute_shards_to_ranks` so the bytes per rank balance.

Load — :class:`MegashardLoadPlanner` (and :func:`empty_state_dict_load_planner` for the offline tools):
non-tensor items are read with ``torch.load(weights_only=True)``, never unpickled freely; the same
rule is checked at save time (:func:`check_weights_only`), so what is saved can be loaded.
"""
from __future__ import annotations

import dataclasses
import io
from collections import defaultdict
from typing import Any, Optional, Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from megashard._compat import dcp_empty_state_dict_load_planner_class, dcp_set_element
from megashard.checkpoint.distribution import distribute_shards_to_ranks
from megashard.errors import CheckpointCorruptedError, CheckpointError

__all__ = [
    "MegashardLoadPlanner",
    "MegashardSavePlanner",
    "WeightsOnlyBytes",
    "check_weights_only",
    "dedup_write_items",
    "empty_state_dict_load_planner",
    "load_weights_only",
]


def _item_id(index) -> tuple:
    """A sortable shard id of a DCP write item: ``(fqn, global offset)``."""
    return (index.fqn, tuple(int(o) for o in index.offset) if index.offset is not None else ())


def _item_bytes(item) -> int:
    """Bytes of the chunk a write item stores (DCP's ``tensor_storage_size`` counts the whole tensor)."""
    td = item.tensor_data
    if td is None:
        return 1  # a non-tensor object: size unknown before pickling, counted as DCP counts it
    n = 1
    for s in td.chunk.sizes:
        n *= int(s)
    return n * td.properties.dtype.itemsize


def dedup_write_items(all_plans: Sequence[SavePlan]) -> tuple[list[SavePlan], dict[tuple, int]]:
    """Keep every write item in exactly one plan: the holder :func:`distribute_shards_to_ranks` picks.

    ``all_plans[r]`` is rank ``r``'s local plan; an item in several plans is a replica (same fqn and
    offset). Sizes are the bytes of each chunk (1 for a non-tensor item).

    Returns: the new plans and ``{(fqn, offset): writing rank}`` for every item.
    """
    holders: dict[tuple, list[int]] = defaultdict(list)
    sizes: dict[tuple, int] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            sid = _item_id(item.index)
            holders[sid].append(rank)
            if sid not in sizes:
                sizes[sid] = _item_bytes(item)
    assignment = distribute_shards_to_ranks(dict(holders), sizes, max(len(all_plans), 1))
    plans = [
        dataclasses.replace(plan, items=[it for it in plan.items if assignment[_item_id(it.index)] == rank])
        for rank, plan in enumerate(all_plans)
    ]
    return plans, assignment


class MegashardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that replicated items are spread by megashard's distribution.

    After a save, ``write_assignment`` (on the coordinator, rank 0) maps ``(fqn, offset)`` to the rank
    that wrote it; the data file names (``__<rank>_<n>.distcp``) say the same.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.write_assignment: dict[tuple, int] = {}

    def create_global_plan(self, all_plans: list[SavePlan]):
        plans, self.write_assignment = dedup_write_items(all_plans)
        # The default dedup that follows finds nothing left to remove.
        return super().create_global_plan(plans)



def load_weights_only(value: io.BytesIO, what: str) -> Any:
    """``torch.load(value, weights_only=True)`` on the CPU; anything else raises CheckpointCorruptedError naming ``what``."""
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: not a plain weights-only object
        raise CheckpointCorruptedError(
            f"{what} cannot be loaded with torch.load(weights_only=True) ({type(e).__name__}: {e}); megashard only "
            "loads tensors, numbers, strings and containers of them from disk, never arbitrary pickled objects"
        ) from None


class WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor items load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_weights_only(value, f"checkpoint item {fqn!r}")
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class MegashardLoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner with weights-only loading of non-tensor items."""



def check_weights_only(obj: Any, what: str) -> None:
    """Raise CheckpointError naming ``what`` unless ``obj`` round-trips through ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{what} must hold only tensors, numbers, strings, None and lists/tuples/dicts of them, so that it "
            f"loads with torch.load(weights_only=True); it does not ({type(e).__name__}: {str(e)[:300]})"
        ) from None



def empty_state_dict_load_planner(keys: Optional[set] = None):
    """DCP's planner that loads a checkpoint into an empty state dict (offline tools), weights-only.

    ``keys``: flattened keys (or prefixes) to load; None loads everything.
    """
    cls = type("WeightsOnlyEmptyStateDictLoadPlanner", (WeightsOnlyBytes, dcp_empty_state_dict_load_planner_class()), {})
    return cls(keys=keys)

