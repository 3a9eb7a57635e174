"""Megatron-LM's NCCL communicator options: the ``nccl_communicator_config_path`` YAML and
``high_priority_stream_groups``, parsed and checked on any machine, turned into ``ProcessGroupNCCL.Options``.

The YAML maps Megatron's group names to options, e.g.::

    dp_cp: {cga_cluster_size: 4, max_ctas: 32, min_ctas: 1}
    tp: {net_name: IB}
    ep_dp: {is_high_priority_stream: true}

:func:`nccl_spec` reads it once per (path, groups) and returns ``{megashard group name: options dict}``;
:func:`nccl_options` builds the ``ProcessGroupNCCL.Options`` of one entry (only where torch has NCCL).
:class:`~megashard.state.ParallelState` passes them to the groups it creates when the backend is nccl.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from megashard.errors import ConfigError, unknown_names

__all__ = ["NCCL_GROUP_NAMES", "NCCL_KEYS", "nccl_options", "nccl_spec", "parse_nccl_config"]

#: Megatron's communicator names (``get_nccl_options(name, ...)`` in its parallel_state) -> megashard group names.
NCCL_GROUP_NAMES: dict[str, tuple[str, ...]] = {
    "dp": ("dp",),
    "dp_cp": ("dp_cp", "hsdp"),
    "intra_dp_cp": ("dp_shard_cp",),
    "cp": ("cp",),
    "hcp": ("hcp",),  # every hierarchical cp level
    "mp": ("mp",),
    "tp": ("tp",),
    "pp": ("pp", "expt_pp"),
    "embd": ("embd",),
    "pos_embd": ("pos_embd",),
    "tp_dp_cp": ("tp_dp_cp",),
    "tp_dp": ("tp_dp",),
    "tp_cp": ("tp_cp",),
    "ep": ("ep",),
    "ep_tp": ("expt_tp",),
    "tp_ep_mp": ("tp_ep",),
    "tp_ep_pp": ("tp_ep_pp",),
    "ep_dp": ("expt_dp",),
    "intra_ep_dp": ("expt_dp_shard",),
    "inter_ep_dp": ("expt_dp_outer",),
    "intra_dist_opt_instance": ("intra_dist_opt",),
    "gtp_remat": ("gtp_remat",),
    "expt_gtp_remat": ("expt_gtp_remat",),
    "gtp_remat_dp": ("dp_gtp_remat",),
    "gtp_remat_dp_cp": ("dp_cp_gtp_remat",),
    "ep_gtp_remat_dp": ("expt_dp_gtp_remat",),
    "tp_ep_gtp_remat_pp": ("tp_ep_pp_with_egtp_remat",),
}
#: Option keys and their checks: name -> (description for errors, check).
NCCL_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name", "is_high_priority_stream")
NET_NAMES = ("ib", "socket")

_CACHE: dict[tuple, dict[str, dict[str, Any]]] = {}


def _check_entry(where: str, name: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: group '{name}' must map option names to values (keys: {', '.join(NCCL_KEYS)}), "
                          f"got {type(entry).__name__} {entry!r}")
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key not in NCCL_KEYS:
            raise ConfigError(f"{where}: group '{name}' has unknown option {unknown_names([str(key)], NCCL_KEYS)}; "
                              f"valid: {', '.join(NCCL_KEYS)}")
        if key == "net_name":
            if not isinstance(value, str) or value.lower() not in NET_NAMES:
                raise ConfigError(f"{where}: {name}.net_name={value!r} is not supported; valid: IB, socket")
        elif key == "is_high_priority_stream":
            from megashard.config.keys import yaml_bool

            value = yaml_bool(value)  # YAML 1.1's yes/no/on/off
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {name}.is_high_priority_stream={value!r} must be true or false")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: {name}.{key}={value!r} must be a non-negative integer")
        out[key] = value
    if "min_ctas" in out and "max_ctas" in out and out["min_ctas"] > out["max_ctas"]:
        raise ConfigError(f"{where}: {name}.min_ctas={out['min_ctas']} exceeds max_ctas={out['max_ctas']}")
    return out


def parse_nccl_config(path: str | None, high_priority_stream_groups: Any = None) -> dict[str, dict[str, Any]]:
    """``{Megatron group name: options}`` from the YAML at ``path`` (None = no file) with
    ``is_high_priority_stream: true`` added for every name in ``high_priority_stream_groups``.
    ConfigError (one line) for an unreadable file, an unknown group name or option, or a bad value."""
    cfgs: dict[str, dict[str, Any]] = {}
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"nccl_communicator_config_path={path!r} must be the path of a YAML file, or null")
        if not os.path.lexists(path):
            raise ConfigError(f"nccl_communicator_config_path={path!r}: no such file")
        from megashard.config.yamlfile import parse_yaml
        from megashard.readers import CONFIG, read_text

        text = read_text(path, "nccl_communicator_config_path", limit=CONFIG, hint="give a YAML file")
        doc = parse_yaml(text, f"nccl_communicator_config_path={path!r}")
        doc = {} if doc is None else doc
        if not isinstance(doc, Mapping):
            raise ConfigError(f"nccl_communicator_config_path={path!r} must hold a mapping of group names to options, "
                              f"got {type(doc).__name__}")
        for name, entry in doc.items():
            if name not in NCCL_GROUP_NAMES:
                raise ConfigError(f"{path}: unknown group {unknown_names([str(name)], NCCL_GROUP_NAMES)}; valid "
                                  f"(Megatron's names): {', '.join(NCCL_GROUP_NAMES)}")
            cfgs[name] = _check_entry(path, name, entry if entry is not None else {})
    if high_priority_stream_groups is not None:
        if isinstance(high_priority_stream_groups, str) or not isinstance(high_priority_stream_groups, (list, tuple)):
            raise ConfigError(f"high_priority_stream_groups={high_priority_stream_groups!r} must be a list of group "
                              f"names such as [dp_cp, ep_dp], or null")
        for name in high_priority_stream_groups:
            if name not in NCCL_GROUP_NAMES:
                raise ConfigError(f"high_priority_stream_groups: unknown group "
                                  f"{unknown_names([str(name)], NCCL_GROUP_NAMES)}; valid: {', '.join(NCCL_GROUP_NAMES)}")
            cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    return cfgs


def nccl_spec(path: str | None, high_priority_stream_groups: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{megashard group name: options}`` of a config's ``nccl_communicator_config_path`` and
    ``high_priority_stream_groups`` (read once per file version and group list; {} without options).
    The hierarchical cp levels appear as ``hcp``."""
    groups = tuple(high_priority_stream_groups or ()) or None
    if path is None and groups is None:
        return {}
    try:  # the file's identity and version: an edited file is read again
        st = os.stat(path) if isinstance(path, str) else None
        version = (st.st_mtime_ns, st.st_size) if st else None
    except OSError:
        version = None
    key = (path, groups, version)
    spec = _CACHE.get(key)
    if spec is None:
        spec = {}
        for name, opts in parse_nccl_config(path, groups).items():
            for ours in NCCL_GROUP_NAMES[name]:
                spec[ours] = opts
        _CACHE[key] = spec
    return spec


def nccl_options(opts: Mapping[str, Any]) -> Any:
    """``torch.distributed.ProcessGroupNCCL.Options`` for one checked entry (as Megatron's ``get_nccl_options``);
    ConfigError when this torch build has no NCCL."""
    import torch.distributed as dist

    cls = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if cls is None:
        raise ConfigError("NCCL communicator options need a torch build with NCCL (torch.distributed.ProcessGroupNCCL); "
                          "this one has none: remove nccl_communicator_config_path/high_priority_stream_groups or run on CUDA")
    o = cls(is_high_priority_stream=bool(opts.get("is_high_priority_stream", False)))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in opts:
            setattr(o.config, key, opts[key])
    return o


def options_key(opts: Mapping[str, Any] | None) -> tuple | None:
    """A hashable form of one entry (the communicator pool keys groups by it)."""
    return tuple(sorted(opts.items())) if opts else None
