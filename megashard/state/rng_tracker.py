"""The RNG tracker: named random streams of one rank, driven through the device's default generator.

A *stream* is a named generator state. ``tracker.fork(name)`` swaps the stream into the device's
default generator for the duration of a ``with`` block, so code inside (dropout, init) draws from it
while the default stream outside is left exactly where it was.

On a CUDA machine the device generator is the current CUDA device's default generator, as in
Megatron-LM. Without CUDA the same code drives the CPU default generator (``torch.default_generator``)
with identical semantics, so everything here runs and is tested on CPU. Which tracker the Megatron-style
functions use, and how streams are seeded, is :mod:`megashard.state.rng`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch

from megashard.errors import ConfigError, RNGTrackerError

__all__ = ["CudaRNGStatesTracker", "RNGStatesTracker"]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def check_seed(name: object, seed: object) -> None:
    """RNGTrackerError naming stream ``name``, the seed and the legal range unless ``seed`` is an int a torch
    generator takes (-2**63..2**64-1, :data:`megashard.config.parallel.TORCH_SEED_RANGE`)."""
    from megashard.config.parallel import TORCH_SEED_RANGE

    if not isinstance(name, str) or not name:
        raise RNGTrackerError(f"RNG stream name {name!r} must be a non-empty string")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RNGTrackerError(f"RNG stream {name!r}: seed must be an int, got {seed!r} ({type(seed).__name__})")
    lo, hi = TORCH_SEED_RANGE
    if not lo <= seed <= hi:
        raise RNGTrackerError(f"RNG stream {name!r}: seed {seed} is outside the range a torch generator takes, "
                              f"-2**63..2**64-1 ({lo}..{hi})")

DeviceLike = Union[int, str, torch.device]


# --------------------------------------------------------------------------- device generator access
_HAS_CUDA: Optional[bool] = None


def _use_cuda() -> bool:
    """torch.cuda.is_available(), asked once per process (it costs microseconds; forks ask often)."""
    global _HAS_CUDA
    if _HAS_CUDA is None:
        _HAS_CUDA = torch.cuda.is_available()
    return _HAS_CUDA


def _cuda_generator(device: DeviceLike) -> torch.Generator:
    """Default generator of a CUDA device; ``-1``/``"cuda"``/``None`` index mean the current device."""
    if device == -1 or device == "cuda":
        index: Optional[int] = None
    elif isinstance(device, int):
        index = None if device < 0 else device
    else:
        dev = torch.device(device)
        index = dev.index if dev.type == "cuda" else None
    if not torch.cuda.default_generators:
        torch.cuda.init()  # default_generators stays empty until CUDA is initialised
    if index is None:
        index = torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _device_generator(device: DeviceLike) -> torch.Generator:
    """The generator a tracker drives: a CUDA default generator, or the CPU one without CUDA."""
    if not _use_cuda():
        return torch.default_generator
    if device == "cpu" or (not isinstance(device, int) and device != "cuda" and torch.device(device).type == "cpu"):
        return torch.default_generator
    return _cuda_generator(device)


def _get_cuda_rng_state(device: DeviceLike = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    """Return the RNG state of ``device``'s default generator.

    ``graph_safe=True`` (CUDA only) returns the generator object registered for CUDA-graph capture
    (``graphsafe_get_state``), or a private copy of it with ``clone=True``; otherwise a uint8 state
    tensor (a fresh tensor, so ``clone`` is moot). Without CUDA this reads the CPU default generator
    and ``graph_safe`` is ignored (CUDA graphs do not exist there).
    """
    gen = _device_generator(device)
    if graph_safe and gen.device.type == "cuda":
        return gen.clone_state() if clone else gen.graphsafe_get_state()
    return gen.get_state()


def _set_cuda_rng_state(new_state: Any, device: DeviceLike = -1, graph_safe: bool = False) -> None:
    """Set ``device``'s default generator (``-1`` = current CUDA device) to ``new_state``.

    Unlike ``torch.cuda.set_rng_state`` the input is not cloned first (the generator copies the bytes
    it needs; the extra clone was a measurable cost in Megatron at scale). With ``graph_safe=True``
    (CUDA only) ``new_state`` is a generator object installed with ``graphsafe_set_state``.
    Without CUDA this sets the CPU default generator.
    """
    gen = _device_generator(device)
    if graph_safe and gen.device.type == "cuda":
        gen.graphsafe_set_state(new_state)
    else:
        gen.set_state(new_state)


def _manual_seed_device(seed: int) -> None:
    """Seed the device default generator only (CUDA current device, else CPU), like ``torch.cuda.manual_seed``."""
    _device_generator(-1).manual_seed(seed)


# --------------------------------------------------------------------------- the tracker
class RNGStatesTracker:
    """Named RNG streams for one rank; Megatron's ``CudaRNGStatesTracker`` with correct nesting.

    * ``add(name, seed)`` creates a stream; a name or seed used twice raises :class:`RNGTrackerError`.
    * ``fork(name)`` runs a block on the stream. Forks nest, also with the same name twice: every
      stream yields the numbers it would yield if the same draws were made in sequential, un-nested
      forks, and the default stream is left as if no fork happened.
    * ``get_states()``/``set_states()`` snapshot and restore all streams (used by recompute).

    With ``is_inference_rng_tracker=True``, ``add``, ``set_states`` and ``fork`` do nothing (inference
    draws from the default stream). ``use_cudagraphable_rng=True`` keeps generator objects registered
    for CUDA-graph capture instead of state tensors (CUDA only).
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        if use_cudagraphable_rng and not _use_cuda():
            raise ConfigError(
                "use_cudagraphable_rng=True needs CUDA (it registers generator states for CUDA-graph "
                "capture), but torch.cuda.is_available() is False; use use_cudagraphable_rng=False."
            )
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self._active: list[str] = []  # names of the forks currently entered, innermost last
        self.reset()

    # -- bookkeeping
    def is_initialized(self) -> bool:
        """True once a stream was added or states were set (and not reset since)."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every stream and seed."""
        self._is_initialized = False
        self.states_: dict[str, Any] = {}
        self.seeds_: set[int] = set()
        self._seed_owner: dict[int, str] = {}

    # -- snapshot / restore
    def get_states(self) -> dict[str, Any]:
        """Snapshot of every stream: ``{name: state}``.

        Inside a fork the innermost forked stream lives in the device generator, so its *current*
        state is reported (not the one it had when the fork began). Graph-safe states are cloned.
        """
        states = dict(self.states_)
        if self._active and self._active[-1] in states:
            states[self._active[-1]] = _get_cuda_rng_state(clone=True, graph_safe=self.use_cudagraphable_rng)
        if self.use_cudagraphable_rng:
            states = {k: (v.clone_state() if isinstance(v, torch.Generator) else v) for k, v in states.items()}
        return states

    def active_forks(self) -> tuple[str, ...]:
        """Names of the forks currently entered, outermost first."""
        return tuple(self._active)

    def set_active_forks(self, names: tuple[str, ...]) -> None:
        """Declare which forks are entered (recompute replays a layer that ran inside forks).

        Only bookkeeping: the generator is not touched. With ``("a",)`` the generator is taken to
        hold stream "a", so a nested ``fork("a")`` continues it, exactly as during the original run.
        """
        self._active = list(names)

    def set_states(self, states: dict[str, Any]) -> None:
        """Replace every stream by ``states`` (as returned by :meth:`get_states`). Seeds are not tracked."""
        if self.is_inference_rng_tracker:
            return
        self._is_initialized = True
        self.states_ = dict(states)

    # -- streams
    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the device generator is left unchanged."""
        if self.is_inference_rng_tracker:
            return
        check_seed(name, seed)
        if name in self.states_:
            raise RNGTrackerError(
                f"RNG stream {name!r} already exists (streams: {sorted(self.states_)}); "
                "pick another name, or call reset() first to reseed every stream."
            )
        if seed in self.seeds_:
            raise RNGTrackerError(
                f"cannot add RNG stream {name!r} with seed {seed}: seed {seed} is already used by stream "
                f"{self._seed_owner.get(seed, '?')!r} (seeds in use: {sorted(self.seeds_)}); two streams with "
                "one seed draw identical numbers. Use a different seed."
            )
        if self.use_cudagraphable_rng:
            new_state = _get_cuda_rng_state(clone=True, graph_safe=True)
            new_state.manual_seed(seed)
        else:
            orig = _get_cuda_rng_state()
            _manual_seed_device(seed)
            new_state = _get_cuda_rng_state()
            _set_cuda_rng_state(orig)
        self.seeds_.add(seed)
        self._seed_owner[seed] = name
        self.states_[name] = new_state
        self._is_initialized = True

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> contextlib.AbstractContextManager:
        """Context manager that draws from stream ``name`` inside the block (default: model-parallel)."""
        if self.is_inference_rng_tracker:
            return contextlib.nullcontext()
        if name not in self.states_:
            raise RNGTrackerError(
                f"RNG stream {name!r} was never added (streams: {sorted(self.states_)}); "
                "call add(name, seed) or model_parallel_manual_seed(seed) first."
            )
        return _Fork(self, name)


class _Fork:
    """One fork level (a class, not @contextmanager: a fork is entered per layer per step, keep it cheap).

    Each level saves what the generator held on entry. If an outer fork is active, that is the outer
    stream's live state: it is written back first, so a nested fork of the *same* stream continues
    from it instead of replaying the stale state stored when the outer fork began. On exit the
    stream's state is stored and the generator goes back to the outer stream (possibly advanced by
    this level) or, at the outermost level, to the state saved on entry.
    """

    __slots__ = ("tracker", "name", "gen", "entry_state")

    def __init__(self, tracker: RNGStatesTracker, name: str) -> None:
        self.tracker, self.name = tracker, name

    def __enter__(self) -> None:
        t = self.tracker
        gen = self.gen = _device_generator(-1)
        graph_safe = t.use_cudagraphable_rng
        self.entry_state = gen.graphsafe_get_state() if graph_safe else gen.get_state()
        if t._active:
            t.states_[t._active[-1]] = self.entry_state
        state = t.states_[self.name]
        gen.graphsafe_set_state(state) if graph_safe else gen.set_state(state)
        t._active.append(self.name)

    def __exit__(self, *exc: Any) -> None:
        t, gen, states = self.tracker, self.gen, self.tracker.states_
        graph_safe = t.use_cudagraphable_rng
        t._active.pop()
        if self.name in states:  # absent if reset() ran inside the block
            states[self.name] = gen.graphsafe_get_state() if graph_safe else gen.get_state()
        if t._active and t._active[-1] in states:
            back = states[t._active[-1]]
        else:
            back = self.entry_state
        gen.graphsafe_set_state(back) if graph_safe else gen.set_state(back)


CudaRNGStatesTracker = RNGStatesTracker  # Megatron-LM's name


def _te_tracker_class() -> type:
    """TransformerEngine's tracker with Megatron's extras (is_initialized, inference no-ops, our errors)."""
    from megashard.state.te import get_te_version, is_te_min_version, require_te

    te_pytorch = require_te("use_te_rng_tracker=True")
    if not is_te_min_version("1.5.0"):
        raise ConfigError(
            f"use_te_rng_tracker=True needs transformer-engine >= 1.5.0 (its graph-safe RNG tracker), "
            f"found {get_te_version()}; upgrade TE or pass use_te_rng_tracker=False."
        )
    base = te_pytorch.distributed.CudaRNGStatesTracker

    class TECudaRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """TE's cudagraph-safe tracker; same interface as :class:`RNGStatesTracker`."""

        def __init__(self, is_inference_rng_tracker: bool = False) -> None:
            super().__init__()
            self.is_inference_rng_tracker = is_inference_rng_tracker
            self.use_cudagraphable_rng = True
            self.reset()

        def is_initialized(self) -> bool:
            return self._is_initialized

        def reset(self) -> None:
            super().reset()
            self._is_initialized = False

        def set_states(self, states: dict) -> None:
            if self.is_inference_rng_tracker:
                return
            super().set_states(states)
            self._is_initialized = True

        def add(self, name: str, seed: int) -> None:
            if self.is_inference_rng_tracker:
                return
            check_seed(name, seed)
            if name in getattr(self, "states_", {}):
                raise RNGTrackerError(f"RNG stream {name!r} already exists (streams: {sorted(self.states_)})")
            if seed in getattr(self, "seeds_", set()):
                raise RNGTrackerError(
                    f"cannot add RNG stream {name!r} with seed {seed}: seed already used "
                    f"(seeds in use: {sorted(self.seeds_)})"
                )
            super().add(name, seed)
            self._is_initialized = True

        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):  # noqa: ANN201
            if self.is_inference_rng_tracker:
                return contextlib.nullcontext()
            return super().fork(name)

    return TECudaRNGStatesTracker
