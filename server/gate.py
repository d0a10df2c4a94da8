"""What every call meets first, in one place: the token, draining, and message parsing.

    gate = CallGate(method_handlers, admission, draining, counted_methods, token, access_log)
    grpc_server.add_generic_rpc_handlers((gate,))

gRPC asks `CallGate.service(details)` once per call, synchronously, as soon as the call's
headers arrive and before its message is read. It answers with
- UNAUTHENTICATED (the message never read) when a token is required and missing or wrong;
- UNAVAILABLE (never read) for an inference call that starts while the server drains;
- otherwise the method's handler, built once at startup to parse its own message (garbage ->
  INVALID_ARGUMENT, server.parsing); inference calls are counted by lifecycle.Admission from
  this moment until their handler returns, so draining waits for a call whose headers came
  before SIGTERM even while its message is still arriving, and the batchers know (through
  lifecycle.Arrivals) that requests are on their way.
- A ModelInfer call's message is received only while fewer than `receive_slots` are being
  received (ReceiveSlots: each may be up to --max-message-bytes, and none is in the memory
  budget until its handler runs). Its handler is request-streaming, run at the headers: it reads
  the one message once it holds a slot (until then gRPC's core holds only what HTTP/2 flow
  control lets in: the server runs without BDP probing, which would open the window to the whole
  message; server.app), and gives the slot back the moment the call is cancelled or its peer
  goes away (gRPC cancels the handler), not when the slot goes stale.
Every refusal is answered through server.errors, like any other error.

Why not grpc.aio interceptors: they run as a chain of coroutines on every call, on the event
loop that is this server's bottleneck (docs/record/performance.md has the figures).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping

import grpc
from attnserve.server.errors import MalformedMessage, ShuttingDown, Unauthenticated, abort, status_for
from attnserve.server.handover import CoreCalls
from attnserve.server.lifecycle import Admission, Draining
from attnserve.server.parsing import bounded_infer_request, tolerant_handler
from attnserve.server.quoting import logged
from attnserve.server.security import REFUSAL, BearerToken, call_peer
from attnserve.server.tracing import Calls
from grpc_health.v1 import health_pb2

logger = logging.getLogger(__name__)


def log_arrival(method: str) -> None:
    """A call's arrival line with --access-log (its headers read): the gate's, and the native
    plane's calls' (server.native_records), on one logger."""
    logger.info("rpc %s", logged(method))


def _refusal(error: Exception, on_call: Callable[[str], None] | None = None, relayed: bool = False
             ) -> grpc.RpcMethodHandler:
    """A handler that ends its call with `error` (on_call is given the peer first).
    Request-streaming, with no deserializer: it runs as soon as the headers arrive and never
    reads or parses the message, however large."""

    async def refuse(request_iterator, context):
        if on_call is not None:
            on_call(call_peer(context, relayed))
        await abort(context, error)

    return grpc.stream_unary_rpc_method_handler(refuse)


_DRAINING_REFUSAL = _refusal(ShuttingDown("server is shutting down; retry on another replica"))
# grpc.health.v1 Watch streams stay open for as long as a client watches: the stop ends them.
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _WatchContext:
    """A Watch call's context that remembers the last status it sent (server.gate.end_watches
    waits for NOT_SERVING to go out); everything else is the call's own context."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.last_status: int | None = None

    async def write(self, message) -> None:
        await self._context.write(message)
        self.last_status = message.status

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class ReceiveSlots:
    """Unary inference messages being received at once: at most `slots` (None: unbounded).

    A slot is taken when a call's headers arrive (take_now) or once one is free (take), and
    given back once its message is read or its call is cancelled (CallGate). A call whose client
    sends headers and then nothing, yet stays connected, is forgotten STALE_S after its slot was
    taken (as lifecycle.Arrivals forgets such calls), so it cannot hold a slot for ever."""

    STALE_S = 10.0

    def __init__(self, slots: int | None, on_idle: Callable[[], None] | None = None) -> None:
        """on_idle: called when no message is being received or waits to be, after some waited
        (the server gives memory back then: server.memory.heap.reclaim)."""
        if slots is not None and slots < 1:
            raise ValueError(f"receive slots must be >= 1, got {slots}")
        self.slots = slots
        self._on_idle = on_idle
        self._waiting = 0  # calls waiting for a slot now
        self._waited = False  # some call waited since on_idle was last called
        self.deferred = 0  # calls whose reading waited for a slot, since start
        self._taken: dict[int, float] = {}  # ticket -> time.monotonic() it was taken (oldest first)
        self._tickets = itertools.count()
        self._freed = asyncio.Event()
        # The native data plane's own slots, of the same number (server.native): (slots, receiving,
        # deferred), added to this plane's figures; None: no native plane.
        self.native: Callable[[], tuple[int, int, int]] | None = None

    def figures(self) -> tuple[int, int, int]:
        """(slots, 0: unbounded; messages being received now; calls whose reading waited), both planes."""
        receiving, deferred = len(self._taken), self.deferred
        if self.native is not None:
            _, native_receiving, native_deferred = self.native()
            receiving, deferred = receiving + native_receiving, deferred + native_deferred
        return self.slots or 0, receiving, deferred

    @property
    def receiving(self) -> int:
        """Messages being received now."""
        stale = time.monotonic() - self.STALE_S
        while self._taken and next(iter(self._taken.values())) < stale:
            self._taken.pop(next(iter(self._taken)))
        return len(self._taken)

    def take_now(self) -> int | None:
        """A slot's ticket, or None when every slot is taken."""
        if self.slots is not None and self.receiving >= self.slots:
            return None
        ticket = next(self._tickets)
        self._taken[ticket] = time.monotonic()
        return ticket

    async def take(self) -> int:
        """A slot's ticket, once one is free (given back, or gone stale)."""
        self.deferred += 1
        self._waiting += 1
        self._waited = True
        try:
            while (ticket := self.take_now()) is None:
                self._freed.clear()
                oldest = next(iter(self._taken.values()))
                try:
                    await asyncio.wait_for(self._freed.wait(), max(oldest + self.STALE_S - time.monotonic(), 0.01))
                except TimeoutError:
                    pass
        finally:
            self._waiting -= 1
        return ticket

    def give_back(self, ticket: int) -> None:
        if self._taken.pop(ticket, None) is not None:
            self._freed.set()

    def call_done(self) -> None:
        """A call whose message waited for a slot is over."""
        if self._waited and not self._waiting and not self._taken and self._on_idle is not None:
            self._waited = False
            self._on_idle()


