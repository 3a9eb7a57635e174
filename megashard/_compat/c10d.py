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
