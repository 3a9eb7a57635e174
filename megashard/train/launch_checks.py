"""The ``launch`` section checked as torchrun would read it, before any process starts (no torch imported).

    check_launch(job.launch)        # ConfigError: one line naming the key, the value, the rule and the way out

:meth:`JobConfig.validate <megashard.train.config.JobConfig.validate>` runs it for every start — ``megashard run``
and its ``--dry-run`` (after the Slurm variables are applied, in :func:`megashard.launch.launcher.plan_launch`),
``megashard plan``, every worker — so what a dry run accepts, torchrun accepts:

- ``nnodes``: a count or an elastic range ``MIN:MAX`` (:func:`megashard.train.sections.parse_node_range`);
- ``rdzv_backend``: one torchrun knows (:func:`rendezvous_backends`: its own and those its plugins register);
- ``rdzv_endpoint``: ``host:port`` exactly as torchrun parses it (no scheme such as ``http://``, no path);
- ``static`` rendezvous on several nodes: a fixed node count, this node's ``node_rank`` and the endpoint of node 0;
- the elastic settings: ``rdzv_last_call``, ``rdzv_node_timeout``, ``unfillable_world``.
"""
from __future__ import annotations

import functools
import re
from typing import Optional

from megashard.errors import ConfigError, unknown_names
from megashard.train.sections import RECOVERY, UNFILLABLE_WORLD, LaunchConfig, parse_node_range

__all__ = ["check_launch", "check_endpoint", "rendezvous_backends", "TORCHRUN_BACKENDS", "MIN_NODE_TIMEOUT_S"]

#: The rendezvous backends torchrun registers itself (torch.distributed.elastic.rendezvous.registry).
TORCHRUN_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")
#: The backends whose rendezvous lets nodes leave and join (an elastic range): ``static`` has a fixed node set.
ELASTIC_BACKENDS = ("c10d", "etcd", "etcd-v2")
#: Shortest ``launch.rdzv_node_timeout``: three heartbeats of at least a second each.
MIN_NODE_TIMEOUT_S = 3
_HOST = re.compile(r"^[\w.:-]+$")  # torchrun's rule for the host of an endpoint (parse_rendezvous_endpoint)


@functools.lru_cache(maxsize=1)
def rendezvous_backends() -> tuple[str, ...]:
    """torchrun's own backends and those installed packages register (entry point group ``torchrun.handlers``)."""
    try:
        from importlib.metadata import entry_points

        plugins = tuple(sorted(e.name for e in entry_points(group="torchrun.handlers")))
    except Exception:  # noqa: BLE001 - a broken package's metadata: torchrun would skip it too
        plugins = ()
    return TORCHRUN_BACKENDS + tuple(p for p in plugins if p not in TORCHRUN_BACKENDS)


def check_endpoint(endpoint: str, where: str = "launch.rdzv_endpoint") -> tuple[str, Optional[int]]:
    """``(host, port)`` of ``host`` / ``host:port`` / ``[ipv6]:port`` as torchrun's --rdzv-endpoint reads it (port in
    1..65535); ConfigError naming the key otherwise — a URL scheme (``http://node0:29500``) and a path included."""
    text = endpoint.strip()
    example = "e.g. node0:29500"
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", text)
    if scheme:
        bare = text[scheme.end():].split("/", 1)[0]
        raise ConfigError(f"{where}={endpoint!r} must be host:port without a scheme ({scheme.group(1)}://): the "
                          f"rendezvous is a TCP address, not a URL; use {where}={bare or 'node0:29500'}")
    if "/" in text:
        raise ConfigError(f"{where}={endpoint!r} must be host:port (no path), {example}")
    if text.startswith("[") and text.endswith("]"):
        host, port = text[1:-1], None
    elif text.startswith("[") and "]:" in text:
        host, _, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, None
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{where}={endpoint!r} must be host or host:port with a port in 1..65535 ({example}); "
                          f"the port is {port!r}")
    if not host or not _HOST.match(host):
        raise ConfigError(f"{where}={endpoint!r}: the host {host!r} must be a host name or an IP address "
                          f"(letters, digits, '.', '-', ':'), {example}")
    return host, (int(port) if port is not None else None)


