"""Log lines a client can trigger, rate-limited: a client must not be able to fill the disk.

    CLIENT_ERRORS.log(logger, logging.WARNING, "refused a malformed HTTP request from %s: %s", peer, why)

Every line a client's request can cause (a malformed HTTP request, an unexpected error while
answering one, on either transport) goes through one RateLimitedLog: at most `burst` lines per
`interval_s`; beyond them lines are dropped and counted, and the next line that gets through says
how many were dropped since the last one ("... [12 similar lines dropped]"). The count never goes
unreported for long: `dropped` holds it, and every dropped line is counted there until then.
Details: docs/rest-hardening.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(self, burst: int = 10, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError(f"burst must be >= 1 and interval_s > 0, got {burst} and {interval_s}")
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._window_start = clock()
        self._in_window = 0  # lines logged in the current window
        self.dropped = 0  # lines dropped since the last one logged
        self.dropped_total = 0  # since start

    def allow(self) -> tuple[bool, int]:
        """Whether a line may be logged now, and how many were dropped before it (reported once)."""
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.burst:
            self.dropped += 1
            self.dropped_total += 1
            return False, 0
        self._in_window += 1
        dropped, self.dropped = self.dropped, 0
        return True, dropped

    def log(self, logger: logging.Logger, level: int, message: str, *args: object,
            exc_info: BaseException | None = None) -> bool:
        """Log `message % args` at `level` unless over the rate; True if it was logged."""
        if not logger.isEnabledFor(level):
            return False
        allowed, dropped = self.allow()
        if not allowed:
            return False
        if dropped:
            message += " [%d similar lines dropped]"
            args = (*args, dropped)
        logger.log(level, message, *args, exc_info=exc_info)
        return True


# One budget for every client-triggered line of the process, whichever transport or module.
CLIENT_ERRORS = RateLimitedLog()
