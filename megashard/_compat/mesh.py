"""DeviceMesh internals: the flattened meshes of a root mesh, PyTorch's own ``_flatten``, the groups a mesh keeps
(:mod:`megashard.state`, tests, benchmarks).
"""
from __future__ import annotations


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


def mesh_flatten(device_mesh, name: str):
    """``device_mesh._flatten(name)``: PyTorch's flattened 1-D view (every rank creates every group)."""
    return device_mesh._flatten(name)
