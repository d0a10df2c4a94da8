"""Follow one call: OpenTelemetry spans and one access line per inference call (docs/tracing.md).

    tracing = Tracing.from_environ(os.environ)       # None unless OTEL_* variables ask for traces
    calls = Calls(tracing, access_log=True)          # what both transports record per call
    call = calls.begin("grpc", "ModelInfer", peer, metadata, bytes_in)  # None when nothing is recorded
    ...  RequestPath.infer(request, time_remaining, call) fills in model, shape, queue and run times
    call.finish(status, bytes_out)                   # ends the span, writes the access line

Traces are off unless asked through the standard variables (OTEL_TRACES_EXPORTER=otlp|console,
or an OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT), so a server that does not ask starts no exporter
thread, and each call costs one `is None` branch per transport. The OpenTelemetry SDK is an
optional extra (`attnserve[otel]`): imported only when asked.

A request's span joins the caller's trace (W3C `traceparent`, `tracestate` from gRPC metadata or
HTTP headers). The batch run that served it is a span of its own (BatchTracer, handed to each
batcher), a child of the first sampled request span it served and linked to every one of them:
a batch serves requests of many traces, and one parent cannot say that.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from attnserve.server.quoting import QUOTED_CHARS

if TYPE_CHECKING:
    from attnserve.server.batcher import BatchStats
    from attnserve.server.errors import Status
    from attnserve.server.graphs import GraphSet
    from attnserve.server.tensors import Work

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("attnserve.access")

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
EXPORTERS = ("otlp", "console")  # OTEL_TRACES_EXPORTER values served; "none" is off
PROTOCOLS = ("grpc", "http/protobuf")  # OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSTALL_HINT = "pip install 'attnserve[otel]'"


class TracingUnavailable(RuntimeError):
    """Traces were asked for (OTEL_* variables) but cannot be exported: the SDK is not installed,
    or a variable names an exporter or protocol this server does not have."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables ask for traces: an exporter named, or an OTLP endpoint given
    without one; OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none say no."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(environ.get(name) for name in _ENDPOINT_VARIABLES)


