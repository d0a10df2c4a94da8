"""Observations of serving: Prometheus collectors and Triton-style model statistics.

The metric names are a contract (dashboards are built on them): attnserve_requests_total,
attnserve_request_duration_seconds, attnserve_queue_duration_seconds,
attnserve_compute_duration_seconds, attnserve_batch_requests, attnserve_padding_ratio,
attnserve_queue_depth, attnserve_runs_in_flight, attnserve_cancelled_requests_total (also by reason
and stage); every one is labelled by model; so are the warm-up's (server.warmup)
attnserve_warmup_runs_total (and graph, session), attnserve_warmup_requests_total (and session)
and attnserve_model_ready_seconds. The memory budget's (one per server,
unlabelled; watch_budget): attnserve_memory_limit_bytes, attnserve_memory_reserved_bytes,
attnserve_memory_waiting_bytes, attnserve_memory_waiters, and the counters
attnserve_memory_waits_total, attnserve_memory_shed_total, attnserve_memory_wait_timeouts_total,
attnserve_memory_too_large_total. The gRPC messages being received (watch_receiving; server.gate):
attnserve_receive_slots, attnserve_receiving_messages, attnserve_receive_deferred_total. The REST
port's connections (watch_http; server.rest): attnserve_http_connections,
attnserve_http_head_timeouts_total, attnserve_http_evictions_total.
With several workers these last two groups are each worker's own, copied into its multiprocess
files once a second (_Mirror) and summed by the supervisor's /metrics.
The native data plane (server.native) counts into the same names: its batches through
ModelObserver and requests_answered, its calls' final statuses at each scrape (add_refresh).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from attnserve.server.batcher import BatchStats
from attnserve.server.memory.budget import MemoryBudget
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `_created` series double the output and no dashboard reads them.
disable_created_metrics()

if TYPE_CHECKING:
    from attnserve.server.shared_stats import StatisticsFile

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)


@dataclass
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def add(self, stats: BatchStats) -> None:
        self.compute_input.add(stats.merge_s)
        self.compute_infer.add(stats.run_s)
        self.compute_output.add(stats.split_s)


@dataclass
class ModelStatistics:
    """What Triton's ModelStatistics RPC reports, for one model."""

    last_inference_ms: int = 0
    inference_count: int = 0  # rows (sequences) inferred
    execution_count: int = 0  # ONNX Runtime runs
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)  # padding and merging
    compute_infer: Duration = field(default_factory=Duration)  # the ONNX Runtime run
    compute_output: Duration = field(default_factory=Duration)  # splitting rows back
    batches: dict[int, BatchDurations] = field(default_factory=dict)  # rows per run -> durations


