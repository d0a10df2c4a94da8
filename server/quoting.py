"""Client text quoted in an error message, bounded: `quoted(name)` is its repr, cut to QUOTED_CHARS
and marked when cut. An error's details travel back in a grpc-message trailer; quoting a 1 MiB
name in full gave clients RESOURCE_EXHAUSTED ("header too large") instead of our message.
server.errors also caps whole details at MAX_DETAILS_CHARS, whatever built them."""

from __future__ import annotations

QUOTED_CHARS = 100
MAX_DETAILS_CHARS = 1024


def quoted(text: object, limit: int = QUOTED_CHARS) -> str:
    text_repr = repr(text)
    if len(text_repr) <= limit:
        return text_repr
    return f"{text_repr[:limit]}... (cut: {len(text_repr) - limit} more characters)"


def bounded_details(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    if len(details) <= limit:
        return details
    return f"{details[:limit]}... (cut: {len(details) - limit} more characters)"
