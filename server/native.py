"""The native data plane (prototype): ModelInfer served by C++, Python called once per batch.

    plane = NativePlane(config, registry, request_path, metrics, loop); port = plane.start()
    plane.begin_drain(); plane.refuse(); plane.wait_idle(timeout_s); plane.stop(grace_s)

attnserve.server._native (native/, built by `make native`) listens on --native-port: it parses
each ModelInfer request, checks it against the contract (the names and datatypes below are
attnserve.contract's, the numbers each model's ModelSpec), queues it per model and forms padded
batches with their masks. One thread per model here takes each batch as numpy views of the
batch's own buffers (no copies), runs the model's existing ONNX Runtime engine on them, and hands
the outputs back; C++ splits and encodes the answers. The rare RPCs answer from tables made
here at start (a prototype: they do not follow model changes). Metrics: each batch's figures
go to the event loop once per batch (server.metrics' histograms and Triton statistics); the calls'
final statuses are counted in C++ and read into attnserve_requests at scrape time (with workers,
once a second: the supervisor's /metrics reads the multiprocess files). The port serves the
Python port's TLS and bearer token (native/security.cc) and, with --workers, is shared by every
worker (SO_REUSEPORT). docs/native-data-plane.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
from attnserve.server.batcher import BatchStats
from attnserve.server.codec import heads_differ_refusal
from attnserve.server.listen import listen_addresses
from attnserve.server.metrics import SYNC_PERIOD_S
from attnserve.server.security import REFUSAL, read_tls_files, read_token

from attnserve import contract

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
UNKNOWN_MODEL = "_unknown"  # the label of calls naming no known model (server.request_path's)


def why_unavailable() -> str | None:
    """None when the extension is built and loads; else why not, and how to build it."""
    try:
        from attnserve.server import _native  # noqa: F401
    except ImportError as err:
        return f"attnserve.server._native is not built or does not load ({err}); build it with `make native`"
    return None


def new_plane(zeros: bool = False):
    """A _native.Plane holding the contract's names; zeros: the native floor (no Python per call)."""
    from attnserve.server import _native
    from attnserve.server.service import STREAM_WINDOW

    plane = _native.Plane(CONTRACT_NAMES)
    plane.set_zeros(zeros)
    plane.set_stream_window(STREAM_WINDOW)
    return plane


def add_tables(plane, request_path, names: list[str]) -> None:
    """The rare RPCs' answers, serialized from Python's own (server.request_path) for these models."""
    plane.set_answer("ServerMetadata", "", request_path.server_metadata().SerializeToString())
    for name in names:
        plane.set_answer("ModelMetadata", name, request_path.model_metadata(name).SerializeToString())
        plane.set_answer("ModelConfig", name, request_path.model_config(name).SerializeToString())
        plane.set_answer("ModelStatistics", name, request_path.model_statistics(name).SerializeToString())


def address(host: str, port: int) -> str:
    first = listen_addresses(host)[0]
    return f"[{first}]:{port}" if ":" in first else f"{first}:{port}"


