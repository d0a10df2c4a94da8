"""The addresses a --host means, for every listener of the server (gRPC, REST).

    addresses = listen_addresses(host)   # localhost: ["127.0.0.1", "::1"]; OSError if unresolvable

Each listener binds all of them on one port, or fails naming the one that failed: never serve
on part of them silently.
"""

from __future__ import annotations

import socket

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def listen_addresses(host: str) -> list[str]:
    if host in _WILDCARDS:
        return [host.strip("[]") or "0.0.0.0"]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise OSError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    return list(dict.fromkeys(info[4][0] for info in infos))