def _protocol(environ: Mapping[str, str]) -> str:
    return (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc").strip().lower()


def check_environ(environ: Mapping[str, str]) -> None:
    """Raise TracingUnavailable, saying what to do, if traces are asked for and cannot be sent:
    at startup, before any worker starts or model loads."""
    if not wanted(environ):
        return
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter not in EXPORTERS:
        raise TracingUnavailable(f"OTEL_TRACES_EXPORTER={exporter!r}: this server exports traces with "
                                 f"{' or '.join(EXPORTERS)} (or none: off)")
    if exporter == "otlp" and _protocol(environ) not in PROTOCOLS:
        raise TracingUnavailable(f"OTLP protocol {_protocol(environ)!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        if exporter == "otlp" and _protocol(environ) == "grpc":
            import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        elif exporter == "otlp":
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as err:
        raise TracingUnavailable(f"traces were asked for (OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT is "
                                 f"set) but the OpenTelemetry SDK is not installed ({err.name} missing): "
                                 f"{INSTALL_HINT}, or unset those variables") from None


def _exporter(environ: Mapping[str, str]):
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if _protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout: its own OTEL_EXPORTER_OTLP_* variables


class Tracing:
    """One process's tracer: its own TracerProvider (not the global one: each Server owns and
    shuts down its own), a batch span processor, and the W3C trace-context propagator."""

    def __init__(self, provider, exporter_name: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self.provider = provider
        self.tracer = provider.get_tracer("attnserve.server")
        self.propagator = TraceContextTextMapPropagator()
        self.exporter_name = exporter_name

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, worker: int | None = None) -> Tracing | None:
        """None unless the OTEL_* variables ask for traces (wanted); TracingUnavailable if they
        ask and cannot be served. The sampler (OTEL_TRACES_SAMPLER, _ARG), the exporter's
        endpoint and the batch processor's settings are the SDK's own variables."""
        environ = os.environ if environ is None else environ
        if not wanted(environ):
            return None
        check_environ(environ)
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes: dict[str, Any] = {}
        if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            attributes[SERVICE_NAME] = "attnserve"
        if worker is not None:
            attributes["attnserve.worker"] = worker
        provider = TracerProvider(resource=Resource.create(attributes))
        exporter = _exporter(environ)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        logger.info("traces: exporting with %s (sampler %s)", type(exporter).__name__,
                    environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
        return cls(provider, type(exporter).__name__)

    def extract(self, carrier: Mapping[str, str]):
        """The caller's context from `traceparent`/`tracestate` (an empty context without them)."""
        return self.propagator.extract(carrier)

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is pending and stop the exporter's thread (the server's stop)."""
        self.provider.shutdown()

    def batch_tracer(self, model: str, version: int, graphs: GraphSet | None) -> BatchTracer:
        return BatchTracer(self, model, version, graphs)


class BatchTracer:
    """A batcher's tracer (handed in at construction, so the batcher imports no OpenTelemetry):
    one span per batch run that served a sampled request, after the run, with its times."""

    def __init__(self, tracing: Tracing, model: str, version: int, graphs: GraphSet | None) -> None:
        self._tracing = tracing
        self._model = model
        self._version = version
        self._graphs = graphs

    def batch_done(self, stats: BatchStats, served: list[tuple[Work, Any]]) -> None:
        """served: each request's Work and the span its Call handed the batcher (None: untraced)."""
        spans = [span for _work, span in served if span is not None and span.get_span_context().trace_flags.sampled]
        if not spans:
            return
        from attnserve.server.tensors import batch_masking

        works = [work for work, _span in served]
        q_len, k_len = max(w.q_len for w in works), max(w.k_len for w in works)
        want_probs = any(w.want_probs for w in works)
        masking = batch_masking({w.masking for w in works}, all(w.k_len == k_len for w in works))
        self.batch_span(stats, spans, q_len, k_len, want_probs, masking)

    def batch_span(self, stats: BatchStats, spans: list, q_len: int, k_len: int, want_probs: bool, masking: str,
                   end_ns: int | None = None) -> None:
        """The batch's span, linked to its sampled request spans, ending at end_ns (None: now);
        both planes' batches (server.native_records hands the native runner's figures)."""
        trace = self._tracing._trace
        attributes = {
            "attnserve.model": self._model, "attnserve.model_version": self._version,
            "attnserve.batch.requests": stats.requests, "attnserve.batch.rows": stats.rows,
            "attnserve.batch.query_length": q_len, "attnserve.batch.key_length": k_len,
            "attnserve.batch.padding_ratio": stats.padding_ratio, "attnserve.batch.masking": masking,
            "attnserve.batch.attn_probs": want_probs,
            "attnserve.batch.session": "solo" if stats.solo else "batch",
            "attnserve.batch.merge_s": stats.merge_s, "attnserve.batch.run_s": stats.run_s,
            "attnserve.batch.split_s": stats.split_s,
        }
        if self._graphs is not None:
            try:
                attributes["attnserve.batch.graph"] = self._graphs.graph_for(masking, want_probs, q_len, k_len)
            except ValueError:
                pass
        end_ns = time.time_ns() if end_ns is None else end_ns
        links = [trace.Link(span.get_span_context()) for span in spans]
        span = self._tracing.tracer.start_span(
            f"batch {self._model}", context=trace.set_span_in_context(spans[0]), kind=trace.SpanKind.INTERNAL,
            attributes=attributes, links=links, start_time=end_ns - int(stats.compute_s * 1e9))
        if stats.failed:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "the batch's run failed"))
        span.end(end_time=end_ns)


def bounded(text: object, limit: int = QUOTED_CHARS, length: int | None = None) -> str:
    """Client text as the access log keeps it: at most `limit` characters, marked when cut.
    length: the text's full length where `text` is its start (a native call's record keeps no more)."""
    text = str(text)
    length = len(text) if length is None else max(length, len(text))
    return text if length <= limit else f"{text[:limit]}...(+{length - limit})"


