"""Client text quoted in an error message, bounded: `quoted(name)` is its repr, cut to QUOTED_CHARS
and marked when cut. An error's details travel back in a grpc-message trailer; quoting a 1 MiB
name in full gave clients RESOURCE_EXHAUSTED ("header too large") instead of our message.
server.errors also caps whole details at MAX_DETAILS_CHARS, whatever built them.

Outside text in a log line (a model's or a file's name, a path, a client's method) goes through
`logged(text)`: as it is when it is printable and without spaces (the usual name: log lines stay
greppable), else quoted(). Text with outside text inside it (an error's reason naming a path)
goes through `escaped(text)`: every character that is not printable written as its escape. A
newline or an escape sequence written raw would forge a log line or drive the reader's terminal."""

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


def logged(text: object, limit: int = QUOTED_CHARS) -> str:
    """`text` for a log line: unchanged if printable, without spaces and at most `limit`
    characters, else quoted (its repr, cut)."""
    text = str(text)
    if len(text) <= limit and text.isprintable() and not any(c.isspace() for c in text):
        return text
    return quoted(text, limit)


def escaped(text: object) -> str:
    """`text` for a log line, with each character that is not printable (newline, escape,
    line separators) written as its escape (\\n, \\x1b) and the rest as it is."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
