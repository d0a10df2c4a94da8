"""Progress of a batch job: items done, items/s and ETA.

On a TTY, a one-line bar redrawn at most 10 times a second. On anything else (a pipe, a log
file: CI, nohup, Kubernetes jobs) a plain line every `every_s` seconds (5 by default), so a
long job shows it is alive and how far it is. The rate is measured from the first item this
run computes to the last, and the job's summary reports that same rate (`rate()`), not one
diluted by reading the input and writing the output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import IO

DEFAULT_EVERY_S = 5.0  # seconds between progress lines when the stream is not a TTY


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, total: int, done: int, stream: IO[str] | None, every_s: float = DEFAULT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """total: items of the job; done: those already finished (resumed) before this run."""
        self.total = total
        self.done = done
        self._first = done
        self._stream = stream
        self._tty = stream is not None and _isatty(stream)
        self._every_s = 0.1 if self._tty else every_s
        self._clock = clock
        self._start = clock()
        self._end: float | None = None  # set by close()
        self._last_draw = self._start
        self.retries = 0

    @property
    def computed(self) -> int:
        return self.done - self._first

    @property
    def seconds(self) -> float:
        """From this run's start to now, or to close()."""
        return (self._end if self._end is not None else self._clock()) - self._start

    def rate(self) -> float:
        """Items computed by this run per second (0.0 when it computed none)."""
        return self.computed / self.seconds if self.computed and self.seconds > 0 else 0.0

    def advance(self, items: int) -> None:
        self.done += items
        now = self._clock()
        due = now - self._last_draw >= self._every_s or (self._tty and self.done == self.total)
        if self._stream is not None and due:
            self._last_draw = now
            self._draw()

    def _text(self) -> str:
        rate = self.rate()
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:.0f} s" if math.isfinite(eta) else "?"
        return f"{self.done}/{self.total} items {rate:.1f} items/s eta {eta_text} retries {self.retries}"

    def _draw(self) -> None:
        if self._tty:
            width = 30
            filled = int(width * self.done / self.total) if self.total else width
            self._stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self._text()}\x1b[K")
        else:
            self._stream.write(f"batch progress: {self._text()}\n")
        self._stream.flush()

    def close(self) -> None:
        """The end of this run's computing: the rate is fixed from here on."""
        self._end = self._clock()
        if self._stream is None or (not self._tty and not self.computed):
            return
        self._draw()  # off a terminal, the last line: the rate the summary reports
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
