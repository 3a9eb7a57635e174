"""The Works a rehearsed rank's point-to-point calls return: a send completes at once (sends are buffered in a
rehearsal) but keeps its tensor alive as long as the Work lives, as gloo's does; a receive takes its message from the
mailbox when it is waited on, as the real one completes then."""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["DeferredRecv", "DoneWork", "SentWork"]


class DeferredRecv:
    """The Work of an ``irecv`` while rehearsing: the peer's message is taken (waiting for the peer rank if needed)
    when the Work is waited on, as the real receive completes then."""

    def __init__(self, recorder: Any, tensor: Any, src: int, k: int):
        self.recorder, self.tensor, self.src, self.k, self.done = recorder, tensor, src, k, False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.done = True
            self.recorder._take(self.tensor, self.src, self.k)
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list:
        return [self.tensor]

    def source_rank(self) -> int:
        return self.src

    def get_future(self) -> Any:
        fut: Any = torch.futures.Future()
        self.wait()
        fut.set_result([self.tensor])
        return fut


class SentWork:
    """The Work of a rehearsed send: complete at once (sends are buffered in the rehearsal), and holding the tensor it
    sends for as long as the Work itself lives — gloo's ``SendWork`` keeps its ``tensor_`` until the Work is destroyed
    (``wait()`` does not let it go), and the pipeline schedules hold their send Works until the step's end
    (interleaved, ZBV, GPipe) or the next send (1F1B). The fake backend's Work holds nothing, so without this a sent
    activation or gradient was freed early and traced peaks came out low (issue 41).

    ``inner``: the backend's own Work (an ``isend`` on the fake backend), kept for anything else asked of it."""

    def __init__(self, tensor: Optional[torch.Tensor], inner: Any = None):
        self.tensor, self.inner = tensor, inner

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list:
        return [] if self.tensor is None else [self.tensor]

    def get_future(self) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(self.result())
        return fut

    def __getattr__(self, name: str) -> Any:  # anything else a caller asks of a Work: the backend's answer
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class DoneWork(SentWork):
    """The Work of a collective an exact rehearsal answered itself (:mod:`megashard.rehearse.exact`): complete, holding
    nothing."""

    def __init__(self) -> None:
        super().__init__(None)
