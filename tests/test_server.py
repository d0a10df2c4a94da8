"""End-to-end: a real server process on loopback, real ONNX Runtime, the generated stubs."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs

TOLERANCE = 1e-5
DIMS = {"self_attention": (512, 512, 8), "cross_attention": (32, 32, 2)}  # q_dim, kv_dim, heads


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _inputs(model, rng, b, lq, lk, **kw):
    q_dim, kv_dim, _ = DIMS[model]
    return random_inputs(rng, b, lq, lk, q_dim, kv_dim, **kw)


def _assert_close(got: dict, want: dict, names=("output", "attn_probs")):
    for name in names:
        assert got[name].shape == want[name].shape, name
        err = float(np.max(np.abs(got[name] - want[name])))
        assert err <= TOLERANCE, f"{name}: max abs error {err}"


# -- health, metadata, extensions -----------------------------------------------------------

def test_live_ready_and_metadata(stub):
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "attnserve" and meta.version
    assert {"model_configuration", "statistics"} <= set(meta.extensions)
    for model, (q_dim, kv_dim, heads) in DIMS.items():
        assert stub.ModelReady(pb.ModelReadyRequest(name=model)).ready
        assert stub.ModelReady(pb.ModelReadyRequest(name=model, version="1")).ready
        m = stub.ModelMetadata(pb.ModelMetadataRequest(name=model))
        assert m.name == model and list(m.versions) == ["1"] and m.platform == "onnxruntime_onnx"
        assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == [
            ("query", "FP32", [-1, -1, q_dim]), ("key", "FP32", [-1, -1, kv_dim]),
            ("value", "FP32", [-1, -1, kv_dim]), ("mask", "BOOL", [-1, -1, -1])]
        assert [(t.name, list(t.shape)) for t in m.outputs] == [
            ("output", [-1, -1, q_dim]), ("attn_probs", [-1, heads, -1, -1])]


def test_repository_index(stub):
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
        ("cross_attention", "1", "READY", ""), ("self_attention", "1", "READY", "")]
    assert len(stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True)).models) == 2
    with pytest.raises(grpc.RpcError) as exc:
        stub.RepositoryIndex(pb.RepositoryIndexRequest(repository_name="elsewhere"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "unknown repository" in exc.value.details()


def test_model_config_and_statistics(stub):
    config = stub.ModelConfig(pb.ModelConfigRequest(name="self_attention")).config
    assert config.name == "self_attention" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 0  # batch dims are explicit
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("query", pb.TYPE_FP32, [-1, -1, 512], False), ("key", pb.TYPE_FP32, [-1, -1, 512], False),
        ("value", pb.TYPE_FP32, [-1, -1, 512], False), ("mask", pb.TYPE_BOOL, [-1, -1, -1], True)]
    before = stub.ModelStatistics(pb.ModelStatisticsRequest(name="cross_attention")).model_stats[0]
    x = _inputs("cross_attention", np.random.default_rng(0), 3, 4, 5)
    stub.ModelInfer(infer_request("cross_attention", **x))
    after = stub.ModelStatistics(pb.ModelStatisticsRequest(name="cross_attention")).model_stats[0]
    assert after.name == "cross_attention" and after.version == "1"
    assert after.inference_count == before.inference_count + 3  # rows
    assert after.execution_count == before.execution_count + 1
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    everything = stub.ModelStatistics(pb.ModelStatisticsRequest())
    assert sorted(s.name for s in everything.model_stats) == sorted(DIMS)


def test_health_service(server):
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    for model in DIMS:
        assert server.health(model) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as exc:
        server.health("no_such_model")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_and_list_through_the_gate(server):
    """Watch (unary-stream) streams the status and parses its own message; List, which
    grpc_health's aio servicer does not implement, is UNIMPLEMENTED without a logged traceback."""
    log_before = len(server.log())
    with server.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        garbage = channel.unary_stream("/grpc.health.v1.Health/Watch")(b"\xff\xff not a request", timeout=10)
        with pytest.raises(grpc.RpcError) as malformed:
            next(garbage)
        with pytest.raises(grpc.RpcError) as listed:
            # By its path: the stubs of older grpcio-health-checking releases have no List.
            channel.unary_unary("/grpc.health.v1.Health/List")(b"", timeout=10)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in malformed.value.details()
    assert listed.value.code() == grpc.StatusCode.UNIMPLEMENTED
    new_log = server.log()[log_before:]
    assert "Traceback" not in new_log, new_log[-3000:]


