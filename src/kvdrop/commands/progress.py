"""A dependency-free terminal progress bar, usable directly as a batch ``progress`` callback.

On a TTY it redraws one line in place (``\\r``) at most every ``min_interval`` seconds; elsewhere
(CI logs, pipes) it prints a plain line at most every ``line_interval`` seconds plus the final one,
so logs stay short. ``silent=True`` turns it off without changing the caller. A new phase (e.g.
prefill -> modify -> decode) finishes the previous line and restarts the clock, so the rate and
ETA are per phase. The ETA extrapolates the rate since the phase's first completion, not since its
start: in batched work the first result carries the latency of the whole pipeline (warm-up, a
full batch in flight) and later ones come at its throughput, so a start-based rate overestimates.
The line starts with the fixed ``label`` if one was given (plus the phase when the label does not
already name it), else with the phase.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.0 -> "1:15"``, ``3725 -> "1:02:05"``; ``"?"`` for unknown/negative/infinite."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    total = round(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """``bar(done, total, phase)`` draws ``phase [#####.....] done/total rate/s ETA m:ss``."""

    def __init__(
        self,
        total: int | None = None,
        *,
        label: str = "",
        stream: TextIO | None = None,
        width: int = 30,
        silent: bool = False,
        min_interval: float = 0.1,
        line_interval: float = 5.0,
        unit: str = "req",
        is_tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if width < 1:
            raise ValueError(f"progress bar width must be >= 1, got {width}")
        if total is not None and total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.phase = ""
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.silent = silent
        self.min_interval = min_interval
        self.line_interval = line_interval
        self.unit = unit
        self.clock = clock
        if is_tty is None:
            isatty = getattr(self.stream, "isatty", None)
            is_tty = bool(isatty()) if callable(isatty) else False
        self.is_tty = is_tty
        self.done = 0
        self._start = clock()
        self._first: tuple[float, int] | None = None  # (time, done) of the first completion
        self._last_draw: float | None = None
        self._line_open = False
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int, phase: str = "") -> None:
        """The batch callback signature: progress is ``done`` of ``total`` in ``phase``."""
        self.update(done, total, phase)

    def update(self, done: int, total: int | None = None, phase: str | None = None) -> None:
        """Record progress and redraw if due (always on completion or a phase change)."""
        with self._lock:
            if phase is not None and phase != self.phase:
                self._finish_line()
                self.phase = phase
                self._start = self.clock()
                self._first = None
                self._last_draw = None
            if total is not None:
                self.total = total
            self.done = done
            now = self.clock()
            if self._first is None and done > 0:
                self._first = (now, done)
            complete = self.total is not None and done >= self.total
            interval = self.min_interval if self.is_tty else self.line_interval
            due = self._last_draw is None or now - self._last_draw >= interval
            if complete or due:
                self._draw(now, final=complete)

    def render(self, now: float | None = None) -> str:
        """The current status line (without ``\\r`` or newline)."""
        now = self.clock() if now is None else now
        elapsed = max(now - self._start, 0.0)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [self.title] if self.title else []
        if self.total:
            frac = min(self.done / self.total, 1.0)
            filled = int(frac * self.width)
            parts.append("[" + "#" * filled + "." * (self.width - filled) + "]")
            parts.append(f"{self.done}/{self.total}")
            remaining = self._remaining(now)
            if self.done >= self.total:
                remaining = 0.0
        else:
            parts.append(f"{self.done}")
            remaining = float("nan")
        parts.append(f"{rate:.2f} {self.unit}/s")
        if self.total and self.done >= self.total:
            parts.append(f"in {format_duration(elapsed)}")
        else:
            parts.append(f"ETA {format_duration(remaining)}")
        return " ".join(parts)

    def _remaining(self, now: float) -> float:
        """Seconds left at the rate since the first completion (unknown before the second)."""
        if self._first is None or self.total is None or self.done <= self._first[1]:
            return float("inf")
        t_first, d_first = self._first
        since = now - t_first
        if since <= 0:
            return float("inf")
        return (self.total - self.done) * since / (self.done - d_first)

    @property
    def title(self) -> str:
        """What the line starts with: the label, the phase, or both."""
        if self.label and self.phase and self.phase not in self.label:
            return f"{self.label} {self.phase}"
        return self.label or self.phase

    def close(self) -> None:
        """End the current line (on a TTY) so later output starts on a fresh line."""
        with self._lock:
            self._finish_line()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, now: float, final: bool) -> None:
        self._last_draw = now
        if self.silent:
            return
        line = self.render(now)
        if self.is_tty:
            self.stream.write("\r\x1b[2K" + line)
            self._line_open = True
            if final:
                self._finish_line()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _finish_line(self) -> None:
        if self._line_open and not self.silent:
            self.stream.write("\n")
            self.stream.flush()
        self._line_open = False
