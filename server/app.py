"""Server(config): the gRPC server with health, reflection, metrics, and a draining stop.

Used by `attnserve serve` and by the tests alike:
    server = Server(config); port = await server.start(); ...; await server.stop(grace_s)

It creates the state its layers share (server.lifecycle: Draining, Arrivals, Admission) and
hands it down: the gate and the servicer hold Draining, the gate updates Arrivals and Admission,
every Batcher reads Arrivals.
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
from attnserve.server.gate import CallGate, HandlerTable
from attnserve.server.lifecycle import Admission, Arrivals, Draining
from attnserve.server.metrics import Metrics
from attnserve.server.metrics_http import MetricsEndpoint
from attnserve.server.models import ModelRegistry, RunBatchFactory
from attnserve.server.security import bearer_token, server_credentials
from attnserve.server.service import InferenceServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_INFER_METHODS = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("ModelInfer", "ModelStreamInfer"))
# grpc_health's aio servicer does not implement Health/List: what it registers for it is the
# generated, synchronous placeholder, which answers UNIMPLEMENTED with a traceback in the log
# per call (and health is open to callers without a token). Left out, gRPC answers
# UNIMPLEMENTED itself.
_NOT_SERVED = frozenset({"/grpc.health.v1.Health/List"})


def method_handlers(servicer: InferenceServicer, health_servicer: health.aio.HealthServicer
                    ) -> dict[str, grpc.RpcMethodHandler]:
    """"/package.Service/Method" -> handler for every method served: the inference service,
    grpc.health.v1 and server reflection, as their generated functions register them."""
    table = HandlerTable()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, table)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, table)
    # Reflection gets a pool that has our private-pool file as well as health's and its own.
    services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(services, pool=reflection_pool(services)), table)
    return {method: h for method, h in table.handlers.items() if method not in _NOT_SERVED}


class Server:
    def __init__(self, config: ServerConfig, run_batch: RunBatchFactory | None = None) -> None:
        """run_batch: how each model's batches are computed, made from its spec; None (the
        server) is ONNX Runtime. bench.floor passes one that returns zeros, to measure this
        stack's own cost with the real gate, servicer and batchers."""
        self.config = config
        self._run_batch = run_batch
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = Metrics()
        self._metrics_endpoint = MetricsEndpoint(self.metrics.registry)
        self.registry: ModelRegistry | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._draining = Draining()
        self._arrivals = Arrivals()
        self._admission = Admission(self._arrivals)

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
        self.registry = ModelRegistry.load(cfg, device, self.metrics, arrivals=self._arrivals,
                                           run_batch=self._run_batch)
        self.registry.start()
        servicer = InferenceServicer(self.registry, self.metrics, self._draining)

        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
        ]
        # Every method is served through the gate (token, draining, parsing; see server.gate).
        gate = CallGate(method_handlers(servicer, self._health), self._admission, self._draining, _INFER_METHODS,
                        token, cfg.access_log)
        self._grpc = grpc.aio.server(options=options)
        self._grpc.add_generic_rpc_handlers((gate,))
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
            try:
                self.metrics_port = await self._metrics_endpoint.start(cfg.host, cfg.metrics_port)
            except OSError as err:
                await self._grpc.stop(None)
                raise OSError(f"metrics port {cfg.host}:{cfg.metrics_port}: {err.strerror or err}") from None
        logger.info("serving %d model(s) %s on %s:%d (metrics %s, max message %d bytes)%s",
                    len(self.registry.loaded), sorted(self.registry.loaded), cfg.host, self.port,
                    f"http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "off",
                    cfg.max_message_bytes,
                    f"; not ready: {sorted(self.registry.failed)}" if self.registry.failed else "")
        if cfg.ready_file is not None:
            self._write_ready_file(cfg.ready_file)
        return self.port

    def _write_ready_file(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"grpc_port": self.port, "metrics_port": self.metrics_port, "pid": os.getpid()}))
        os.replace(tmp, path)

    async def stop(self, grace_s: float) -> None:
        """Drain: readiness and health to NOT_SERVING, refuse new calls, finish every admitted
        one (within grace_s), then close."""
        started = time.monotonic()
        self._draining.begin()
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
        await self._metrics_endpoint.close()
        logger.info("stopped after %.2fs (%d call(s) were in flight when draining began)",
                    time.monotonic() - started, in_flight)