class CallGate(grpc.GenericRpcHandler):
    def __init__(self, method_handlers: Mapping[str, grpc.RpcMethodHandler], admission: Admission,
                 draining: Draining, counted_methods: frozenset[str], token: BearerToken | None = None,
                 access_log: bool = False, receive_slots: int | None = None,
                 on_receive_idle: Callable[[], None] | None = None, relayed: bool = False) -> None:
        """method_handlers: "/package.Service/Method" -> handler, for every method served (a kind
        server.parsing does not wrap is a TypeError here, at startup).
        counted_methods: the inference methods Admission counts (and draining refuses).
        receive_slots: unary inference messages received at once (ReceiveSlots); None: any.
        on_receive_idle: ReceiveSlots' on_idle.
        relayed: calls come from the native data plane's relay (server.security.call_peer)."""
        self._relayed = relayed
        self.receive = ReceiveSlots(receive_slots, on_receive_idle)
        # The inference methods' messages have their `parameters` bounded before they are parsed.
        self._handlers = {
            method: tolerant_handler(method, h, bounded_infer_request if method in counted_methods else None)
            for method, h in method_handlers.items()}
        self.calls_seen = 0  # every call gRPC has handed to the event loop (server.handover)
        self.last_call_at = float("-inf")  # time.monotonic() of the latest call's headers
        self._watches: dict[asyncio.Task, _WatchContext] = {}  # the handler tasks of open Watch streams
        self._ending: set[asyncio.Task] = set()  # those end_watches() cancelled
        if WATCH_METHOD in self._handlers:
            self._handlers[WATCH_METHOD] = self._tracked_watch(self._handlers[WATCH_METHOD])
        self._admission = admission
        self._draining = draining
        self._counted = counted_methods
        self._token = token
        self._access_log = access_log
        # Refusals here never reach the servicer: their access lines are written here.
        self._refusals = Calls(None, access_log=True) if access_log else None

    def _refused(self, error: Exception, method: str, also: Callable[[str], None] | None = None
                 ) -> grpc.RpcMethodHandler:
        """A refusal that writes the call's access line (and calls `also` with the peer)."""
        refusals = self._refusals

        def on_call(peer: str) -> None:
            if also is not None:
                also(peer)
            refusals.begin("grpc", method.rsplit("/", 1)[-1], peer, None).finish(status_for(error))

        return _refusal(error, on_call, self._relayed)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        self.calls_seen += 1
        self.last_call_at = time.monotonic()
        method = details.method
        # The token first, unknown methods included: nothing tells an outsider what exists.
        if self._token is not None and not self._token.admits(method, details.invocation_metadata):
            token = self._token
            if self._refusals is not None:
                return self._refused(Unauthenticated(REFUSAL), method, lambda peer: token.note_refusal(method, peer))
            return _refusal(Unauthenticated(REFUSAL), lambda peer: token.note_refusal(method, peer), self._relayed)
        handler = self._handlers.get(method)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED
        # The call's headers are in; its access line comes once answered (server.tracing). Behind the
        # native plane, the plane wrote the inference calls' lines at their headers (server.native_records).
        if self._access_log and not (self._relayed and method in self._counted):
            log_arrival(method)
        if method not in self._counted:
            return handler
        if self._draining.refusing:
            if self._refusals is not None:
                return self._refused(ShuttingDown("server is shutting down; retry on another replica"), method)
            return _DRAINING_REFUSAL
        return self._counted_call(handler)

    async def quiet(self, since: float, quiet_s: float, bound_s: float) -> None:
        """Return once no call has come for quiet_s, counting from `since` (when refusals
        began) at the earliest, or after bound_s: a call on its way when the drain began (a
        load balancer still sending) meets the refusal (UNAVAILABLE, retried elsewhere), not
        gRPC's stop, which cancels calls that arrive while it begins."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() - max(self.last_call_at, since) < quiet_s and time.monotonic() < deadline:
            await asyncio.sleep(quiet_s / 4)

    async def handed_over(self, core: CoreCalls, bound_s: float) -> bool:
        """Return once every call gRPC's core has received on this server has come through
        here (True), or after bound_s (False: calls kept coming, or channelz cannot tell).
        Begin the stop right after, without giving the event loop a turn: then it cancels no
        call that core was still holding for this loop."""
        deadline = time.monotonic() + bound_s
        while (taken := core.started()) is not None and taken > self.calls_seen:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.001)
        return taken is not None

    async def end_watches(self, flush_s: float = 1.0) -> int:
        """End every open health Watch stream, with status OK, once it has sent NOT_SERVING (or
        after flush_s): an open Watch would otherwise hold the stop for the whole grace period.
        Returns how many were ended."""
        deadline = time.monotonic() + flush_s
        while any(w.last_status != NOT_SERVING for w in self._watches.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # each watcher writes its update on its own task
        for task in self._watches:
            self._ending.add(task)
            task.cancel()
        return len(self._watches)

    def _tracked_watch(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_stream
        watches, ending = self._watches, self._ending

        async def watch(request, context):
            task = asyncio.current_task()
            watches[task] = tracked = _WatchContext(context)
            try:
                return await inner(request, tracked)
            except asyncio.CancelledError:
                if task in ending:
                    return None  # ended by the stop: a clean end of the stream
                raise  # the client went away
            finally:
                watches.pop(task, None)
                ending.discard(task)

        return grpc.unary_stream_rpc_method_handler(watch, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)

    def _counted_call(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler, counted by Admission from now (headers) until it returns."""
        admission = self._admission
        if handler.unary_unary is not None:
            ticket = admission.arrived(unary=True)
            inner_unary = handler.unary_unary
            receive = self.receive
            slot = receive.take_now()  # None: every slot is taken, the message is read once one is free

            # Request-streaming even though the call is unary: gRPC runs this as soon as the
            # headers arrive and cancels it the moment the call is cancelled or its peer goes, so
            # the slot and the call's place in Admission are given back then (a unary handler
            # never runs for a call whose message does not arrive).
            async def unary(request_iterator, context):
                taken = slot
                try:
                    if taken is None:
                        taken = await receive.take()
                    messages = aiter(request_iterator)
                    request = await anext(messages, None)
                    if request is not None:
                        # Read the end of the stream too: grpcio 1.72 keeps a call's HTTP/2 stream
                        # open until it is read (max_concurrent_streams then refuses new calls).
                        try:
                            async with asyncio.timeout(ReceiveSlots.STALE_S):
                                await anext(messages, None)
                        except TimeoutError:
                            pass  # a client that never half-closes: its message is here, go on
                except BaseException:  # cancelled, or the peer went away, before the message came
                    admission.started(ticket)
                    admission.finished()
                    raise
                finally:
                    if taken is not None:
                        receive.give_back(taken)
                admission.started(ticket)
                try:
                    if request is None:
                        await abort(context, MalformedMessage(ValueError("the call sent no request message")))
                    return await inner_unary(request, context)
                finally:
                    del request  # before the reclaim below: a refused call's frames outlive it
                    admission.finished()
                    if slot is None:
                        receive.call_done()

            return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        ticket = admission.arrived(unary=False)
        inner_stream = handler.stream_stream

        async def stream(request_iterator, context):
            admission.started(ticket, stream=True)
            try:
                async for response in inner_stream(request_iterator, context):
                    yield response
            finally:
                admission.finished(stream=True)

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