def check_launch(la: LaunchConfig) -> None:
    """Every rule of the ``launch`` section that needs no machine (see the module docstring)."""
    lo, hi = parse_node_range(la.nnodes)
    if la.nproc_per_node < 1:
        raise ConfigError(f"launch.nproc_per_node={la.nproc_per_node} must be a positive integer")
    if la.max_restarts < 0:
        raise ConfigError(f"launch.max_restarts={la.max_restarts} must be >= 0")
    if not la.monitor_interval > 0:
        raise ConfigError(f"launch.monitor_interval={la.monitor_interval} must be > 0")
    if la.rdzv_backend not in TORCHRUN_BACKENDS and la.rdzv_backend not in rendezvous_backends():  # plugins: slow
        backends = rendezvous_backends()
        hint = unknown_names([la.rdzv_backend], backends) if la.rdzv_backend else "''"
        raise ConfigError(f"launch.rdzv_backend={hint} is not a torchrun rendezvous backend; known: "
                          f"{', '.join(backends)} (c10d needs nothing but launch.rdzv_endpoint)")
    if la.rdzv_endpoint is not None:
        check_endpoint(la.rdzv_endpoint)
    if la.node_rank is not None and not 0 <= la.node_rank < hi:
        raise ConfigError(f"launch.node_rank={la.node_rank} must be in 0..nnodes-1 = 0..{hi - 1}")
    if la.rdzv_backend == "static" and hi > 1:
        if lo < hi:
            raise ConfigError(f"launch.nnodes={la.nnodes} is an elastic range, but launch.rdzv_backend=static has a "
                              f"fixed set of nodes; use launch.rdzv_backend=c10d (or etcd-v2) for an elastic job")
        if la.node_rank is None:
            raise ConfigError(
                f"launch.rdzv_backend=static with launch.nnodes={hi} needs launch.node_rank: this node's rank, 0 on the "
                f"node of launch.rdzv_endpoint and {'1 on the other' if hi == 2 else f'1..{hi - 1} on the others'}, "
                "different on every node (under Slurm it is SLURM_NODEID); or use launch.rdzv_backend=c10d, which "
                "numbers the nodes itself")
    if lo < hi and la.rdzv_backend not in ELASTIC_BACKENDS and la.rdzv_backend in TORCHRUN_BACKENDS:
        raise ConfigError(f"launch.nnodes={la.nnodes}: launch.rdzv_backend={la.rdzv_backend} cannot re-form the "
                          f"world; use one of {', '.join(ELASTIC_BACKENDS)}")
    if la.rdzv_last_call < 0:
        raise ConfigError(f"launch.rdzv_last_call={la.rdzv_last_call} must be >= 0 seconds")
    if la.rdzv_node_timeout < MIN_NODE_TIMEOUT_S:
        raise ConfigError(f"launch.rdzv_node_timeout={la.rdzv_node_timeout} must be >= {MIN_NODE_TIMEOUT_S} seconds "
                          "(three heartbeats of a second or more)")
    if la.unfillable_world not in UNFILLABLE_WORLD:
        raise ConfigError(f"launch.unfillable_world={la.unfillable_world!r} must be one of "
                          f"{', '.join(UNFILLABLE_WORLD)}")
    if la.recovery not in RECOVERY:
        raise ConfigError(f"launch.recovery={la.recovery!r} must be one of {', '.join(RECOVERY)} (live: the running "
                          "workers re-form the world in place; restart: torchrun restarts them from the checkpoint)")


def rdzv_conf(la: LaunchConfig) -> str:
    """torchrun's ``--rdzv-conf`` of an elastic job: how long the rendezvous waits for more nodes and when a silent
    node counts as gone (``last_call_timeout``, ``keep_alive_interval`` × ``keep_alive_max_attempt``)."""
    keep_alive = -(-la.rdzv_node_timeout // 3)
    return f"last_call_timeout={la.rdzv_last_call},keep_alive_interval={keep_alive},keep_alive_max_attempt=3"