class Metrics:
    def __init__(self, shared_dir: Path | None = None) -> None:
        """shared_dir: with several worker processes (server.workers), where every worker's
        statistics are published and summed from (server.shared_stats); None: this process alone.
        The Prometheus collectors are then in prometheus_client's multiprocess mode (set up by
        the supervisor's PROMETHEUS_MULTIPROC_DIR before this process imported it)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("attnserve_requests", "Inference requests by final gRPC status code.",
                                ["model", "code"], registry=self.registry)
        self.request_duration = Histogram("attnserve_request_duration_seconds",
                                          "Inference request time in the server, decode to encode.",
                                          ["model"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.queue_duration = Histogram("attnserve_queue_duration_seconds",
                                        "Time a request waited in its model's queue.",
                                        ["model"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.compute_duration = Histogram("attnserve_compute_duration_seconds",
                                          "Time of one batch: pad, ONNX Runtime run, split.",
                                          ["model"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.batch_requests = Histogram("attnserve_batch_requests", "Requests merged into one ONNX Runtime run.",
                                        ["model"], buckets=_BATCH_BUCKETS, registry=self.registry)
        self.padding_ratio = Histogram("attnserve_padding_ratio",
                                       "Padded share of each batch's attention matrix.",
                                       ["model"], buckets=_RATIO_BUCKETS, registry=self.registry)
        self.solo_batches = Counter("attnserve_solo_batches", "Batches of a lone request, given to the solo "
                                    "runs (server.batcher, \"Solo runs\"): the unfused graphs' spinning sessions.",
                                    ["model"], registry=self.registry)
        # With several workers: the sum over the live ones (a dead worker's queue is gone).
        self.queue_depth = Gauge("attnserve_queue_depth", "Requests waiting in the model's queue.",
                                 ["model"], registry=self.registry, multiprocess_mode="livesum")
        # Warm-up runs are no client's inference: counted here, never in ModelStatistics.
        self.warmup_runs = Counter("attnserve_warmup_runs", "Warm-up runs before a model reported ready "
                                   "(server.warmup), by graph and session kind (regular, solo).",
                                   ["model", "graph", "session"], registry=self.registry)
        self.warmup_requests = Counter("attnserve_warmup_requests", "Warm-up requests sent down the request "
                                       "path (decode, batcher, encode) before a model reported ready "
                                       "(server.warmup), by the session kind that ran them (regular, solo).",
                                       ["model", "session"], registry=self.registry)
        # With several workers: the slowest live worker's (each warms its own sessions).
        self.model_ready_seconds = Gauge("attnserve_model_ready_seconds", "Time-to-ready of the model's last "
                                         "load: seconds from the server's start (or the load's) until it "
                                         "reported ready, warm-up included.", ["model"], registry=self.registry,
                                         multiprocess_mode="livemax")
        self.shared_memory_output_writes = Counter(
            "attnserve_shared_memory_outputs", "Outputs written into a shared memory region, by how: \"run\" "
            "(a lone run's own arrays, written whole) or \"copied\" (a merged batch's rows).",
            ["written"], registry=self.registry)
        self.runs_in_flight = Gauge("attnserve_runs_in_flight", "Batches of the model computing now.",
                                    ["model"], registry=self.registry, multiprocess_mode="livesum")
        self.cancelled = Counter("attnserve_cancelled_requests", "Inference requests whose client went away, by "
                                 "why (client, deadline, disconnect) and where they were (queued, running, "
                                 "terminated, answered).", ["model", "reason", "stage"], registry=self.registry)
        self.statistics: dict[str, ModelStatistics] = {}
        # (model, plane) -> requests queued / batches computing there: the gauges show each sum
        # (set_queue_depth, set_runs_in_flight), so both planes' calls count in one series.
        self._queue_depths: dict[tuple[str, str], int] = {}
        self._runs: dict[tuple[str, str], int] = {}
        # `statistics` is written and read on the event loop thread only (batcher callbacks,
        # the servicer): no lock on the request path.
        self._shared_dir = shared_dir
        self._refreshes: list = []  # called before each scrape (add_refresh)
        self._before_statistics: list = []  # called before statistics are read (add_before_statistics)
        self._mirror: _Mirror | None = None
        self.shared: StatisticsFile | None = None
        if shared_dir is not None:
            import os

            from attnserve.server.shared_stats import StatisticsFile

            self.shared = StatisticsFile(shared_dir, os.getpid())

    def model_statistics(self, model: str) -> ModelStatistics:
        """The server's statistics of `model`: this process's, or every worker's summed."""
        for count in self._before_statistics:
            count()
        if self._shared_dir is None:
            return self.statistics[model]
        from attnserve.server.shared_stats import gather

        return gather(self._shared_dir).get(model) or ModelStatistics()

    def watch_budget(self, budget: MemoryBudget) -> None:
        """Expose the memory budget (read when /metrics is scraped, on the metrics port's thread:
        plain integer reads)."""
        self._watch(_BudgetCollector(budget))

    def watch_receiving(self, receive) -> None:
        """Expose server.gate.ReceiveSlots: its slots, the messages being received, the calls
        whose reading waited for a slot."""
        self._watch(_ReceiveCollector(receive))

    def watch_http(self, port) -> None:
        """Expose server.rest.RestPort's connections: open now, closed for a late request head
        (408), closed at the cap for a new connection."""
        self._watch(_HttpCollector(port))

    def watch_shared_memory(self, regions) -> None:
        """Expose server.shm.SystemSharedMemory: regions registered and mapped, and their bytes."""
        self._watch(_SharedMemoryCollector(regions))

    def shared_memory_outputs(self, written: str, count: int) -> None:
        """`count` outputs of one request written into shared memory regions: "run" (from the lone
        run's own arrays) or "copied" (the request's rows of a merged batch)."""
        self.shared_memory_output_writes.labels(written).inc(count)

    def _watch(self, collector) -> None:
        if self._shared_dir is None:
            self.registry.register(collector)
            return
        if self._mirror is None:
            self._mirror = _Mirror(self.registry)
        self._mirror.add(collector)

    def warm_up_ran(self, model: str):
        """What server.warmup calls after each run, (graph, session), from the warm-up's thread."""
        def ran(graph: str, session: str) -> None:
            self.warmup_runs.labels(model, graph, session).inc()

        return ran

    def warm_up_sent(self, model: str):
        """What server.warmup.warm_request_path calls after each request, (session), on the loop."""
        def sent(session: str) -> None:
            self.warmup_requests.labels(model, session).inc()

        return sent

    def model_ready(self, model: str, seconds: float) -> None:
        self.model_ready_seconds.labels(model).set(seconds)

    def set_queue_depth(self, model: str, plane: str, depth: int) -> None:
        """`depth` requests of `model` wait in `plane`'s queues ("python": the batcher's, on each
        change; "native": the plane's, read at each scrape): the gauge shows both planes' sum."""
        self._queue_depths[model, plane] = depth
        self.queue_depth.labels(model).set(sum(d for (m, _), d in self._queue_depths.items() if m == model))

    def set_runs_in_flight(self, model: str, plane: str, running: int) -> None:
        """`running` batches of `model` compute on `plane` now (as set_queue_depth)."""
        self._runs[model, plane] = running
        self.runs_in_flight.labels(model).set(sum(n for (m, _), n in self._runs.items() if m == model))

    def add_refresh(self, refresh) -> None:
        """refresh() is called on the event loop before each /metrics scrape: figures kept
        elsewhere (the native data plane's counters) are read into the collectors then."""
        self._refreshes.append(refresh)

    def add_before_statistics(self, count) -> None:
        """count() is called on the event loop before statistics are read: figures held
        elsewhere (the native data plane's batches) are counted first."""
        self._before_statistics.append(count)

    def refresh(self) -> None:
        for refresh in self._refreshes:
            refresh()

    def requests_answered(self, model: str, durations_s) -> None:
        """Requests answered OK by the native data plane (their count is its final statuses',
        read at scrape time): their durations, as request_done records an OK one's."""
        observe = self.request_duration.labels(model).observe
        stats = self.statistics.get(model)
        for duration_s in durations_s:
            observe(duration_s)
            if stats is not None:
                stats.success.add(duration_s)
        if stats is not None and self.shared is not None:  # workers: ModelStatistics sums the files
            self.shared.publish(model, stats)

    def observer(self, model: str) -> ModelObserver:
        self.statistics.setdefault(model, ModelStatistics())
        return ModelObserver(self, model)

    def request_cancelled(self, model: str, reason: str, stage: str) -> None:
        self.cancelled.labels(model, reason, stage).inc()

    def request_done(self, model: str, code: str, duration_s: float) -> None:
        self.requests.labels(model, code).inc()
        if code == "OK":
            self.request_duration.labels(model).observe(duration_s)
        stats = self.statistics.get(model)
        if stats is not None:
            (stats.success if code == "OK" else stats.fail).add(duration_s)
            if self.shared is not None:
                self.shared.publish(model, stats)


