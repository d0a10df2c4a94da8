"""Client text quoted in an error message, bounded: `echo(name)` is its repr, cut to ECHO_CHARS
and marked when cut. An error's details travel back in a grpc-message trailer; quoting a 1 MiB
name in full gave clients RESOURCE_EXHAUSTED ("header too large") instead of our message.
server.errors also caps whole details at MAX_DETAILS_CHARS, whatever built them."""

from __future__ import annotations

ECHO_CHARS = 100
MAX_DETAILS_CHARS = 1024


def echo(text: object, limit: int = ECHO_CHARS) -> str:
    quoted = repr(text)
    if len(quoted) <= limit:
        return quoted
    return f"{quoted[:limit]}... (cut: {len(quoted) - limit} more characters)"


def capped(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    if len(details) <= limit:
        return details
    return f"{details[:limit]}... (cut: {len(details) - limit} more characters)"
