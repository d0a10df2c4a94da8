"""The Prometheus endpoint: GET /metrics over HTTP/1.1, on the server's event loop.

    endpoint = MetricsEndpoint(registry)
    port = await endpoint.start(host, port)   # OSError if the port is taken
    ...
    await endpoint.close()

Only `/metrics` (with or without a query string) is served: any other path is 404, any other
method than GET and HEAD 405, so an HTTP probe pointed at this port by mistake fails instead of
passing. Every connection is bounded: at most MAX_CONNECTIONS open at once (more are closed at
once), MAX_REQUEST_BYTES of request line and headers, READ_TIMEOUT_S to send them, one request
per connection. No thread per request: prometheus_client's own server starts one for every
unfinished request.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

PATH = "/metrics"
MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 10.0


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, refresh=None) -> None:
        """refresh: called before each scrape (server.metrics.Metrics.refresh)."""
        self._registry = registry
        self._refresh = refresh
        self._server: asyncio.Server | None = None
        self._open = 0
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on every address `host` resolves to; returns the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            status, body, content_type = self._answer(head)
            await self._respond(writer, status, body, content_type, head.startswith(b"HEAD "))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that went away, sent too much, or too slowly: nothing to answer
        finally:
            self._open -= 1
            writer.close()

    def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", b"bad request\n", "text/plain"
        method, target, _version = parts
        if target.split("?", 1)[0] != PATH:
            return "404 Not Found", f"not found: metrics are at {PATH}\n".encode(), "text/plain"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"use GET\n", "text/plain"
        if self._refresh is not None:
            self._refresh()
        return "200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str,
                       head_only: bool) -> None:
        header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                  "Connection: close\r\n\r\n").encode("latin-1")
        writer.write(header if head_only else header + body)
        await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
