"""The HTTP/REST port: the Open Inference Protocol's REST binding, a thin adapter over
server.answers (the request path the gRPC servicer uses), on the gRPC server's event loop.

    rest = RestPort(answers, admission, draining, token, max_body_bytes, access_log)
    port = await rest.start(host, port, ssl_context)   # OSError if it cannot listen
    await rest.close(timeout_s)                        # after the drain: listeners, then connections

Every request meets, in order: the token (all paths but /v2/health/*, unknown ones included),
the route (unknown: 404, another method: 405), and for inference the drain: refused with 503
(never read, never computed) once the server refuses new calls, else counted by
lifecycle.Admission from its headers until it is answered, as the gRPC gate counts a call. The
body is bounded by --max-message-bytes after inflating (gzip, deflate: aiohttp inflates it a
chunk at a time, so a bomb is refused at the bound, not held), read within BODY_TIMEOUT_S, then
rest_codec turns it into the pb.ModelInferRequest that Answers.infer decodes, batches and
encodes like a gRPC one. Every error is `{"error": "..."}` with the HTTP column of
server.errors' table.

aiohttp's low-level server (aiohttp.web.Server): no Application, router or middleware chain per
request; the routes are a table of our own. Bounds: MAX_CONNECTIONS open at once (beyond them a
connection is closed at once), request line and header fields of MAX_FIELD_BYTES, MAX_HEADERS
headers, idle keep-alive connections closed after KEEPALIVE_S. Why aiohttp and not uvicorn with
starlette: bench/http_library.py (the README's Design section has the figures).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from attnserve.server.answers import Answers
from attnserve.server.echo import echo
from attnserve.server.errors import (BodyTooLarge, NoSuchEndpoint, ShuttingDown, Status, Unauthenticated,
                                     status_for)
from attnserve.server.lifecycle import Admission, Draining
from attnserve.server.listen import listen_addresses
from attnserve.server.rest_codec import (HEADER_LENGTH, as_json, check_json_answer, encode_infer, parse_infer,
                                         parse_shm_register)
from attnserve.server.security import OPEN_PATH_PREFIXES, REFUSAL, BearerToken

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
MAX_FIELD_BYTES = 8190  # a request line or one header field
MAX_HEADERS = 64
KEEPALIVE_S = 75.0
BODY_TIMEOUT_S = 60.0  # to send a body once its headers came
_HTTP_REFUSAL = "missing or invalid bearer token: send header 'Authorization: Bearer <token>'"
_JSON = "application/json"

Handler = Callable[..., Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class _Route:
    pattern: re.Pattern
    method: str
    handler: str  # RestPort's method
    infer: bool = False  # counted by Admission, refused while draining


_M = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
_SHM = r"/v2/systemsharedmemory"
_ROUTES = (
    _Route(re.compile(r"/v2/health/live"), "GET", "_live"),
    _Route(re.compile(r"/v2/health/ready"), "GET", "_ready"),
    _Route(re.compile(r"/v2/?"), "GET", "_server_metadata"),
    _Route(re.compile(_M + "/infer"), "POST", "_infer", infer=True),
    _Route(re.compile(_M + "/ready"), "GET", "_model_ready"),
    _Route(re.compile(_M + "/config"), "GET", "_model_config"),
    _Route(re.compile(r"/v2/models/stats"), "GET", "_model_stats"),
    _Route(re.compile(_M + "/stats"), "GET", "_model_stats"),
    _Route(re.compile(r"/v2/repository/index"), "POST", "_repository_index"),
    _Route(re.compile(r"/v2/repository/index"), "GET", "_repository_index"),
    _Route(re.compile(r"/v2/repository/models/(?P<model>[^/]+)/load"), "POST", "_load"),
    _Route(re.compile(r"/v2/repository/models/(?P<model>[^/]+)/unload"), "POST", "_unload"),
    _Route(re.compile(_M), "GET", "_model_metadata"),
    # Triton's shared memory extension (server.shm).
    _Route(re.compile(_SHM + r"/status"), "GET", "_shm_status"),
    _Route(re.compile(_SHM + r"/region/(?P<region>[^/]+)/status"), "GET", "_shm_status"),
    _Route(re.compile(_SHM + r"/region/(?P<region>[^/]+)/register"), "POST", "_shm_register"),
    _Route(re.compile(_SHM + r"/unregister"), "POST", "_shm_unregister"),
    _Route(re.compile(_SHM + r"/region/(?P<region>[^/]+)/unregister"), "POST", "_shm_unregister"),
    _Route(re.compile(r"/v2/cudasharedmemory(?:/.*)?"), "GET", "_cuda_shm"),
    _Route(re.compile(r"/v2/cudasharedmemory(?:/.*)?"), "POST", "_cuda_shm"),
)


def _json_response(document: object, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(document, separators=(",", ":")).encode(), status=status,
                        content_type=_JSON)


def error_response(status: Status) -> web.Response:
    response = _json_response({"error": status.details}, status.http)
    if status.http == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


class RestPort:
    def __init__(self, answers: Answers, admission: Admission, draining: Draining, token: BearerToken | None,
                 max_body_bytes: int, access_log: bool = False, max_json_bytes: int | None = None) -> None:
        """max_json_bytes: the most JSON text a request, or an answer's `data`, may take
        (--max-json-bytes): it is parsed and written on the event loop."""
        self._answers = answers
        self._max_json_bytes = max_json_bytes
        self._admission = admission
        self._draining = draining
        self._token = token
        self._max_body_bytes = max_body_bytes
        self._access_log = access_log
        self._web: web.Server | None = None
        self._listeners: list[asyncio.Server] = []
        self.port: int | None = None

    # -- listening ---------------------------------------------------------------------------

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> int:
        """Listen on every address `host` resolves to, all on one port; returns it. reuse_port:
        share the port with the other worker processes (server.workers)."""
        loop = asyncio.get_running_loop()
        self._web = web.Server(self._handle, request_factory=self._make_request, max_line_size=MAX_FIELD_BYTES,
                               max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS,
                               keepalive_timeout=KEEPALIVE_S, access_log=None)
        try:
            for address in listen_addresses(host):
                try:
                    listener = await loop.create_server(self._protocol, address, port, ssl=ssl_context,
                                                        reuse_address=True, reuse_port=reuse_port or None,
                                                        backlog=MAX_CONNECTIONS)
                except OSError as err:
                    raise OSError(f"cannot listen on {address}:{port} (--host {host}): {err.strerror or err}") from None
                self._listeners.append(listener)
                port = listener.sockets[0].getsockname()[1]  # the rest take the port the first one got
        except OSError:
            await self.close(0)
            raise
        self.port = port
        return port

    def _protocol(self):
        if len(self._web.connections) >= MAX_CONNECTIONS:
            return _Closing()
        return self._web()

    def _make_request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                               client_max_size=self._max_body_bytes)

    async def close(self, timeout_s: float) -> None:
        """Stop listening, then close the connections, each once its request is answered (at
        most timeout_s)."""
        for listener in self._listeners:
            listener.close()
        if self._web is not None:
            await self._web.shutdown(timeout_s)
        for listener in self._listeners:
            await listener.wait_closed()
        self._listeners.clear()

    # -- every request -----------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        try:
            if self._token is not None and not path.startswith(OPEN_PATH_PREFIXES) and not self._authorized(request):
                self._token.note_refusal(f"{request.method} {path}", str(request.remote))
                raise Unauthenticated(_HTTP_REFUSAL)
            route, params = _route(request.method, path)
            if self._access_log:
                logger.info("http %s %s", request.method, path[:200])  # the client's text, bounded
            handler = getattr(self, route.handler)
            response = await (self._counted(handler, request, params) if route.infer else handler(request, **params))
        except Exception as err:
            response = error_response(status_for(err))
        if self._draining.active:
            response.force_close()  # a client reconnects, through its balancer, to another replica
        return response

    def _authorized(self, request: web.BaseRequest) -> bool:
        return self._token.authorized([("authorization", v) for v in request.headers.getall("Authorization", ())])

    async def _counted(self, handler: Handler, request: web.BaseRequest, params: dict) -> web.StreamResponse:
        """An inference request: refused while the server refuses new calls (before its body is
        read), else counted by Admission from now until answered."""
        if self._draining.refusing:
            raise ShuttingDown("server is shutting down; retry on another replica")
        admission = self._admission
        ticket = admission.arrived(unary=True)
        started = False

        def start() -> None:  # the body is in: the request is no longer arriving but running
            nonlocal started
            admission.started(ticket)
            started = True

        try:
            return await handler(request, start, **params)
        finally:
            if not started:
                admission.started(ticket)
            admission.finished()

    async def _body(self, request: web.BaseRequest) -> bytes:
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise BodyTooLarge(f"the request body has {request.content_length:,} bytes, over the "
                               f"{self._max_body_bytes:,}-byte limit (--max-message-bytes)")
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"the request body is over the {self._max_body_bytes:,}-byte limit "
                               "(--max-message-bytes; inflated, when it came compressed)") from None
        except (HttpProcessingError, RequestPayloadError) as err:  # a corrupt gzip or deflate body, among others
            raise ValueError(f"the request body cannot be read: {getattr(err, 'message', None) or err}") from None
        except TimeoutError:
            raise ValueError(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s") from None

    # -- endpoints ---------------------------------------------------------------------------

    async def _live(self, request: web.BaseRequest) -> web.Response:
        return _json_response({"live": True})

    async def _ready(self, request: web.BaseRequest) -> web.Response:
        ready = self._answers.server_ready()
        return _json_response({"ready": ready}, 200 if ready else 503)

    async def _server_metadata(self, request: web.BaseRequest) -> web.Response:
        return _json_response(as_json(self._answers.server_metadata()))

    async def _model_metadata(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        return _json_response(as_json(self._answers.model_metadata(model, version or "")))

    async def _model_ready(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        ready = self._answers.model_ready(model, version or "")
        return _json_response({"name": model, "ready": ready}, 200 if ready else 503)

    async def _model_config(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        # Triton's REST answer is the configuration itself (gRPC's is wrapped in {"config": ...}).
        return _json_response(as_json(self._answers.model_config(model, version or "").config))

    async def _model_stats(self, request: web.BaseRequest, model: str = "", version: str | None = None
                           ) -> web.Response:
        return _json_response(as_json(self._answers.model_statistics(model, version or "")))

    async def _repository_index(self, request: web.BaseRequest) -> web.Response:
        ready_only = False
        if request.method == "POST" and request.can_read_body:
            document = json.loads(await self._body(request) or b"{}")
            if not isinstance(document, dict) or not isinstance(document.get("ready", False), bool):
                raise ValueError('the index request body must be {"ready": true|false}')
            ready_only = document.get("ready", False)
        index = self._answers.repository_index("", ready_only)
        return _json_response([{k: v for k, v in as_json(m).items() if v != ""} for m in index.models])

    async def _load(self, request: web.BaseRequest, model: str) -> web.Response:
        """Triton's load: (re)load the model from the repository. Its parameters (a config or
        files sent with the call) are not supported: refused rather than ignored."""
        await self._parameters(request, "load", allowed=())
        await self._answers.load("", model)
        return _json_response({})

    async def _unload(self, request: web.BaseRequest, model: str) -> web.Response:
        # unload_dependents (tritonclient sends it): there are no ensembles here to unload.
        await self._parameters(request, "unload", allowed=("unload_dependents",))
        await self._answers.unload("", model)
        return _json_response({})

    async def _shm_status(self, request: web.BaseRequest, region: str = "") -> web.Response:
        return _json_response([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                               for r in self._answers.shm_status(region)])

    async def _shm_register(self, request: web.BaseRequest, region: str) -> web.Response:
        body = await self._body(request) if request.can_read_body else b""
        document = parse_shm_register(body, region)
        self._answers.shm_register(region, document["key"], document["offset"], document["byte_size"])
        return _json_response({})

    async def _shm_unregister(self, request: web.BaseRequest, region: str = "") -> web.Response:
        self._answers.shm_unregister(region)
        return _json_response({})

    async def _cuda_shm(self, request: web.BaseRequest) -> web.Response:
        self._answers.cuda_shm()
        return _json_response({})  # not reached: cuda_shm raises

    async def _parameters(self, request: web.BaseRequest, what: str, allowed: tuple[str, ...]) -> None:
        body = await self._body(request) if request.can_read_body else b""
        document = json.loads(body or b"{}")
        parameters = document.get("parameters", {}) if isinstance(document, dict) else None
        if not isinstance(parameters, dict) or set(parameters) - set(allowed):
            raise ValueError(f"{what} takes {'only ' + ', '.join(allowed) if allowed else 'no parameters'} here; "
                             f"got {echo(str(document))}")

    async def _infer(self, request: web.BaseRequest, start: Callable[[], None], model: str,
                     version: str | None) -> web.StreamResponse:
        began = time.monotonic()
        try:
            header_length = request.headers.get(HEADER_LENGTH)
            try:
                length = None if header_length is None else int(header_length)
            except ValueError:
                raise ValueError(f"{HEADER_LENGTH} must be an integer, got {header_length[:40]!r}") from None
            body = await self._body(request)
            message, binary_outputs = parse_infer(body, length, model, version or "", self._max_json_bytes)
            if self._max_json_bytes is not None:
                check_json_answer(message, self._answers.spec(model, version or ""), binary_outputs,
                                  self._max_json_bytes)
        except Exception as err:  # counted as an inference request's outcome, as gRPC's decode errors are
            status = status_for(err)
            self._answers.request_done(model, status, began)
            return error_response(status)
        start()  # no await from here to the batcher's queue (lifecycle.Arrivals)
        answer, status = await self._answers.infer(message, None)
        if answer is None:
            return error_response(status)
        try:
            body, json_length = encode_infer(answer, binary_outputs)
            response = web.Response(body=body, content_type=_JSON if json_length is None else "application/octet-stream")
            if json_length is not None:
                response.headers[HEADER_LENGTH] = str(json_length)
            if "gzip" in request.headers.get("Accept-Encoding", "") or "deflate" in request.headers.get("Accept-Encoding", ""):
                response.enable_compression()
            return await self._sent(request, response)
        finally:
            answer.release()  # sent (or the client is gone): its share of the memory budget goes back

    async def _sent(self, request: web.BaseRequest, response: web.Response) -> web.Response:
        """Write the answer now (aiohttp would once the handler returns), so that what it holds
        is counted until it is written: a client that does not read holds its share of the
        memory budget, as a gRPC one does, until the write is done or its connection ends."""
        if self._draining.active:
            response.force_close()  # before the headers go: they say "Connection: close"
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away; aiohttp's own write of the response finds it gone too
        return response


def _route(method: str, path: str) -> tuple[_Route, dict[str, str | None]]:
    allowed = []
    for route in _ROUTES:
        match = route.pattern.fullmatch(path)
        if match is None:
            continue
        if route.method == method or (method == "HEAD" and route.method == "GET"):
            return route, match.groupdict()
        allowed.append(route.method)
    if allowed:
        raise NoSuchEndpoint(f"{path} takes {' or '.join(sorted(set(allowed)))}, not {method}", http=405)
    raise NoSuchEndpoint(f"no such endpoint: {method} {path[:200]} (the Open Inference Protocol's are under /v2)")


class _Closing(asyncio.Protocol):
    """A connection over MAX_CONNECTIONS: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()
