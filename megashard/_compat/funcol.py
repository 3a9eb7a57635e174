"""Functional collectives (``torch.distributed._functional_collectives``, private): what DTensor's redistribution
calls. :mod:`megashard.doctor.intercept` wraps their Python entry points and sees their outputs through the one
private function every output passes through."""
from __future__ import annotations

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


def functional_group(group, tag: str = ""):
    """``(process group, axis name)`` of a functional collective's ``group`` argument: the ProcessGroup torch resolves
    its name to (``c10d._resolve_process_group``, private; None where it cannot) and, for a mesh dimension (``(mesh,
    dim)`` or a 1-d mesh), that dimension's name in the mesh (None without names)."""
    name = functional_group_name(group, tag)
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - a name this torch cannot resolve (or no such helper)
        pg = None
    mesh, dim = (group if isinstance(group, tuple) and len(group) == 2 else (group, 0))
    names = getattr(mesh, "mesh_dim_names", None)
    axis = names[dim] if names and isinstance(dim, int) and 0 <= dim < len(names) else None
    return pg, axis


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


def process_group_by_name(name: str):
    """The ProcessGroup torch registered under ``name`` (what a functional collective's group resolves to), or None
    (:mod:`megashard.rehearse` names the group of a functional collective)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError:  # pragma: no cover - a torch without the registry
        return None
    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