class NativePlane:
    def __init__(self, config, registry, request_path, metrics=None, loop: asyncio.AbstractEventLoop | None = None,
                 zeros: bool = False, token=None, shared_port: bool = False) -> None:
        """metrics (server.metrics.Metrics) and loop, the event loop that owns them: where the
        native calls are counted (None: not counted). zeros: the native floor (bench.native_floor):
        C++ answers zeros itself, no runner threads. token: server.security.BearerToken (None:
        no token asked for), whose refusals on the native port it counts and logs.
        shared_port: worker processes share --native-port (SO_REUSEPORT; server.workers)."""
        self._config = config
        self._zeros = zeros
        self._metrics = metrics
        self._loop = loop
        self._token = token
        self._shared_port = shared_port
        self._token_refused = 0  # native token refusals already handed to token.note_refusal
        self._sync_task: asyncio.Task | None = None
        self._codes_counted: dict[tuple[str, str], int] = {}  # (model, code) -> final statuses counted so far
        self._plane = new_plane(zeros)
        self._runners: list[threading.Thread] = []
        self._stopping = threading.Event()
        names = sorted(registry.loaded)
        self._models = []  # (name, spec, run, run_solo), by the plane's model index
        self._observers = []  # server.metrics.ModelObserver, by the plane's model index
        for name in names:
            lv = registry.get(name)
            spec = lv.spec
            index = self._plane.add_model(
                name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                config.max_batch_size or spec.max_batch_size, lv.limits.max_q_len, lv.limits.max_kv_len,
                config.max_attention_bytes, config.max_queue_size, config.max_padding_ratio,
                "" if lv.limits.graphs.takes_head_masks else heads_differ_refusal(spec))
            assert index == len(self._models)
            self._models.append((name, spec, lv.batcher.run_batch, lv.batcher.run_solo))
            if metrics is not None:
                self._observers.append(metrics.observer(name))
        add_tables(self._plane, request_path, names)
        self._in_flight_gauge = None
        if metrics is not None:
            from prometheus_client import Gauge

            self._in_flight_gauge = Gauge(IN_FLIGHT_METRIC, "Calls queued or computing on the native "
                                          "data plane (--data-plane native).", registry=metrics.registry,
                                          multiprocess_mode="livesum")  # workers: the live ones' sum
            metrics.add_refresh(self.refresh_metrics)

    def start(self) -> int:
        """Bind --native-port and start a runner thread per model; the bound port."""
        cfg = self._config
        target = address(cfg.host, cfg.native_port)
        cert, key, client_ca = read_tls_files(cfg)
        token = read_token(cfg.auth_token_file) if cfg.auth_token_file is not None else b""
        self._plane.set_security(cert, key, client_ca, token, REFUSAL)
        self._plane.set_reuse_port(self._shared_port)
        port = self._plane.start(target, cfg.max_message_bytes, cfg.max_concurrent_streams)
        if port == 0:
            raise OSError(f"native data plane: cannot listen on {target} (--native-port)")
        for index, (name, *_rest) in enumerate(() if self._zeros else self._models):
            thread = threading.Thread(target=self._run_forever, args=(index,), name=f"native-{name}", daemon=True)
            thread.start()
            self._runners.append(thread)
        logger.info("native data plane (prototype%s) serving ModelInfer for %s on %s%s%s",
                    " answering zeros" if self._zeros else "", [m[0] for m in self._models],
                    f"{target.rsplit(':', 1)[0]}:{port}", " (TLS)" if cert else "",
                    ", shared by the workers" if self._shared_port else "")
        if self._loop is not None and (self._token is not None or self._shared_port):
            self._sync_task = self._loop.create_task(self._sync_forever())
        return port

    async def _sync_forever(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(SYNC_PERIOD_S)
            self.sync()

    def sync(self) -> None:
        """On the event loop: the native port's token refusals to token.note_refusal (counted,
        logged as the Python plane's are); with workers, the calls' final statuses into
        attnserve_requests too, since the supervisor's /metrics reads the files, not our refresh."""
        if self._token is not None:
            refused, method = self._plane.token_refusals()
            if refused > self._token_refused:
                self._token.note_refusal(method or "?", "the native port", refused - self._token_refused)
                self._token_refused = refused
        if self._shared_port and self._metrics is not None:
            self.refresh_metrics()

    def _run_forever(self, index: int) -> None:
        # Not lowered (unlike the batchers' run threads): this thread also sends the answers
        # (gRPC's Finish), the event loop's part in the Python plane; ONNX Runtime's pool
        # threads keep the compute priority they were opened with.
        name, spec, run, run_solo = self._models[index]
        plane = self._plane
        while not self._stopping.is_set():
            batch = plane.next_batch(index, _WAIT_MS)
            if batch is None:
                continue
            started = time.perf_counter()
            solo = failed = False
            try:
                feeds = batch.feeds(spec.query_dim, spec.kv_dim)
                # A lone call (no other in flight) takes the spinning sessions, as the Python
                # batcher's solo runs do; under load their spinning would starve gRPC's threads.
                solo = run_solo is not None and plane.in_flight() <= 1
                output, attn_probs = (run_solo if solo else run)(feeds, batch.want_probs)
                ran = time.perf_counter()
                plane.complete(batch, output, attn_probs if batch.want_probs else None)
            except Exception as err:  # the batch's calls fail; the plane keeps serving
                logger.exception("native data plane: a batch of %s failed", name)
                plane.fail(batch, f"{type(err).__name__}: {err}")
                failed, ran = True, time.perf_counter()
            self._observe(index, batch, started, ran, solo, failed)

    def _observe(self, index: int, batch, started: float, ran: float, solo: bool, failed: bool) -> None:
        """The batch's figures to the event loop, which owns the metrics: once per batch."""
        if not self._observers or self._loop is None:
            return
        done = time.perf_counter()
        stats = BatchStats(requests=batch.requests, rows=batch.rows, padding_ratio=batch.padding_ratio,
                           compute_s=done - started, queue_s=tuple(batch.queue_s), failed=failed,
                           run_s=ran - started, split_s=done - ran, solo=solo)
        try:
            self._loop.call_soon_threadsafe(self._observed, index, stats, tuple(batch.done_s))
        except RuntimeError:
            pass  # the loop is closed: the server is gone

    def _observed(self, index: int, stats: BatchStats, done_s: tuple[float, ...]) -> None:
        self._observers[index].on_batch(stats)
        self._metrics.requests_answered(self._models[index][0], done_s)

    def refresh_metrics(self) -> None:
        """At each scrape: attnserve_requests gets the native calls' final statuses (counted in
        C++) since the last one; attnserve_native_in_flight the calls queued or computing now."""
        self._in_flight_gauge.set(self._plane.in_flight())
        names = [m[0] for m in self._models] + [UNKNOWN_MODEL]
        for index, name in enumerate(names):
            for value, count in enumerate(self._plane.final_codes(index)):
                key = (name, _CODE_NAMES.get(value, "UNKNOWN"))
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
        return self._plane.in_flight()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block up to timeout_s until no call is queued or computing; whether none is."""
        return self._plane.wait_idle(max(int(timeout_s * 1000), 0))

    def stop(self, grace_s: float) -> None:
        """Refuse what is still queued (UNAVAILABLE), let running batches finish within grace_s,
        then GOAWAY and the listener closed."""
        self._stopping.set()
        self._plane.stop(grace_s)
        for thread in self._runners:
            thread.join()
        if self._sync_task is not None:  # the last figures, after the last batches' (queued before it)
            try:
                self._loop.call_soon_threadsafe(self._last_sync)
            except RuntimeError:
                pass  # the loop is closed: the server is gone

    def _last_sync(self) -> None:
        self._sync_task.cancel()
        self.sync()
        logger.info("native data plane stopped: %s", self.counters())
