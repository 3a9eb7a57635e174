"""The one place megashard touches private PyTorch APIs (supported: torch 2.11 - 2.14).

Every private name megashard needs is imported here, with a fallback or a clear error where it moved
between releases; the rest of the package imports these names from this module only.
"""
from __future__ import annotations

import os

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


# --- DTensor placement internals (used by megashard.tensors.shape / placements) ---------------------
# `_StridedShard` is the placement FSDP2 gives a parameter whose dim is sharded by TP and FSDP at once. It is
# looked up on first use (module ``__getattr__`` below): importing DTensor costs ~0.5 s, and `import
# megashard.parallel_state` must not pay it.
def __getattr__(name: str):
    if name == "_StridedShard":
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_local_shape_offset_fn():
    """The plain-data core of DTensor's own local-shape/offset arithmetic (torch >= 2.9), or None."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - moved or renamed in some release
        return None
    return _compute_local_shape_and_global_offset


def torch_compute_local_shape_and_global_offset(global_shape, mesh, placements):
    """PyTorch's own `compute_local_shape_and_global_offset` for the calling rank (reference answer)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def torch_local_shape_and_offset_at(global_shape, mesh_shape, coordinate, placements):
    """PyTorch's answer for any mesh coordinate without a process group, or None if this torch lacks it."""
    fn = _torch_local_shape_offset_fn()
    if fn is None:
        return None
    return fn(global_shape, tuple(mesh_shape), list(coordinate), placements)


# --- autograd checkpoint guard (used by megashard.state.recompute) --------------------------------------
# False while torch.autograd.grad() (rather than .backward()) runs a graph: recompute cannot work then.
def autograd_checkpoint_valid() -> bool:
    """`torch.autograd._is_checkpoint_valid()`, or True on a torch without it."""
    fn = getattr(torch.autograd, "_is_checkpoint_valid", None)
    return True if fn is None else bool(fn())


# --- DeviceMesh internals (flattened-name registry of a root mesh) -------------------------------
def mesh_flattened_names(device_mesh) -> list[str]:
    """Names of meshes flattened (``_flatten``) from ``device_mesh``'s root; [] where the API is absent."""
    try:
        root = device_mesh._get_root_mesh()
    except AttributeError:
        root = device_mesh
    mapping = getattr(root, "_flatten_mapping", None)
    if isinstance(mapping, dict):
        return list(mapping)
    try:  # torch <= 2.9 kept them in a global registry
        from torch.distributed.device_mesh import _mesh_resources

        return list(_mesh_resources.root_to_flatten_mapping.get(root, {}))
    except (ImportError, AttributeError):
        return []


def mesh_release_groups(device_mesh) -> None:
    """Drop the process groups a DeviceMesh keeps in its ``_pg_registry`` (torch >= 2.10; a no-op where it has
    none). After its state is destroyed a mesh must not be used; caches of DTensor sharding propagation may keep
    the mesh itself alive until interpreter shutdown, and with it — without this — every group and its backend
    threads (megashard.state.pool explains why those must end before Python does)."""
    registry = getattr(device_mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


# --- a process group's backend object (tests/gpu: the NCCL options a communicator was created with) -----------
def backend_options(group, device) -> object:
    """The options of ``group``'s backend for ``device`` (``ProcessGroupNCCL.Options`` on NCCL): what the
    communicator was created with (high-priority stream, ``config.cga_cluster_size`` / ``max_ctas`` / ...)."""
    return group._get_backend(torch.device(device)).options


# --- pipeline stages (megashard.models.pipeline) -----------------------------------------------------
def pipeline_stage_class() -> type:
    """``torch.distributed.pipelining.PipelineStage``, or a subclass that never sends to its own rank.

    Schedules that place two adjacent stages on one rank (``zbv``'s V: stages 1 and 2 on pp rank 1) pass
    activations between them in memory, but where the schedule warms its communicators up with the stages'
    ``_get_init_p2p_neighbors_ops`` (torch 2.11; 2.13 votes instead), those ops include an isend/irecv to the
    stage's own rank, which gloo has no connection for ("Pair is not connected"). Where that method exists the
    subclass drops the ops whose peer is this rank; everything else is PyTorch's own stage.
    """
    from torch.distributed.pipelining import PipelineStage

    if not callable(getattr(PipelineStage, "_get_init_p2p_neighbors_ops", None)):
        return PipelineStage
    if not _STAGE_CLASS:
        class NoSelfP2PStage(PipelineStage):
            def _get_init_p2p_neighbors_ops(self):
                ops = super()._get_init_p2p_neighbors_ops()
                return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]

        _STAGE_CLASS.append(NoSelfP2PStage)
    return _STAGE_CLASS[0]


