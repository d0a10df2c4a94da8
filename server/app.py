"""Server(config): the gRPC server with health, reflection, metrics, and a draining stop.

Used by `attnserve serve` and by the tests alike:
    server = Server(config); port = await server.start(); ...; await server.stop(grace_s)

It creates the state its layers share (server.lifecycle: Draining, Arrivals, Admission) and
hands it down: the gate and the servicer hold Draining, the gate updates Arrivals and Admission,
every Batcher reads Arrivals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from attnserve.files import write_json_atomic
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.proto import reflection_pool
from attnserve.server.config import ServerConfig
from attnserve.server.engine import choose_device
from attnserve.server.gate import CallGate, HandlerTable
from attnserve.server.lifecycle import Admission, Arrivals, Draining, MemoryBudget
from attnserve.server.memory import configure_allocator, default_memory_limit, reclaim
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


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on every address `host` resolves to (localhost: 127.0.0.1 and ::1), all on one
    port, or raise OSError naming the one that failed: never serve on part of them silently.
    Returns the port (the one chosen by the system when `port` is 0)."""
    if host in _WILDCARDS:
        addresses = [host.strip("[]") or "0.0.0.0"]
    else:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise OSError(f"--host {host}: cannot resolve it ({err.strerror})") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        try:
            bound = (server.add_secure_port(target, credentials) if credentials is not None
                     else server.add_insecure_port(target))
        except RuntimeError as err:
            raise OSError(f"cannot listen on {target} (--host {host}): {err}") from None
        if bound == 0:
            raise OSError(f"cannot listen on {target} (--host {host})")
        port = bound  # the rest take the port the first one got
    return port


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
        self._gate: CallGate | None = None
        self._health = health.aio.HealthServicer()
        self._draining = Draining()
        self._arrivals = Arrivals()
        self._admission = Admission(self._arrivals)
        self.budget: MemoryBudget | None = None

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
        configure_allocator()
        limit = cfg.memory_limit_bytes if cfg.memory_limit_bytes is not None else default_memory_limit()
        loop = asyncio.get_running_loop()
        # Once a large use of the budget is over, what gRPC and numpy freed goes back to the
        # system (off the event loop: malloc_trim walks every heap).
        self.budget = MemoryBudget(limit, on_idle=lambda: loop.call_later(
            _TRIM_DELAY_S, lambda: loop.run_in_executor(None, reclaim)))
        self.registry = ModelRegistry.load(cfg, device, self.metrics, arrivals=self._arrivals,
                                           run_batch=self._run_batch, budget=self.budget)
        self.registry.start()
        servicer = InferenceServicer(self.registry, self.metrics, self._draining, self.budget)

        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
            # A client that opens calls and never reads their answers is held here and by the
            # memory budget (its unsent answers stay counted until its calls end).
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        ]
        # Every method is served through the gate (token, draining, parsing; see server.gate).
        gate = CallGate(method_handlers(servicer, self._health), self._admission, self._draining, _INFER_METHODS,
                        token, cfg.access_log)
        self._gate = gate
        self._grpc = grpc.aio.server(options=options)
        self._grpc.add_generic_rpc_handlers((gate,))
        self.port = bind(self._grpc, cfg.host, cfg.port, credentials)
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
        logger.info("serving %d model(s) %s on %s:%d (metrics %s, max message %d bytes, memory budget %d bytes)%s",
                    len(self.registry.loaded), sorted(self.registry.loaded), cfg.host, self.port,
                    f"http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "off",
                    cfg.max_message_bytes, limit,
                    f"; not ready: {sorted(self.registry.failed)}" if self.registry.failed else "")
        if cfg.ready_file is not None:
            self._write_ready_file(cfg.ready_file)
        return self.port

    def _write_ready_file(self, path: Path) -> None:
        write_json_atomic(path, {"grpc_port": self.port, "metrics_port": self.metrics_port, "pid": os.getpid()})

    def hurry(self) -> None:
        """A second signal: end the drain delay and the grace period now; what has not started
        computing is refused with UNAVAILABLE (never computed), running batches finish."""
        self._draining.hurry()

    async def stop(self, grace_s: float, drain_delay_s: float = 0.0) -> None:
        """Drain, in three steps:
        1. readiness and health turn NOT_SERVING (Watch streams are told), and for drain_delay_s
           calls are still admitted: a load balancer that has not yet seen the change loses none;
        2. then new calls are refused with UNAVAILABLE (never computed: retry elsewhere), and
           every admitted call finishes within grace_s; what is still queued then is refused
           with UNAVAILABLE and running batches finish;
        3. Watch streams end, and after a pause in incoming calls gRPC stops: GOAWAY, the
           listener closed. hurry() cuts 1 and 2 short."""
        started = time.monotonic()
        self._draining.begin()
        await self._health.enter_graceful_shutdown()
        if drain_delay_s > 0 and not self._draining.hurried.is_set():
            logger.info("draining: readiness NOT_SERVING, still admitting calls for %.1fs", drain_delay_s)
            await _wait_for(self._draining.hurried, drain_delay_s)
        self._draining.refuse()
        in_flight = self._admission.in_flight
        grace_left = 0.0 if self._draining.hurried.is_set() else grace_s
        logger.info("refusing new calls (UNAVAILABLE); finishing %d call(s) in flight within %.1fs",
                    in_flight, grace_left)
        finished = await self._admission.wait_idle(grace_left, interrupt=self._draining.hurried)
        if not finished:
            logger.warning("%s with %d call(s) unfinished; refusing queued ones",
                           "second signal" if self._draining.hurried.is_set() else f"grace period {grace_s:.1f}s over",
                           self._admission.in_flight)
        if self.registry is not None:
            await self.registry.close(abandon_queued=not finished)
        watches = await self._gate.end_watches() if self._gate is not None else 0
        if self._grpc is not None:
            if self._gate is not None and not self._draining.hurried.is_set():
                await self._gate.quiet(_QUIET_S, _QUIET_BOUND_S)
            # GOAWAY, the listener closed. What was admitted is answered by now; gRPC cancels
            # anything still running after the margin (the refusals' answers leave well before).
            await self._grpc.stop(_RUNNING_MARGIN_S)
        await self._metrics_endpoint.close()
        logger.info("stopped after %.2fs (%d call(s) in flight when new calls were refused, %d watch stream(s) "
                    "ended)", time.monotonic() - started, in_flight, watches)


# Before GOAWAY, wait for a pause in the calls coming in (at most _QUIET_BOUND_S): gRPC's stop
# cancels the calls it received but had not yet handed to a busy event loop (CANCELLED); through
# the gate they are answered UNAVAILABLE (retry elsewhere).
_QUIET_S = 0.1
_QUIET_BOUND_S = 0.5
# gRPC cancels whatever still runs this long after our own grace: the batches already running
# when the grace ran out (they finish: the README's promise) and the answers refused at that
# point (UNAVAILABLE) get this long to leave.
_RUNNING_MARGIN_S = 10.0
# After the memory budget empties, the call that released it is still finishing (its request
# and response objects go when its handler's frames do): trim a moment later.
_TRIM_DELAY_S = 0.05


async def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """True if `event` is set within timeout_s."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
