"""An exact CPU measure of memory (the tests, benchmarks/advisor.py and the advisor's traces use this one class): the bytes of every live tensor storage, counted by a ``TorchDispatchMode``.

    with LiveBytes(warmup_steps=1) as live:
        train(job)
    live.peak      # most bytes of tensor storages alive at once (after any op), after the first optimizer step

Every op's outputs are unwrapped (DTensors and other wrapper subclasses down to their plain tensors) and each new
storage is counted once (views share it) until it is freed (a weak-reference finalizer on the storage). FSDP2 frees
and re-allocates its unsharded parameters with ``UntypedStorage.resize_``, which is no op: the mode patches
``resize_`` while it is active, so those bytes count too. What torch allocates outside tensors (gloo's buffers, the
allocator's rounding) is not counted: this is what a program holds, as ``torch.cuda.max_memory_allocated`` counts
on a GPU.

**The peak is defined so that it does not depend on thread timing** (the same job measures the same bytes on every
run, loaded machine or not):

- *the steady state*: with ``warmup_steps=k`` the peak is taken over the ops after the k-th optimizer step (a global
  optimizer step hook marks it): from then on the optimizer's state exists and every step takes the same path, the
  one the advisor's estimate describes;
- *buffers a communication thread lets go*: gloo's worker thread keeps a collective's tensors until it has finished
  with the call, which may be before or after the program has dropped them (an FSDP all-gather buffer lingered for
  a whole block's parameters on some runs: 63.9 or 75.9 MiB for one job). A storage freed on another thread than
  the one running the mode counts as freed right after the last op of the program that used it (as input or
  output), which is when the program itself no longer held it; a storage freed on the program's thread counts as
  freed where it was. So every free is placed by the program's own order of ops, which is deterministic.

Live bytes are kept per op (``timeline`` records ``(op, live bytes after it)`` when a list is given); the peak is
computed from them when read (:attr:`peak`, :attr:`peak_op`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch

from megashard._compat import dispatch_api

TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves = dispatch_api()


def _plain(t: Any) -> list[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [x for a in attrs for x in _plain(getattr(t, a))]
    return [t]


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while the mode is active (see the module docstring).

    ``warmup_steps``: optimizer steps (of any ``torch.optim`` optimizer) before the peak is taken (0: from the start).
    """

    def __init__(self, warmup_steps: int = 0, origins: bool = False) -> None:
        super().__init__()
        self._origins: Optional[dict[int, list]] = {} if origins else None  # key -> [op, bytes, born, died]
        self._lifetimes: list[list] = []
        self.live = 0
        self.warmup_steps = warmup_steps
        self.steps = 0
        """Optimizer steps seen while the mode was active."""
        self.offthread_frees = 0
        """Storages freed on another thread (placed after their last use)."""
        self._sizes: dict[int, int] = {}
        self._last: dict[int, int] = {}  # storage -> index of the last op that used it
        self._deltas: list[int] = [0]  # bytes allocated (+) / freed (-) per op index; index 0: before any op
        self._names: list[str] = ["start"]
        self._start = 0  # first op index the peak looks at
        self._lock = threading.RLock()
        self._thread = threading.get_ident()
        self._orig_resize: Any = None
        self._op = "before"
        self._hook: Any = None
        self.timeline: Optional[list[tuple[str, int]]] = None  # (op, live bytes after it) when recording
        self.phase: Optional[str] = None
        """A label of where the program is (set by the caller, e.g. from module hooks); :meth:`phase_peaks`."""
        self._phase_at: list[tuple[int, str]] = []

    # ------------------------------------------------------------------ bookkeeping
    def _track(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        with self._lock:
            if key in self._sizes:
                self._last[key] = len(self._deltas) - 1
                return
            if st.device.type == "meta":
                return
            n = st.nbytes()
            self._sizes[key] = n
            self._last[key] = len(self._deltas) - 1
            self.live += n
            self._deltas[-1] += n
            if self._origins is not None:
                rec = [self._op, n, len(self._deltas) - 1, None]
                self._origins[key] = rec
                self._lifetimes.append(rec)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            n = self._sizes.pop(key, 0)
            last = self._last.pop(key, len(self._deltas) - 1)
            self.live -= n
            if threading.get_ident() == self._thread:
                at = len(self._deltas) - 1
            else:  # a communication thread let go of it: freed right after the program's last use
                self.offthread_frees += 1
                at = min(last + 1, len(self._deltas) - 1)
            self._deltas[at] -= n
            if self._origins is not None and key in self._origins:
                self._origins.pop(key)[3] = at

    def _note(self, what: str) -> None:
        """Close the current op: what it allocated (and what was freed meanwhile) is its delta."""
        with self._lock:
            if self.phase is not None:
                self._phase_at.append((len(self._deltas) - 1, self.phase))
            if self.timeline is not None:
                self.timeline.append((what, self.live))
            self._names[-1] = what
            self._deltas.append(0)
            self._names.append("")

    def adopt(self, tensors: Any) -> None:
        """Count tensors created before the mode (e.g. a model's parameters), so that views of them made under the mode
        are not taken for new storages."""
        for t in tensors:
            for p in _plain(t):
                self._track(p.untyped_storage())
        self.reset_peak()

    def reset_peak(self) -> None:
        """Take the peak from now on."""
        with self._lock:
            self._start = len(self._deltas) - 1

    def _peak(self) -> tuple[int, int]:
        with self._lock:
            deltas = list(self._deltas)
        live, best, at = 0, None, self._start
        for i, d in enumerate(deltas):
            live += d
            if i >= self._start and (best is None or live > best):
                best, at = live, i
        return (best or 0), at

    def phase_peaks(self) -> dict[str, int]:
        """The most live bytes after any op labelled with each :attr:`phase` (since the peak's start)."""
        with self._lock:
            deltas = list(self._deltas)
            labels = dict(self._phase_at)
        out: dict[str, int] = {}
        self._phase_index: dict[str, int] = {}
        live = 0
        for i, d in enumerate(deltas):
            live += d
            if i >= self._start and i in labels and live > out.get(labels[i], -1):
                out[labels[i]] = live
                self._phase_index[labels[i]] = i
        return out

    @property
    def peak(self) -> int:
        """Most bytes alive at once after any op since the start (after the warm-up steps, or :meth:`reset_peak`)."""
        return self._peak()[0]

    @property
    def peak_op(self) -> str:
        """The op after which the peak was reached."""
        return self._names[self._peak()[1]] or "start"

    def _on_step(self, *args: Any) -> None:
        self.steps += 1
        self._note(f"optimizer step {self.steps}")
        if self.steps == self.warmup_steps:
            self.reset_peak()

    # ------------------------------------------------------------------ the mode
    def breakdown(self, top: int = 12, phase: Optional[str] = None) -> list[tuple[str, int]]:
        """``(op that made it, bytes)`` of the storages alive at the peak (or at ``phase``'s peak, after
        :meth:`phase_peaks`), largest first (``origins=True`` only)."""
        at = self._peak()[1] if phase is None else self._phase_index[phase]
        out: dict[str, int] = {}
        for op, n, born, died in self._lifetimes:
            if born <= at and (died is None or died > at):
                out[op] = out.get(op, 0) + n
        return sorted(out.items(), key=lambda kv: -kv[1])[:top]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._op = str(func)
        for t in tree_leaves((args, kwargs)):  # inputs: the last use of their storages
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    key = id(p.untyped_storage())
                    if key in self._sizes:
                        self._last[key] = len(self._deltas) - 1
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    self._track(p.untyped_storage())
        self._note(str(func))
        return out

    def __enter__(self) -> "LiveBytes":
        self._thread = threading.get_ident()
        self._orig_resize = orig = torch.UntypedStorage.resize_
        mode = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            key = id(st)
            res = orig(st, size)
            mode._op = "UntypedStorage.resize_"
            with mode._lock:
                if key in mode._sizes:
                    mode.live += size - mode._sizes[key]
                    mode._deltas[-1] += size - mode._sizes[key]
                    mode._sizes[key] = size
                    mode._last[key] = len(mode._deltas) - 1
                    if mode._origins is not None and key in mode._origins:
                        now = len(mode._deltas) - 1
                        mode._origins[key][3] = now
                        mode._origins[key] = rec = ["UntypedStorage.resize_", size, now, None]
                        mode._lifetimes.append(rec)
                else:
                    mode._track(st)
            mode._note("UntypedStorage.resize_")
            return res

        torch.UntypedStorage.resize_ = resize_
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._on_step)
        if self.warmup_steps == 0:
            self.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._hook is not None:
            self._hook.remove()
        return super().__exit__(*exc)
