"""Native calls' access lines and spans (native/core/records.h, server.native_records, docs/tracing.md).

The native plane keeps a record per call and hands the records to the event loop in bulk, which
writes them with server.tracing's one writer. Against real servers with `--data-plane native`:
the same calls sent to the Python port and to the native port (OK, bad tensor, unknown model,
no token, cancelled while its batch runs, a stream's requests) give the same access-line fields
and values (durations and peer ports aside); spans follow the caller's traceparent, with the
batch span linked to the request span, as on the Python port; a burst that overflows a small
record buffer drops records, counts them in attnserve_access_records_dropped_total, and the
plane serves on. In-process, a batch of calls into a buffer of 2 keeps 2 records and counts the
rest. Batches are held at a gate the test controls (tests.gated_server), never a guess of speed.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native

from tests.gated_server import GatedServer
from tests.oip import infer_request
from tests.server_process import ServerProcess

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

WAIT_S = 60.0  # a bound on waiting for a state the test reaches, not a guess of speed
TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# What differs between two calls by nature: when and how long, and the client's port.
VARYING = {"time", "duration_ms", "queue_ms", "run_ms", "peer"}


def native_port(proc: ServerProcess) -> int:
    """Where native calls go: the server's gRPC port (the Python plane sits behind it: proc.python_target)."""
    return proc.port


def _inputs(rows: int = 1, length: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows * 100 + length)
    return {name: rng.standard_normal((rows, length, 512), dtype=np.float32) for name in ("query", "key", "value")}


def _sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _wait_metric(proc: ServerProcess, name: str, at_least: float) -> None:
    deadline = time.monotonic() + WAIT_S
    while _sum(proc.scrape(), name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}:\n{proc.scrape()}"
        time.sleep(0.01)


def _access_lines(proc: ServerProcess) -> list[dict]:
    documents = [json.loads(line) for line in proc.log().splitlines() if line.strip()]
    return [d for d in documents if d["logger"] == "attnserve.access"]


def _wait_lines(proc: ServerProcess, count: int) -> list[dict]:
    deadline = time.monotonic() + WAIT_S
    while len(lines := _access_lines(proc)) < count:
        assert time.monotonic() < deadline, f"{len(lines)} access lines, expected {count}:\n{proc.log()}"
        time.sleep(0.01)
    return lines


