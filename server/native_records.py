"""The native data plane's calls as access lines and spans, written by server.tracing's one writer.

    records = NativeRecords(plane, calls, capacity, metrics)   # before the plane starts
    records.start(loop)           # the event loop drains the records when the plane says some wait
    records.batch_done(...)       # once per batch (the runner's figures): the batch's span
    records.stop()                # the last records written

The plane (native/core/records.h) keeps a bounded record of each call it answers, refused or
computed: the access line's fields, the traceparent it was sent and its times on the plane's
own clock, turned into epoch time once. The records reach Python in bulk: the plane writes an
eventfd when its buffer stops being empty, and the event loop takes everything held, so no call
takes the GIL. Each record becomes a server.tracing.Call with explicit times: the same line and
span fields as a Python-plane call. A full buffer drops records and counts them
(attnserve_access_records_dropped_total). Only with --access-log or tracing on: otherwise the
plane is never told to record and no call pays for it. docs/tracing.md, "The native data plane".
"""

from __future__ import annotations

import asyncio
import logging

from attnserve.server.errors import status_of_code
from attnserve.server.gate import log_arrival
from attnserve.server.graphs import GENERAL, HEADS, KEY_PADDING, NO_MASK
from attnserve.server.tracing import TRACEPARENT, TRACESTATE, Call, Calls

logger = logging.getLogger(__name__)

DROPPED_METRIC = "attnserve_access_records_dropped_total"
# _native.Plane.take_arrivals_and_records' tuples (native/bindings.cc); client text comes as bytes.
RECORD_FIELDS = ("traced", "method", "peer", "model", "version", "request_id", "traceparent", "tracestate", "code",
                 "details", "start_ns", "end_ns", "admitted_ns", "run_start_ns", "run_end_ns", "queue_s", "run_s",
                 "batch_requests", "rows", "q_len", "k_len", "bytes_in", "bytes_out", "batch", "model_chars",
                 "version_chars", "request_id_chars")
MASKINGS = (NO_MASK, KEY_PADDING, GENERAL, HEADS)  # _native.Batch.masking's values
_MAX_OPEN_BATCHES = 4096  # batches whose spans wait for their figures: a bound, should one never come


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class NativeRecords:
    def __init__(self, plane, calls: Calls, capacity: int, metrics=None) -> None:
        """plane: the _native.Plane, told here to record (before it starts); calls: the
        RequestPath's (access log, tracing); capacity: records held undrained at most."""
        self._plane = plane
        self._calls = calls
        self._lines = Calls(None, access_log=calls.access_log)  # refusals before a request: a line, no span
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch_spans: dict[int, list] = {}  # batch id -> its calls' sampled spans, until its figures come
        self._dropped_counted = 0
        self._dropped = None
        plane.set_records(capacity, arrivals=calls.access_log)  # arrivals: the gate's "rpc <method>" lines
        if metrics is not None:
            from prometheus_client import Counter

            self._dropped = Counter(DROPPED_METRIC.removesuffix("_total"),
                                    "Native data plane call records dropped because the buffer the event loop "
                                    "drains was full (their access lines and spans are missing).",
                                    registry=metrics.registry)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._plane.records_fd(), self.drain)

    def stop(self) -> None:
        """On the event loop, once the plane has stopped: the last records written."""
        if self._loop is not None:
            self._loop.remove_reader(self._plane.records_fd())
            self._loop = None
        self.drain()
        self._batch_spans.clear()

    def refresh_metrics(self) -> None:
        if self._dropped is None:
            return
        dropped = self._plane.records_dropped()
        if dropped > self._dropped_counted:
            self._dropped.inc(dropped - self._dropped_counted)
            self._dropped_counted = dropped

    def drain(self) -> None:
        """Every record held now, written (lines) and exported (spans)."""
        arrivals, records = self._plane.take_arrivals_and_records()
        for method, count in arrivals.items():  # headers read: the gate's lines, before any call's end
            for _ in range(count):
                log_arrival(method)
        for record in records:
            try:
                self._write(record)
            except Exception:  # one bad record must not stop the others' (nor the event loop's reader)
                logger.exception("native data plane: a call record could not be written")

    def _write(self, record: tuple) -> None:
        (traced, method, peer, model, version, request_id, traceparent, tracestate, code, details, start_ns, end_ns,
         admitted_ns, _run_start_ns, run_end_ns, queue_s, run_s, batch_requests, rows, q_len, k_len, bytes_in,
         bytes_out, batch, model_chars, version_chars, request_id_chars) = record
        status = status_of_code(code, _text(details))
        if not traced:  # refused before a request was read (its token, bytes that do not parse)
            if self._calls.access_log:
                Call(self._lines, "grpc", method, _text(peer), None, bytes_in, started_ns=start_ns).finish(
                    status, end_ns=end_ns)
            return
        headers = None
        if traceparent:
            headers = {TRACEPARENT: _text(traceparent)}
            if tracestate:
                headers[TRACESTATE] = _text(tracestate)
        call = Call(self._calls, "grpc", method, _text(peer), headers, bytes_in, started_ns=start_ns)
        call.lengths = {"model": model_chars, "version": version_chars, "request_id": request_id_chars}
        call.request(_text(model), _text(version), _text(request_id))
        if rows:
            call.admitted(rows, q_len, k_len, at_ns=admitted_ns or None)
        if run_s >= 0:
            call.computed(queue_s, run_s, batch_requests, _text(version), at_ns=run_end_ns or None)
            call.encoded(at_ns=run_end_ns or None)
        call.finish(status, bytes_out, end_ns=end_ns)
        self.joins_batch(batch, call.span)

    def joins_batch(self, batch_id: int, span) -> None:
        """A REST call computed in batch `batch_id` (server.native's submit_infer): its span, linked
        from the batch's span as a gRPC call's is."""
        if batch_id and span is not None and span.get_span_context().trace_flags.sampled:
            self._batch_spans.setdefault(batch_id, []).append(span)
            while len(self._batch_spans) > _MAX_OPEN_BATCHES:
                self._batch_spans.pop(next(iter(self._batch_spans)))

    def batch_done(self, tracer, stats, batch_id: int, q_len: int, k_len: int, want_probs: bool, masking: int,
                   end_ns: int) -> None:
        """On the event loop, once per batch, after its calls were settled: its span (tracer:
        server.tracing.BatchTracer), linked to its calls' sampled spans."""
        self.drain()  # the batch's records were handed over before its figures were scheduled
        spans = self._batch_spans.pop(batch_id, None)
        if spans and tracer is not None:
            tracer.batch_span(stats, spans, q_len, k_len, want_probs, MASKINGS[masking], end_ns=end_ns)
