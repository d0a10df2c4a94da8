"""Server(config): the gRPC server with health, reflection, metrics, and a draining stop.

Used by `python -m server` and by the tests alike:
    server = Server(config); port = await server.start(); ...; await server.stop(grace_s)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pb_grpc
from server.config import ServerConfig
from server.engine import choose_device
from server.metrics import Metrics
from server.models import ModelRegistry
from server.security import MalformedMessageGuard, auth_interceptors, server_credentials
from server.service import InferenceServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_INFER_METHODS = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("ModelInfer", "ModelStreamInfer"))


class _Admission(grpc.aio.ServerInterceptor):
    """Tracks inference RPCs from the moment their headers arrive, before their message does.

    A call admitted before SIGTERM is served even if its bytes are still arriving when draining
    starts (grpc's own stop(grace) would cancel it); a call that starts after is refused with
    UNAVAILABLE, so the client retries on another replica.

    gRPC never runs the handler of a call whose message does not arrive (client gone, deadline
    hit on the way), so "arriving" calls are forgotten after ARRIVAL_TIMEOUT_S; calls whose
    handler runs are counted until it returns, whatever happens."""

    ARRIVAL_TIMEOUT_S = 10.0
    _PRUNE_EVERY = 1024

    def __init__(self, access_log: bool) -> None:
        self.draining = False
        self._arriving: dict[int, float] = {}  # call number -> time.monotonic() its headers came
        self._running = 0
        self.streams = 0  # ModelStreamInfer calls running: open for long, not requests on the way
        self._changed = asyncio.Event()
        self._calls = itertools.count()
        self._access_log = access_log

    @property
    def in_flight(self) -> int:
        return self._running + len(self._arriving)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if self._access_log:
            logger.info("rpc %s", details.method)
        if handler is None or details.method not in _INFER_METHODS:
            return handler
        admitted = not self.draining
        call = next(self._calls)
        self._arriving[call] = time.monotonic()
        if call % self._PRUNE_EVERY == 0:
            self._forget_stale_arrivals()
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request, context):
                self._started(call)
                try:
                    if not admitted:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")
                    return await inner_unary(request, context)
                finally:
                    self._finished()

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        inner_stream = handler.stream_stream

        async def stream(request_iterator, context):
            self._started(call)
            self.streams += 1
            try:
                if not admitted:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")
                async for response in inner_stream(request_iterator, context):
                    yield response
            finally:
                self.streams -= 1
                self._finished()

        return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)

    def _started(self, call: int) -> None:
        self._arriving.pop(call, None)
        self._running += 1

    def _finished(self) -> None:
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


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = Metrics()
        self.registry: ModelRegistry | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._admission = _Admission(config.access_log)

    async def start(self) -> int:
        """Load the models, bind, serve. Returns the bound gRPC port.
        Raises engine.DeviceUnavailable for --device cuda without CUDA."""
        cfg = self.config
        # TLS files and the token are checked before anything slow: a bad one fails at once.
        credentials = server_credentials(cfg)
        auth = auth_interceptors(cfg)
        device = choose_device(cfg.device)
        if device.why_not_cuda:
            logger.warning("device auto: serving on CPU because %s", device.why_not_cuda)
        # Creating sessions blocks for a while; nothing else is running yet.
        self.registry = ModelRegistry.load(cfg, device, self.metrics, arrivals=self._requests_arriving)
        self.registry.start()
        servicer = InferenceServicer(self.registry, self.metrics)
        self._servicer = servicer

        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
        ]
        # Unauthenticated calls stop before admission; the guard sits inside it (a message that
        # does not parse is answered INVALID_ARGUMENT by a call admission saw start and finish).
        self._grpc = grpc.aio.server(interceptors=[*auth, self._admission, MalformedMessageGuard()],
                                     options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc)
        address = f"{cfg.host}:{cfg.port}"
        self.port = (self._grpc.add_secure_port(address, credentials) if credentials is not None
                     else self._grpc.add_insecure_port(address))
        await self._grpc.start()

        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.registry.loaded:
            await self._health.set(name, serving)
        for name in self.registry.failed:
            await self._health.set(name, not_serving)
        overall = serving if self.registry.loaded else not_serving
        await self._health.set("", overall)
        await self._health.set(SERVICE_NAME, overall)

        if cfg.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(cfg.host, cfg.metrics_port)
        logger.info("serving %d model(s) %s on %s:%d (metrics %s, max message %d bytes)%s",
                    len(self.registry.loaded), sorted(self.registry.loaded), cfg.host, self.port,
                    f"http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "off",
                    cfg.max_message_bytes,
                    f"; not ready: {sorted(self.registry.failed)}" if self.registry.failed else "")
        if cfg.ready_file is not None:
            self._write_ready_file(cfg.ready_file)
        return self.port

    def _requests_arriving(self) -> int:
        """Inference calls the server has received (headers or message) that have not reached a
        batcher yet: the batchers wait a little for them instead of running each one alone."""
        return max(self._admission.in_flight - self._admission.streams - self.registry.requests_inside(), 0)

    def _write_ready_file(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"grpc_port": self.port, "metrics_port": self.metrics_port, "pid": os.getpid()}))
        os.replace(tmp, path)

    async def stop(self, grace_s: float) -> None:
        """Drain: readiness and health to NOT_SERVING, refuse new calls, finish every admitted
        one (within grace_s), then close."""
        started = time.monotonic()
        self._admission.draining = True
        self._servicer.draining = True
        await self._health.enter_graceful_shutdown()
        in_flight = self._admission.in_flight
        finished = await self._admission.wait_idle(grace_s)
        if not finished:
            # The grace period bounds the stop: what has not started computing is refused with
            # UNAVAILABLE (safe to retry elsewhere); running batches finish.
            logger.warning("grace period %.1fs over with %d call(s) unfinished; refusing queued ones",
                           grace_s, self._admission.in_flight)
        if self.registry is not None:
            await self.registry.close(abandon_queued=not finished)
        remaining = grace_s - (time.monotonic() - started)
        if self._grpc is not None:
            await self._grpc.stop(max(remaining, 0.1))
        self.metrics.close()
        logger.info("stopped after %.2fs (%d call(s) were in flight when draining began)",
                    time.monotonic() - started, in_flight)
