"""The Works a rehearsed rank's point-to-point calls return: a send completes at once (sends are buffered in a
rehearsal); a receive takes its message from the mailbox when it is waited on, as the real one completes then."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeferredRecv", "DoneWork"]


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



class DoneWork:
    """The Work of a rehearsed send: complete at once (sends are buffered in the rehearsal)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None
