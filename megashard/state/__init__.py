"""The third step of the flow: the process groups, meshes and per-rank state of a layout on a running world.

    state = megashard.state.initialize(ParallelConfig(tp=2, dp_outer=2))   # under torchrun
    state.group("tp"); state.fsdp_mesh; state.locals.rng_tracker
    megashard.state.destroy()

Modules, in the order a state is built: ``devices`` (which device and backend; the default process group),
``agreement`` (every rank runs the same config), ``pool`` (communicators, shared by all states of a process),
``core`` (:class:`ParallelState`: groups and gloo twins), ``meshes`` (device meshes over those groups),
``hyper_grid`` (Megatron's ``HyperCommGrid`` over the same pool, members only),
``modules`` (one state per module of a multi-module job, and the bridge across a seam),
``layout_locals`` (per-layout RNG tracker, memory buffer, virtual-pipeline rank), ``current`` (the current state
and the module-level functions); and what runs on a state: ``rng_tracker`` (named RNG streams), ``rng`` (the
current state's tracker and Megatron's seeding), ``memory`` (scratch buffers), ``index`` (the FSDP/HSDP view),
``pg_collection`` (Megatron's ``ProcessGroupCollection``),
``recompute`` (activation recompute that replays the RNG), ``te`` (optional TransformerEngine).
"""
from megashard.state.core import ParallelState
from megashard.state.current import (
    current_locals,
    destroy,
    get_parallel_state,
    initialize,
    is_initialized,
    set_parallel_state,
)
from megashard.state.devices import (
    LAUNCHER_ENV,
    check_devices,
    cuda_unavailable_reason,
    current_device,
    end_distributed,
    init_distributed,
    resolve_backend,
)
from megashard.state.hyper_grid import HyperCommGrid
from megashard.state.layout_locals import LayoutLocals
from megashard.state.meshes import VIEW_AXES
from megashard.state.modules import ModuleBridge, init_module_state
from megashard.state.pool import pooled_group_count, release_process_groups

__all__ = [
    "HyperCommGrid", "LAUNCHER_ENV", "LayoutLocals", "ModuleBridge", "ParallelState", "VIEW_AXES", "check_devices",
    "cuda_unavailable_reason", "current_device", "current_locals", "destroy", "end_distributed", "get_parallel_state",
    "init_distributed", "init_module_state", "initialize", "is_initialized", "pooled_group_count",
    "release_process_groups", "resolve_backend", "set_parallel_state",
]