class Calls:
    """What each inference call records: a span (with `tracing`) and an access line (with
    `access_log`). begin() returns None when neither is on: the transports then skip it all."""

    def __init__(self, tracing: Tracing | None, access_log: bool) -> None:
        self.tracing = tracing
        self.access_log = access_log
        self.on = tracing is not None or access_log

    def begin(self, transport: str, method: str, peer: str, headers: Mapping[str, str] | None,
              bytes_in: int = 0) -> Call | None:
        if not self.on:
            return None
        return Call(self, transport, method, peer, headers, bytes_in)


_LIMITED = ("peer", "method", "model", "version", "request_id")  # client text in the access line


class Call:
    """One call's record, from its arrival to its answer (or error): finished exactly once."""

    __slots__ = ("_calls", "transport", "method", "peer", "bytes_in", "bytes_out", "started", "started_ns",
                 "model", "version", "request_id", "shape", "queue_s", "run_s", "batch_requests", "span",
                 "_parent", "finished", "lengths")

    def __init__(self, calls: Calls, transport: str, method: str, peer: str, headers: Mapping[str, str] | None,
                 bytes_in: int, started_ns: int | None = None) -> None:
        """started_ns: when the call began, on the epoch clock, for a call recorded elsewhere (a
        native call's record, server.native_records); None: now."""
        self._calls = calls
        self.transport = transport
        self.method = method
        self.peer = peer
        self.bytes_in = bytes_in
        self.bytes_out = 0
        self.started = time.monotonic()
        self.started_ns = time.time_ns() if started_ns is None else started_ns
        self.model = self.version = self.request_id = ""
        self.shape: tuple[int, int, int] | None = None  # B, Lq, Lk
        self.queue_s = self.run_s = None
        self.batch_requests = 0
        self.span = None
        self._parent = headers
        self.finished = False
        self.lengths: dict[str, int] | None = None  # client text's full lengths, where only its start is kept

    # -- filled in by the request path (server.request_path) --------------------------------------

    def request(self, model: str, version: str, request_id: str) -> None:
        """The inference request is in: its span starts (at the call's arrival) in the caller's trace."""
        self.model, self.version, self.request_id = model, version, request_id
        tracing = self._calls.tracing
        if tracing is None or self.span is not None:
            return
        trace = tracing._trace
        parent = tracing.extract(self._parent) if self._parent is not None else None
        lengths = self.lengths or {}
        model_text = bounded(model, length=lengths.get("model"))
        self.span = tracing.tracer.start_span(
            f"infer {model_text}", context=parent, kind=trace.SpanKind.SERVER, start_time=self.started_ns,
            attributes={"attnserve.model": model_text, "attnserve.transport": self.transport,
                        "rpc.method": self.method,
                        "attnserve.request_id": bounded(request_id, length=lengths.get("request_id")),
                        "attnserve.request_bytes": self.bytes_in})

    def decoded(self, work: Work) -> None:
        """The request was admitted (decoded, checked) and goes to the batcher's queue."""
        self.admitted(work.rows, work.q_len, work.k_len)

    def admitted(self, rows: int, q_len: int, k_len: int, at_ns: int | None = None) -> None:
        """Admitted with this shape, at at_ns (epoch clock; None: now)."""
        self.shape = (rows, q_len, k_len)
        span = self.span
        if span is not None and span.is_recording():
            span.set_attributes({"attnserve.batch_size": rows, "attnserve.query_length": q_len,
                                 "attnserve.key_length": k_len})
            span.add_event("admitted", timestamp=at_ns)

    def computed(self, queue_s: float, compute_s: float, batch_requests: int, version: int | str,
                 at_ns: int | None = None) -> None:
        """Its batch ran: the queue wait and the run, as the batcher measured them; the run
        ended at at_ns (epoch clock; None: now)."""
        self.queue_s, self.run_s, self.batch_requests = queue_s, compute_s, batch_requests
        self.version = str(version)
        span = self.span
        if span is not None and span.is_recording():
            now = time.time_ns() if at_ns is None else at_ns
            run_start = now - int(compute_s * 1e9)
            span.add_event("dequeued", {"attnserve.queue_s": queue_s}, timestamp=run_start)
            span.add_event("computed", {"attnserve.run_s": compute_s, "attnserve.batch_requests": batch_requests},
                           timestamp=now)

    def encoded(self, at_ns: int | None = None) -> None:
        span = self.span
        if span is not None and span.is_recording():
            span.add_event("encoded", timestamp=at_ns)

    # -- the end -----------------------------------------------------------------------------

    def finish(self, status: Status, bytes_out: int = 0, http_status: int | None = None,
               end_ns: int | None = None) -> None:
        """The call is answered (sent, or refused): end its span, write its access line. Once.
        end_ns: when it was answered, on the epoch clock (a native call's record); None: now."""
        if self.finished:
            return
        self.finished = True
        self.bytes_out = bytes_out
        duration_s = time.monotonic() - self.started if end_ns is None else (end_ns - self.started_ns) / 1e9
        span = self.span
        trace_id = ""
        if span is not None:
            context = span.get_span_context()
            if context.trace_flags.sampled:
                trace_id = format(context.trace_id, "032x")
            elif self._parent is not None:  # not sampled: the caller's trace id, if it sent one
                trace_id = _trace_id_of(self._parent.get(TRACEPARENT))
            if span.is_recording():
                trace = self._calls.tracing._trace
                span.set_attributes({"attnserve.model_version": self.version, "attnserve.status": status.code.name,
                                     "attnserve.response_bytes": bytes_out,
                                     "http.response.status_code": http_status or status.http})
                if status.code.name != "OK":
                    span.set_status(trace.Status(trace.StatusCode.ERROR, status.details[:200]))
            span.end(end_time=end_ns)
        elif self._parent is not None:  # not traced here: the caller's trace id, when it sent one
            trace_id = _trace_id_of(self._parent.get(TRACEPARENT))
        if self._calls.access_log:
            self._write_access_line(status, duration_s, trace_id, http_status or status.http)

    def _write_access_line(self, status: Status, duration_s: float, trace_id: str, http_status: int) -> None:
        fields = {
            "transport": self.transport, "peer": self.peer, "method": self.method, "model": self.model,
            "version": self.version, "request_id": self.request_id, "status": status.code.name,
            "http_status": http_status, "duration_ms": round(duration_s * 1000, 3),
            "queue_ms": None if self.queue_s is None else round(self.queue_s * 1000, 3),
            "run_ms": None if self.run_s is None else round(self.run_s * 1000, 3),
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "trace_id": trace_id,
        }
        lengths = self.lengths or {}
        for name in _LIMITED:
            fields[name] = bounded(fields[name], length=lengths.get(name))
        access_logger.info("%s", _AccessLine(fields), extra={"access": fields})


