"""``install()``: Megatron-LM's ``megatron.core.parallel_state`` answering from megashard's state.

After ``megashard.megatron.install()`` every function of Megatron's ``parallel_state`` that megashard's facade
(:mod:`megashard.parallel_state`) also has — ``initialize_model_parallel``, ``destroy_model_parallel``, every group,
size and rank getter, Megatron's ``set_*`` overrides — is megashard's; so is
``ProcessGroupCollection.use_mpu_process_groups``. Megatron's own training code (``GPTModel``, its schedules, its
optimizer set-up) then runs on megashard's groups, which each rank creates for its own groups only. Functions that
read no state (``RankGenerator``, ``create_group``, ``generate_masked_orthogonal_rank_groups``,
``default_embedding_ranks``, ``get_nccl_options``, ``update_pg_timeout``) stay Megatron's.

Modules that imported a function by name (``from megatron.core.parallel_state import get_tensor_model_parallel_group``)
before ``install()`` are rebound too (every loaded ``megatron.*`` module attribute that *is* one of the replaced
functions). ``uninstall()`` restores everything. Call ``install()`` before Megatron initialises its parallel state.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

__all__ = ["install", "installed", "uninstall"]

#: (module, attribute) -> the original object, while installed
_ORIGINALS: dict[tuple[int, str], tuple[Any, Any]] = {}
_ABSENT = object()


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return bool(_ORIGINALS)


def _replacements(mps: Any) -> dict[str, Callable]:
    """Megatron parallel_state name -> megashard's function for it (adapted to this Megatron version's signature)."""
    import megashard.parallel_state as ms
    from megashard import state as _state

    out: dict[str, Callable] = {}
    for name, theirs in vars(mps).items():
        if name.startswith("_") or not inspect.isfunction(theirs) or theirs.__module__ != mps.__name__:
            continue
        ours = getattr(ms, name, None)
        if callable(ours):
            out[name] = ours
    sig = inspect.signature(mps.initialize_model_parallel).parameters

    if "create_all_gather_group" in sig:  # Megatron 0.14–0.16: the all-gather twin is an initialisation option
        @functools.wraps(ms.initialize_model_parallel)
        def initialize_model_parallel(*args: Any, create_all_gather_group: Optional[bool] = False, **kw: Any) -> None:
            ms.initialize_model_parallel(*args, **kw)
            if create_all_gather_group:
                ms.create_all_gather_groups(for_expert_parallelism=False)

        out["initialize_model_parallel"] = initialize_model_parallel

    if "independent_all_gather" in inspect.signature(mps.get_data_parallel_group).parameters:
        @functools.wraps(ms.get_data_parallel_group)
        def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False,
                                    independent_all_gather: bool = False, **kw: Any):
            if independent_all_gather:
                ag = getattr(ms._st(), "all_gather_groups", {}).get("dp_cp_ag")
                if ag is None:
                    from megashard.errors import StateError

                    raise StateError("independent_all_gather=True: no all-gather group; initialise with "
                                     "create_all_gather_group=True")
                return ag
            return ms.get_data_parallel_group(with_context_parallel, partial_data_parallel=partial_data_parallel, **kw)

        out["get_data_parallel_group"] = get_data_parallel_group

    def has_separate_all_gather_group() -> bool:
        return _state.is_initialized() and bool(getattr(ms._st(), "all_gather_groups", {}).get("dp_cp_ag"))

    def is_unitialized() -> bool:
        return not _state.is_initialized()

    def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False):
        return ms.get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)

    def destroy_global_memory_buffer() -> None:
        _state.current_locals().memory_buffer = None

    for fn in (has_separate_all_gather_group, is_unitialized, get_data_modulo_expert_parallel_group,
               destroy_global_memory_buffer):
        if hasattr(mps, fn.__name__):
            out[fn.__name__] = fn

    init = out["initialize_model_parallel"]

    @functools.wraps(init)
    def initialize_model_parallel(*args: Any, **kw: Any) -> None:
        from megashard.errors import ConfigError, StateError

        try:
            init(*args, **kw)
        except ConfigError as e:  # Megatron raises RuntimeError / AssertionError here: be both, still ConfigError
            raise _MegatronConfigError(str(e)) from None
        except StateError as e:
            raise _MegatronStateError(str(e)) from None

    out["initialize_model_parallel"] = initialize_model_parallel
    # megashard's Megatron 0.19 API that an older megatron-core lacks (create_all_gather_groups, the gtp getters …)
    for name in dir(ms):
        fn = getattr(ms, name)
        if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__.startswith("megashard.parallel_")\
                and not hasattr(mps, name):
            out[name] = fn
    return out


def _error_types() -> tuple[type, type]:
    from megashard.errors import ConfigError, StateError

    class MegatronConfigError(ConfigError, RuntimeError, AssertionError):
        """megashard's ConfigError, also the RuntimeError / AssertionError Megatron raises for bad sizes."""

    class MegatronStateError(StateError, AssertionError):
        """megashard's StateError, also the AssertionError Megatron raises (e.g. before init_process_group)."""

    return MegatronConfigError, MegatronStateError


_MegatronConfigError, _MegatronStateError = _error_types()


def _use_mpu_process_groups(cls: type, required_pgs: Optional[list[str]] = None) -> Any:
    """Megatron's ``ProcessGroupCollection.use_mpu_process_groups`` over megashard's current state."""
    import dataclasses

    from megashard import state as _state
    from megashard.state.pg_collection import pg_collection_groups

    names = {f.name for f in dataclasses.fields(cls)}
    wanted = list(names) if required_pgs is None else list(required_pgs)
    invalid = [pg for pg in wanted if pg not in names]
    if invalid:
        raise ValueError(f"Invalid process groups requested: {invalid}")
    groups = pg_collection_groups(_state.get_parallel_state())
    return cls(**{k: groups.get(k) for k in wanted})


def _set(owner: Any, attr: str, value: Any) -> None:
    key = (id(owner), attr)
    if key not in _ORIGINALS:
        # the raw attribute (a classmethod stays a classmethod), with its owner, to restore it (_ABSENT: delete)
        _ORIGINALS[key] = (owner, vars(owner).get(attr, _ABSENT))
    setattr(owner, attr, value)


def install() -> None:
    """Make Megatron-LM's ``megatron.core.parallel_state`` and ``ProcessGroupCollection.use_mpu_process_groups``
    answer from megashard (idempotent). Raises MissingExtraError without megatron-core."""
    if installed():
        return
    try:
        import megatron.core.parallel_state as mps
    except ImportError as e:
        from megashard.errors import MissingExtraError

        raise MissingExtraError(f"megashard.megatron.install() needs megatron-core, which does not import here ({e}): "
                                "pip install -e '.[megatron-test]' (or pip install megatron-core)") from None
    from megatron.core.process_groups_config import ProcessGroupCollection

    repl = _replacements(mps)
    originals = {id(getattr(mps, n)): n for n in repl if hasattr(mps, n)}
    for name, fn in repl.items():
        _set(mps, name, fn)
    _set(ProcessGroupCollection, "use_mpu_process_groups", classmethod(_use_mpu_process_groups))
    # Rebind names other Megatron modules imported from parallel_state before install().
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is mps or not mod_name.startswith("megatron."):
            continue
        for attr, value in list(vars(mod).items()):
            name = originals.get(id(value))
            if name is not None and inspect.isfunction(value):
                _set(mod, attr, repl[name])


def uninstall() -> None:
    """Restore Megatron's own functions (call it after ``destroy_model_parallel``)."""
    for (_, attr), (owner, value) in _ORIGINALS.items():
        if value is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, value)
    _ORIGINALS.clear()