class ModelObserver:
    """The batcher's view of Metrics, bound to one model's labels."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._model = model
        self._stats = metrics.statistics[model]
        self._shared = metrics.shared
        self._queue_duration = metrics.queue_duration.labels(model)
        self._compute_duration = metrics.compute_duration.labels(model)
        self._batch_requests = metrics.batch_requests.labels(model)
        self._padding_ratio = metrics.padding_ratio.labels(model)
        self._metrics = metrics
        self._solo_batches = metrics.solo_batches.labels(model)

    def on_batch(self, stats: BatchStats) -> None:
        self._compute_duration.observe(stats.compute_s)
        self._batch_requests.observe(stats.requests)
        self._padding_ratio.observe(stats.padding_ratio)
        for waited in stats.queue_s:
            self._queue_duration.observe(waited)
        if stats.solo:
            self._solo_batches.inc()
        if stats.failed or stats.terminated:  # a stopped run inferred nothing (nor failed anyone)
            return
        s = self._stats
        s.last_inference_ms = int(time.time() * 1000)
        s.inference_count += stats.rows
        s.execution_count += 1
        for waited in stats.queue_s:  # per request, as Triton counts them
            s.queue.add(waited)
            s.compute_input.add(stats.merge_s)
            s.compute_infer.add(stats.run_s)
            s.compute_output.add(stats.split_s)
        s.batches.setdefault(stats.rows, BatchDurations()).add(stats)
        if self._shared is not None:
            self._shared.publish(self._model, s, stats.rows)

    def on_queue_depth(self, depth: int) -> None:
        self._metrics.set_queue_depth(self._model, "python", depth)

    def on_runs(self, running: int) -> None:
        self._metrics.set_runs_in_flight(self._model, "python", running)


class _BudgetCollector:
    """memory.budget.MemoryBudget's figures as Prometheus metrics, read at each scrape."""

    _GAUGES = (("limit_bytes", "limit_bytes", "The memory budget above idle RSS (--memory-limit-bytes)."),
               ("reserved_bytes", "reserved_bytes",
                "Bytes reserved now: queued inputs, runs in flight, unsent answers."),
               ("waiting_bytes", "waiting_bytes", "Inputs of the requests waiting for memory now."),
               ("waiters", "waiters", "Requests waiting for memory now."))
    _COUNTERS = (("waits", "waits", "Requests that waited for memory."),
                 ("shed", "shed",
                  "Requests shed at once for memory (RESOURCE_EXHAUSTED: no deadline, or no room to wait)."),
                 ("wait_timeouts", "wait_timeouts", "Requests whose deadline passed while they waited for memory."),
                 ("too_large", "too_large", "Requests refused as never fitting the budget (INVALID_ARGUMENT)."))

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget

    def describe(self):
        return [GaugeMetricFamily(f"attnserve_memory_{name}", doc) for name, _, doc in self._GAUGES] + \
            [CounterMetricFamily(f"attnserve_memory_{name}", doc) for name, _, doc in self._COUNTERS]

    def collect(self):
        for name, attribute, doc in self._GAUGES:
            yield GaugeMetricFamily(f"attnserve_memory_{name}", doc, value=getattr(self._budget, attribute))
        for name, attribute, doc in self._COUNTERS:
            yield CounterMetricFamily(f"attnserve_memory_{name}", doc, value=getattr(self._budget, attribute))