def test_reflection_lists_services(server):
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_reflection_describes_every_service(server):
    # Our stubs live in a private descriptor pool (attnserve.proto.generate); reflection must still
    # hand out the file of every service it lists, as grpcurl's `describe` asks for it.
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        services = [s.name for s in listed.list_services_response.service]
        replies = list(stub.ServerReflectionInfo(iter(
            [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in services])))
    assert len(replies) == len(services) >= 3
    for name, reply in zip(services, replies, strict=True):
        assert reply.WhichOneof("message_response") == "file_descriptor_response", (name, reply.error_response)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in reply.file_descriptor_response.file_descriptor_proto]
        package, _, service = name.rpartition(".")
        assert any(f.package == package and service in {s.name for s in f.service} for f in files), name
    ours = next(r for n, r in zip(services, replies, strict=True) if n == "inference.GRPCInferenceService")
    (inference_file,) = [descriptor_pb2.FileDescriptorProto.FromString(b)
                         for b in ours.file_descriptor_response.file_descriptor_proto]
    assert inference_file.name == pb.DESCRIPTOR.name
    assert {"ModelInferRequest", "RepositoryIndexResponse"} <= {m.name for m in inference_file.message_type}


# -- inference and parity -------------------------------------------------------------------

@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_parity_with_eager(stub, eager_modules, model, raw, masked):
    rng = np.random.default_rng(zlib.crc32(f"{model} {raw} {masked}".encode()))  # fixed: hash() is salted
    b, lq, lk = (4, 256, 77) if model == "cross_attention" else (2, 10, 7)
    x = _inputs(model, rng, b, lq, lk, masked=masked, fully_masked_row=masked)
    response = stub.ModelInfer(infer_request(model, raw=raw, request_id="r-1", **x))
    assert response.id == "r-1" and response.model_name == model and response.model_version == "1"
    assert bool(response.raw_output_contents) == raw  # answered the way it was asked
    _assert_close(outputs_of(response), eager(eager_modules[model], **x))


def test_output_selection(stub, eager_modules):
    x = _inputs("self_attention", np.random.default_rng(1), 1, 5, 6, masked=True)
    want = eager(eager_modules["self_attention"], **x)
    only = outputs_of(stub.ModelInfer(infer_request("self_attention", outputs=("output",), **x)))
    assert list(only) == ["output"]
    _assert_close(only, want, names=("output",))
    probs = outputs_of(stub.ModelInfer(infer_request("self_attention", outputs=("attn_probs",), **x)))
    assert list(probs) == ["attn_probs"]
    _assert_close(probs, want, names=("attn_probs",))
    both = outputs_of(stub.ModelInfer(infer_request("self_attention", **x)))
    assert list(both) == ["output", "attn_probs"]


def test_request_over_grpc_default_message_size(stub, eager_modules):
    """4 x 200 x 512 float32 in three tensors is 4.9 MB: over gRPC's 4 MiB default."""
    x = _inputs("self_attention", np.random.default_rng(2), 4, 200, 200)
    response = stub.ModelInfer(infer_request("self_attention", outputs=("output",), **x))
    _assert_close(outputs_of(response), eager(eager_modules["self_attention"], **x), names=("output",))


def test_concurrent_mixed_lengths_equal_unbatched(server, stub, eager_modules):
    """Concurrent requests of different lengths and masks are batched (padding + masking) and
    each still equals its own unbatched eager result."""
    rng = np.random.default_rng(3)
    cases = []
    for i in range(48):
        lq, lk = int(rng.integers(1, 24)), int(rng.integers(1, 24))
        cases.append(_inputs("self_attention", rng, int(rng.integers(1, 3)), lq, lk,
                             masked=i % 3 == 0, fully_masked_row=i % 7 == 0))
    before = _metric(server, "attnserve_batch_requests_count", "self_attention")
    before_sum = _metric(server, "attnserve_batch_requests_sum", "self_attention")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda x: stub.ModelInfer(infer_request("self_attention", **x)), cases))
    for x, response in zip(cases, responses, strict=True):
        _assert_close(outputs_of(response), eager(eager_modules["self_attention"], **x))
    runs = _metric(server, "attnserve_batch_requests_count", "self_attention") - before
    merged = _metric(server, "attnserve_batch_requests_sum", "self_attention") - before_sum
    assert merged == 48
    assert runs < 48, "no batch of more than one request formed under concurrent load"


