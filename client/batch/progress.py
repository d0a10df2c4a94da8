"""A one-line progress bar with items/s, redrawn at most 10 times a second on a TTY.

On anything else (a pipe, a log file) it stays silent: the summary line says it all.
"""

from __future__ import annotations

import math
import time
from typing import IO


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, total: int, done: int, stream: IO[str] | None) -> None:
        self.total = total
        self.done = done
        self._first = done
        self._stream = stream if stream is not None and _isatty(stream) else None
        self._start = time.monotonic()
        self._last_draw = 0.0
        self.retries = 0

    def advance(self, items: int) -> None:
        self.done += items
        now = time.monotonic()
        if self._stream is not None and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        rate = (self.done - self._first) / max(now - self._start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:.0f} s" if math.isfinite(eta) else "?"
        self._stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} items "
                           f"{rate:,.0f} items/s eta {eta_text} retries {self.retries}\x1b[K")
        self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()