_STAGE_CLASS: list = []  # built on first use: importing pipelining loads DTensor


# --- process-group timeouts (megashard.state.pool; tests read them back) ------------------------------------
def options_with_timeout(pg_options, timeout):
    """``pg_options`` (e.g. ``ProcessGroupNCCL.Options``) carrying ``timeout`` in its private ``_timeout``.

    ``new_group(timeout=..., pg_options=...)`` gives the NCCL communicator ``timeout`` (it sets
    ``pg_options._timeout = timeout``), but first warns "backend_options._timeout was specified, but timeout kwarg
    has a default value that will always override it" whenever the two differ (torch 2.11-2.13) - so, at every
    group megashard created with options, since a fresh Options object holds torch's default (10 min). Setting
    the same value first is what torch does anyway, without the warning. Objects without ``_timeout`` pass as
    they are."""
    if pg_options is not None and hasattr(pg_options, "_timeout"):
        pg_options._timeout = timeout
    return pg_options


def group_timeout(group, device: str = "cpu"):
    """The timeout (a ``timedelta``) ``group``'s backend for ``device`` was created with (gloo: the group's
    ``ProcessGroupGloo.Options``; NCCL: ``ProcessGroupNCCL.Options``), or None where the backend keeps none."""
    try:
        backend = group._get_backend(torch.device(device))
    except (AttributeError, RuntimeError):
        return None
    return getattr(getattr(backend, "options", None), "_timeout", None)


# --- fake backend, `_flatten`, backend creators (benchmarks/init_scale.py, tests/test_fake_scale.py) ---
def fake_store():
    """A ``FakeStore`` for ``init_process_group("fake", store=..., rank=r, world_size=W)``: one process
    simulates one rank of any world size. Importing its module registers the ``fake`` backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def mesh_flatten(device_mesh, name: str):
    """``device_mesh._flatten(name)``: PyTorch's flattened 1-D view (every rank creates every group)."""
    return device_mesh._flatten(name)


def wrap_backend_creator(backend: str, wrap):
    """Replace the creator registered for plugin ``backend`` (e.g. ``"fake"``) by ``wrap(creator)``, e.g. to
    count communicators. Returns a function that restores the original creator."""
    plugins = torch.distributed.Backend._plugins
    key = backend.upper()
    old = plugins[key]
    plugins[key] = type(old)(wrap(old.creator_fn), old.extended_api)

    def restore() -> None:
        plugins[key] = old

    return restore


# --- DCP internals (megashard.checkpoint: state_dict, planners, storage) ---------------------------
# Offline (no process group) loading as DCP's own `dcp_to_torch_save` does it, DCP's nested-dict helpers,
# and the globals a `.metadata` pickle may reference (for a restricted unpickler: no arbitrary code).
def dcp_empty_state_dict_load_planner_class() -> type:
    """DCP's ``_EmptyStateDictLoadPlanner`` class: rebuilds the state dict (optionally only ``keys=``)
    from the checkpoint's metadata, for loading without a model."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


def dcp_load_state_dict(state_dict, storage_reader, planner, *, process_group=None, no_dist: bool = False) -> None:
    """DCP's ``_load_state_dict`` (``load`` without its Stateful handling), also usable with ``no_dist=True``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict, storage_reader, process_group=process_group, no_dist=no_dist, planner=planner)


def dcp_flatten_state_dict(state_dict):
    """``(flat, mappings)``: DCP's flattening of a nested state dict into dotted keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)


def dcp_set_element(root, path, value) -> None:
    """DCP's ``set_element``: put ``value`` at the (mapping) ``path`` of a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dcp_metadata_global_allowed(module: str, name: str) -> bool:
    """True if a DCP ``.metadata`` pickle may reference ``module.name``: DCP's metadata/storage classes,
    torch sizes, dtypes, layouts and memory formats, paths. Functions and other globals are refused."""
    import importlib
    import inspect

    if (module, name) in {("torch._utils", "_get_layout"), ("torch.serialization", "_get_layout"),
                          ("collections", "OrderedDict"),
                          ("builtins", "set"), ("builtins", "frozenset")}:
        return True
    if module == "pathlib":
        return name in {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
    if module in {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                  "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.storage"}:
        if module == "torch.distributed.checkpoint.filesystem" and name not in {"_StorageInfo", "_StoragePrefix"}:
            return False
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        return inspect.isclass(obj) and obj.__module__ == module
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    return False


def dcp_metadata_enum_member(owner, name):
    """``owner[name]`` if ``owner`` is an Enum class :func:`dcp_metadata_global_allowed` admits and ``name``
    one of its members, else None.

    Python 3.11.0-3.11.4 (e.g. Debian's 3.11.2) pickle an Enum member as ``getattr(EnumClass, name)``,
    so DCP metadata written there references ``builtins.getattr``. A restricted unpickler resolves that
    call through this function: attribute lookup only for members of allow-listed DCP Enum classes
    (``_MEM_FORMAT_ENCODING``, ``WriteItemType``, ...), never methods, dunders or anything else.
    """
    import enum
    import importlib

    if not (isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str)):
        return None
    module, qualname = getattr(owner, "__module__", None), getattr(owner, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str) and dcp_metadata_global_allowed(module, qualname)):
        return None
    try:  # the class must be the one its module exports under that name (not a look-alike)
        if getattr(importlib.import_module(module), qualname) is not owner:
            return None
    except (ImportError, AttributeError):
        return None
    return owner.__members__.get(name)


