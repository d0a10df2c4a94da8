"""The HTTP/REST port: the Open Inference Protocol's REST binding, a thin adapter over
server.request_path (the request path the gRPC servicer uses), on the gRPC server's event loop.

    rest = RestPort(request_path, admission, draining, token, max_body_bytes, access_log)
    port = await rest.start(host, port, ssl_context)   # OSError if it cannot listen
    await rest.close(timeout_s)                        # after the drain: listeners, then connections

Every request meets, in order: the token (all paths but /v2/health/*), the route (404, 405),
the drain (503 once the server refuses new calls, else counted by lifecycle.Admission until
answered), then a body bounded by --max-message-bytes after inflating, read within
BODY_TIMEOUT_S and holding its share of the memory budget (_Held) until parsed. rest_codec turns
it into the pb.ModelInferRequest that RequestPath.infer handles like a gRPC one. Every error is
`{"error": "..."}` with the HTTP column of server.errors' table, aiohttp's own refusals too.

aiohttp's low-level server, no router or middleware chain per request; each connection is a
_Connection that times its request head and, at --max-http-connections, is closed first if it
has waited longest for one. A client that closes its connection while its inference request is
queued or computing cancels it (_Connection.cancelled_if_lost): it leaves the queue, or its run
stops (server.batcher, "Cancellation"). Bounds and why: docs/rest-hardening.md, docs/record/rest.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestPayloadError
from attnserve.server.errors import (
    OK,
    BodyTooLarge,
    ClientGone,
    NoSuchEndpoint,
    ShuttingDown,
    Status,
    Unauthenticated,
    status_for,
)
from attnserve.server.lifecycle import Admission, Draining
from attnserve.server.listen import listen_addresses
from attnserve.server.memory.budget import MemoryBudget, MemoryExhausted, Reservation
from attnserve.server.quoting import logged, quoted
from attnserve.server.ratelimit import CLIENT_ERRORS
from attnserve.server.request_path import DISCONNECT, RequestPath
from attnserve.server.rest_codec import (
    HEADER_LENGTH,
    as_json,
    check_json_answer,
    encode_infer,
    json_parse_bytes,
    parse_infer,
    parse_json,
    parse_shm_register,
)
from attnserve.server.security import OPEN_PATH_PREFIXES, BearerToken

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # --max-http-connections' default
HEAD_TIMEOUT_S = 10.0  # --http-header-timeout-s' default
MAX_FIELD_BYTES = 8190  # a request line or one header field
MAX_HEADERS = 64
KEEPALIVE_S = 75.0
BODY_TIMEOUT_S = 60.0  # to send a body once its headers came
# Bytes a body costs while it is received: its chunks and their join (server/memory/costs.py counts
# what a request holds after it is parsed).
RECEIVE_FACTOR = 2
_RECEIVE_STEP = 64 << 10  # the first reservation of a body: one read's worth
_HTTP_REFUSAL = "missing or invalid bearer token: send header 'Authorization: Bearer <token>'"
_JSON = "application/json"
_CALL = "attnserve.call"  # the request's record (server.tracing.Call), where spans and access lines are on

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
    def __init__(self, request_path: RequestPath, admission: Admission, draining: Draining, token: BearerToken | None,
                 max_body_bytes: int, access_log: bool = False, max_json_bytes: int | None = None,
                 budget: MemoryBudget | None = None, max_connections: int = MAX_CONNECTIONS,
                 head_timeout_s: float = HEAD_TIMEOUT_S, core=None) -> None:
        """max_json_bytes: the most JSON text a request, or an answer's `data`, may take
        (--max-json-bytes): it is parsed and written on the event loop. budget: the server's
        memory budget, which a body takes from as it is received and parsed (None: unbounded
        but for max_body_bytes). max_connections: open at once (--max-http-connections);
        head_timeout_s: the most a request head may take (--http-header-timeout-s). core: the native
        data plane (server.native.NativePlane), whose queues its inference requests join beside the
        gRPC port's (None: the Python request path serves them)."""
        self._request_path = request_path
        self._core = core
        self._budget = budget
        self._max_connections = max_connections
        self._head_timeout_s = head_timeout_s
        self._open: set[_Connection] = set()
        # Connections awaiting a request head (new, between requests, or sending one), in the
        # order they began to wait: at the cap the first is closed for a new one.
        self._waiting: dict[_Connection, None] = {}
        self.head_timeouts = 0  # connections closed with 408 (server.metrics exposes these)
        self.evictions = 0  # connections closed at the cap for a new one
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
        self._web_options = dict(max_line_size=MAX_FIELD_BYTES, max_field_size=MAX_FIELD_BYTES,
                                 max_headers=MAX_HEADERS, keepalive_timeout=KEEPALIVE_S, access_log=None)
        self._web = web.Server(self._handle, request_factory=self._make_request, **self._web_options)
        try:
            for address in listen_addresses(host):
                try:
                    listener = await loop.create_server(self._protocol, address, port, ssl=ssl_context,
                                                        reuse_address=True, reuse_port=reuse_port or None,
                                                        backlog=self._max_connections)
                except OSError as err:
                    raise OSError(f"cannot listen on {address}:{port} (--host {host}): {err.strerror or err}") from None
                self._listeners.append(listener)
                port = listener.sockets[0].getsockname()[1]  # the rest take the port the first one got
        except OSError:
            await self.close(0)
            raise
        self.port = port
        return port

    def _protocol(self) -> asyncio.Protocol:
        if len(self._open) >= self._max_connections:
            if not self._waiting:
                return _Closing()  # every connection has a request in hand
            oldest = next(iter(self._waiting))
            self._waiting.pop(oldest)
            self._open.discard(oldest)
            self.evictions += 1
            oldest.evict()
        connection = _Connection(self, self._web, loop=asyncio.get_running_loop(), **self._web_options)
        # Counted from here, not from connection_made: asyncio accepts a burst of connections
        # (and a TLS handshake runs) before any of them is made.
        self._open.add(connection)
        self._waiting[connection] = None
        return connection

    @property
    def open_connections(self) -> int:
        return len(self._open)

    # -- connections: the request head's timer and the waiting order (see _Connection) --------

    def _opened(self, connection: _Connection) -> None:
        connection.time_head(self._head_timeout_s)

    def _head_came(self, connection: _Connection) -> None:
        self._waiting.pop(connection, None)
        connection.untime_head()

    def _answered(self, connection: _Connection) -> None:
        if connection in self._open:
            self._waiting[connection] = None

    def _head_began(self, connection: _Connection) -> None:
        connection.time_head(self._head_timeout_s)

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)
        self._waiting.pop(connection, None)
        connection.untime_head()

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
        self._head_came(request.protocol)
        path = request.path
        call = status = None
        if self._request_path.calls is not None:
            call = request[_CALL] = self._request_path.calls.begin(
                "http", f"{request.method} {path}", str(request.remote), request.headers, request.content_length or 0)
        try:
            if self._token is not None and not path.startswith(OPEN_PATH_PREFIXES) and not self._authorized(request):
                self._token.note_refusal(f"{request.method} {path}", str(request.remote))
                raise Unauthenticated(_HTTP_REFUSAL)
            route, params = _route(request.method, path)
            if self._access_log:
                logger.info("http %s %s", logged(request.method), logged(path, 200))  # the client's text, bounded
            handler = getattr(self, route.handler)
            response = await (self._counted(handler, request, params) if route.infer else handler(request, **params))
        except Exception as err:
            status = status_for(err)
            response = error_response(status)
        if call is not None and not call.finished:  # not an inference call's answer (_infer's)
            call.finish(status or OK, response.content_length or 0, http_status=response.status)
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

    async def _body(self, request: web.BaseRequest, held: _Held) -> bytes:
        """The request's body, inflated, read a chunk at a time: `held` takes from the memory
        budget what it holds as it grows (MemoryExhausted, 429, once the budget is spent)."""
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise BodyTooLarge(f"the request body has {request.content_length:,} bytes, over the "
                               f"{self._max_body_bytes:,}-byte limit (--max-message-bytes)")
        if request.content_length is not None:  # inflated it is larger still: refused unread if this cannot fit
            held.check_fits(RECEIVE_FACTOR * request.content_length)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                while chunk := await request.content.readany():
                    size += len(chunk)
                    if size > self._max_body_bytes:
                        raise BodyTooLarge(f"the request body is over the {self._max_body_bytes:,}-byte limit "
                                           "(--max-message-bytes; inflated, when it came compressed)")
                    if RECEIVE_FACTOR * size > held.nbytes:
                        ahead = min(max(size, _RECEIVE_STEP), self._max_body_bytes - size)  # doubling
                        held.grow_to(RECEIVE_FACTOR * size, RECEIVE_FACTOR * ahead)
                    chunks.append(chunk)
        except (HttpProcessingError, RequestPayloadError) as err:  # a corrupt gzip or deflate body, among others
            raise ValueError(f"the request body cannot be read: {getattr(err, 'message', None) or err}") from None
        except ConnectionError:
            raise ClientGone("the client went away while its request body was being received") from None
        except TimeoutError:
            raise ValueError(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _json_body(self, request: web.BaseRequest, default: object) -> object:
        """A small JSON body (the repository API's), parsed within the memory budget."""
        if not request.can_read_body:
            return default
        held = _Held(self._budget, "this request's body")
        try:
            body = await self._body(request, held)
            held.grow_to(held.nbytes + json_parse_bytes(body))
            return parse_json(body) if body else default
        finally:
            held.release()

    # -- endpoints ---------------------------------------------------------------------------

    async def _live(self, request: web.BaseRequest) -> web.Response:
        return _json_response({"live": True})

    async def _ready(self, request: web.BaseRequest) -> web.Response:
        ready = self._request_path.server_ready()
        return _json_response({"ready": ready}, 200 if ready else 503)

    async def _server_metadata(self, request: web.BaseRequest) -> web.Response:
        return _json_response(as_json(self._request_path.server_metadata()))

    async def _model_metadata(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        return _json_response(as_json(self._request_path.model_metadata(model, version or "")))

    async def _model_ready(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        ready = self._request_path.model_ready(model, version or "")
        return _json_response({"name": model, "ready": ready}, 200 if ready else 503)

    async def _model_config(self, request: web.BaseRequest, model: str, version: str | None) -> web.Response:
        # Triton's REST answer is the configuration itself (gRPC's is wrapped in {"config": ...}).
        return _json_response(as_json(self._request_path.model_config(model, version or "").config))

    async def _model_stats(self, request: web.BaseRequest, model: str = "", version: str | None = None
                           ) -> web.Response:
        return _json_response(as_json(self._request_path.model_statistics(model, version or "")))

    async def _repository_index(self, request: web.BaseRequest) -> web.Response:
        ready_only = False
        if request.method == "POST" and request.can_read_body:
            document = await self._json_body(request, {})
            if not isinstance(document, dict) or not isinstance(document.get("ready", False), bool):
                raise ValueError('the index request body must be {"ready": true|false}')
            ready_only = document.get("ready", False)
        index = self._request_path.repository_index("", ready_only)
        return _json_response([{k: v for k, v in as_json(m).items() if v != ""} for m in index.models])

    async def _load(self, request: web.BaseRequest, model: str) -> web.Response:
        """Triton's load: (re)load the model from the repository. Its parameters (a config or
        files sent with the call) are not supported: refused rather than ignored."""
        await self._parameters(request, "load", allowed=())
        await self._request_path.load("", model)
        return _json_response({})

    async def _unload(self, request: web.BaseRequest, model: str) -> web.Response:
        # unload_dependents (tritonclient sends it): there are no ensembles here to unload.
        await self._parameters(request, "unload", allowed=("unload_dependents",))
        await self._request_path.unload("", model)
        return _json_response({})

    async def _shm_status(self, request: web.BaseRequest, region: str = "") -> web.Response:
        return _json_response([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                               for r in self._request_path.shm_status(region)])

    async def _shm_register(self, request: web.BaseRequest, region: str) -> web.Response:
        document = parse_shm_register(await self._json_body(request, {}), region)
        self._request_path.shm_register(region, document["key"], document["offset"], document["byte_size"])
        return _json_response({})

    async def _shm_unregister(self, request: web.BaseRequest, region: str = "") -> web.Response:
        self._request_path.shm_unregister(region)
        return _json_response({})

    async def _cuda_shm(self, request: web.BaseRequest) -> web.Response:
        self._request_path.cuda_shm()
        return _json_response({})  # not reached: cuda_shm raises

    async def _parameters(self, request: web.BaseRequest, what: str, allowed: tuple[str, ...]) -> None:
        document = await self._json_body(request, {})
        parameters = document.get("parameters", {}) if isinstance(document, dict) else None
        if not isinstance(parameters, dict) or set(parameters) - set(allowed):
            raise ValueError(f"{what} takes {'only ' + ', '.join(allowed) if allowed else 'no parameters'} here; "
                             f"got {quoted(str(document))}")

    async def _infer(self, request: web.BaseRequest, start: Callable[[], None], model: str,
                     version: str | None) -> web.StreamResponse:
        began = time.monotonic()
        held = _Held(self._budget, "this request's body")
        try:
            header_length = request.headers.get(HEADER_LENGTH)
            try:
                length = None if header_length is None else int(header_length)
            except ValueError:
                raise ValueError(f"{HEADER_LENGTH} must be an integer, got {header_length[:40]!r}") from None
            body = await self._body(request, held)
            json_bytes = len(body) if length is None else min(max(length, 0), len(body))
            if self._max_json_bytes is None or json_bytes <= self._max_json_bytes:  # over it: refused unparsed
                held.grow_to(held.nbytes + json_parse_bytes(body if json_bytes == len(body) else body[:json_bytes]))
            message, binary_outputs = parse_infer(body, length, model, version or "", self._max_json_bytes)
            del body  # what is left is the message, which the batcher's reservation counts
            if self._max_json_bytes is not None:
                check_json_answer(message, self._request_path.spec(model, version or ""), binary_outputs,
                                  self._max_json_bytes)
        except Exception as err:  # counted as an inference request's outcome, as gRPC's decode errors are
            status = status_for(err)
            response = error_response(status)
            self._request_path.request_done(model, status, began, request.get(_CALL))
            return response
        finally:
            held.release()
        start()  # no await from here to the batcher's queue (lifecycle.Arrivals)
        call = request.get(_CALL)
        with request.protocol.cancelled_if_lost():
            if self._core is not None and self._core.takes(message):  # one queue with the gRPC port's calls
                if call is not None:
                    call.request(message.model_name, message.model_version, message.id)
                answer, status = await self._core.submit_infer(message, call)
                if answer is None and call is not None:
                    call.finish(status)
            else:
                answer, status = await self._request_path.infer(message, None, call, DISCONNECT)
        if answer is None:
            return error_response(status)
        try:
            body, json_length = encode_infer(answer, binary_outputs)
            content_type = _JSON if json_length is None else "application/octet-stream"
            response = web.Response(body=body, content_type=content_type)
            if json_length is not None:
                response.headers[HEADER_LENGTH] = str(json_length)
            accepted = request.headers.get("Accept-Encoding", "")
            if "gzip" in accepted or "deflate" in accepted:
                response.enable_compression()
            response = await self._sent(request, response)
            if call is not None:
                call.finish(status, len(body))
            return response
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


class _Held:
    """What one request's body takes from the memory budget while it is received and parsed,
    given back at once when it is parsed (the batcher's reservation counts the request from
    then on) or refused."""

    def __init__(self, budget: MemoryBudget | None, what: str) -> None:
        self._budget = budget
        self._what = what
        self._parts: list[Reservation] = []
        self.nbytes = 0

    def check_fits(self, nbytes: int) -> None:
        if self._budget is not None:
            self._budget.check_fits(nbytes, self._what)

    def grow_to(self, nbytes: int, ahead: int = 0) -> None:
        """Hold `nbytes` in all, `nbytes + ahead` where that fits now (so that a growing body is
        reserved a few times, not per chunk): MemoryTooLarge (400) if `nbytes` could never fit,
        MemoryExhausted (429) if it does not fit now (a body never waits for memory: it would
        hold its connection and what it has received while it waits)."""
        if self._budget is None or nbytes <= self.nbytes:
            return
        self._budget.check_fits(nbytes, self._what)
        for target in (nbytes + ahead, nbytes) if ahead > 0 else (nbytes,):
            reservation = self._budget.try_reserve(target - self.nbytes)
            if reservation is not None:
                self._parts.append(reservation)
                self.nbytes = target
                return
        self._budget.count_shed()
        raise MemoryExhausted(f"memory budget: {self._budget.used_bytes:,} of {self._budget.limit_bytes:,} bytes "
                              f"in use (--memory-limit-bytes); receiving and parsing {self._what} needs "
                              f"{nbytes:,}; retry later")

    def release(self) -> None:
        for reservation in self._parts:
            reservation.release()
        self._parts.clear()
        self.nbytes = 0


def _refusal_text(status: int, exc: BaseException | None, message: str | None) -> tuple[int, str]:
    """aiohttp's own refusal (the request did not parse as HTTP) as our status and message."""
    if isinstance(exc, ContentEncodingError):
        return 415, ("the request's Content-Encoding is not supported: send the body as it is, or with gzip or "
                     "deflate")
    if isinstance(exc, LineTooLong) or (message and "Too many headers" in message):
        return 431, (f"the request line or a header field is over {MAX_FIELD_BYTES:,} bytes, or it has more "
                     f"than {MAX_HEADERS} headers")
    if status >= 500:
        return status, "internal error; the server log has the details"
    detail = (message or getattr(exc, "message", None) or str(exc or "") or "malformed").strip()
    detail = detail.splitlines()[0].rstrip(":")  # aiohttp adds the line and a caret under it
    return status, f"the request is not valid HTTP/1.1: {detail[:200]}"


class _Connection(web.RequestHandler):
    """One HTTP connection: aiohttp's, with two changes. Its refusals (a request that is not
    valid HTTP) are `{"error": ...}` JSON and log one rate-limited line, not a traceback. And its
    request head is timed: a new connection, and one that has begun a request after an idle
    keep-alive spell, must send the whole head within the timeout (else 408 and closed), and
    while it waits for a head it is in RestPort's waiting order, whose oldest is closed when a
    new connection comes at the cap (docs/rest-hardening.md)."""

    def __init__(self, port: RestPort, manager: web.Server, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._port = port
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle = False  # between requests: the next byte starts a head
        self._evicted = False
        self._cancelled_if_lost: asyncio.Task | None = None  # see cancelled_if_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._evicted:  # closed for a newer connection before it was made
            self.force_close()
        else:
            self._port._opened(self)

    def evict(self) -> None:
        """Close this connection (or, not yet made, close it when it is) without an answer."""
        self._evicted = True
        self.untime_head()
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._port._lost(self)
        task, self._cancelled_if_lost = self._cancelled_if_lost, None
        if task is not None:
            task.cancel()
        super().connection_lost(exc)

    @contextlib.contextmanager
    def cancelled_if_lost(self):
        """Losing the connection cancels the handler while in this block: only an inference's
        wait, not aiohttp's handler_cancellation's every handler (a model load must not stop
        halfway because its client left)."""
        self._cancelled_if_lost = asyncio.current_task()
        if self.transport is None:  # lost before the block began: cancelled at its first wait
            self._cancelled_if_lost.cancel()
        try:
            yield
        finally:
            self._cancelled_if_lost = None

    def data_received(self, data: bytes) -> None:
        if self._idle and data:
            self._idle = False
            self._port._head_began(self)
        super().data_received(data)

    async def finish_response(self, request, resp, start_time):
        result = await super().finish_response(request, resp, start_time)
        if self.transport is not None:
            self._idle = True
            self._port._answered(self)
        return result

    def time_head(self, timeout_s: float) -> None:
        self.untime_head()
        self._head_timer = asyncio.get_running_loop().call_later(timeout_s, self._head_late, timeout_s)

    def untime_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self, timeout_s: float) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None:
            return
        self._port.head_timeouts += 1
        body = json.dumps({"error": f"the request head did not arrive within {timeout_s:g}s "
                                    "(--http-header-timeout-s)"}).encode()
        transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.force_close()  # the transport sends what it was given, then closes

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        self._port._head_came(self)
        status, text = _refusal_text(status, exc, message)
        if status >= 500:
            CLIENT_ERRORS.log(logger, logging.ERROR, "error answering an HTTP request from %s: %r", request.remote,
                              exc, exc_info=exc)
        else:
            CLIENT_ERRORS.log(logger, logging.INFO, "refused an HTTP request from %s (%d): %s", request.remote,
                              status, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the answer was being sent already; nothing more can be")
        response = _json_response({"error": text}, status)
        response.force_close()
        return response

    def log_exception(self, message: str, *args, exc_info: BaseException | None = None, **kwargs) -> None:
        if isinstance(exc_info, (HttpProcessingError, RequestPayloadError, ConnectionError)):  # the client's fault
            CLIENT_ERRORS.log(self.logger, logging.INFO, "%s: %s", message % args, _first_line(exc_info))
        else:
            CLIENT_ERRORS.log(self.logger, logging.ERROR, message, *args, exc_info=exc_info)


def _first_line(err: BaseException) -> str:
    text = (getattr(err, "message", None) or str(err)).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]
