"""An exact CPU measure of memory: the bytes of every live tensor storage, counted by a ``TorchDispatchMode``.

    with LiveBytes() as live:
        train(job)
    live.peak      # most bytes of tensor storages alive at once (after any op), since the mode was entered

Every op's outputs are unwrapped (DTensors and other wrapper subclasses down to their plain tensors) and each new
storage is counted once (views share it) until Python frees it (a weak-reference finalizer). FSDP2 frees and
re-allocates its unsharded parameters with ``UntypedStorage.resize_``, which is no op: the mode patches ``resize_``
while it is active, so those bytes count too. What torch allocates outside tensors (gloo's buffers, the allocator's
rounding) is not counted: this is what a program holds, as ``torch.cuda.max_memory_allocated`` counts on a GPU.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain(t: Any) -> list[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [x for a in attrs for x in _plain(getattr(t, a))]
    return [t]


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while the mode is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._sizes: dict[int, int] = {}
        self._orig_resize: Any = None
        self.timeline: list[tuple[str, int]] | None = None  # (op, live bytes after it) when recording

    def _track(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._sizes or st.device.type == "meta":
            return
        n = st.nbytes()
        self._sizes[key] = n
        self.live += n
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _note(self, what: str) -> None:
        if self.timeline is not None:
            self.timeline.append((what, self.live))
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, what

    def adopt(self, tensors: Any) -> None:
        """Count tensors created before the mode (e.g. a model's parameters), so that views of them made under the mode
        are not taken for new storages."""
        for t in tensors:
            for p in _plain(t):
                self._track(p.untyped_storage())
        self.reset_peak()

    def reset_peak(self) -> None:
        self.peak, self.peak_op = self.live, "reset"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    self._track(p.untyped_storage())
        self._note(str(func))
        return out

    def __enter__(self) -> "LiveBytes":
        self._orig_resize = orig = torch.UntypedStorage.resize_
        mode = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            key = id(st)
            res = orig(st, size)
            if key in mode._sizes:
                mode.live += size - mode._sizes[key]
                mode._sizes[key] = size
            else:
                mode._track(st)
            mode._note("UntypedStorage.resize_")
            return res

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)
