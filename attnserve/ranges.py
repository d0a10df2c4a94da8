"""Ranges: every bound of a number a flag or config.json may set, in one place (a leaf: the
server's config layer, the contract's serving defaults and export all check against it).

The upper bounds are what the libraries and the native data plane take (docs/server.md, "Ranges");
past them a value failed deep inside (an OverflowError, a TypeError at the plane's hand-over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1  # gRPC's integer channel arguments, socket.listen's backlog, the native plane's Start
INT64_MAX = 2**63 - 1  # the native plane's int64_t counts, bytes and lengths
# native/core/types.h's kMaxTimeoutUs: a later deadline would overflow the plane's clock (nanoseconds
# in an int64). Every delay, wait and timeout is bounded by it, on both planes alike.
MAX_WAIT_US = 2**50
MAX_WAIT_MS = MAX_WAIT_US / 1e3
MAX_WAIT_S = MAX_WAIT_US / 1e6
# A width, head count or sequence length whose single float32 row could not travel in one gRPC
# message (at most INT32_MAX bytes) can never be served.
MAX_ELEMENTS = INT32_MAX // 4


@dataclass(frozen=True)
class Range:
    """The values a setting may take: an integer or a finite number in low..high (a bound excluded
    when open), in `unit`; `never`: infinity is accepted too and means never (stored as None)."""

    low: float
    high: float
    integer: bool = True
    unit: str = ""
    low_open: bool = False
    high_open: bool = False
    never: str = ""  # what infinity means ("never", "no limit"); empty: refused

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        span = (f"in {self.low}..{self.high}" if self.integer
                else f"in {left}{figure(self.low)}, {figure(self.high)}{right}")
        unit = f" {self.unit}" if self.unit else ""
        return f"{kind} {span}{unit}" + (f" (or inf: {self.never})" if self.never else "")

    def check(self, name: str, value: Any) -> Any:
        """value, or None for infinity where it means never; ValueError naming `name` and the range."""
        number = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if number and not isinstance(value, bool):
            if self.never and value == math.inf:
                return None
            if (math.isfinite(value) and (self.low < value if self.low_open else self.low <= value)
                    and (value < self.high if self.high_open else value <= self.high)):
                return value
        raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


def figure(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def count(low: int = 1, high: int = INT64_MAX, unit: str = "") -> Range:
    return Range(low, high, unit=unit)


# config.json's and the flags' shared ones: a flag overrides the value of every model's config.json.
BATCH_SIZE = count(unit="sequences")
QUEUE_DELAY_MS = Range(0, MAX_WAIT_MS, integer=False, unit="ms")
WIDTH = count(high=MAX_ELEMENTS)  # attention dims, d_model and num_heads
LENGTH = count(high=MAX_ELEMENTS, unit="positions")  # max_q_len, max_kv_len
CROSSOVER_LENGTH = count(low=0, high=MAX_ELEMENTS, unit="positions")
VERSION = count()  # version numbers and counts of versions
PRIORITY_LEVELS = count()
QUEUE_TIMEOUT_US = count(low=0, high=MAX_WAIT_US - 1, unit="microseconds")  # 0: none; the plane reads its bound as none
