"""Server(config): the gRPC server with health, reflection, metrics, and a draining stop.

Used by `attnserve serve` and by the tests alike:
    server = Server(config); port = await server.start(); ...; await server.stop(grace_s)
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.proto import reflection_pool
from attnserve.server.config import ServerConfig
from attnserve.server.engine import choose_device
from attnserve.server.gate import Admission, CallGate, HandlerTable
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelRegistry
from attnserve.server.security import bearer_token, server_credentials
from attnserve.server.service import InferenceServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_INFER_METHODS = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("ModelInfer", "ModelStreamInfer"))


class Server:
    def __init__(self, config: ServerConfig, servicer_class: type[InferenceServicer] = InferenceServicer) -> None:
        """servicer_class: the inference service's implementation (bench.floor swaps in one
        that answers without computing, to measure this stack's own cost)."""
        self.config = config
        self._servicer_class = servicer_class
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = Metrics()
        self.registry: ModelRegistry | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._admission = Admission()

    async def start(self) -> int:
        """Load the models, bind, serve. Returns the bound gRPC port.
        Raises engine.DeviceUnavailable for --device cuda without CUDA."""
        cfg = self.config
        # TLS files and the token are checked before anything slow: a bad one fails at once.
        credentials = server_credentials(cfg)
        token = bearer_token(cfg)
        device = choose_device(cfg.device)
        if device.why_not_cuda:
            logger.warning("device auto: serving on CPU because %s", device.why_not_cuda)
        # Creating sessions blocks for a while; nothing else is running yet.
        self.registry = ModelRegistry.load(cfg, device, self.metrics, arrivals=self._requests_arriving)
        self.registry.start()
        servicer = self._servicer_class(self.registry, self.metrics)
        self._servicer = servicer

        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
        ]
        # Every method is served through the gate (token, draining, parsing; see server.gate).
        table = HandlerTable()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, table)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, table)
        # Reflection gets a pool that has our private-pool file as well as health's and its own.
        services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(services, pool=reflection_pool(services)), table)
        self._grpc = grpc.aio.server(options=options)
        self._grpc.add_generic_rpc_handlers((CallGate(table.handlers, self._admission, _INFER_METHODS, token,
                                                      cfg.access_log),))
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
