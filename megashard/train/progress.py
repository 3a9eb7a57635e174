"""The progress bar rank 0 prints to stderr: step, loss, tokens/s and time left (no tqdm).

On a terminal the bar is redrawn in place (``\\r``) at most every ``min_interval`` seconds; otherwise
(a log file, CI) one line is printed every ``log_interval`` steps and at the last step.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_duration(seconds: float) -> str:
    """``3725.2`` -> ``"1:02:05"``; ``65`` -> ``"1:05"``."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(tokens_per_s: float) -> str:
    """``12345.0`` -> ``"12.3k"``."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


class ProgressBar:
    """``update(step, loss, tokens_per_s)`` after every step; ``close()`` at the end.

    Args:
        total: the last step number; ``start``: the step a resumed run starts after.
        stream: where to draw (default ``sys.stderr``); ``enabled=False`` draws nothing.
        log_interval: steps between lines when ``stream`` is not a terminal.
        width: characters of the bar itself.
    """

    def __init__(self, total: int, start: int = 0, *, stream: Optional[TextIO] = None, enabled: bool = True,
                 log_interval: int = 10, width: int = 24, min_interval: float = 0.1) -> None:
        self.total, self.start = total, start
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_interval, self.width, self.min_interval = max(1, log_interval), width, min_interval
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._line = ""

    def render(self, step: int, loss: float, tokens_per_s: float, elapsed: float) -> str:
        """The text of the bar for ``step`` (exposed for tests)."""
        done = step - self.start
        left = self.total - step
        eta = elapsed / done * left if done > 0 else 0.0
        frac = step / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        digits = len(str(self.total))
        return (f"step {step:>{digits}}/{self.total} [{bar}] loss {loss:.4f} | {format_rate(tokens_per_s)} tok/s"
                f" | {format_duration(elapsed)} elapsed, {format_duration(eta)} left")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        last = step >= self.total
        if self.tty:
            if not last and now - self._last_draw < self.min_interval:
                return
            self._line = self.render(step, loss, tokens_per_s, now - self.t0)
            self.stream.write("\r" + self._line + "\x1b[K")
        else:
            if not last and (step - self.start) % self.log_interval and step != self.start + 1:
                return
            self.stream.write(self.render(step, loss, tokens_per_s, now - self.t0) + "\n")
        self.stream.flush()
        self._last_draw = now

    def close(self) -> None:
        if self.enabled and self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