class _ReceiveCollector:
    """server.gate.ReceiveSlots' figures, read at each scrape."""

    def __init__(self, receive) -> None:
        self._receive = receive

    def describe(self):
        return list(self.collect())

    def collect(self):
        slots, receiving, deferred = self._receive.figures()
        yield GaugeMetricFamily("attnserve_receive_slots", "ModelInfer messages received at once at most "
                                "(--max-receiving-bytes / --max-message-bytes); 0: unbounded.", value=slots)
        yield GaugeMetricFamily("attnserve_receiving_messages", "ModelInfer messages being received now.",
                                value=receiving)
        yield CounterMetricFamily("attnserve_receive_deferred", "ModelInfer calls whose message waited for a "
                                  "receive slot before it was read.", value=deferred)


class _HttpCollector:
    """server.rest.RestPort's connection figures, read at each scrape."""

    def __init__(self, port) -> None:
        self._port = port

    def describe(self):
        return list(self.collect())

    def collect(self):
        p = self._port
        yield GaugeMetricFamily("attnserve_http_connections", "REST connections open now.", value=p.open_connections)
        yield CounterMetricFamily("attnserve_http_head_timeouts", "REST connections closed (408) because a request "
                                  "head took longer than --http-header-timeout-s.", value=p.head_timeouts)
        yield CounterMetricFamily("attnserve_http_evictions", "REST connections waiting for a request head, closed "
                                  "at --max-http-connections for a new connection.", value=p.evictions)