def test_stream_infer_answers_in_order(stub, eager_modules):
    rng = np.random.default_rng(4)
    good = [_inputs("cross_attention", rng, 1, 8, 3) for _ in range(2)]
    requests = [infer_request("cross_attention", request_id="a", **good[0]),
                infer_request("cross_attention", request_id="bad", query=good[0]["query"]),
                infer_request("cross_attention", request_id="b", **good[1])]
    responses = list(stub.ModelStreamInfer(iter(requests)))
    assert [r.infer_response.id for r in responses] == ["a", "bad", "b"]
    assert responses[1].error_message.startswith("INVALID_ARGUMENT") and "key" in responses[1].error_message
    for x, r in zip(good, (responses[0], responses[2]), strict=True):
        assert not r.error_message
        _assert_close(outputs_of(r.infer_response), eager(eager_modules["cross_attention"], **x))


# -- errors ---------------------------------------------------------------------------------

def _bad_requests():
    rng = np.random.default_rng(5)
    x = _inputs("self_attention", rng, 2, 3, 4)
    q, k, v = x["query"], x["key"], x["value"]
    mask = np.ones((2, 3, 4), dtype=np.bool_)
    short_raw = infer_request("self_attention", query=q, key=k, value=v)
    short_raw.raw_input_contents[1] = short_raw.raw_input_contents[1][:-4]
    typed_short = infer_request("self_attention", raw=False, query=q, key=k, value=v)
    del typed_short.inputs[0].contents.fp32_contents[-1]
    mixed = infer_request("self_attention", query=q, key=k, value=v)
    mixed.inputs[0].contents.fp32_contents.extend(q.ravel().tolist())
    huge = infer_request("self_attention", query=q, key=k, value=v)
    huge.inputs[0].shape[:] = [2, 1 << 20, 512]
    # Typed contents over --max-typed-bytes (4 MiB): a 4.5 MB typed query; a 5.1 MB typed answer.
    wide = np.zeros((2, 1100, 512), np.float32)
    typed_inputs = infer_request("self_attention", raw=False, query=wide, key=wide[:, :1], value=wide[:, :1])
    x400 = np.zeros((1, 400, 512), np.float32)
    typed_answer = infer_request("self_attention", raw=False, outputs=("attn_probs",), query=x400, key=x400, value=x400)
    # The protocol's BOOL is one byte, 0 or 1: 0x02 and 0xFF are not BOOLs (numpy reads both as true).
    bool_bytes = {}
    for byte in (0x02, 0xFF):
        request = infer_request("self_attention", query=q, key=k, value=v, mask=mask)
        raw = bytearray(request.raw_input_contents[3])
        raw[5] = byte
        request.raw_input_contents[3] = bytes(raw)
        bool_bytes[f"mask byte 0x{byte:02X}"] = (request, f"'mask': BOOL bytes must be 0 or 1; byte 5 is 0x{byte:02X}")
    # Typed contents in a field not the input's datatype's: refused naming it, never ignored or read.
    foreign = {}
    in_bytes = infer_request("self_attention", raw=False, query=q, key=k, value=v)
    in_bytes.inputs[0].contents.ClearField("fp32_contents")
    in_bytes.inputs[0].contents.bytes_contents.append(q.tobytes())
    foreign["FP32 in bytes_contents"] = (in_bytes, "input 'query': contents.bytes_contents is not for datatype FP32: "
                                                   "its values go in contents.fp32_contents or raw_input_contents")
    beside = infer_request("self_attention", raw=False, query=q, key=k, value=v)  # fp32_contents whole, and more
    beside.inputs[1].contents.int64_contents.extend([1, 2])
    foreign["FP32 with int64_contents beside"] = (beside, "input 'key': contents.int64_contents is not for datatype "
                                                          "FP32")
    mask_fields = infer_request("self_attention", raw=False, query=q, key=k, value=v, mask=mask)
    mask_fields.inputs[3].contents.bytes_contents.append(b"\x01")
    mask_fields.inputs[3].contents.uint64_contents.append(1)
    foreign["BOOL with uint64_contents and bytes_contents"] = (
        mask_fields, "input 'mask': contents.uint64_contents is not for datatype BOOL: its values go in "
                     "contents.bool_contents or raw_input_contents")  # the first in field order
    raw_beside = infer_request("self_attention", query=q, key=k, value=v)
    raw_beside.inputs[2].contents.fp64_contents.append(1.0)
    foreign["raw with fp64_contents"] = (raw_beside, "input 'value': contents.fp64_contents is not for datatype FP32")
    return bool_bytes | foreign | {
        "missing key": (infer_request("self_attention", query=q, value=v), "'key'"),
        "unknown input": (infer_request("self_attention", query=q, key=k, value=v, bias=q), "'bias'"),
        "duplicate": (infer_request("self_attention", query=q, key=k, value=v), "more than once"),
        "dtype": (infer_request("self_attention", query=q.astype(np.bool_), key=k, value=v), "FP32"),
        "rank": (infer_request("self_attention", query=q[0], key=k, value=v), "rank 3"),
        "width": (infer_request("self_attention", query=q[..., :256].copy(), key=k, value=v), "512"),
        "batch": (infer_request("self_attention", query=q, key=k[:1].copy(), value=v), "batch size"),
        "k/v lengths": (infer_request("self_attention", query=q, key=k, value=v[:, :3].copy()), "length"),
        "mask shape": (infer_request("self_attention", query=q, key=k, value=v, mask=mask[:, :, :3].copy()), "mask"),
        "mask dtype": (infer_request("self_attention", query=q, key=k, value=v, mask=mask.astype(np.float32)), "BOOL"),
        "raw bytes": (short_raw, "bytes"),
        "typed count": (typed_short, "values"),
        "raw and typed": (mixed, "use one"),
        "unknown output": (infer_request("self_attention", outputs=("logits",), query=q, key=k, value=v), "'logits'"),
        "over limits": (huge, "max_q_len"),
        # Refused before protobuf parses it: the message's bytes besides raw_input_contents.
        "typed inputs over --max-typed-bytes": (
            typed_inputs, f"typed contents: the request holds {typed_inputs.ByteSize():,} bytes besides "
                          "raw_input_contents, over the 4,194,304-byte limit for typed contents (--max-typed-bytes); "
                          "send the inputs as raw_input_contents"),
        "typed answer over --max-typed-bytes": (
            typed_answer, f"its answer would hold {8 * 400 * 400 * 4:,} bytes of tensors as typed contents, over the "
                          "4,194,304-byte limit for typed contents (--max-typed-bytes); send the inputs as "
                          "raw_input_contents and the answer comes as raw_output_contents"),
    }


