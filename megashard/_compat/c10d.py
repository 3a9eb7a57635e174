"""Process-group internals of ``torch.distributed.distributed_c10d``: a group's backend options and timeout, the fake
backend and backend creators, the default store, destroying a members-only group, the live group count, and
object collectives without numpy (:mod:`megashard.state`, :mod:`megashard.doctor`, tests, benchmarks).
"""
from __future__ import annotations

import torch


# --- a process group's backend object (tests/gpu: the NCCL options a communicator was created with) -----------
def backend_options(group, device) -> object:
    """The options of ``group``'s backend for ``device`` (``ProcessGroupNCCL.Options`` on NCCL): what the
    communicator was created with (high-priority stream, ``config.cga_cluster_size`` / ``max_ctas`` / ...)."""
    return group._get_backend(torch.device(device)).options


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


def members_only_options(pg_options, backend):
    """``pg_options`` for a group its members create alone (``new_group(use_local_synchronization=True)``), such
    that torch builds its communicator among the members instead of splitting the default group's.

    Where the default group is bound to a device, torch makes every later group of the same backend by splitting the
    default group's communicator (``_get_split_source``). ``ncclCommSplit`` is collective over the whole default
    group - torch has the non-members do a "no-color" split, but only when they call ``new_group``, which
    members-only creation spares them - so the members of a group that not every rank is in (the pipeline-edge
    groups, a multi-module layout's groups) could wait for ranks that never come. torch 2.15's NCCL (``nccl2``, its
    default ``nccl``) binds the default group to its device when it creates it (``_nccl2_device``): that is every
    NCCL job on 2.15. ``lazy_init`` on the options (2.15's ``_new_process_group_helper``: "a lazy_init group is not
    created by splitting") keeps the group out of the split, so its members build it among themselves as on 2.13.
    Gloo's creator ignores the split source (it builds every group afresh), and other backends, unbound default
    groups and torch without ``lazy_init`` (2.11, 2.13) get ``pg_options`` as they are. Read from torch's source
    and checked on CPU; unproven on GPUs (docs/gpu.md)."""
    import torch.distributed as dist

    if not dist.is_initialized() or getattr(dist.group.WORLD, "bound_device_id", None) is None:
        return pg_options
    if "nccl" not in str(backend or dist.get_backend()).lower():
        return pg_options
    if pg_options is None:
        try:
            from torch.distributed import ProcessGroupNCCL
        except ImportError:  # a build without NCCL: there is nothing to split
            return None
        fresh = ProcessGroupNCCL.Options()
        if not hasattr(fresh, "lazy_init"):  # torch 2.11 - 2.13: no way to opt out; keep torch's own default options
            return None
        fresh.is_high_priority_stream = False  # what torch's NCCL creator sets on options it makes itself
        pg_options = fresh
    if hasattr(pg_options, "lazy_init"):
        pg_options.lazy_init = True
    return pg_options


def group_timeout(group, device: str = "cpu"):
    """The timeout (a ``timedelta``) ``group``'s backend for ``device`` was created with (gloo: the group's
    ``ProcessGroupGloo.Options``; NCCL: ``ProcessGroupNCCL.Options``), or None where the backend keeps none."""
    try:
        backend = group._get_backend(torch.device(device))
    except (AttributeError, RuntimeError):
        return None
    return getattr(getattr(backend, "options", None), "_timeout", None)


# --- fake backend and backend creators (benchmarks/init_scale.py, tests/test_fake_scale.py) ---------------
def fake_store():
    """A ``FakeStore`` for ``init_process_group("fake", store=..., rank=r, world_size=W)``: one process
    simulates one rank of any world size. Importing its module registers the ``fake`` backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


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


# --- the default group's store (megashard.doctor publishes each rank's record there) -------------------------------
def default_store():
    """The store the default process group was created with (torchrun's TCPStore, a FileStore, ...)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


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


# --- members-only groups (megashard.state.pool) ------------------------------------------------------------
class _DestroyedGroupName:
    """Stands in torch's group-name map for a destroyed members-only group (see :func:`destroy_group_keep_name`)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def shutdown(self) -> None:  # torch shuts every named group down when the default group is destroyed
        return None


def destroy_group_keep_name(pg) -> None:
    """Destroy a members-only process group (its backend, sockets and threads) but keep its name taken.

    torch names a ``use_local_synchronization`` group by a hash of its ranks and of the *number* of named groups
    (``_hash_ranks_to_str``) and rendezvouses under that name in the default store: a destroyed group's name coming
    back (same ranks, same count) would read the dead group's store keys and connect to closed sockets. Keeping
    the count (a placeholder entry under the same name) makes every later name new; the entries go with the
    default group (``destroy_process_group()`` clears the map). torch 2.15 counts group creations instead
    (:func:`members_only_name_salt`), which a destroy never lowers: there the placeholder only keeps the name taken."""
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


def live_process_groups() -> list:
    """This process's live process groups other than the default group (torch's group map)."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in c10d._world.pg_map if pg is not c10d._world.default_pg]


def members_only_name_salt() -> int:
    """The count torch salts the name of the next members-only group with (``_hash_ranks_to_str``): the number of
    group creations of this process (``_world.group_count``) where torch counts those (2.15; a group is named on its
    members only, so a rank that created fewer groups than its peers names the next one differently), else the
    number of live named groups (``len(_world.pg_names)``: torch 2.11 and 2.13). Probed from torch's source."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    try:
        counts_creations = "group_count" in inspect.getsource(c10d._hash_ranks_to_str)
    except (OSError, TypeError, AttributeError):  # no source (a frozen install): decide by release
        from megashard._compat.version import TORCH_VERSION

        counts_creations = TORCH_VERSION >= (2, 15)
    return int(c10d._world.group_count) if counts_creations else len(c10d._world.pg_names)
