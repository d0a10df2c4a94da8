"""Server(config): the gRPC server with health, reflection, metrics, the REST port, and a draining stop.

Used by `attnserve serve` and by the tests alike:
    server = Server(config); port = await server.start(); ...; await server.stop(grace_s)

It creates the state its layers share (server.lifecycle: Draining, Arrivals, Admission) and
hands it down: the gate, the REST port and RequestPath hold Draining, the gate and the REST port
update Arrivals and Admission, every Batcher reads Arrivals. Both transports answer through one
RequestPath (server.request_path): gRPC's servicer and the REST port are adapters over it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from attnserve.proto import REFLECTION_V1, reflection_pool
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import codec, shm
from attnserve.server.config import ServerConfig
from attnserve.server.data_plane import choose_data_plane
from attnserve.server.engine import CUDA, choose_device
from attnserve.server.gate import CallGate, HandlerTable
from attnserve.server.handover import CoreCalls
from attnserve.server.lifecycle import Admission, Arrivals, Draining
from attnserve.server.listen import listen_addresses
from attnserve.server.memory import heap
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.costs import DEFAULT_SHARE, default_memory_limit
from attnserve.server.memory.reclaim import Reclaimer
from attnserve.server.metrics import Metrics
from attnserve.server.metrics_http import MetricsEndpoint
from attnserve.server.models import ModelRegistry, RunBatchFactory
from attnserve.server.repository import ModelLoadError
from attnserve.server.request_path import RequestPath
from attnserve.server.rest import RestPort
from attnserve.server.security import BearerToken, bearer_token, server_credentials, server_ssl_context
from attnserve.server.service import InferenceServicer
from attnserve.server.shm import SystemSharedMemory
from attnserve.server.tracing import Calls, Tracing
from attnserve.server.workers import WorkerContext
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from attnserve.files import write_json_atomic

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# --max-receiving-bytes when not given: this share of the memory budget (the headroom the budget
# leaves, memory.DEFAULT_SHARE, holds it).
DEFAULT_RECEIVING_SHARE = 0.25
_INFER_METHODS = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("ModelInfer", "ModelStreamInfer"))
# grpc_health's aio servicer does not implement Health/List: what it registers for it is the
# generated, synchronous placeholder, which answers UNIMPLEMENTED with a traceback in the log
# per call (and health is open to callers without a token). Left out, gRPC answers
# UNIMPLEMENTED itself.
_NOT_SERVED = frozenset({"/grpc.health.v1.Health/List"})


def method_handlers(servicer: InferenceServicer, health_servicer: health.aio.HealthServicer,
                    max_typed_bytes: int | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """"/package.Service/Method" -> handler for every method served: the inference service,
    grpc.health.v1 and server reflection, as their generated functions register them.
    max_typed_bytes: --max-typed-bytes, which the inference messages' parsing enforces."""
    table = HandlerTable()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, table)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, table)
    # Reflection gets a pool that has our private-pool file as well as health's and its own.
    services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
                REFLECTION_V1)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(services, pool=reflection_pool(services)), table)
    # grpc.reflection.v1 (what current grpcurl and Postman ask first) beside v1alpha: the same
    # messages on the wire (attnserve.proto.reflection_v1_file), so the same handler serves it.
    table.handlers[f"/{REFLECTION_V1}/ServerReflectionInfo"] = table.handlers[
        f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"]
    handlers = {method: h for method, h in table.handlers.items() if method not in _NOT_SERVED}
    # Inference messages carry their tensors' raw bytes: server.codec reads and writes those
    # itself, without protobuf's copies (see "the wire" there).
    infer, stream = f"/{SERVICE_NAME}/ModelInfer", f"/{SERVICE_NAME}/ModelStreamInfer"
    parse = functools.partial(codec.parse_infer_request, max_typed_bytes=max_typed_bytes)
    handlers[infer] = grpc.unary_unary_rpc_method_handler(
        handlers[infer].unary_unary, request_deserializer=parse,
        response_serializer=codec.serialize_infer_response)
    handlers[stream] = grpc.stream_stream_rpc_method_handler(
        handlers[stream].stream_stream, request_deserializer=parse,
        response_serializer=handlers[stream].response_serializer)
    return handlers


def grpc_connection_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """gRPC core's connection age and keepalive arguments from the config (docs/deployment.md,
    "Connections")."""
    options = [
        ("grpc.keepalive_time_ms", int(cfg.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.grpc_keepalive_timeout_s * 1000)),
        # Idle connections are pinged too (a dead peer holds no call to fail), and clients' pings
        # without calls are accepted (otherwise core allows one per two hours).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.grpc_keepalive_min_ping_interval_s * 1000)),
    ]
    if cfg.grpc_max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", int(cfg.grpc_max_connection_age_s * 1000)))
    if cfg.grpc_max_connection_age_grace_s is not None:
        options.append(("grpc.max_connection_age_grace_ms", int(cfg.grpc_max_connection_age_grace_s * 1000)))
    return options


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on every address `host` resolves to (localhost: 127.0.0.1 and ::1), all on one
    port, or raise OSError naming the one that failed: never serve on part of them silently.
    Returns the port (the one chosen by the system when `port` is 0)."""
    addresses = listen_addresses(host)
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
    def __init__(self, config: ServerConfig, run_batch: RunBatchFactory | None = None,
                 worker: WorkerContext | None = None,
                 warm_up_hold: Callable[[Server, str, int], None] | None = None) -> None:
        """run_batch: how each model's batches are computed, made from its spec; None (the
        server) is ONNX Runtime. bench.floor passes one that returns zeros, to measure this
        stack's own cost with the real gate, servicer and batchers. worker: this process is one
        of several serving the same ports (server.workers); None: the server is this process.
        warm_up_hold: called (this server, model, version) before each version's warm-up, on its
        thread: a test's hold (tests.warmup_held_server)."""
        self.config = config
        self._warm_up_hold = warm_up_hold
        self.worker = worker
        self._run_batch = run_batch
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._native = None  # --data-plane native (server.native): it serves `port`, Python behind it
        self.data_plane: str | None = None  # "native" or "python" once started (server.data_plane)
        self._private_dir: Path | None = None  # the Python server's socket behind the native plane
        self._rest: RestPort | None = None
        self.metrics = Metrics(worker.directory if worker is not None else None)
        self._metrics_endpoint = MetricsEndpoint(self.metrics.registry, refresh=self.metrics.refresh)
        self.registry: ModelRegistry | None = None
        self._grpc: grpc.aio.Server | None = None
        self._gate: CallGate | None = None
        self._core_calls: CoreCalls | None = None  # what gRPC's core has taken (server.handover)
        self._health = health.aio.HealthServicer()
        self._draining = Draining()
        self._arrivals = Arrivals()
        self._admission = Admission(self._arrivals)
        self.budget: MemoryBudget | None = None
        self._budget_counter = None  # the budget's counter shared with the native data plane (server.native)
        self._receive_slots = 0  # ModelInfer messages received at once (server.gate.ReceiveSlots)
        self.tracing: Tracing | None = None  # OpenTelemetry, when OTEL_* variables ask (server.tracing)
        self._shared_memory: SystemSharedMemory | None = None  # --allow-shared-memory
        self._shm_expiry: asyncio.Task | None = None  # unregisters idle regions (--shared-memory-idle-timeout-s)
        self._gc_frozen = False  # server.memory.heap.freeze_gc() since the start, and no model change since

    async def start(self) -> int:
        """Load the models, bind, serve. Returns the bound gRPC port.
        Raises engine.DeviceUnavailable for --device cuda without CUDA, and
        data_plane.DataPlaneUnavailable for --data-plane native without its extension."""
        cfg = self.config
        started = time.monotonic()  # time-to-ready counts from here
        # TLS files and the token are checked before anything slow: a bad one fails at once.
        credentials = server_credentials(cfg)
        ssl_context = server_ssl_context(cfg)
        token = bearer_token(cfg)
        # Every worker exports its own spans (tracing.TracingUnavailable: asked, cannot be served).
        self.tracing = Tracing.from_environ(os.environ, self.worker.index if self.worker is not None else None)
        device = choose_device(cfg.device)
        if device.why_not_cuda:
            logger.warning("device auto: serving on CPU because %s", device.why_not_cuda)
        # Before anything slow: --data-plane native without its extension is refused at once.
        plane, _why_not_native = choose_data_plane(cfg.data_plane)
        self.data_plane = plane
        native = plane == "native"
        # Creating sessions blocks for a while; nothing else is running yet.
        heap.configure_allocator()
        # With several workers each takes its share of the default (the supervisor divides a given limit).
        share = DEFAULT_SHARE / (self.worker.workers if self.worker is not None else 1)
        limit = cfg.memory_limit_bytes if cfg.memory_limit_bytes is not None else default_memory_limit(share)
        # Once a large use of the budget is over, freed heap goes back to the system; crowded,
        # the heap turns lean (server.memory.reclaim).
        reclaimer = Reclaimer(asyncio.get_running_loop(), budget=lambda: self.budget)
        self.budget = MemoryBudget(limit, on_idle=reclaimer.on_idle, on_crowded=reclaimer.on_crowded)
        if native:  # one budget for both planes: its counter is the native plane's
            from attnserve.server.native import share_budget

            self._budget_counter = share_budget(self.budget, asyncio.get_running_loop())
        self.metrics.watch_budget(self.budget)
        self.registry = ModelRegistry.from_repository(cfg, device, self.metrics, arrivals=self._arrivals,
                                                      run_batch=self._run_batch, budget=self.budget,
                                                      lone_call_signal=self._admission, tracing=self.tracing)
        if not self.registry.known_names() and cfg.model_control_mode == "none":
            raise ModelLoadError(f"the model repository {cfg.model_repository} holds no model (no <name>/config.json): "
                                 "export one (attnserve export), or start with --model-control-mode explicit or "
                                 "poll to load models later")
        self.registry.started_at = started
        self.registry.listener = self._model_changed
        self.registry.follow = self._native_follows
        if self._warm_up_hold is not None:
            self.registry.warm_up_hold = functools.partial(self._warm_up_hold, self)
        self.registry.start()
        if cfg.allow_shared_memory:
            self._shared_memory = SystemSharedMemory(cfg.shared_memory_max_regions, cfg.shared_memory_max_bytes,
                                                     self.budget, cfg.shared_memory_idle_timeout_s)
            self.metrics.watch_shared_memory(self._shared_memory)
            if cfg.shared_memory_idle_timeout_s:
                self._shm_expiry = asyncio.get_running_loop().create_task(shm.expire_forever(self._shared_memory),
                                                                          name="shared-memory-expiry")
        request_path = RequestPath(self.registry, self.metrics, self._draining, Calls(self.tracing, cfg.access_log),
                                   shared_memory=self._shared_memory, data_plane=plane,
                                   why_no_cuda_shm=shm.why_no_cuda(device.providers[0] == CUDA, device.why_not_cuda))
        servicer = InferenceServicer(request_path, self.budget, relayed=native)

        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # A port in use is an error, not a silent second listener; workers share theirs (server.workers).
            ("grpc.so_reuseport", int(self.worker is not None)),
            # A client that opens calls and never reads their answers is held here and by the
            # memory budget (its unsent answers stay counted until its calls end).
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            # BDP probing opens a stream's window to its whole message before the handler reads it:
            # without it a call whose reading waits (server.gate's receive slots, a stream that
            # stops reading) holds no more than HTTP/2's initial window in gRPC's core.
            ("grpc.http2.bdp_probe", 0),
            *grpc_connection_options(cfg),
        ]
        receiving = cfg.max_receiving_bytes if cfg.max_receiving_bytes is not None else int(
            limit * DEFAULT_RECEIVING_SHARE)
        slots = max(receiving // cfg.max_message_bytes, 1)
        self._receive_slots = slots  # the native port's too (NativePlane)
        # Every method is served through the gate (token, draining, parsing; see server.gate).
        gate = CallGate(method_handlers(servicer, self._health, cfg.max_typed_bytes), self._admission,
                        self._draining, _INFER_METHODS, token, cfg.access_log, receive_slots=slots,
                        on_receive_idle=reclaimer.on_idle, relayed=native)
        self._gate = gate
        self.metrics.watch_receiving(gate.receive)
        servers_before = CoreCalls.server_ids()
        self._grpc = grpc.aio.server(options=options)
        self._core_calls = CoreCalls.of_new_server(servers_before)
        self._grpc.add_generic_rpc_handlers((gate,))
        if native:  # the plane serves the port and relays the rest here: a socket only this process reaches
            self._private_dir = Path(tempfile.mkdtemp(prefix="attnserve-grpc-"))  # mode 0700
            upstream = f"unix:{self._private_dir / 'grpc.sock'}"
            if self._grpc.add_insecure_port(upstream) == 0:
                raise OSError(f"cannot listen on {upstream}")
        else:
            self.port = bind(self._grpc, cfg.host, cfg.port, credentials)
        await self._grpc.start()

        for name in self.registry.known_names():
            await self._model_changed(name, self.registry.ready(name))
        if native:  # listening while the models warm, as the Python port does (warming versions are refused)
            self.port = self._start_native(request_path, token, upstream, [
                ("grpc.http2.bdp_probe", 0), *grpc_connection_options(cfg)])
        if cfg.http_port >= 0:
            self._rest = RestPort(request_path, self._admission, self._draining, token, cfg.max_message_bytes,
                                  cfg.access_log, cfg.max_json_bytes, budget=self.budget,
                                  max_connections=cfg.max_http_connections, head_timeout_s=cfg.http_header_timeout_s,
                                  core=self._native)
            try:
                self.http_port = await self._rest.start(cfg.host, cfg.http_port, ssl_context,
                                                        reuse_port=self.worker is not None)
                self.metrics.watch_http(self._rest)
            except OSError as err:
                await self._grpc.stop(None)
                raise OSError(f"HTTP/REST port: {err}") from None
        if cfg.metrics_port >= 0:
            try:
                self.metrics_port = await self._metrics_endpoint.start(cfg.host, cfg.metrics_port)
            except OSError as err:
                await self._grpc.stop(None)
                if self._rest is not None:
                    await self._rest.close(0)
                raise OSError(f"metrics port {cfg.host}:{cfg.metrics_port}: {err.strerror or err}") from None
        # Readiness stays false (index: WARMING) until each model's graphs have run (server.warmup);
        # the ready file is written after, so it still means ready.
        await self.registry.warm_up_at_start()
        # Said once the models are warm and every listener is up, the native one included.
        logger.info("serving %d model(s) %s on %s:%d (data plane %s, REST %s, metrics %s, max message %d bytes, "
                    "model control %s, memory budget %d bytes, %d message(s) received at once)%s",
                    len(self.registry.loaded), sorted(self.registry.loaded), cfg.host, self.port,
                    "python" if self._native is None else f"native, python behind it on {upstream}",
                    f"http{'s' if ssl_context else ''}://{cfg.host}:{self.http_port}/v2" if self.http_port else "off",
                    f"http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "off",
                    cfg.max_message_bytes, cfg.model_control_mode, limit, slots,
                    f"; not ready: {sorted(self.registry.failed)}" if self.registry.failed else "")
        # What exists now lives as long as the server: the cyclic collector need not walk it
        # again (server.memory.heap.freeze_gc; a model change gives it back: _model_changed).
        heap.freeze_gc()
        self._gc_frozen = True
        if cfg.ready_file is not None:
            self._write_ready_file(cfg.ready_file)
        return self.port

    async def _model_changed(self, name: str, ready: bool) -> None:
        """Health follows the registry: per model, and overall (serving while any model is).
        After the start, a change may retire a version: what freeze_gc() left out of the
        collector's walks becomes collectable again (server.memory.heap.unfreeze_gc).
        The native plane follows first, before any await: both ports change in the same turn."""
        self._native_follows()
        if self._gc_frozen:
            heap.unfreeze_gc()
            self._gc_frozen = False
        if self._draining.active:
            return  # NOT_SERVING since the drain began, whatever changes
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(name, serving if ready else not_serving)
        overall = serving if self.registry is not None and self.registry.ready_names() else not_serving
        await self._health.set("", overall)
        await self._health.set(SERVICE_NAME, overall)

    def _native_follows(self) -> None:
        """The native plane serves what the registry serves now: before the change's ready line is
        logged (the registry's `follow`), since its calls do not wait for the event loop."""
        if self._native is not None:
            self._native.sync()

    def _start_native(self, request_path: RequestPath, token: BearerToken | None, upstream: str,
                      channel_args: list[tuple[str, int]]) -> int:
        """The native data plane's listener on --port (server.native), with the Python port's TLS, token
        and connection arguments, relaying what it does not serve to `upstream`; workers share its port.
        The extension loads (start: choose_data_plane)."""
        from attnserve.server.native import NativePlane

        self._native = NativePlane(self.config, self.registry, request_path, self.metrics, asyncio.get_running_loop(),
                                   budget_counter=self._budget_counter, receive_slots=self._receive_slots,
                                   token=token, shared_port=self.worker is not None)
        if self._gate is not None:  # attnserve_receive_*: both planes' slots
            self._gate.receive.native = self._native.receive_figures
        return self._native.start(upstream, channel_args)

    async def _native_idle(self, deadline: float) -> bool:
        """Whether the native plane's queued and computing calls all finished by `deadline`
        (monotonic), looking at the second signal between short waits."""
        while not self._draining.hurried.is_set():
            left = deadline - time.monotonic()
            if await asyncio.to_thread(self._native.wait_idle, min(max(left, 0.0), _NATIVE_IDLE_STEP_S)):
                return True
            if left <= 0:
                return False
        return False

    def _write_ready_file(self, path: Path) -> None:
        # python_grpc: where the Python gRPC server listens (behind the native plane: its private socket).
        python_grpc = (f"unix:{self._private_dir / 'grpc.sock'}" if self._native is not None
                       else f"127.0.0.1:{self.port}")
        write_json_atomic(path, {"grpc_port": self.port, "http_port": self.http_port, "metrics_port": self.metrics_port,
                                 "python_grpc": python_grpc, "pid": os.getpid()})

    def hurry(self) -> None:
        """A second signal: end the drain delay and the grace period now; what has not started
        computing is refused with UNAVAILABLE (never computed), running batches finish."""
        self._draining.hurry()
        if self._native is not None:  # at once: its runners would otherwise form the next batch meanwhile
            self._native.halt()

    async def stop(self, grace_s: float, drain_delay_s: float = 0.0) -> None:
        """Drain, in three steps:
        1. readiness and health turn NOT_SERVING (Watch streams are told), and for drain_delay_s
           calls are still admitted: a load balancer that has not yet seen the change loses none;
        2. then new calls are refused with UNAVAILABLE (REST: 503; never computed: retry elsewhere), and
           every admitted call finishes within grace_s; what is still queued then is refused
           with UNAVAILABLE and running batches finish;
        3. Watch streams end; after a pause in incoming calls, and once the event loop has seen
           every call gRPC's core took, gRPC stops: GOAWAY, the listener closed; then the REST port's listeners and
           connections close. hurry() cuts 1 and 2 short. Readiness on REST
           (/v2/health/ready) is 503 from step 1 on."""
        started = time.monotonic()
        if self._gc_frozen:  # what freeze_gc() left out goes back to the collector (a process may start another Server)
            heap.unfreeze_gc()
            self._gc_frozen = False
        self._draining.begin()
        if self._native is not None:
            self._native.begin_drain()
        await self._health.enter_graceful_shutdown()
        if drain_delay_s > 0 and not self._draining.hurried.is_set():
            logger.info("draining: readiness NOT_SERVING, still admitting calls for %.1fs", drain_delay_s)
            await _wait_for(self._draining.hurried, drain_delay_s)
        self._draining.refuse()
        if self._native is not None:  # its queued and computing calls finish too
            self._native.refuse()
        refused_at = time.monotonic()
        in_flight = self._admission.in_flight + (self._native.in_flight() if self._native is not None else 0)
        grace_left = 0.0 if self._draining.hurried.is_set() else grace_s
        logger.info("refusing new calls (UNAVAILABLE); finishing %d call(s) in flight within %.1fs",
                    in_flight, grace_left)
        finished = await self._admission.wait_idle(grace_left, interrupt=self._draining.hurried)
        if finished and self._native is not None:
            finished = await self._native_idle(refused_at + grace_left)
        if not finished:
            unfinished = self._admission.in_flight + (self._native.in_flight() if self._native is not None else 0)
            if self._native is not None:  # what has not started is refused before the line says so
                self._native.halt()
            logger.warning("%s with %d call(s) unfinished; refusing queued ones",
                           "second signal" if self._draining.hurried.is_set() else f"grace period {grace_s:.1f}s over",
                           unfinished)
        if self._native is not None:  # what is still queued refused; GOAWAY; running batches finish
            # Watch streams, relayed through the plane, end first: its stop waits for its calls.
            watches = await self._gate.end_watches() if self._gate is not None else 0
            await asyncio.to_thread(self._native.stop, _RUNNING_MARGIN_S)
        if self.registry is not None:
            await self.registry.close(abandon_queued=not finished)
        if self._native is None:
            watches = await self._gate.end_watches() if self._gate is not None else 0
        if self._grpc is not None:
            if self._gate is not None and not self._draining.hurried.is_set():
                await self._gate.quiet(refused_at, _QUIET_S, _QUIET_BOUND_S)
                if self._core_calls is None:
                    await asyncio.sleep(_HANDOVER_PAUSE_S)  # channelz cannot tell: give the loop turns
                elif not await self._gate.handed_over(self._core_calls, _HANDOVER_BOUND_S):
                    logger.warning("stopping while calls still come in: gRPC may cancel some (CANCELLED)")
            # GOAWAY, the listener closed, begun right after handed_over() (no await between:
            # the lock inside is free). What was admitted is answered by now; gRPC cancels
            # anything still running after the margin (the refusals' answers leave well before).
            await self._grpc.stop(_RUNNING_MARGIN_S)
        if self._rest is not None:
            # Listeners closed; each connection closes once its answer is out (what was admitted
            # is answered by now, refusals take a moment).
            await self._rest.close(_RUNNING_MARGIN_S)
        await self._metrics_endpoint.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans exported (the exporter's timeout bounds it)
            self.tracing = None
        if self._shm_expiry is not None:
            self._shm_expiry.cancel()
        if self._shared_memory is not None:
            self._shared_memory.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        logger.info("stopped after %.2fs (%d call(s) in flight when new calls were refused, %d watch stream(s) "
                    "ended)", time.monotonic() - started, in_flight, watches)


# Before GOAWAY, refuse for at least _QUIET_S and until calls pause that long (at most
# _QUIET_BOUND_S): gRPC's stop cancels (CANCELLED) a call that arrives while it begins, so calls
# still coming (a load balancer that has not noticed, clients retrying) meet the refusal instead.
_QUIET_S = 0.1
_QUIET_BOUND_S = 0.5
# Then wait (at most _HANDOVER_BOUND_S) until the event loop has seen every call gRPC's
# core took: its stop cancels (CANCELLED) the ones core still holds for a busy loop, whereas
# through the gate they are answered UNAVAILABLE (retry elsewhere). server.handover says how.
_HANDOVER_BOUND_S = 2.0
_HANDOVER_PAUSE_S = 0.1  # where channelz cannot tell
_NATIVE_IDLE_STEP_S = 0.1  # how often a drain waiting for the native plane looks for a second signal
# gRPC cancels whatever still runs this long after our own grace: the batches already running
# when the grace ran out (they finish: docs/server.md's promise) and the answers refused at that
# point (UNAVAILABLE) get this long to leave.
_RUNNING_MARGIN_S = 10.0


async def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """True if `event` is set within timeout_s."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