@pytest.mark.parametrize("case", sorted(_bad_requests()))
def test_bad_request_is_invalid_argument(stub, case):
    request, fragment = _bad_requests()[case]
    if case == "duplicate":
        request.inputs.add().CopyFrom(request.inputs[0])
        request.raw_input_contents.append(request.raw_input_contents[0])
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in exc.value.details()


def test_client_text_in_errors_is_echoed_bounded(stub):
    """A 1 MiB input name, model name or datatype comes back cut to a few hundred characters,
    marked as cut; the status stays the right one (gRPC clients report an oversized trailer as
    RESOURCE_EXHAUSTED, which docs/protocol.md calls 'queue full')."""
    q = np.zeros((1, 2, 512), np.float32)
    huge = "x" * (1 << 20)
    bad_name = infer_request("self_attention", query=q, key=q, value=q)
    bad_name.inputs[0].name = huge
    bad_type = infer_request("self_attention", query=q, key=q, value=q)
    bad_type.inputs[0].datatype = huge
    cases = [(bad_name, grpc.StatusCode.INVALID_ARGUMENT), (bad_type, grpc.StatusCode.INVALID_ARGUMENT),
             (infer_request(huge, query=q, key=q, value=q), grpc.StatusCode.NOT_FOUND),
             (infer_request("self_attention", version=huge, query=q, key=q, value=q), grpc.StatusCode.NOT_FOUND)]
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request)
        assert exc.value.code() == code
        assert len(exc.value.details()) < 1200 and "(cut: " in exc.value.details()


def test_unknown_model_and_version_are_not_found(stub):
    x = _inputs("cross_attention", np.random.default_rng(6), 1, 2, 2)
    for request in (infer_request("nope", **x), infer_request("cross_attention", version="9", **x)):
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    for call, request in ((stub.ModelMetadata, pb.ModelMetadataRequest(name="nope")),
                          (stub.ModelReady, pb.ModelReadyRequest(name="nope")),
                          (stub.ModelConfig, pb.ModelConfigRequest(name="cross_attention", version="9"))):
        with pytest.raises(grpc.RpcError) as exc:
            call(request)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_request_does_not_harm_its_batch(stub, eager_modules):
    """Good and bad requests sent together: the good ones are answered correctly."""
    rng = np.random.default_rng(7)
    good = [_inputs("self_attention", rng, 1, 6, 6) for _ in range(12)]
    bad = infer_request("self_attention", query=good[0]["query"], key=good[0]["key"],
                        value=good[0]["value"][:, :5].copy())
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(stub.ModelInfer, infer_request("self_attention", **x)) for x in good]
        bads = [pool.submit(stub.ModelInfer, bad) for _ in range(4)]
        for x, f in zip(good, goods, strict=True):
            _assert_close(outputs_of(f.result()), eager(eager_modules["self_attention"], **x))
        for f in bads:
            assert f.exception().code() == grpc.StatusCode.INVALID_ARGUMENT


# -- metrics --------------------------------------------------------------------------------

def _scrape(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def _metric(server, name: str, model: str, extra: str = "") -> float:
    pattern = rf'^{name}{{(?=[^}}]*model="{model}")(?=[^}}]*{extra})[^}}]*}} (\S+)$'
    values = [float(m.group(1)) for m in re.finditer(pattern, _scrape(server), re.M)]
    return sum(values)


def test_metrics_contract(server, stub):
    x = _inputs("cross_attention", np.random.default_rng(8), 1, 2, 3)
    stub.ModelInfer(infer_request("cross_attention", **x))
    with pytest.raises(grpc.RpcError):
        stub.ModelInfer(infer_request("cross_attention", query=x["query"]))
    text = _scrape(server)
    for name in ("attnserve_requests_total", "attnserve_request_duration_seconds_bucket",
                 "attnserve_queue_duration_seconds_bucket", "attnserve_compute_duration_seconds_bucket",
                 "attnserve_batch_requests_bucket", "attnserve_padding_ratio_bucket", "attnserve_queue_depth"):
        assert re.search(rf'^{name}{{[^}}]*model="cross_attention"', text, re.M), name
    assert _metric(server, "attnserve_requests_total", "cross_attention", 'code="OK"') >= 1
    assert _metric(server, "attnserve_requests_total", "cross_attention", 'code="INVALID_ARGUMENT"') >= 1


def test_one_stream_batches_its_requests_and_answers_in_order(model_repository, eager_modules):
    """Requests of one ModelStreamInfer stream are submitted as they arrive, so they share
    ONNX Runtime runs; the answers still come back in request order. A run is held at a gate
    until the rest of the requests wait in the queue, so they must share runs on any machine."""
    rng = np.random.default_rng(12)
    xs = [_inputs("cross_attention", rng, 1, 16, 9) for _ in range(24)]
    with GatedServer(model_repository) as proc, proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answers = pool.submit(lambda: list(stub.ModelStreamInfer(
                iter([infer_request("cross_attention", request_id=str(i), **x) for i, x in enumerate(xs)]),
                timeout=120)))
            # A stream reads its next request only once the first is answered (until then it does
            # not know what an answer holds of the memory budget): the first run goes alone.
            assert proc.gate.wait_started() == 1
            proc.gate.release()
            held = proc.gate.wait_started()  # the second run, held while the rest arrive and queue
            _wait_for_queue_depth(proc, "cross_attention", 23 - held)
            proc.gate.release(24)
            responses = answers.result(120)
        runs = 2
        while proc.gate.has_started():
            proc.gate.wait_started(0)
            runs += 1
    assert [r.infer_response.id for r in responses] == [str(i) for i in range(24)]
    for x, r in zip(xs, responses, strict=True):
        assert not r.error_message
        _assert_close(outputs_of(r.infer_response), eager(eager_modules["cross_attention"], **x))
    assert runs < 24, "the stream's requests never shared a run"


def _wait_for_queue_depth(proc: GatedServer, model: str, depth: int, timeout_s: float = 60.0) -> None:
    """Until the server's own gauge says `depth` requests wait in the model's queue (a state, not a guess)."""
    deadline = time.monotonic() + timeout_s
    line = f'attnserve_queue_depth{{model="{model}"}} '
    while (got := next((float(row[len(line):]) for row in proc.scrape().splitlines() if row.startswith(line)),
                       None)) != depth:
        assert time.monotonic() < deadline, f"queue depth {got}, expected {depth}"
        time.sleep(0.01)


def test_a_stream_message_that_does_not_parse_ends_it_after_the_answers_before_it(server):
    rng = np.random.default_rng(13)
    good = infer_request("cross_attention", request_id="first",
                         **_inputs("cross_attention", rng, 1, 4, 5)).SerializeToString()
    with server.channel() as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)
        answers = call(iter([good, b"\xff\xff not a request", good]), timeout=30)
        first = next(answers)
        assert first.infer_response.id == "first" and not first.error_message
        with pytest.raises(grpc.RpcError) as caught:
            next(answers)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in caught.value.details()


def test_a_stream_cancelled_midway_leaves_the_server_well(server, stub, eager_modules):
    rng = np.random.default_rng(14)
    x = _inputs("cross_attention", rng, 1, 64, 33)
    request = infer_request("cross_attention", **x)
    log_before = len(server.log())
    with server.channel() as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request] * 200), timeout=60)
        assert not next(call).error_message
        call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            for _ in call:
                pass
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    _assert_close(outputs_of(stub.ModelInfer(request, timeout=30)), eager(eager_modules["cross_attention"], **x))
    new_log = server.log()[log_before:]
    assert "Traceback" not in new_log and "never retrieved" not in new_log, new_log[-3000:]


def _reflection_v1_messages(tmp_path):
    """The canonical grpc.reflection.v1 proto (tests/protos: grpc/grpc-proto's file, as Debian's
    grpc-proto package ships it), compiled here with grpcio-tools: a real v1 client's messages
    and service, sharing nothing with the server's v1alpha code."""
    import importlib.util

    protoc = pytest.importorskip("grpc_tools.protoc")
    include = Path(__file__).parent / "protos"
    out = tmp_path / "v1"
    out.mkdir()
    assert protoc.main(["protoc", f"-I{include}", f"--python_out={out}",
                        str(include / "grpc/reflection/v1/reflection.proto")]) == 0
    # By path: `grpc.reflection.v1` would resolve inside grpcio's own `grpc` package.
    spec = importlib.util.spec_from_file_location("reflection_v1_pb2", out / "grpc/reflection/v1/reflection_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reflection_v1_as_grpcurl_and_postman_ask_it(server, tmp_path):
    """grpc.reflection.v1, beside v1alpha: list the services, then the file of each (ours with
    the repository RPCs, and v1's own)."""
    v1_pb2 = _reflection_v1_messages(tmp_path)
    service = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
    assert service.full_name == "grpc.reflection.v1.ServerReflection"
    with server.channel() as channel:
        info = channel.stream_stream(f"/{service.full_name}/ServerReflectionInfo",
                                     request_serializer=v1_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=v1_pb2.ServerReflectionResponse.FromString)
        (listed,) = info(iter([v1_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for s in listed.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        replies = list(info(iter([
            v1_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
            v1_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")]),
            timeout=10))
    files = [[descriptor_pb2.FileDescriptorProto.FromString(b)
              for b in r.file_descriptor_response.file_descriptor_proto]
             for r in replies]
    (inference,) = [f for f in files[0] if f.package == "inference"]
    assert {"RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"} <= {
        m.name for m in inference.service[0].method}
    (v1,) = [f for f in files[1] if f.package == "grpc.reflection.v1"]
    assert v1.name == "grpc/reflection/v1/reflection.proto"
    assert [m.input_type for m in v1.service[0].method] == [".grpc.reflection.v1.ServerReflectionRequest"]