def _one_of_each(proc: GatedServer, channel: grpc.Channel, header: str) -> None:
    """OK (with a traceparent), a bad tensor, an unknown model, no token, a stream (OK, bad),
    and a call cancelled while its batch runs; every batch let through the gate one at a time."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    proc.gate.release()
    stub.ModelInfer(infer_request("self_attention", request_id="ok", **_inputs(1, 4)),
                    metadata=(*AUTH, ("traceparent", header)), timeout=WAIT_S)
    proc.gate.wait_started()
    bad = _inputs(1, 4)
    bad["query"] = bad["query"][:, :, :100]
    for request, code in ((infer_request("self_attention", request_id="bad", **bad), grpc.StatusCode.INVALID_ARGUMENT),
                          (infer_request("nope", version="2", request_id="unknown", **_inputs(1, 4)),
                           grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, metadata=AUTH, timeout=WAIT_S)
        assert exc.value.code() == code
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(infer_request("self_attention", request_id="no-token", **_inputs(1, 4)), timeout=WAIT_S)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    proc.gate.release()
    stream = [infer_request("self_attention", request_id="s-0", **_inputs(1, 4)),
              infer_request("self_attention", request_id="s-1", **bad)]
    answers = list(stub.ModelStreamInfer(iter(stream), metadata=AUTH, timeout=WAIT_S))
    assert [a.infer_response.id for a in answers] == ["s-0", "s-1"] and answers[1].error_message
    proc.gate.wait_started()
    cancelled_before = _sum(proc.scrape(), "attnserve_cancelled_requests_total")
    future = stub.ModelInfer.future(infer_request("self_attention", request_id="cancelled", **_inputs(1, 4)),
                                    metadata=AUTH, timeout=WAIT_S)
    proc.gate.wait_started()  # its batch runs (held)
    future.cancel()
    _wait_metric(proc, "attnserve_cancelled_requests_total", cancelled_before + 1)  # the server saw it
    proc.gate.release()


def test_native_calls_write_the_access_lines_the_python_port_writes_for_the_same_calls(model_repository, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with GatedServer(model_repository, "--data-plane", "native", "--access-log",
                     "--log-format", "json", "--auth-token-file", str(token)) as proc:
        planes = {}
        with grpc.insecure_channel(proc.python_target) as channel:  # the Python plane, behind the native one
            _one_of_each(proc, channel, header)
            planes["python"] = _wait_lines(proc, 7)
        with grpc.insecure_channel(f"127.0.0.1:{native_port(proc)}") as channel:
            _one_of_each(proc, channel, header)
            planes["native"] = _wait_lines(proc, 14)[len(planes["python"]):]
    assert len(planes["python"]) == 7 and len(planes["native"]) == 7, planes

    def key(line: dict) -> str:
        return line["request_id"] or line["status"]

    python, ours = ({key(line): line for line in lines} for lines in (planes["python"], planes["native"]))
    assert sorted(python) == sorted(ours) == sorted(
        ["ok", "bad", "unknown", "UNAUTHENTICATED", "s-0", "s-1", "cancelled"]), (python, ours)
    differ = {}
    for name, line in ours.items():
        want = python[name]
        assert set(line) == set(want), (name, line, want)
        differ.update({(name, f): (line[f], want[f]) for f in set(line) - VARYING if line[f] != want[f]})
        for f in ("queue_ms", "run_ms"):  # measured where, and only where, the Python port measures it
            if (line[f] is None) != (want[f] is None):
                differ[name, f] = (line[f], want[f])
        assert line["duration_ms"] >= 0
    assert not differ, differ  # (call, field): (native, python)
    ok = ours["ok"]
    assert (ok["status"], ok["http_status"], ok["version"], ok["trace_id"]) == (
        "OK", 200, "1", "0af7651916cd43dd8448eb211c80319c")
    assert ok["peer"].startswith("ipv4:127.0.0.1:") and ok["queue_ms"] >= 0 and ok["run_ms"] > 0
    assert ok["bytes_in"] > 3 * 4 * 512 * 4 and ok["bytes_out"] > 4 * 512 * 4
    assert (ours["s-0"]["method"], ours["s-0"]["status"]) == ("ModelStreamInfer", "OK")
    assert (ours["cancelled"]["status"], ours["cancelled"]["http_status"]) == ("CANCELLED", 499)
    assert ours["UNAUTHENTICATED"]["http_status"] == 401


def test_native_calls_follow_traceparent_with_a_request_span_and_a_linked_batch_span(model_repository):
    otel = pytest.importorskip("tests.test_tracing")  # its receiver; skips without the SDK
    receiver = otel.Receiver()
    proc = ServerProcess(model_repository, "--data-plane", "native", "--access-log",
                         "--log-format", "json", env=otel.otel_env(receiver))
    try:
        ids, details = {}, {}
        for plane, target in (("python", proc.python_target), ("native", f"127.0.0.1:{native_port(proc)}")):
            header, trace_id, span_id = otel.traceparent()
            bad_header, bad_trace, _ = otel.traceparent()
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                stub.ModelInfer(infer_request("self_attention", request_id=f"{plane}-ok", **_inputs(1, 4)),
                                metadata=(("traceparent", header),), timeout=WAIT_S)
                bad = _inputs(1, 4)
                bad["key"] = bad["key"][:, :, :7]
                with pytest.raises(grpc.RpcError) as exc:
                    stub.ModelInfer(infer_request("self_attention", **bad),
                                    metadata=(("traceparent", bad_header),), timeout=WAIT_S)
            ids[plane] = (trace_id, span_id, bad_trace)
            details[plane] = exc.value.details()
        spans = receiver.wait_for(
            lambda s: all(otel._request_span(s, t) is not None and otel._request_span(s, b) is not None
                          for t, _p, b in ids.values()) and len(otel._batch_spans(s)) >= 2,
            "both planes' request spans and batch spans")
        lines = {line["request_id"]: line for line in _wait_lines(proc, 4)}
    finally:
        proc.stop()
        receiver.stop()
    seen = {}
    for plane, (trace_id, parent_id, bad_trace) in ids.items():
        span = otel._request_span(spans, trace_id)
        assert span.parent_span_id == parent_id and span.kind == span.SPAN_KIND_SERVER
        assert span.start_time_unix_nano <= span.end_time_unix_nano
        assert lines[f"{plane}-ok"]["trace_id"] == trace_id.hex()
        batch = [b for b in otel._batch_spans(spans) if any(link.span_id == span.span_id for link in b.links)]
        assert len(batch) == 1 and batch[0].trace_id == trace_id, (plane, otel._batch_spans(spans))
        assert batch[0].start_time_unix_nano <= batch[0].end_time_unix_nano
        failed = otel._request_span(spans, bad_trace)
        assert failed.status.code == failed.status.STATUS_CODE_ERROR
        assert failed.status.message == details[plane][:200]  # what the client was told
        seen[plane] = (otel._attrs(span), [e.name for e in span.events], otel._attrs(batch[0]),
                       otel._attrs(failed))
    python, ours = seen["python"], seen["native"]
    assert set(ours[0]) == set(python[0]) and set(ours[2]) == set(python[2]), (ours, python)
    same = ("attnserve.model", "attnserve.transport", "rpc.method", "attnserve.model_version", "attnserve.status",
            "attnserve.request_bytes", "attnserve.response_bytes", "http.response.status_code",
            "attnserve.batch_size", "attnserve.query_length", "attnserve.key_length")
    assert {k: ours[0][k] for k in same} == {k: python[0][k] for k in same}
    assert ours[1] == python[1]  # the events: admitted, dequeued, computed, encoded
    assert ours[3] == python[3]  # the refused call's span
    assert ours[2]["attnserve.batch.requests"] == 1 and ours[2]["attnserve.model"] == "self_attention"


def test_a_burst_over_the_record_buffer_drops_and_counts_records_and_the_plane_serves_on(model_repository):
    burst = 8
    with GatedServer(model_repository, "--data-plane", "native", "--access-log",
                     "--log-format", "json", "--max-batch-size", "16",
                     env={"ATTNSERVE_ACCESS_RECORDS_BUFFER": "2"}) as proc, \
            grpc.insecure_channel(f"127.0.0.1:{native_port(proc)}") as channel, \
            concurrent.futures.ThreadPoolExecutor(burst + 1) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        x = _inputs(1, 4)
        first = pool.submit(stub.ModelInfer, infer_request("self_attention", request_id="first", **x), timeout=WAIT_S)
        proc.gate.wait_started()  # held: the burst queues behind it and then runs as one batch
        futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", request_id=f"b-{i}", **x),
                               timeout=WAIT_S) for i in range(burst)]
        _wait_metric(proc, "attnserve_native_in_flight", burst + 1)
        proc.gate.release(2)
        first.result()
        assert proc.gate.wait_started() == burst  # one batch: its records come in one piece
        for future in futures:
            future.result()
        # That batch's records into a buffer of 2: at least burst - 2 of them dropped.
        _wait_metric(proc, "attnserve_access_records_dropped_total", burst - 2)
        proc.gate.release()
        stub.ModelInfer(infer_request("self_attention", request_id="after", **x), timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not any(line["request_id"] == "after" for line in _access_lines(proc)):
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.01)
        dropped = _sum(proc.scrape(), "attnserve_access_records_dropped_total")
    # Every call is either written or counted: first, the burst, after.
    assert len(_access_lines(proc)) + dropped == burst + 2, (dropped, _access_lines(proc))


def test_a_batchs_records_go_over_at_once_into_a_bounded_buffer(model_repository):
    """In-process, the test as the runner: 5 calls run as one batch, a buffer of 2 keeps 2
    records (with the access line's fields) and counts 3 dropped; nothing is kept unasked."""
    from attnserve.server.config import ServerConfig
    from attnserve.server.native_records import RECORD_FIELDS
    from attnserve.server.repository import read_model_spec

    spec = read_model_spec(model_repository / "self_attention")
    cfg = ServerConfig()
    unasked = native.new_plane()
    assert unasked.records_fd() == -1 and unasked.records_dropped() == 0
    assert unasked.take_arrivals_and_records() == ({}, [])
    plane = native.new_plane()
    plane.set_records(2)
    index = plane.add_model(spec.name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                            32, spec.max_q_len, spec.max_kv_len, cfg.max_attention_bytes, cfg.max_queue_size,
                            cfg.max_padding_ratio)
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
    calls = 5
    try:
        with (grpc.insecure_channel(f"127.0.0.1:{port}") as ch,
              concurrent.futures.ThreadPoolExecutor(calls) as pool):
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", request_id=f"r-{i}",
                                                                  **_inputs(1, 4)), timeout=60) for i in range(calls)]
            deadline = time.monotonic() + WAIT_S
            while plane.queued(index) < calls:
                assert time.monotonic() < deadline, f"{plane.queued(index)} of {calls} calls queued"
                time.sleep(0.005)
            batch = plane.next_batch(index, 1000)
            assert batch.requests == calls
            feeds = batch.feeds(spec.query_dim, spec.kv_dim)
            rows, q_len = feeds["query"].shape[:2]
            plane.complete(batch, np.zeros((rows, q_len, spec.out_dim), np.float32),
                           np.zeros((rows, spec.num_heads, q_len, batch.k_len), np.float32))
            for future in futures:
                future.result()
    finally:
        plane.stop(1.0)
    records = [dict(zip(RECORD_FIELDS, r, strict=True)) for r in plane.take_arrivals_and_records()[1]]
    assert len(records) == 2 and plane.records_dropped() == calls - 2
    for r in records:
        assert (r["traced"], r["method"], r["model"], r["version"], r["code"]) == (
            True, "ModelInfer", b"self_attention", str(spec.version).encode(), 0)
        assert r["request_id"].startswith(b"r-") and r["peer"].startswith(b"ipv4:127.0.0.1:")
        assert r["batch"] == batch.id and r["batch_requests"] == calls and (r["rows"], r["q_len"]) == (1, 4)
        assert 0 < r["start_ns"] <= r["admitted_ns"] <= r["run_start_ns"] <= r["run_end_ns"] <= r["end_ns"]
        assert r["queue_s"] >= 0 and r["run_s"] > 0 and r["bytes_in"] > 0 and r["bytes_out"] > 0
        assert abs(r["start_ns"] - time.time_ns()) < 3600e9  # the epoch clock, not the plane's steady one
    assert plane.take_arrivals_and_records()[1] == []
