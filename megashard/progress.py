"""Progress on stderr (no tqdm): the training job's step bar and the byte counter of long file operations.

* :class:`ProgressBar` — rank 0 of ``megashard run``: step, loss, tokens/s and time left;
* :class:`Progress` — bytes done of a known total: ``megashard ckpt`` verifying and consolidating,
  ``megashard data prepare`` tokenizing.

Both write the same way (:class:`StatusLine`): on a terminal one line redrawn in place (``\\r``), at most every
``min_interval`` seconds; elsewhere (a log file, CI) whole lines, now and then (:class:`Progress`: every
``log_seconds`` seconds, nothing for a short job). This module imports nothing
heavy, so a command that shows progress pays nothing for it.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "ProgressBar", "StatusLine", "format_duration", "format_rate"]


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


class StatusLine:
    """Where a progress display writes: ``stream`` (default ``sys.stderr``); ``enabled=False`` writes nothing.

    On a terminal (:attr:`tty`) :meth:`redraw` replaces the current line, :meth:`due` says whether
    ``min_interval`` seconds have passed since the last redraw, and :meth:`finish` ends the line; elsewhere
    :meth:`print` writes whole lines.
    """

    def __init__(self, stream: Optional[TextIO] = None, enabled: bool = True, min_interval: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = min_interval
        self.t0 = time.monotonic()
        self._last_draw = float("-inf")
        self._line = ""

    def elapsed(self) -> float:
        """Seconds since the display was made."""
        return time.monotonic() - self.t0

    def due(self) -> bool:
        return time.monotonic() - self._last_draw >= self.min_interval

    def redraw(self, text: str) -> None:
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._last_draw, self._line = time.monotonic(), text

    def print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the redrawn line (if one was drawn), so that what follows starts on a line of its own."""
        if self.enabled and self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = ""


class ProgressBar(StatusLine):
    """``update(step, loss, tokens_per_s)`` after every step; ``close()`` at the end.

    Args:
        total: the last step number; ``start``: the step a resumed run starts after.
        stream: where to draw (default ``sys.stderr``); ``enabled=False`` draws nothing.
        log_interval: steps between lines when ``stream`` is not a terminal (the first and last step too).
        width: characters of the bar itself.
        min_interval: seconds between redraws on a terminal (the last step is always drawn).
    """

    def __init__(self, total: int, start: int = 0, *, stream: Optional[TextIO] = None, enabled: bool = True,
                 log_interval: int = 10, width: int = 24, min_interval: float = 0.1) -> None:
        super().__init__(stream, enabled, min_interval)
        self.total, self.start = total, start
        self.log_interval, self.width = max(1, log_interval), width

    def render(self, step: int, loss: float, tokens_per_s: float, elapsed: float, *, lr: Optional[float] = None,
               grad_norm: Optional[float] = None, step_time: Optional[float] = None) -> str:
        """The text of the bar for ``step`` (exposed for tests); ``lr``, ``grad_norm`` and ``step_time`` (seconds of
        the step) are shown when given."""
        done = step - self.start
        left = self.total - step
        eta = elapsed / done * left if done > 0 else 0.0
        frac = step / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        digits = len(str(self.total))
        extra = "".join((f" | lr {lr:.2e}" if lr is not None else "",
                         f" | grad norm {grad_norm:.3f}" if grad_norm is not None else ""))
        pace = f" | {step_time * 1000:.0f} ms/step" if step_time is not None else ""
        return (f"step {step:>{digits}}/{self.total} [{bar}] loss {loss:.4f}{extra} | {format_rate(tokens_per_s)} "
                f"tok/s{pace} | {format_duration(elapsed)} elapsed, {format_duration(eta)} left")

    def update(self, step: int, loss: float, tokens_per_s: float, **shown: Optional[float]) -> None:
        """After ``step``; ``shown``: the keyword arguments of :meth:`render` (lr, grad_norm, step_time)."""
        if not self.enabled:
            return
        last = step >= self.total
        if self.tty:
            if last or self.due():
                self.redraw(self.render(step, loss, tokens_per_s, self.elapsed(), **shown))
        elif last or (step - self.start) % self.log_interval == 0 or step == self.start + 1:
            self.print(self.render(step, loss, tokens_per_s, self.elapsed(), **shown))

    def close(self) -> None:
        self.finish()


class Progress(StatusLine):
    """Bytes done of ``total``: ``label [#####-----]  50.0%  12.0/24.0 MB  1.2 s``; ``update(n)`` as ``n`` more
    bytes are done, ``close()`` at the end (shows 100 %). Off a terminal (a log) it prints a line at most every
    ``log_seconds`` seconds, the first after ``log_seconds``, and a last line at ``close()`` only if it printed
    one before: a short job leaves nothing in the log (its command prints its own summary)."""

    def __init__(self, total: int, label: str, *, stream: Optional[TextIO] = None, enabled: bool = True,
                 log_seconds: float = 10.0) -> None:
        super().__init__(stream, enabled)
        self.total, self.label, self.done = max(int(total), 0), label, 0
        self.log_seconds = log_seconds
        self._last_log = time.monotonic()
        self._logged = False

    def render(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 24)
        return (f"{self.label} [{bar:<24}] {frac * 100:5.1f}%  {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB  "
                f"{self.elapsed():.1f} s")

    def update(self, n: int) -> None:
        self.done = min(self.done + int(n), self.total) if self.total else self.done + int(n)
        if not self.enabled:
            return
        if self.tty:
            if self.due():
                self.redraw(self.render())
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_seconds:
            self._last_log, self._logged = now, True
            self.print(self.render())

    def close(self) -> None:
        if not self.enabled:
            return
        self.done = self.total
        if self.tty:
            self.redraw(self.render())
            self.finish()
        elif self._logged:
            self.print(self.render())