def dcp_narrow_tensor_by_index(tensor, offsets, sizes):
    """DCP's ``narrow_tensor_by_index``: the part of a saved chunk that a read item asks for."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, sizes)


# --- DCP's DefaultStager (megashard.checkpoint.async_save) -----------------------------------------------
_STAGER_REUSABLE: list = []


def dcp_default_stager_reusable() -> bool:
    """True if one DCP ``DefaultStager`` can stage again and again (torch 2.13: it keeps its host copies from save
    to save); False where each ``stage()`` ends by closing it (torch 2.11: ``close()`` empties its deepcopy table,
    and the next ``stage()`` fails with ``KeyError: <class 'type'>``). Decided once per process by staging a
    two-entry dict twice on the CPU (microseconds)."""
    if not _STAGER_REUSABLE:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            sd = {"t": torch.zeros(2), "cls": int}
            ok = all(stager.stage(sd)["cls"] is int for _ in range(2))
        except Exception:  # noqa: BLE001 - KeyError on torch 2.11; anything else: do not reuse either
            ok = False
        finally:
            stager.close()
        _STAGER_REUSABLE.append(ok)
    return _STAGER_REUSABLE[0]


# --- DTensor gathers on gloo with CUDA tensors (megashard.tensors.uneven.gather.full_tensor) --------------------
#: torch releases (major, minor) -> whether a DTensor gather (``redistribute`` Shard -> Replicate, ``full_tensor()``)
#: kills the process (SIGSEGV in every rank) on gloo with CUDA tensors; raw collectives (all_gather_into_tensor,
#: broadcast) work there. Filled from :func:`probe_gloo_cuda_dtensor_gather` on a GPU (tests/gpu/test_cuda_gloo.py
#: compares the two): 2.11 from torch 2.11.0+cu130 on an H100. A release not listed is treated as affected.
GLOO_CUDA_DTENSOR_GATHER_CRASHES: dict[tuple[int, int], bool] = {(2, 11): True}


def dtensor_gather_crashes(device_type: str, backend: str, version: tuple[int, int] = TORCH_VERSION,
                           table: dict | None = None) -> bool:
    """True where a DTensor gather must not be used: a CUDA mesh over gloo on a torch release that crashes there
    (per :data:`GLOO_CUDA_DTENSOR_GATHER_CRASHES`; an unlisted release counts as affected: the way round costs a
    little speed, a crash costs the job). NCCL, CPU meshes and listed unaffected releases: False."""
    if device_type != "cuda" or "gloo" not in str(backend) or "nccl" in str(backend):
        return False
    known = (GLOO_CUDA_DTENSOR_GATHER_CRASHES if table is None else table).get(tuple(version[:2]))
    return True if known is None else bool(known)


_GATHER_PROBE = r"""
import os, sys, datetime, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
rank, world, device, init = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
if device == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh(device, (world,))
full = torch.arange(48, dtype=torch.float32, device=device).reshape(8, 6)
d = distribute_tensor(full, mesh, [Shard(0)])
ok = torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full) and torch.equal(d.full_tensor(), full)
print("gathered", int(ok), flush=True)  # the verdict: what happens at teardown is not the gather's
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 3)
"""


def probe_gloo_cuda_dtensor_gather(device: str = "cuda", timeout: float = 180.0) -> bool | None:
    """Run a DTensor gather (Shard(0) -> Replicate and ``full_tensor()``) on gloo in two child processes on
    ``device`` (both on ``cuda:0`` for CUDA). True: a child died of a signal (torch's crash); False: both gathered
    the right tensor; None: undecided (the children failed otherwise or timed out). Seconds: a few (CUDA set-up)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megashard-gather-probe-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-c", _GATHER_PROBE, str(r), device, init], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2)]
        codes = []
        for p in procs:
            try:
                out = p.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0]
            # A child that reported its gather is judged by it: a crash at teardown (gloo's, seen once on torch
            # 2.11 on CPU) is not the crash this probes for.
            codes.append(0 if "gathered 1" in out else 3 if "gathered 0" in out else p.returncode)
    return probe_verdict(codes)


