"""What every call meets first, in one place: the token, draining, and message parsing.

    gate = CallGate(method_handlers, admission, counted_methods, token, access_log)
    grpc_server.add_generic_rpc_handlers((gate,))

gRPC asks `CallGate.service(details)` once per call, synchronously, as soon as the call's
headers arrive and before its message is read. It answers with
- UNAUTHENTICATED (the message never read) when a token is required and missing or wrong;
- UNAVAILABLE (never read) for an inference call that starts while the server drains;
- otherwise the method's handler, built once at startup to parse its own message (garbage ->
  INVALID_ARGUMENT, server.parsing); inference calls are counted by Admission from
  this moment until their handler returns, so draining waits for a call whose headers came
  before SIGTERM even while its message is still arriving.
Every refusal is answered through server.errors, like any other error.

Why not grpc.aio interceptors: they run as a chain of coroutines on every call, on the event
loop that is this server's bottleneck (with a canned answer and no model, three of them cost
2,983 vs 3,530 calls/s at concurrency 32; with the model the difference is within this
machine's noise).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable, Mapping

import grpc

from attnserve.server.errors import ShuttingDown, Unauthenticated, abort
from attnserve.server.parsing import tolerant_handler
from attnserve.server.security import REFUSAL, BearerToken

logger = logging.getLogger(__name__)


class Admission:
    """Counts inference calls from the moment their headers arrive, before their message does.

    gRPC never runs the handler of a call whose message does not arrive (client gone, deadline
    hit on the way), so "arriving" calls are forgotten after ARRIVAL_TIMEOUT_S; calls whose
    handler runs are counted until it returns, whatever happens."""

    ARRIVAL_TIMEOUT_S = 10.0
    _PRUNE_EVERY = 1024

    def __init__(self) -> None:
        self.draining = False
        self._arriving: dict[int, float] = {}  # call number -> time.monotonic() its headers came
        self._running = 0
        self.streams = 0  # ModelStreamInfer calls running: open for long, not requests on the way
        self._changed = asyncio.Event()
        self._calls = itertools.count()

    @property
    def in_flight(self) -> int:
        return self._running + len(self._arriving)

    def arrived(self) -> int:
        call = next(self._calls)
        self._arriving[call] = time.monotonic()
        if call % self._PRUNE_EVERY == 0:
            self._forget_stale_arrivals()
        return call

    def started(self, call: int) -> None:
        self._arriving.pop(call, None)
        self._running += 1

    def finished(self) -> None:
        self._running -= 1
        self._changed.set()

    def _forget_stale_arrivals(self) -> None:
        too_old = time.monotonic() - self.ARRIVAL_TIMEOUT_S
        for call in [c for c, t in self._arriving.items() if t < too_old]:
            del self._arriving[call]

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no admitted call is running or arriving; False if timeout_s passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._forget_stale_arrivals()
            if self.in_flight == 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            try:  # wake on each finished call, and poll for arrivals that never come
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.05))
            except TimeoutError:
                pass


def _refusal(error: Exception, on_call: Callable[[str], None] | None = None) -> grpc.RpcMethodHandler:
    """A handler that ends its call with `error` (on_call is given the peer first).
    Request-streaming, with no deserializer: it runs as soon as the headers arrive and never
    reads or parses the message, however large."""

    async def refuse(request_iterator, context):
        if on_call is not None:
            on_call(context.peer())
        await abort(context, error)

    return grpc.stream_unary_rpc_method_handler(refuse)


_DRAINING_REFUSAL = _refusal(ShuttingDown("server is shutting down; retry on another replica"))


class CallGate(grpc.GenericRpcHandler):
    def __init__(self, method_handlers: Mapping[str, grpc.RpcMethodHandler], admission: Admission,
                 counted_methods: frozenset[str], token: BearerToken | None = None,
                 access_log: bool = False) -> None:
        """method_handlers: "/package.Service/Method" -> handler, for every method served (a kind
        server.parsing does not wrap is a TypeError here, at startup).
        counted_methods: the inference methods Admission counts (and draining refuses)."""
        self._handlers = {method: tolerant_handler(method, h) for method, h in method_handlers.items()}
        self._admission = admission
        self._counted = counted_methods
        self._token = token
        self._access_log = access_log

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        # The token first, unknown methods included: nothing tells an outsider what exists.
        if self._token is not None and not self._token.admits(method, details.invocation_metadata):
            token = self._token
            return _refusal(Unauthenticated(REFUSAL), lambda peer: token.note_refusal(method, peer))
        handler = self._handlers.get(method)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED
        if self._access_log:
            logger.info("rpc %s", method)
        if method not in self._counted:
            return handler
        if self._admission.draining:
            return _DRAINING_REFUSAL
        return self._counted_call(handler, self._admission.arrived())

    def _counted_call(self, handler: grpc.RpcMethodHandler, call: int) -> grpc.RpcMethodHandler:
        """The handler, counted by Admission until it returns."""
        admission = self._admission
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request, context):
                admission.started(call)
                try:
                    return await inner_unary(request, context)
                finally:
                    admission.finished()

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.stream_stream

        async def stream(request_iterator, context):
            admission.started(call)
            admission.streams += 1
            try:
                async for response in inner_stream(request_iterator, context):
                    yield response
            finally:
                admission.streams -= 1
                admission.finished()

        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


class HandlerTable:
    """Stands in for a grpc server in the generated `add_*Servicer_to_server` functions and
    keeps what they register: {"/package.Service/Method": handler}."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler
