"""Traces and access lines (server.tracing, docs/tracing.md), end to end: a real server exports
its spans over OTLP/gRPC to a receiver stand-in on loopback (the collector's TraceService from
opentelemetry-proto, unmodified), and writes one access line per call.

Batches are held at a gate the test controls (tests.gated_server), so that requests queue and
run together without guessing how long a run takes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk")
from attnserve.proto import inference_pb2_grpc as pb_grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from tests.gated_server import GatedServer  # noqa: E402
from tests.oip import infer_request  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

WAIT_S = 60.0


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request, context):
        with self._changed:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, what: str) -> list:
        """The spans once predicate(spans) holds (the exporter sends every OTEL_BSP_SCHEDULE_DELAY)."""
        deadline = time.monotonic() + WAIT_S
        with self._changed:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"not received within {WAIT_S}s: {what}; got {self.spans}")
                self._changed.wait(left)
            return list(self.spans)

    def stop(self) -> None:
        self._server.stop(None)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def otel_env(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_SERVICE_NAME": "attnserve-test",
            "OTEL_BSP_SCHEDULE_DELAY": "20"}


def traceparent() -> tuple[str, bytes, bytes]:
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


def _inputs(rows: int = 1, length: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows * 100 + length)
    return {name: rng.standard_normal((rows, length, 512), dtype=np.float32) for name in ("query", "key", "value")}


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def _request_span(spans, trace_id: bytes):
    found = [s for s in spans if s.trace_id == trace_id and s.name.startswith("infer ")]
    return found[0] if found else None


def _batch_spans(spans):
    return [s for s in spans if s.name.startswith("batch ")]


def _queue_depth(proc: ServerProcess, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(rf'^attnserve_queue_depth{{model="{model}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_queue_depth(proc: ServerProcess, model: str, depth: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while _queue_depth(proc, model) != depth:
        assert time.monotonic() < deadline, f"queue depth of {model} never reached {depth}"
        time.sleep(0.01)


def _rest_body(x: dict[str, np.ndarray], request_id: str = "") -> bytes:
    return json.dumps({"id": request_id, "inputs": [
        {"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()} for n,
        a in x.items()]}).encode()


def _rest(proc: ServerProcess, path: str, body: bytes | None, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(f"http://{proc.http_address}{path}", data=body, headers=headers or {},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


# -- traces ------------------------------------------------------------------------------------


def test_a_grpc_call_with_a_traceparent_gets_its_request_span_under_the_callers_and_a_linked_batch_span(
        model_repository, receiver):
    header, trace_id, caller_span = traceparent()
    with GatedServer(model_repository, env=otel_env(receiver)) as proc, proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        proc.gate.release()
        response = stub.ModelInfer(infer_request("self_attention", request_id="r-1", **_inputs(2, 5)),
                                   metadata=(("traceparent", header), ("tracestate", "vendor=1")), timeout=WAIT_S)
        assert response.id == "r-1"
        spans = receiver.wait_for(lambda s: _request_span(s, trace_id) is not None and _batch_spans(s),
                                  "the request span and a batch span")
    request = _request_span(spans, trace_id)
    assert request.parent_span_id == caller_span  # joined the caller's trace, under its span
    assert request.kind == request.SPAN_KIND_SERVER
    attrs = _attrs(request)
    assert attrs["attnserve.model"] == "self_attention" and attrs["attnserve.transport"] == "grpc"
    assert attrs["attnserve.status"] == "OK" and attrs["attnserve.model_version"] == "1"
    assert (attrs["attnserve.batch_size"], attrs["attnserve.query_length"], attrs["attnserve.key_length"]) == (2, 5, 5)
    assert attrs["attnserve.request_bytes"] > 3 * 2 * 5 * 512 * 4
    assert attrs["attnserve.response_bytes"] > 2 * 5 * 512 * 4
    assert [e.name for e in request.events] == ["admitted", "dequeued", "computed", "encoded"]
    assert request.trace_state == "vendor=1"
    (batch,) = _batch_spans(spans)
    assert batch.trace_id == trace_id and batch.parent_span_id == request.span_id
    assert [(link.trace_id, link.span_id) for link in batch.links] == [(trace_id, request.span_id)]
    battrs = _attrs(batch)
    assert battrs["attnserve.batch.rows"] == 2 and battrs["attnserve.batch.requests"] == 1
    assert battrs["attnserve.batch.padding_ratio"] == 0.0 and battrs["attnserve.batch.session"] == "batch"
    assert battrs["attnserve.batch.graph"]


def test_requests_that_run_together_get_one_batch_span_linked_to_each(model_repository, receiver):
    with GatedServer(model_repository, env=otel_env(receiver)) as proc, proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        pool = futures.ThreadPoolExecutor(max_workers=4)
        first = pool.submit(stub.ModelInfer, infer_request("self_attention", **_inputs(1, 3)), timeout=WAIT_S)
        assert proc.gate.wait_started() == 1  # the first batch runs, held: the next three queue behind it
        parents = [traceparent() for _ in range(3)]
        calls = []
        for i, (header, _t, _s) in enumerate(parents):  # one at a time: their order in the queue is known
            calls.append(pool.submit(stub.ModelInfer, infer_request("self_attention", **_inputs(1, 3 + i)),
                                     metadata=(("traceparent", header),), timeout=WAIT_S))
            _wait_queue_depth(proc, "self_attention", i + 1)
        proc.gate.release()
        assert proc.gate.wait_started() == 3  # one batch of the three
        proc.gate.release()
        first.result()
        for call in calls:
            call.result()
        spans = receiver.wait_for(lambda s: all(_request_span(s, t) is not None for _h, t, _s in parents)
                                  and any(len(b.links) == 3 for b in _batch_spans(s)), "three requests' batch")
    requests = [_request_span(spans, t) for _h, t, _s in parents]
    assert [r.parent_span_id for r in requests] == [s for _h, _t, s in parents]
    (batch,) = [b for b in _batch_spans(spans) if len(b.links) == 3]
    assert {(link.trace_id, link.span_id) for link in batch.links} == {(r.trace_id, r.span_id) for r in requests}
    assert (batch.trace_id, batch.parent_span_id) == (requests[0].trace_id, requests[0].span_id)  # the oldest's
    attrs = _attrs(batch)
    assert attrs["attnserve.batch.requests"] == 3 and attrs["attnserve.batch.rows"] == 3
    assert attrs["attnserve.batch.padding_ratio"] > 0  # lengths 3, 4, 5 padded to 5
    assert all(_attrs(r)["attnserve.status"] == "OK" for r in requests)


def test_a_rest_call_with_a_traceparent_joins_the_callers_trace_and_its_batch_span_links_to_it(
        model_repository, receiver):
    header, trace_id, caller_span = traceparent()
    with GatedServer(model_repository, env=otel_env(receiver)) as proc:
        proc.gate.release()
        status = _rest(proc, "/v2/models/self_attention/infer", _rest_body(_inputs(1, 4), "rest-1"),
                       {"traceparent": header, "Content-Type": "application/json"})
        assert status == 200
        spans = receiver.wait_for(lambda s: _request_span(s, trace_id) is not None and _batch_spans(s),
                                  "the REST request span and its batch span")
    request = _request_span(spans, trace_id)
    assert request.parent_span_id == caller_span
    attrs = _attrs(request)
    assert attrs["attnserve.transport"] == "http" and attrs["attnserve.request_id"] == "rest-1"
    assert attrs["http.response.status_code"] == 200 and attrs["attnserve.response_bytes"] > 0
    (batch,) = _batch_spans(spans)
    assert [(link.trace_id, link.span_id) for link in batch.links] == [(trace_id, request.span_id)]


def test_a_failed_call_ends_its_span_with_an_error_status(model_repository, receiver):
    header, trace_id, _span = traceparent()
    with GatedServer(model_repository, env=otel_env(receiver)) as proc, proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        bad = _inputs(1, 4)
        bad["query"] = bad["query"][:, :, :100]  # not the model's width
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(infer_request("self_attention", **bad), metadata=(("traceparent", header),), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        spans = receiver.wait_for(lambda s: _request_span(s, trace_id) is not None, "the failed call's span")
    request = _request_span(spans, trace_id)
    assert _attrs(request)["attnserve.status"] == "INVALID_ARGUMENT"
    assert request.status.code == request.status.STATUS_CODE_ERROR
    assert not _batch_spans(spans)  # never batched


def _exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("Otel")]


def test_with_tracing_off_no_exporter_thread_exists_and_with_it_on_one_does(model_repository, monkeypatch, receiver):
    from attnserve.server.app import Server
    from attnserve.server.config import ServerConfig

    config = ServerConfig(model_repository=model_repository, host="127.0.0.1", port=0, http_port=0, metrics_port=-1,
                          drain_delay_s=0, grace_period_s=5)

    async def serve_one_call() -> list[str]:
        server = Server(config)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    infer_request("self_attention", **_inputs(1, 3)), metadata=(("traceparent", traceparent()[0]),))
            return _exporter_threads()
        finally:
            await server.stop(5)

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    assert asyncio.run(serve_one_call()) == []
    for name, value in otel_env(receiver).items():  # the positive control: the same server, asked to trace
        monkeypatch.setenv(name, value)
    assert asyncio.run(serve_one_call()) != []
    assert _exporter_threads() == []  # the stop shut it down


def test_traces_asked_for_with_an_unknown_exporter_refuse_to_start_with_a_clear_message(model_repository):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                             "--workers", "1"], env={**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"},
                            capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 3
    assert "OTEL_TRACES_EXPORTER='zipkin'" in result.stderr


def test_the_sdk_missing_is_a_clear_refusal(monkeypatch):
    import builtins

    from attnserve.server import tracing

    real_import = builtins.__import__

    def no_sdk(name, *args, **kwargs):
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'attnserve\[otel\]'"):
        tracing.check_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert tracing.Tracing.from_environ({}) is None  # not asked: nothing imported, no error


def test_which_variables_ask_for_traces():
    from attnserve.server.tracing import wanted

    assert not wanted({})
    assert wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not wanted({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})


# -- access lines ------------------------------------------------------------------------------


def _access_lines(proc: ServerProcess, count: int) -> list[dict]:
    """The first `count` access lines of a --log-format json server, once it has written them;
    every line of its log parses as JSON."""
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = [line for line in proc.log().splitlines() if line.strip()]
        documents = [json.loads(line) for line in lines]  # every line, not only the access ones
        access = [d for d in documents if d["logger"] == "attnserve.access"]
        if len(access) >= count:
            return access
        assert time.monotonic() < deadline, f"{len(access)} access lines, expected {count}:\n{proc.log()}"
        time.sleep(0.01)


FIELDS = {"time", "level", "logger", "transport", "peer", "method", "model", "version", "request_id", "status",
          "http_status", "duration_ms", "queue_ms", "run_ms", "bytes_in", "bytes_out", "trace_id"}


def test_one_json_access_line_per_call_with_its_fields_for_ok_and_each_error_class(model_repository):
    header, trace_id, _span = traceparent()
    long_name = "m" * 5000
    with GatedServer(model_repository, "--access-log", "--log-format", "json", "--max-queue-size", "1") as proc, \
            proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        proc.gate.release()
        stub.ModelInfer(infer_request("self_attention", request_id="ok-1", **_inputs(1, 4)),
                        metadata=(("traceparent", header),), timeout=WAIT_S)
        proc.gate.wait_started()  # ok-1's own line: the next wait_started() must be the held batch's
        bad = _inputs(1, 4)
        bad["query"] = bad["query"][:, :, :100]
        for request in (infer_request("self_attention", request_id="bad-1", **bad),
                        infer_request(long_name, request_id="x" * 5000, **_inputs(1, 4))):
            with pytest.raises(grpc.RpcError):
                stub.ModelInfer(request, timeout=WAIT_S)
        # A full queue: one batch held at the gate, one request queued, the third refused.
        pool = futures.ThreadPoolExecutor(max_workers=2)
        held = pool.submit(stub.ModelInfer, infer_request("self_attention", request_id="held", **_inputs(1, 4)),
                           timeout=WAIT_S)
        proc.gate.wait_started()
        queued = pool.submit(stub.ModelInfer, infer_request("self_attention", request_id="queued", **_inputs(1, 4)),
                             timeout=WAIT_S)
        _wait_queue_depth(proc, "self_attention", 1)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(infer_request("self_attention", request_id="shed", **_inputs(1, 4)), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        proc.gate.release(3)  # the held batch, the queued one, the REST call's below
        held.result(), queued.result()
        # REST: OK, a bad body, an unknown model, an unknown path.
        assert _rest(proc, "/v2/models/self_attention/infer", _rest_body(_inputs(1, 4), "rest-ok"),
                     {"traceparent": header}) == 200
        assert _rest(proc, "/v2/models/self_attention/infer", b"{not json") == 400
        assert _rest(proc, "/v2/models/nope/infer", _rest_body(_inputs(1, 4))) == 404
        assert _rest(proc, "/v3/nothing", None) == 404
        lines = _access_lines(proc, 10)
    by_id = {line["request_id"]: line for line in lines if line["request_id"]}
    for line in lines:
        assert FIELDS <= set(line), sorted(FIELDS - set(line))
        assert line["level"] == "INFO" and line["duration_ms"] >= 0
    ok = by_id["ok-1"]
    assert (ok["transport"], ok["method"], ok["model"], ok["version"], ok["status"], ok["http_status"]) == (
        "grpc", "ModelInfer", "self_attention", "1", "OK", 200)
    assert ok["trace_id"] == trace_id.hex() and ok["peer"].startswith("ipv4:127.0.0.1:")
    assert ok["queue_ms"] >= 0 and ok["run_ms"] > 0
    assert ok["bytes_in"] > 3 * 4 * 512 * 4 and ok["bytes_out"] > 4 * 512 * 4
    assert (by_id["bad-1"]["status"], by_id["bad-1"]["http_status"], by_id["bad-1"]["run_ms"]) == (
        "INVALID_ARGUMENT", 400, None)
    shed = by_id["shed"]
    assert (shed["status"], shed["http_status"]) == ("RESOURCE_EXHAUSTED", 429)
    unknown = next(line for line in lines if line["status"] == "NOT_FOUND" and line["transport"] == "grpc")
    assert len(unknown["model"]) < 200 and len(unknown["request_id"]) < 200  # the client's text, bounded
    rest_ok = by_id["rest-ok"]
    assert (rest_ok["transport"], rest_ok["status"], rest_ok["http_status"], rest_ok["trace_id"]) == (
        "http", "OK", 200, trace_id.hex())
    assert rest_ok["method"] == "POST /v2/models/self_attention/infer" and rest_ok["bytes_out"] > 0
    rest = [line for line in lines if line["transport"] == "http"]
    assert sorted(line["http_status"] for line in rest) == [200, 400, 404, 404]
    assert {line["status"] for line in rest} == {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED"}
    assert all(line["trace_id"] == "" for line in lines if line["request_id"] not in ("ok-1", "rest-ok"))


def test_text_access_lines_and_refusals_at_the_gate(model_repository, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    proc = ServerProcess(model_repository, "--access-log", "--auth-token-file", str(token))
    try:
        channel = proc.channel()
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(infer_request("self_attention", **_inputs(1, 4)), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.ModelInfer(infer_request("self_attention", request_id='a "quoted" id', **_inputs(1, 4)),
                        metadata=(("authorization", "Bearer s3cret"),), timeout=WAIT_S)
        assert _rest(proc, "/v2/models/self_attention/infer", _rest_body(_inputs(1, 4))) == 401
        stream = [infer_request("self_attention", request_id=f"s-{i}", **_inputs(1, 4)) for i in range(2)]
        answers = list(stub.ModelStreamInfer(iter(stream), metadata=(("authorization", "Bearer s3cret"),),
                                             timeout=WAIT_S))
        assert [a.infer_response.id for a in answers] == ["s-0", "s-1"]
        log = proc.wait_for_log("attnserve.access", 5)
        channel.close()
    finally:
        proc.stop()
    lines = [line for line in log.splitlines() if "attnserve.access" in line]
    # A call's line is written once it is answered, so lines of calls a client made one after the other may
    # swap places: each is looked up by what it says.
    assert len(lines) == 5, lines
    grpc_lines = [line for line in lines if "transport=grpc" in line]
    http_lines = [line for line in lines if "transport=http" in line]
    assert len(grpc_lines) == 4 and len(http_lines) == 1, lines
    refused = [line for line in grpc_lines if "status=UNAUTHENTICATED" in line]
    assert len(refused) == 1 and re.search(r"transport=grpc peer=ipv4:127\.0\.0\.1:\d+ method=ModelInfer model=- "
                                           r".*status=UNAUTHENTICATED http_status=401", refused[0]), refused
    assert sum('request_id="a \\"quoted\\" id" status=OK http_status=200' in line for line in grpc_lines) == 1, lines
    assert "status=UNAUTHENTICATED http_status=401" in http_lines[0], http_lines
    stream_lines = [line for line in grpc_lines if "method=ModelStreamInfer" in line]
    assert len(stream_lines) == 2, lines  # each request of a stream has its own line, in the stream's order
    for i, line in enumerate(stream_lines):
        assert f"method=ModelStreamInfer model=self_attention version=1 request_id=s-{i} status=OK" in line, line


# -- the batch CLI -----------------------------------------------------------------------------


def test_a_batch_jobs_calls_are_one_trace_each_call_a_span_of_its_own(model_repository, receiver, tmp_path,
                                                                      monkeypatch):
    from attnserve.client.batch import BatchJob, run_batch
    from attnserve.client.options import ClientOptions

    from tests.test_batch_job import make_input

    make_input(tmp_path / "in.npz", "cross_attention", 40, 4, 6, seed=1)
    proc = ServerProcess(model_repository, env=otel_env(receiver))
    try:
        caller_trace = secrets.token_hex(16)  # run inside the caller's trace, as $TRACEPARENT says
        monkeypatch.setenv("TRACEPARENT", f"00-{caller_trace}-{secrets.token_hex(8)}-01")
        joined = run_batch(BatchJob(model="cross_attention", input_path=tmp_path / "in.npz",
                                    output_path=tmp_path / "joined.npz", batch_size=10, concurrency=2),
                           ClientOptions(url=proc.address))
        monkeypatch.delenv("TRACEPARENT")
        summary = run_batch(BatchJob(model="cross_attention", input_path=tmp_path / "in.npz",
                                     output_path=tmp_path / "out.npz", batch_size=10, concurrency=2),
                            ClientOptions(url=proc.address))
        trace_id = bytes.fromhex(summary.trace_id)
        spans = receiver.wait_for(
            lambda s: len([x for x in s if x.trace_id == trace_id and x.name.startswith("infer ")]) == 4
            and len([x for x in s if x.trace_id == bytes.fromhex(caller_trace) and x.name.startswith("infer ")]) == 4,
            "four request spans in each job's trace")
    finally:
        proc.stop()
    assert joined.trace_id == caller_trace and summary.trace_id != caller_trace
    requests = [s for s in spans if s.trace_id == trace_id and s.name.startswith("infer ")]
    assert len({s.parent_span_id for s in requests}) == 4  # each call its own span id
    assert f"trace {summary.trace_id}" in summary.line()