class _SharedMemoryCollector:
    """server.shm.SystemSharedMemory's figures, read at each scrape."""

    def __init__(self, regions) -> None:
        self._regions = regions

    def describe(self):
        return list(self.collect())

    def collect(self):
        r = self._regions
        yield GaugeMetricFamily("attnserve_shared_memory_regions", "System shared memory regions registered now.",
                                value=r.registered)
        yield GaugeMetricFamily("attnserve_shared_memory_bytes", "Bytes of the system shared memory regions "
                                "registered now.", value=r.registered_bytes)
        yield GaugeMetricFamily("attnserve_shared_memory_mapped_regions", "System shared memory regions mapped now: "
                                "registered, or unregistered and still in use by a request "
                                "(--shared-memory-max-regions bounds them).", value=r.mapped)
        yield GaugeMetricFamily("attnserve_shared_memory_mapped_bytes", "Bytes of the system shared memory regions "
                                "mapped now (--shared-memory-max-bytes bounds them).", value=r.mapped_bytes)
        yield CounterMetricFamily("attnserve_shared_memory_expired", "System shared memory regions unregistered "
                                  "because no request used them for --shared-memory-idle-timeout-s.",
                                  value=r.expired_total)


# With several workers, how often figures kept outside the collectors reach the multiprocess files.
SYNC_PERIOD_S = 1.0


class _Mirror:
    """With several workers the supervisor serves /metrics from the workers' multiprocess files,
    which a collector's figures read at scrape time never reach: this copies them into Gauges
    (summed over the live workers: the whole server's limit, reservations, slots) and Counters,
    every PERIOD_S, on a daemon thread (plain integer reads, as a scrape does)."""

    PERIOD_S = SYNC_PERIOD_S

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._copies: list[tuple[object, dict[str, Gauge | Counter]]] = []  # collector, family name -> copy
        self._counted: dict[str, float] = {}  # counter family -> value copied so far
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # add (the event loop, at start) and the thread's sync

    def add(self, collector) -> None:
        with self._lock:
            self._add(collector)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrics-mirror", daemon=True)
            self._thread.start()

    def _add(self, collector) -> None:
        copies: dict[str, Gauge | Counter] = {}
        for family in collector.collect():
            if family.type == "counter":
                copies[family.name] = Counter(family.name, family.documentation, registry=self._registry)
            else:
                copies[family.name] = Gauge(family.name, family.documentation, registry=self._registry,
                                            multiprocess_mode="livesum")
        self._copies.append((collector, copies))
        self._sync()

    def _sync(self) -> None:
        for collector, copies in self._copies:
            for family in collector.collect():
                value = family.samples[0].value
                copy = copies[family.name]
                if isinstance(copy, Counter):
                    delta = value - self._counted.get(family.name, 0.0)
                    if delta > 0:
                        copy.inc(delta)
                        self._counted[family.name] = value
                else:
                    copy.set(value)

    def _run(self) -> None:
        while True:
            time.sleep(self.PERIOD_S)
            with self._lock:
                self._sync()