def probe_verdict(codes: list) -> bool | None:
    """The probe's verdict from its children's exit codes (``subprocess`` style: -N = killed by signal N)."""
    if any(c is not None and c < 0 and c != -9 for c in codes):  # SIGSEGV/SIGABRT/SIGBUS: torch crashed
        return True
    if codes and all(c == 0 for c in codes):
        return False
    return None


# --- DTensor local shard without autograd (used by megashard.tensors.uneven) -----------------------
def dtensor_local(dtensor) -> torch.Tensor:
    """The local shard of a DTensor without going through ``to_local()``'s autograd Function.

    ``DTensor._local_tensor`` costs nothing, where ``to_local()`` costs ~0.2 ms (it matters for state
    dicts of thousands of tensors); falls back to ``to_local()`` if the attribute ever disappears.
    """
    local = getattr(dtensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dtensor.to_local()


# --- object collectives without numpy (all_gather_object & co., used by megashard.checkpoint, DCP) ----
# torch's private `distributed_c10d._tensor_to_object` unpickles a received object via
# `tensor.numpy().tobytes()`, so every object collective (and with it DCP save/load) raises "Numpy is not
# available" when numpy is missing, although torch does not depend on numpy. megashard does not either:
# where numpy cannot be used, that one function is replaced by a copy into a bytearray. With numpy,
# torch's own function stays in place.
def _numpy_usable() -> bool:
    try:
        torch.zeros(1).numpy()
        return True
    except Exception:  # noqa: BLE001 - RuntimeError("Numpy is not available"), or a broken numpy install
        return False


def install_numpy_free_object_collectives() -> bool:
    """Make torch's object collectives work without numpy; True if the replacement was installed."""
    import io
    import pickle

    import torch.distributed as dist

    if not dist.is_available() or _numpy_usable():
        return False
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d._tensor_to_object, "_megashard_numpy_free", False):
        return True

    def _tensor_to_object(tensor, tensor_size, *args, **kwargs):
        size = int(tensor_size)
        buf = bytearray(size)
        if size:
            torch.frombuffer(buf, dtype=torch.uint8).copy_(tensor.reshape(-1)[:size].view(torch.uint8).cpu())
        return getattr(c10d, "_unpickler", pickle.Unpickler)(io.BytesIO(buf)).load()

    _tensor_to_object._megashard_numpy_free = True
    c10d._tensor_to_object = _tensor_to_object
    return True


# --- torch.optim.Adam internals (used by megashard.train.optim) ------------------------------------------
def adam_init_group(opt, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) -> bool:
    """``torch.optim.Adam._init_group``: fills the lists with a group's parameters that have gradients and their
    state (created on first use); returns whether any is complex. Same signature in torch 2.11 - 2.14."""
    return bool(opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps))


install_numpy_free_object_collectives()