class _AccessLine:
    """The text form of an access line, built only if a handler formats it (logging's laziness)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{name}={_text_value(value)}" for name, value in self.fields.items())


def _text_value(value: object) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, str) and (not value.isprintable() or any(c in value for c in ' "=')):
        return json.dumps(value)
    return str(value)


_HEX = frozenset("0123456789abcdef")


def _trace_id_of(traceparent: object) -> str:
    """The trace id of a W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex>"), or "" if it is not one."""
    if not isinstance(traceparent, str) or len(traceparent) < 55 or traceparent[2:3] != "-":
        return ""
    trace_id = traceparent[3:35]
    if traceparent[35:36] != "-" or not set(trace_id) <= _HEX or trace_id == "0" * 32:
        return ""
    return trace_id


def carrier_of(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """gRPC metadata as a propagator's carrier: the trace-context keys only (their values text)."""
    carrier = {}
    for key, value in metadata or ():
        if key in (TRACEPARENT, TRACESTATE) and isinstance(value, str):
            carrier[key] = value
    return carrier


class JsonFormatter(logging.Formatter):
    """`--log-format json`: one JSON object per line: time, level, logger, message, and an access
    line's fields at the top level."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname, "logger": record.name,
        }
        if self._worker is not None:
            document["worker"] = self._worker
            document["pid"] = record.process
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            document.update(access)
        else:
            document["message"] = record.getMessage()
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)
