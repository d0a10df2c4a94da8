"""W3C trace context for calls the client makes (docs/tracing.md), without OpenTelemetry: a
batch job is one trace, each of its calls a span id of its own in it, sent as `traceparent`.

    trace = JobTrace.start()                # joins $TRACEPARENT's trace when the caller set one
    metadata = trace.call_metadata()        # (("traceparent", "00-<trace>-<new span>-01"),)

The server's request spans are children of these call span ids, so a tracing backend shows the
job's calls as one trace (and `trace.trace_id` finds it); the client exports no spans itself.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

TRACEPARENT = "traceparent"
# version 00, a trace id and a parent id (not all zeros), the flags: the W3C Trace Context header.
_TRACEPARENT = re.compile(r"00-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-(?P<flags>[0-9a-f]{2})")


def _nonzero(length: int) -> str:
    while (value := secrets.token_hex(length)) == "0" * (2 * length):
        pass
    return value


@dataclass(frozen=True)
class JobTrace:
    trace_id: str  # 32 hex digits
    flags: str = "01"  # sampled, unless the caller's traceparent said otherwise

    @classmethod
    def start(cls, environ: Mapping[str, str] | None = None) -> JobTrace:
        """A new trace, or the caller's from $TRACEPARENT (the convention for commands run inside a trace)."""
        environ = os.environ if environ is None else environ
        match = _TRACEPARENT.fullmatch(environ.get("TRACEPARENT", "").strip().lower())
        if match and match["trace"] != "0" * 32 and match["span"] != "0" * 16:
            return cls(match["trace"], match["flags"])
        return cls(_nonzero(16))

    def traceparent(self) -> str:
        """A traceparent for one call: this trace, a new span id."""
        return f"00-{self.trace_id}-{_nonzero(8)}-{self.flags}"

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TRACEPARENT, self.traceparent()),)