# --- the default group's store (megashard.doctor publishes each rank's record there) -------------------------------
def default_store():
    """The store the default process group was created with (torchrun's TCPStore, a FileStore, ...)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


# --- functional collectives (megashard.doctor.intercept sees DTensor's redistribution and funcol calls) --------------
#: The Python entry points of ``torch.distributed._functional_collectives`` that start a collective (the names this
#: torch has are wrapped; DTensor's redistribution calls them by module attribute, so the wrappers see it).
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single",
    "all_gather_single_autograd", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_single", "reduce_scatter_single_autograd", "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "permute_tensor",
)


def functional_collectives():
    """The module ``torch.distributed._functional_collectives`` (private), or None where it cannot be imported."""
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:  # pragma: no cover - no distributed build
        return None
    return funcol


def functional_group_name(group, tag: str = "") -> str:
    """torch's name of the process group a functional collective's ``group`` argument means (a ProcessGroup, a
    1-d DeviceMesh, ``(mesh, dim)``, a rank list or a name)."""
    return str(functional_collectives()._resolve_group_name(group, tag))


def hook_functional_outputs(hook):
    """Let ``hook(raw, wrapped)`` see every tensor a functional collective returns, before the caller does
    (``_maybe_wrap_tensor``, private: the one function every funcol output passes through; ``raw`` is the tensor
    that ``wait_tensor`` is later called on). Returns the function that undoes it (None where this torch has no
    such function)."""
    funcol = functional_collectives()
    original = getattr(funcol, "_maybe_wrap_tensor", None) if funcol is not None else None
    if original is None:
        return None

    def maybe_wrap_tensor(raw):
        out = original(raw)
        hook(raw, out)
        return out

    funcol._maybe_wrap_tensor = maybe_wrap_tensor

    def undo() -> None:
        if funcol._maybe_wrap_tensor is maybe_wrap_tensor:
            funcol._maybe_wrap_tensor = original

    return undo


# --- torchrun's elastic agent (used by megashard.launch.agent) ---------------------------------------------
def elastic_agent_gives_up_on(exit_codes: frozenset) -> bool:
    """Make the elastic agent ``torch.distributed.run`` builds (``LocalElasticAgent``, private monitoring loop) stop
    instead of restarting the workers when a failed worker exited with one of ``exit_codes``: an error a restart
    cannot fix (a bad config, a checkpoint of another model) must not burn ``--max-restarts``. The job then ends as
    if no restarts were left (ChildFailedError). Returns False where this torch's agent has another shape."""
    try:
        import torch.distributed.launcher.api as launcher_api
        from torch.distributed.elastic.agent.server.api import WorkerState
    except ImportError:  # pragma: no cover - moved in some release
        return False
    base = getattr(launcher_api, "LocalElasticAgent", None)
    if base is None or not hasattr(base, "_monitor_workers"):  # pragma: no cover
        return False
    if getattr(base, "_megashard_gives_up_on", None) is not None:
        base._megashard_gives_up_on = frozenset(exit_codes)
        return True

    class Agent(base):  # type: ignore[misc, valid-type]
        _megashard_gives_up_on = frozenset(exit_codes)

        def _monitor_workers(self, worker_group):  # noqa: ANN001 - torch's signature
            result = super()._monitor_workers(worker_group)
            failures = getattr(result, "failures", None) or {}
            if result.state == WorkerState.FAILED and any(
                    getattr(f, "exitcode", None) in self._megashard_gives_up_on for f in failures.values()):
                self._remaining_restarts = 0
            return result

    launcher_api.LocalElasticAgent = Agent
    return True


class _DestroyedGroupName:
    """Stands in torch's group-name map for a destroyed members-only group (see :func:`destroy_group_keep_name`)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def shutdown(self) -> None:  # torch shuts every named group down when the default group is destroyed
        return None


# --- torchrun's rendezvous (megashard.launch.startwatch: how many nodes joined while a node is missing) --------------
def capture_rendezvous_handlers(sink: list) -> bool:
    """Append every rendezvous handler torchrun's launcher creates (in this process) to ``sink``: the launcher's
    ``rdzv_registry.get_rendezvous_handler`` is wrapped (looked up as a module attribute at launch). False where this
    torch's launcher has another shape."""
    try:
        import torch.distributed.launcher.api as launcher_api
    except ImportError:  # pragma: no cover
        return False
    registry = getattr(launcher_api, "rdzv_registry", None)
    original = getattr(registry, "get_rendezvous_handler", None)
    if original is None:  # pragma: no cover
        return False

    def get_rendezvous_handler(params, *args, **kwargs):
        handler = original(params, *args, **kwargs)
        sink.append(handler)
        return handler

    registry.get_rendezvous_handler = get_rendezvous_handler
    return True


def rendezvous_joined(handler) -> list[str] | None:
    """The nodes (``host:pid``) that joined the current round of a dynamic rendezvous (c10d, etcd; torch's private
    ``_state_holder.state``: participants, then the wait list), or None where the handler keeps no such state."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if state is None:
        return None
    nodes = list(getattr(state, "participants", {}) or {}) + list(getattr(state, "wait_list", ()) or ())
    return [f"{getattr(n, 'addr', '?')}:{getattr(n, 'pid', '?')}" for n in nodes]


def destroy_group_keep_name(pg) -> None:
    """Destroy a members-only process group (its backend, sockets and threads) but keep its name taken.

    torch names a ``use_local_synchronization`` group by a hash of its ranks and of the *number* of named groups
    (``_hash_ranks_to_str``) and rendezvouses under that name in the default store: a destroyed group's name coming
    back (same ranks, same count) would read the dead group's store keys and connect to closed sockets. Keeping
    the count (a placeholder entry under the same name) makes every later name new; the entries go with the
    default group (``destroy_process_group()`` clears the map)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    name = c10d._world.pg_names.get(pg)
    dist.destroy_process_group(pg)
    if name is not None:
        c10d._world.pg_names[_DestroyedGroupName(name)] = name


def live_process_group_count() -> int:
    """Live process groups of this process (torch's group map, the default group included)."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)
