"""The native data plane (server.data_plane: the default where built): ModelInfer in C++, Python once per batch.

    plane = NativePlane(config, registry, request_path, metrics, loop); port = plane.start()
    plane.begin_drain(); plane.refuse(); plane.wait_idle(timeout_s); plane.stop(grace_s)

attnserve.server._native (native/, built by `make native`) listens on --port: it parses
each ModelInfer request, checks it against the contract (the names and datatypes below are
attnserve.contract's, the numbers each model's ModelSpec), queues it per model and forms padded
batches with their masks. One thread per model here takes each batch as numpy views of the
batch's own buffers (no copies), runs the model's existing ONNX Runtime engine on them, and hands
the outputs back; C++ splits and encodes the answers. The plane serves exactly the versions the
registry serves: sync() pushes the registry's state in the same event-loop turn as each change
(a new version gets its queue and runner; a retired one finishes what is queued on it, then its
runner ends). The rare RPCs (readiness, metadata, config, statistics, the index) are relayed to
the event loop as bytes and answered by the same RequestPath as the Python port: one source of
truth. The rest, and ModelInfer requests it does not carry (shared memory; recorded calls), go
byte for byte to the Python gRPC server on a private Unix socket (native/grpc/relay.h). Metrics: each
batch's figures go to the event loop once per batch; final statuses are counted in C++ by name.
Request control as on the Python plane: each model's QueuePolicy and --priority-aging-batches
go to C++, which reads `priority`/`timeout`, orders and expires its queue; a cancelled call leaves
it at once, a batch whose calls all left is stopped through its RunStop (plane.on_stop).
Memory: a native call reserves its cost from the process's one budget and waits within its
deadline in the budget's one queue of waiters (share_budget); --max-queue-size and
--max-queued-bytes bound each queue. Counters kept in C++ are read at scrape time (with workers,
once a second). The port serves the Python port's TLS and bearer token (native/grpc/security.cc) and,
with --workers, is shared by every worker (SO_REUSEPORT). docs/native-data-plane.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import grpc
from attnserve.proto import inference_pb2 as pb
from attnserve.server import parsing
from attnserve.server.batcher import QUEUED, RUNNING, TERMINATED, BatchStats
from attnserve.server.codec import (
    _REQUEST_OVERHEAD_BYTES,
    _RESPONSE_OVERHEAD_BYTES,
    WIRE_MIN_BYTES,
    InferResponse,
    heads_differ_refusal,
    native_graph_terms,
)
from attnserve.server.data_plane import NATIVE_MISSING_NOTE, why_unavailable  # noqa: F401 (this module's API too)
from attnserve.server.errors import OK, status_for, status_of_code
from attnserve.server.lifecycle import Arrivals
from attnserve.server.listen import listen_addresses, reserve_port
from attnserve.server.memory.costs import native_cost_terms
from attnserve.server.metrics import SYNC_PERIOD_S
from attnserve.server.models import ModelUnavailable
from attnserve.server.native_records import NativeRecords
from attnserve.server.quoting import logged
from attnserve.server.request_path import ANSWERED, CLIENT, DEADLINE, DISCONNECT
from attnserve.server.security import NATIVE_PORT, OPEN_METHOD_PREFIXES, REFUSAL, read_tls_files, read_token
from attnserve.server.shm import BYTE_SIZE, OFFSET, REGION
from attnserve.server.tensors import RunStop

from attnserve import contract
from attnserve.ranges import BATCH_SIZE, PRIORITY_LEVELS, QUEUE_DELAY_MS, QUEUE_TIMEOUT_US, WIDTH

logger = logging.getLogger(__name__)

# The contract as the C++ side takes it: names and datatypes, never spelled again there.
CONTRACT_NAMES = {
    "query": "query", "key": "key", "value": "value", "mask": "mask",
    "output": "output", "attn_probs": "attn_probs",
    "fp32": contract.DATATYPES["query"], "bool": contract.DATATYPES["mask"],
}
assert set(contract.INPUT_NAMES) == {"query", "key", "value", "mask"}
assert contract.OUTPUT_NAMES == ("output", "attn_probs")

_WAIT_MS = 100  # how often an idle runner thread looks whether the plane is stopping
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}  # as the Python plane labels them
IN_FLIGHT_METRIC = "attnserve_native_in_flight"  # registered only while the plane serves
OBSERVE_EVERY_S = 0.05  # how long a batch's figures may wait for the event loop (NativePlane._observe)
UNKNOWN_MODEL = "_unknown"  # the label of calls naming no known model (server.request_path's)
# plane.cancellations(index)'s order (native/core/types.h's kCancelReasons x kCancelStages).
CANCEL_LABELS = tuple((reason, stage) for reason in (CLIENT, DEADLINE, DISCONNECT)
                      for stage in (QUEUED, RUNNING, TERMINATED, ANSWERED))

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

# The rare RPCs the native port relays: method -> (request type, its answer from the RequestPath),
# as server.service answers them on the Python port.
RELAYED = {
    "ServerReady": (pb.ServerReadyRequest, lambda rp, r: pb.ServerReadyResponse(ready=rp.server_ready())),
    "ModelReady": (pb.ModelReadyRequest, lambda rp, r: pb.ModelReadyResponse(ready=rp.model_ready(r.name, r.version))),
    "ServerMetadata": (pb.ServerMetadataRequest, lambda rp, r: rp.server_metadata()),
    "ModelMetadata": (pb.ModelMetadataRequest, lambda rp, r: rp.model_metadata(r.name, r.version)),
    "ModelConfig": (pb.ModelConfigRequest, lambda rp, r: rp.model_config(r.name, r.version)),
    "ModelStatistics": (pb.ModelStatisticsRequest, lambda rp, r: rp.model_statistics(r.name, r.version)),
    "RepositoryIndex": (pb.RepositoryIndexRequest, lambda rp, r: rp.repository_index(r.repository_name, r.ready)),
}


# A ModelInfer request with one of these parameters on an input or output goes to the Python request
# path as it is (Triton's system and CUDA shared memory: server.shm).
SHARED_MEMORY_PARAMETERS = (REGION, OFFSET, BYTE_SIZE)


def python_serves_all(request_path) -> bool:
    """Whether every ModelInfer request goes to the Python request path: none now (native calls
    write their own access lines and spans: server.native_records); kept as the one switch."""
    return False


def new_plane(zeros: bool = False, max_typed_bytes: int = 0):
    """A _native.Plane holding the contract's names; zeros: the native floor (no Python per call).
    Its messages are bounded as server.parsing and codec bound the Python plane's (max_typed_bytes:
    --max-typed-bytes; 0: none)."""
    from attnserve.server import _native
    from attnserve.server.service import STREAM_WINDOW

    plane = _native.Plane(CONTRACT_NAMES)
    plane.set_zeros(zeros)
    plane.set_stream_window(STREAM_WINDOW)
    plane.set_message_bounds(parsing.MAX_PARAMETERS, parsing.MAX_PARAMETERS_BYTES, parsing.MAX_REQUEST_FIELDS,
                             parsing.PRESCAN_MIN_BYTES, WIRE_MIN_BYTES, max_typed_bytes, _REQUEST_OVERHEAD_BYTES)
    return plane


def share_budget(budget, loop: asyncio.AbstractEventLoop):
    """Makes the memory budget's counter the native one (_native.Budget), so that native calls
    and the Python plane's take from one budget and wait in one queue (the counter's); a Python
    waiter granted by a native release is woken on `loop`. Returns the counter (for
    NativePlane), or None where the extension is not built."""
    if why_unavailable() is not None:
        return None
    from attnserve.server import _native

    counter = budget.shared_counter(_native.Budget)
    # Native calls' releases empty the budget too: after a large use the event loop reclaims (MemoryBudget.wake).
    counter.set_idle_after(budget.IDLE_AFTER_BYTES)

    def woken() -> None:
        counter.drain()
        budget.wake()

    loop.add_reader(counter.wake_fd(), woken)
    return counter


def add_tables(plane, request_path, names: list[str]) -> None:
    """The rare RPCs' answers, serialized from Python's own (server.request_path) for these models."""
    plane.set_answer("ServerMetadata", "", request_path.server_metadata().SerializeToString())
    for name in names:
        plane.set_answer("ModelMetadata", name, request_path.model_metadata(name).SerializeToString())
        plane.set_answer("ModelConfig", name, request_path.model_config(name).SerializeToString())
        plane.set_answer("ModelStatistics", name, request_path.model_statistics(name).SerializeToString())


def targets(addresses: list[str], port: int) -> list[str]:
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]


class NativePlane:
    def __init__(self, config, registry, request_path, metrics=None, loop: asyncio.AbstractEventLoop | None = None,
                 zeros: bool = False, budget_counter=None, receive_slots: int = 0, token=None,
                 shared_port: bool = False) -> None:
        """metrics (server.metrics.Metrics) and loop, the event loop that owns them and the
        registry: where the native calls are counted and the rare RPCs answered (None: not
        counted, and the rare RPCs answered from tables made now). zeros: the native floor
        (bench.native_floor): C++ answers zeros itself, no runner threads. budget_counter: the
        memory budget's shared counter (share_budget; None: native calls reserve nothing).
        receive_slots: ModelInfer messages the native port receives at once (server.gate.ReceiveSlots'
        rule and number; 0: any).
        token: server.security.BearerToken (None: no token asked for), whose refusals on the native
        port it counts and logs. shared_port: worker processes share --port (SO_REUSEPORT;
        server.workers)."""
        self._config = config
        self._receive_slots = receive_slots
        self._zeros = zeros
        self._metrics = metrics
        self._loop = loop
        self._registry = registry
        self._request_path = request_path
        self._token = token
        self._shared_port = shared_port
        self._token_refused = 0  # native token refusals already handed to token.note_refusal
        self._sync_task: asyncio.Task | None = None
        self._codes_counted: dict[tuple[str, str], int] = {}  # (model, code) -> final statuses counted so far
        self._cancels_counted: dict[tuple[str, str, str], int] = {}  # (model, reason, stage) -> counted so far
        self._plane = new_plane(zeros, config.max_typed_bytes or 0)
        # Access lines and spans of native calls (server.native_records): only when asked.
        calls = getattr(request_path, "calls", None)
        self._records = None if calls is None or zeros or loop is None else NativeRecords(
            self._plane, calls, config.access_records_buffer, metrics)
        self._tracing = calls.tracing if self._records is not None else None
        # A drain waits for a call whose message is still arriving as long as the Python plane does.
        self._plane.set_arrival_timeout(Arrivals.TIMEOUT_S)
        self._tracers: list = []  # server.tracing.BatchTracer by the plane's model index (tracing on)
        self._budget_counter = budget_counter
        # The REST front's calls in the core (submit_infer): ticket -> (future, call), until answered.
        self._submitted: dict[int, tuple[asyncio.Future, object]] = {}
        if budget_counter is not None:
            from attnserve.server.service import STREAM_BUDGET_SHARE

            self._plane.set_budget(budget_counter, native_cost_terms(), STREAM_BUDGET_SHARE)
        self._runners: list[threading.Thread] = []
        self._started = False
        self._stopping = threading.Event()
        # Batches answered whose figures have not reached the event loop yet, by ticket: a
        # ModelStatistics asked after an answer is answered once that answer's batch is counted.
        self._unobserved: set[int] = set()
        self._unobserved_lock = threading.Lock()
        self._last_ticket = 0
        self._after_observed: list[tuple[int, Callable[[], None]]] = []
        # Batches' figures not yet counted, drained on the event loop every OBSERVE_EVERY_S (or at
        # once when a ModelStatistics waits): a wake per batch cost a c=1 call more than the run.
        self._pending: list[tuple] = []
        self._drain_scheduled = False
        # (name, spec, run, run_solo, stoppable) by the plane's model index; run and run_solo are
        # let go of once a retired version's runner ends (its sessions go with the last reference).
        self._models: list[tuple] = []
        self._plane.set_priority_aging(config.priority_aging_batches)
        self._observers = []  # server.metrics.ModelObserver, by the plane's model index
        self._computing: list[int] = []  # by model index: its runners computing a batch (read at scrapes)
        self._computing_lock = threading.Lock()  # --batches-in-flight runners per model
        self._lanes: dict = {}  # LoadedVersion -> its model index, while the registry serves it
        self._routed: set[str] = set()
        if zeros or loop is None:  # the floor: the default versions, and tables made now
            names = sorted(registry.loaded)
            for name in names:
                self._lane(name, registry.get(name))
            add_tables(self._plane, request_path, names)
        else:
            self.sync()
            self._plane.set_relay(self._relay)
        self._in_flight_gauge = None
        if metrics is not None:
            from prometheus_client import Gauge

            self._in_flight_gauge = Gauge(IN_FLIGHT_METRIC, "Calls queued or computing on the native "
                                          "data plane (--data-plane native).", registry=metrics.registry,
                                          multiprocess_mode="livesum")  # workers: the live ones' sum
            metrics.add_refresh(self.refresh_metrics)
            metrics.add_before_statistics(self.count_pending)

    # -- model changes (docs/native-data-plane.md, "Model changes and the rare RPCs") ---------

    def sync(self) -> None:
        """Serve what the registry serves now: called on the event loop in the same turn as each
        change (Server._model_changed), so no call on either port sees the two differ. A version
        no longer served is retired: the calls queued on it run on it, later ones go elsewhere."""
        registry, plane = self._registry, self._plane
        plane.set_serving(registry.unknown_tail())
        names = set(registry.known_names())
        for name in self._routed - names:
            plane.unroute(name)
        served = set()
        for name in sorted(names):
            try:
                registry.get(name)
            except ModelUnavailable as err:  # unloaded, failed, warming: the Python port's words
                status = status_for(err)
                plane.route(name, {}, status.code.value[0], status.details, "")
                continue
            versions = {}
            for version in registry.versions(name):
                lv = registry.get(name, str(version))
                versions[version] = self._lane(name, lv)
                served.add(lv)
            plane.route(name, versions, 0, "", registry.not_loaded_tail(name))
        self._routed = names
        for lv in [lv for lv in self._lanes if lv not in served]:
            plane.retire(self._lanes.pop(lv))

    def _lane(self, name: str, lv) -> int:
        """The plane's model index for version lv: a queue (and, once started, a runner) of its own."""
        if lv in self._lanes:
            return self._lanes[lv]
        spec, config = lv.spec, self._config
        d_model = spec.d_model or max(spec.query_dim, spec.kv_dim, spec.out_dim)  # as models.GraphCosting
        delay_us = round(lv.batcher.policy.max_queue_delay_s * 1e6)
        policy = spec.queue_policy  # the one source of the schedule's numbers (config.json)
        # What the plane's setters take (server.config's ranges, checked at the flags and config.json
        # already): checked again before the first, so a refusal never leaves a model half added.
        for field, value, allowed in (("max_batch_size", config.max_batch_size or spec.max_batch_size, BATCH_SIZE),
                                      ("max_queue_delay_ms", delay_us / 1e3, QUEUE_DELAY_MS),
                                      ("d_model", d_model, WIDTH),
                                      ("priority_levels", policy.priority_levels, PRIORITY_LEVELS),
                                      ("default_timeout_microseconds", policy.default_timeout_us, QUEUE_TIMEOUT_US)):
            allowed.check(f"model {name} version {spec.version}: {field}", value)
        index = self._plane.add_model(
            name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
            config.max_batch_size or spec.max_batch_size, lv.limits.max_q_len, lv.limits.max_kv_len,
            config.max_attention_bytes, config.max_queue_size, config.max_padding_ratio,
            "" if lv.limits.graphs.takes_head_masks else heads_differ_refusal(spec))
        assert index == len(self._models)
        self._plane.set_graphs(index, **native_graph_terms(lv.limits.graphs))  # the attention bound's graph
        # codec's answer and typed-contents bounds, and the projection width of the cost model.
        self._plane.set_model_bounds(index, d_model, config.max_message_bytes, config.max_typed_bytes or 0,
                                     _RESPONSE_OVERHEAD_BYTES, config.max_queued_bytes)
        self._plane.set_schedule(index, policy.priority_levels, policy.default_priority_level,
                                 policy.default_timeout_us, policy.allow_timeout_override)
        self._plane.set_queue_delay(index, delay_us)
        self._models.append((name, spec, lv.batcher.run_batch, lv.batcher.run_solo, lv.batcher.stoppable_runs))
        self._computing.append(0)
        if self._tracing is not None:
            self._tracers.append(self._tracing.batch_tracer(name, spec.version, lv.limits.graphs))
        if self._metrics is not None:
            self._observers.append(self._metrics.observer(name))
        self._lanes[lv] = index
        if self._started:
            self._start_runner(index)
        return index

    def _relay(self, method: str, data: bytes, reply) -> None:
        """A rare RPC from a gRPC thread: answered on the event loop, which owns the registry."""
        try:
            self._loop.call_soon_threadsafe(self._answer, method, data, reply)
        except RuntimeError:  # the loop is closed: the server is gone
            reply(_UNAVAILABLE, "the server is stopping", b"")

    def _answer(self, method: str, data: bytes, reply) -> None:
        if method == "ModelStatistics":  # after the batches answered before it are counted (_counted)
            self.count_pending()
            with self._unobserved_lock:
                latest = max(self._unobserved, default=0)
                if latest:  # its batch's figures wake the loop at once (_observe)
                    self._after_observed.append((latest, lambda: self._answer_now(method, data, reply)))
                    return
        self._answer_now(method, data, reply)

    def _answer_now(self, method: str, data: bytes, reply) -> None:
        request_type, answer = RELAYED[method]
        try:
            response = answer(self._request_path, request_type.FromString(data))
        except Exception as err:  # the Python port's status and words (server.errors)
            status = status_for(err)
            reply(status.code.value[0], status.details, b"")
            return
        reply(0, "", response.SerializeToString())

    # -- the REST front's calls (docs/native-data-plane.md, "REST in the core") -----------------

    @staticmethod
    def takes(message: pb.ModelInferRequest) -> bool:
        """Whether the core serves this request: all but shared memory's (the Python request path's)."""
        return not any(tensor.parameters and any(key in tensor.parameters for key in SHARED_MEMORY_PARAMETERS)
                       for tensor in (*message.inputs, *message.outputs))

    async def submit_infer(self, message: pb.ModelInferRequest, call=None) -> tuple[InferResponse | None, object]:
        """One inference request into the core's queue for its model version, beside the gRPC
        port's calls: (the answer, OK), or (None, the status). Called on the event loop, which the
        answers reach once for all that are ready (_take_answers). The caller releases the answer
        once it is sent (its memory reservation). call (server.tracing.Call): given the core's
        figures (admitted, queue wait, run, batch) for its line and span. A cancelled caller (its
        connection ended: REST has no cancel of its own) takes its request out of the core, as a
        gRPC call whose client went away does, counted under the reason `disconnect`."""
        ticket = self._plane.submit(message.SerializeToString(), None, call is not None)
        future = self._loop.create_future()
        self._submitted[ticket] = (future, call)
        try:
            return await future
        except asyncio.CancelledError:
            self._plane.cancel_submitted(ticket, True)  # its answer still comes: _take_answers drops it
            raise

    def _take_answers(self) -> None:
        """On the event loop: every answer ready, to its caller."""
        for ticket, code, details, head, raw, reserved, figures in self._plane.take_answers():
            future, call = self._submitted.pop(ticket, (None, None))
            reservation = _Reserved(self._budget_counter, reserved)
            if future is None or future.done():  # its caller went away
                reservation.release()
                continue
            if code != 0:
                reservation.release()
                future.set_result((None, status_of_code(code, details.decode("utf-8", "replace"))))
                continue
            try:
                message = pb.ModelInferResponse.FromString(head)
                if call is not None and figures is not None:
                    self._figures(call, message.model_version, *figures)
            except Exception as err:  # this caller's answer fails alone; the others' are still given
                reservation.release()
                future.set_result((None, status_for(err)))
                continue
            future.set_result((InferResponse(message, list(raw), reservation), OK))

    def _close_answers(self) -> None:
        self._loop.remove_reader(self._plane.answers_fd())
        self._take_answers()

    def _figures(self, call, version: str, admitted_ns: int, rows: int, q_len: int, k_len: int, queue_s: float,
                 run_s: float, batch_requests: int, batch: int, run_end_ns: int) -> None:
        call.admitted(rows, q_len, k_len, at_ns=admitted_ns or None)
        call.computed(queue_s, run_s, batch_requests, version, at_ns=run_end_ns or None)
        call.encoded(at_ns=run_end_ns or None)
        if self._records is not None:
            self._records.joins_batch(batch, call.span)

    def answer_from_own_thread(self) -> None:
        """The floor (zeros) only: its calls answered from one thread of the plane's, not gRPC's."""
        self._plane.set_zeros_handoff()

    def receive_figures(self) -> tuple[int, int, int]:
        """The native port's receive slots: (slots, messages being received now, calls whose message waited)."""
        return tuple(self._plane.receive_figures())

    def start(self, upstream: str | None = None, channel_args: list[tuple[str, int]] = ()) -> int:
        """Bind --port and start a runner thread per model; the bound port. upstream: the Python
        server's private socket ("unix:PATH"), where every call the plane does not serve goes
        (None: answered UNIMPLEMENTED); channel_args: the Python server's gRPC arguments."""
        cfg = self._config
        addresses = listen_addresses(cfg.host)
        self._plane.set_receive_slots(self._receive_slots)
        cert, key, client_ca = read_tls_files(cfg)
        token = read_token(cfg.auth_token_file) if cfg.auth_token_file is not None else b""
        self._plane.set_security(cert, key, client_ca, token, REFUSAL)
        self._plane.set_open_prefixes(list(OPEN_METHOD_PREFIXES))
        self._plane.set_channel_args(list(channel_args))
        if upstream is not None:
            self._plane.set_upstream(upstream)
            self._plane.set_fallback(python_serves_all(self._request_path), list(SHARED_MEMORY_PARAMETERS))
        port, held = cfg.port, []
        if port == 0 and len(addresses) > 1:  # gRPC would give each its own: one port, free on all, held while it binds
            port, held = reserve_port(cfg.host, 0)
        self._plane.set_reuse_port(self._shared_port or bool(held))
        try:
            port = self._plane.start(targets(addresses, port), cfg.max_message_bytes, cfg.max_concurrent_streams)
        finally:
            for sock in held:
                sock.close()
        if port == 0:  # server.app.bind's words
            unbound = self._plane.unbound() or targets(addresses, cfg.port)[0]
            raise OSError(f"cannot listen on {unbound} (--host {cfg.host})")
        if self._records is not None:
            self._records.start(self._loop)
        if self._loop is not None and not self._zeros:
            self._loop.add_reader(self._plane.answers_fd(), self._take_answers)
        if not self._zeros:
            self._started = True
            for index in sorted(self._lanes.values()):
                self._start_runner(index)
        names = [m[0] for m in self._models]  # the server starts the plane first: each model joins once ready
        logger.info("native data plane%s serving ModelInfer %s on %s%s%s",
                    " (answering zeros)" if self._zeros else "",
                    f"for {names}" if names else "for each model once it is ready",
                    ", ".join(targets(addresses, port)), " (TLS)" if cert else "",
                    ", shared by the workers" if self._shared_port else "")
        if self._loop is not None and (self._token is not None or self._shared_port):
            self._sync_task = self._loop.create_task(self._sync_forever())
        return port

    def _start_runner(self, index: int) -> None:
        """--batches-in-flight runner threads for model `index`: its runs at once, as the batcher's."""
        name, spec = self._models[index][:2]
        for _ in range(max(self._config.batches_in_flight, 1)):
            thread = threading.Thread(target=self._run_forever, args=(index,), name=f"native-{name}-v{spec.version}",
                                      daemon=True)
            thread.start()
            self._runners.append(thread)

    async def _sync_forever(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(SYNC_PERIOD_S)
            self._sync_counts()

    def _sync_counts(self) -> None:
        """On the event loop: the native port's token refusals to token.note_refusal (counted,
        logged as the Python plane's are); with workers, the calls' final statuses into
        attnserve_requests too, since the supervisor's /metrics reads the files, not our refresh."""
        if self._token is not None:
            refused, method = self._plane.token_refusals()
            if refused > self._token_refused:
                self._token.note_refusal(method or "?", NATIVE_PORT, refused - self._token_refused)
                self._token_refused = refused
        if self._shared_port and self._metrics is not None:
            self.refresh_metrics()

    def _run_forever(self, index: int) -> None:
        # Not lowered (unlike the batchers' run threads): this thread also sends the answers
        # (gRPC's Finish), the event loop's part in the Python plane; ONNX Runtime's pool
        # threads keep the compute priority they were opened with.
        name, spec, run, run_solo, stoppable = self._models[index]
        plane = self._plane
        while not self._stopping.is_set():
            batch = plane.next_batch(index, _WAIT_MS)
            if batch is None:
                if plane.drained(index):  # retired, and what was queued on it has run
                    break
                continue
            started = time.perf_counter()
            with self._computing_lock:  # attnserve_runs_in_flight, until its answers are handed back
                self._computing[index] += 1
            solo = failed = terminated = False
            ticket = self._handing_over()  # before any of its calls is answered
            # C++ calls stop.stop() once every call of the batch is cancelled (RunOptions.terminate).
            stop = RunStop()
            plane.on_stop(batch, stop.stop)
            try:
                if stop.stopped:  # every call left before it ran
                    raise RuntimeError("stopped before it ran")
                feeds = batch.feeds(spec.query_dim, spec.kv_dim)
                # A lone call (no other in flight) takes the spinning sessions, as the Python
                # batcher's solo runs do; under load their spinning would starve gRPC's threads.
                solo = run_solo is not None and plane.in_flight() <= 1
                options = {"stop": stop} if stoppable else {}
                output, attn_probs = (run_solo if solo else run)(feeds, batch.want_probs, **options)
                ran = time.perf_counter()
                plane.complete(batch, output, attn_probs if batch.want_probs else None)
            except Exception as err:
                ran = time.perf_counter()
                if stop.stopped:  # every call was cancelled: nobody to tell, no failure (answered CANCELLED)
                    plane.fail(batch, "stopped")
                    terminated = True
                else:  # the batch's calls fail; the plane keeps serving (server.batcher's line and words)
                    logger.exception("model %s: batch of %d requests failed", logged(name), batch.requests)
                    # ONNX Runtime's text stays in the log, as the Python plane keeps it there.
                    plane.fail(batch, f"model {name}: the batch this request was in failed "
                                      f"({type(err).__name__}; the server log has the traceback)")
                    failed = True
            with self._computing_lock:
                self._computing[index] -= 1
            self._observe(index, batch, started, ran, solo, failed, terminated=terminated, ticket=ticket)
        run = run_solo = batch = None
        self._models[index] = (name, spec, None, None, False)  # its sessions go with the registry's last reference

    def _handing_over(self) -> int:
        """A ticket for a batch about to be answered, whose figures the event loop will count (0: none)."""
        if not self._observers or self._loop is None:
            return 0
        with self._unobserved_lock:
            self._last_ticket += 1
            self._unobserved.add(self._last_ticket)
            return self._last_ticket

    def _counted(self, ticket: int) -> None:
        """On the event loop: the batch's figures are counted; ModelStatistics that waited for it go on."""
        with self._unobserved_lock:
            self._unobserved.discard(ticket)
            oldest = min(self._unobserved, default=self._last_ticket + 1)
            ready = [answer for latest, answer in self._after_observed if latest < oldest]
            self._after_observed = [(latest, answer) for latest, answer in self._after_observed if latest >= oldest]
        for answer in ready:
            answer()

    def _observe(self, index: int, batch, started: float, ran: float, solo: bool, failed: bool,
                 terminated: bool = False, ticket: int = 0) -> None:
        """The batch's figures to the event loop, which owns the metrics: counted there within
        OBSERVE_EVERY_S, at once when a ModelStatistics waits for them, and before any scrape or
        statistics read (count_pending)."""
        if not self._observers or self._loop is None:
            return
        done = time.perf_counter()
        # The batch's span (tracing on): its figures, with the end on the epoch clock, taken here.
        span_figures = None if not self._tracers else (
            batch.id, batch.q_len, batch.k_len, batch.want_probs, batch.masking, time.time_ns())
        stats = BatchStats(requests=batch.requests, rows=batch.rows, padding_ratio=batch.padding_ratio,
                           compute_s=done - started, queue_s=tuple(batch.queue_s), failed=failed,
                           run_s=ran - started, split_s=done - ran, solo=solo, terminated=terminated)
        with self._unobserved_lock:
            self._pending.append((index, stats, tuple(batch.done_s), span_figures, ticket))
            # With --workers, the others read this worker's statistics from its file: written at once.
            now = bool(self._after_observed) or self._shared_port
            later = not now and not self._drain_scheduled
            self._drain_scheduled = self._drain_scheduled or later
        try:
            if now:
                self._loop.call_soon_threadsafe(self.count_pending)
            elif later:
                self._loop.call_soon_threadsafe(self._loop.call_later, OBSERVE_EVERY_S, self.count_pending)
        except RuntimeError:
            pass  # the loop is closed: the server is gone

    def count_pending(self) -> None:
        """On the event loop: the batches' figures held so far, counted (metrics, statistics, spans)."""
        with self._unobserved_lock:
            pending, self._pending = self._pending, []
            self._drain_scheduled = False
        for item in pending:
            self._observed(*item)

    def _observed(self, index: int, stats: BatchStats, done_s: tuple[float, ...], span_figures=None,
                  ticket: int = 0) -> None:
        try:
            self._observers[index].on_batch(stats)
            self._metrics.requests_answered(self._models[index][0], done_s)
            if span_figures is not None and self._records is not None:
                self._take_answers()  # the REST calls' spans of this batch, before its span links them
                self._records.batch_done(self._tracers[index], stats, *span_figures)
            if self._shared_port and self._metrics is not None:  # the supervisor's /metrics reads the files:
                self._count_final_statuses()  # its calls there by the time ModelStatistics counts them
        finally:  # the statistics that wait for it are answered, whatever happened here
            if ticket:
                self._counted(ticket)

    def refresh_metrics(self) -> None:
        """At each scrape: attnserve_requests gets the native calls' final statuses (counted in
        C++) since the last one; attnserve_native_in_flight the calls queued or computing now;
        attnserve_queue_depth the calls queued in the plane now (beside the batchers')."""
        self.count_pending()  # the batches' figures held for the event loop (_observe)
        self._in_flight_gauge.set(self._plane.in_flight())
        depths: dict[str, int] = {}  # the gauges' native parts: every version's queue and runner of a name
        runs: dict[str, int] = {}
        for index, (name, *_rest) in enumerate(self._models):
            depths[name] = depths.get(name, 0) + self._plane.queued(index)
            runs[name] = runs.get(name, 0) + self._computing[index]
        for name, depth in depths.items():
            self._metrics.set_queue_depth(name, "native", depth)
            self._metrics.set_runs_in_flight(name, "native", runs[name])
        if self._records is not None:
            self._records.refresh_metrics()
        self._count_final_statuses()
        for index, (name, *_rest) in enumerate(self._models):
            for labels, count in zip(CANCEL_LABELS, self._plane.cancellations(index), strict=True):
                key = (name, *labels)
                delta = count - self._cancels_counted.get(key, 0)
                if delta > 0:
                    self._metrics.cancelled.labels(*key).inc(delta)
                    self._cancels_counted[key] = count

    def _count_final_statuses(self) -> None:
        """On the event loop: attnserve_requests gets the native calls' final statuses since the last time."""
        for name, codes in self._plane.final_codes_by_name().items():
            for value, count in enumerate(codes):
                key = (name or UNKNOWN_MODEL, _CODE_NAMES.get(value, "UNKNOWN"))
                delta = count - self._codes_counted.get(key, 0)
                if delta > 0:
                    self._metrics.requests.labels(*key).inc(delta)
                    self._codes_counted[key] = count

    def counters(self) -> dict[str, int]:
        return self._plane.counters()

    def begin_drain(self) -> None:
        """ServerReady and ModelReady on the native port answer false; calls are still admitted."""
        self._plane.set_ready(False)

    def refuse(self) -> None:
        """New calls refused with UNAVAILABLE (never computed); queued and running ones go on."""
        self._plane.refuse()

    def in_flight(self) -> int:
        """Calls queued or computing, and those whose message is still arriving."""
        return self._plane.in_flight() + self._plane.arriving()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block up to timeout_s until no call is queued, computing or arriving; whether none is."""
        return self._plane.wait_idle(max(int(timeout_s * 1000), 0))

    def halt(self) -> None:
        """At once: what is queued or still arriving is refused (UNAVAILABLE, never computed) and
        no batch is formed any more; running batches finish (stop() follows)."""
        self._stopping.set()
        self._plane.halt()

    def stop(self, grace_s: float) -> None:
        """Refuse what is still queued (UNAVAILABLE), let running batches finish within grace_s,
        then GOAWAY and the listener closed."""
        self._stopping.set()
        self._plane.stop(grace_s)
        for thread in self._runners:
            thread.join()
        # Every batch has run: the totals are final (bench.stages reads this line).
        logger.info("native data plane stopped: %s", self.counters())
        if self._loop is not None:  # the last batches' figures, before the last lines, spans and figures below
            try:
                self._loop.call_soon_threadsafe(self.count_pending)
            except RuntimeError:
                pass  # the loop is closed: the server is gone
        if self._loop is not None and not self._zeros:  # the REST calls' last answers (refused by the stop)
            try:
                self._loop.call_soon_threadsafe(self._close_answers)
            except RuntimeError:
                pass  # the loop is closed: the server is gone
        if self._records is not None:  # the last calls' lines and spans, on the event loop
            try:
                self._loop.call_soon_threadsafe(self._records.stop)
            except RuntimeError:
                pass  # the loop is closed: the server is gone
        if self._sync_task is not None:  # the last figures, after the last batches' (queued before it)
            try:
                self._loop.call_soon_threadsafe(self._last_sync)
            except RuntimeError:
                pass  # the loop is closed: the server is gone

    def _last_sync(self) -> None:
        self._sync_task.cancel()
        self._sync_counts()


class _Reserved:
    """A core call's budget reservation, given back once its answer is sent (InferResponse.release)."""

    __slots__ = ("_counter", "_nbytes")

    def __init__(self, counter, nbytes: int) -> None:
        self._counter = counter
        self._nbytes = nbytes

    def release(self) -> None:
        if self._nbytes > 0 and self._counter is not None:
            self._counter.give(self._nbytes)
        self._nbytes = 0
