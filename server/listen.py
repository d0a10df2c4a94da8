"""The addresses a --host means, for every listener of the server (gRPC, REST).

    addresses = listen_addresses(host)   # localhost: ["127.0.0.1", "::1"]; OSError if unresolvable
    port, held = reserve_port(host, 0)   # one port free on all of them, held with SO_REUSEPORT

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


def reserve_port(host: str, port: int) -> tuple[int, list[socket.socket]]:
    """Bind (never listen) every address of `host` on one port with SO_REUSEPORT: the port the
    workers will share, held for the server's life, or the one port a listener that binds them
    together (the native plane) takes for `--port 0`. OSError if it is in use by a listener that
    does not share."""
    held: list[socket.socket] = []
    try:
        for address in listen_addresses(host):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as err:
                raise OSError(f"cannot listen on {address}:{port} (--host {host}): {err.strerror or err}") from None
            port = sock.getsockname()[1]  # the rest take the port the first one got
    except OSError:
        for sock in held:
            sock.close()
        raise
    return port, held
