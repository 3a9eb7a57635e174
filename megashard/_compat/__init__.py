"""The one place megashard touches private PyTorch APIs (supported: torch 2.11 - 2.15).

Every private name megashard needs is imported here, with a fallback or a clear error where it moved between
releases; the rest of the package imports these names from this package only (``from megashard._compat import
...``). One module per part of PyTorch it adapts:

* ``version``: :data:`TORCH_VERSION`, what the others branch on where a capability cannot be probed;
* ``c10d``: process groups (backend options and timeouts, the fake backend, the default store, destroying a
  members-only group, object collectives without numpy);
* ``mesh``: DeviceMesh (flattened meshes, the groups a mesh keeps);
* ``dtensor``: DTensor (``_StridedShard``, local shapes and offsets, a local shard without autograd);
* ``dtensor_gather``: which releases crash gathering a DTensor on gloo with CUDA tensors, and the probe;
* ``dcp``: torch.distributed.checkpoint (offline loading, nested dicts, the metadata allow-list, the stager);
* ``dispatch``: ``TorchDispatchMode`` and pytree (the advisor's live-memory count; no modes for a rehearsal's
  transfers);
* ``pipelining``: the pipeline stage; ``autograd``: the checkpoint guard and Adam's ``_init_group``;
  ``elastic``: torchrun's agent and its rendezvous; ``funcol``: the functional collectives (what the hang doctor
  wraps to see DTensor's).

Nothing here imports DTensor, the device mesh or yaml when imported (``import megashard.parallel_state`` must not
pay for them): ``_StridedShard`` is looked up on first use.
"""
from __future__ import annotations

from megashard._compat.autograd import adam_init_group, autograd_checkpoint_valid
from megashard._compat.dispatch import dispatch_api, no_dispatch_modes
from megashard._compat.c10d import (
    backend_options,
    default_store,
    destroy_group_keep_name,
    fake_store,
    group_timeout,
    install_numpy_free_object_collectives,
    live_process_group_count,
    live_process_groups,
    members_only_name_salt,
    members_only_options,
    options_with_timeout,
    wrap_backend_creator,
)
from megashard._compat.dcp import (
    dcp_default_stager_reusable,
    dcp_empty_state_dict_load_planner_class,
    dcp_flatten_state_dict,
    dcp_load_state_dict,
    dcp_metadata_enum_member,
    dcp_metadata_global_allowed,
    dcp_narrow_tensor_by_index,
    dcp_set_element,
)
from megashard._compat.dtensor import (
    dtensor_local,
    strided_shard_class,
    torch_compute_local_shape_and_global_offset,
    torch_local_shape_and_offset_at,
)
from megashard._compat.dtensor_gather import (
    GLOO_CUDA_DTENSOR_GATHER_CRASHES,
    dtensor_gather_crashes,
    probe_gloo_cuda_dtensor_gather,
    probe_verdict,
)
from megashard._compat.elastic import (
    RENDEZVOUS_NODE_ENV,
    RENDEZVOUS_ROUND_ENV,
    abort_process_groups,
    capture_rendezvous_handlers,
    elastic_agent_gives_up_on,
    elastic_agent_live_hooks,
    export_rendezvous_round,
    rendezvous_agent,
    rendezvous_dropped,
    rendezvous_forget_lost,
    rendezvous_joined,
    set_group_world_size,
)
from megashard._compat.funcol import (
    FUNCTIONAL_COLLECTIVES,
    functional_collectives,
    functional_group,
    functional_group_name,
    hook_functional_outputs,
    process_group_by_name,
)
from megashard._compat.mesh import mesh_flatten, mesh_flattened_names, mesh_release_groups
from megashard._compat.pipelining import pipeline_stage_class, pipelines_infer_shapes_on_fake
from megashard._compat.version import TORCH_VERSION

__all__ = [
    "FUNCTIONAL_COLLECTIVES", "GLOO_CUDA_DTENSOR_GATHER_CRASHES", "RENDEZVOUS_NODE_ENV", "RENDEZVOUS_ROUND_ENV",
    "TORCH_VERSION",
    "abort_process_groups", "adam_init_group", "autograd_checkpoint_valid", "backend_options", "capture_rendezvous_handlers",
    "dcp_default_stager_reusable", "dcp_empty_state_dict_load_planner_class", "dcp_flatten_state_dict",
    "dcp_load_state_dict", "dcp_metadata_enum_member", "dcp_metadata_global_allowed", "dcp_narrow_tensor_by_index",
    "dcp_set_element", "default_store", "destroy_group_keep_name", "dispatch_api", "dtensor_gather_crashes",
    "dtensor_local", "elastic_agent_gives_up_on", "elastic_agent_live_hooks", "export_rendezvous_round", "fake_store",
    "functional_collectives", "functional_group", "functional_group_name", "group_timeout", "hook_functional_outputs",
    "install_numpy_free_object_collectives", "pipelines_infer_shapes_on_fake", "process_group_by_name",
    "live_process_group_count", "live_process_groups", "members_only_name_salt", "members_only_options",
    "mesh_flatten", "mesh_flattened_names", "mesh_release_groups", "no_dispatch_modes", "options_with_timeout",
    "pipeline_stage_class",
    "probe_gloo_cuda_dtensor_gather", "probe_verdict", "rendezvous_agent", "rendezvous_dropped",
    "rendezvous_forget_lost", "rendezvous_joined", "set_group_world_size", "strided_shard_class",
    "torch_compute_local_shape_and_global_offset", "torch_local_shape_and_offset_at", "wrap_backend_creator",
]


def __getattr__(name: str):
    # `_StridedShard` (the placement FSDP2 gives a dim sharded by TP and FSDP at once), looked up on first use:
    # importing DTensor costs ~0.5 s.
    if name == "_StridedShard":
        return strided_shard_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# torch's object collectives unpickle through numpy: make them work without it (a no-op where numpy works).
install_numpy_free_object_collectives()
