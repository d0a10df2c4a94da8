"""One gRPC port with the native data plane (native/relay.h, docs/native-data-plane.md "One port").

Against a real `attnserve serve --data-plane native`: the plane listens on --port, and every call
it does not serve itself (health, reflection, load and unload, shared memory; ModelInfer requests
with shared-memory parameters or while calls are recorded) is relayed to the Python server on a
private Unix socket, with the caller's metadata, deadline and cancellation. Held work waits at
tests/gated_server.py's gate, never on a guess of the machine's speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.gated_server import GatedServer
from tests.oip import CASES, WIDTHS, infer_request, outputs_of, random_inputs
from tests.seed_reference import served_references
from tests.server_process import ServerProcess
from tests.test_cancellation import _metrics, _sample, _wait_metric
from tests.test_shared_memory import _check, _Regions, _shm_infer, _want

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

NATIVE = ("--data-plane", "native")
MODEL = "self_attention"
WAIT_S = 60.0  # a bound on waiting for a state, not a guess of speed
SERVICE = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES = 4 << 20


def _x(rng, lq: int = 4) -> np.ndarray:
    return rng.standard_normal((1, lq, 512), dtype=np.float32)


def _request(x: np.ndarray) -> pb.ModelInferRequest:
    return infer_request(MODEL, query=x, key=x, value=x)


@pytest.fixture(scope="module")
def native_server(model_repository):
    proc = ServerProcess(model_repository, *NATIVE, "--allow-shared-memory", "--model-control-mode", "explicit",
                         "--max-message-bytes", str(MAX_MESSAGE_BYTES))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def references(eager_modules):
    return served_references(eager_modules)


@pytest.fixture()
def regions():
    with _Regions() as create:
        yield create


def test_one_port_the_python_server_listens_on_a_private_socket_only(native_server):
    log = native_server.log()
    assert "data plane native, python behind it on unix:" in log
    socket_path = log.split("python behind it on unix:", 1)[1].split(",", 1)[0]
    assert os.stat(os.path.dirname(socket_path)).st_mode & 0o777 == 0o700
    with native_server.channel() as channel:  # ServerLive (native) and RepositoryIndex (relayed) on the one port
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S).live
        assert {m.name for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=WAIT_S).models} >= {MODEL}


def test_health_check_and_reflection_are_relayed(native_server):
    assert native_server.health() == health_pb2.HealthCheckResponse.SERVING
    assert native_server.health(SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with native_server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=WAIT_S))
    services = {s.name for s in answers[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_load_and_unload_on_the_port_change_what_model_infer_serves(native_server):
    x = _x(np.random.default_rng(1))
    with native_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        before = outputs_of(stub.ModelInfer(_request(x), timeout=WAIT_S))["output"]
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=MODEL), timeout=WAIT_S)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(_request(x), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "unloaded" in exc.value.details()
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=WAIT_S)
        np.testing.assert_array_equal(outputs_of(stub.ModelInfer(_request(x), timeout=WAIT_S))["output"], before)


def _output_region(address: str, regions, name: str, size: int):
    """A system shared-memory region of `size` bytes registered on the server as `name`, and a
    function making a ModelInfer request for x whose output goes there (the plane relays it)."""
    handle = regions(name, size)
    client = grpcclient.InferenceServerClient(url=address)
    try:
        client.register_system_shared_memory(name, handle._shm_key, size)
    finally:
        client.close()

    def relayed(x: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
        request = infer_request(MODEL, request_id=request_id, query=x, key=x, value=x)
        out = request.outputs.add(name="output")
        out.parameters["shared_memory_region"].string_param = name
        out.parameters["shared_memory_byte_size"].int64_param = size
        return request

    return handle, relayed


def test_shared_memory_requests_go_to_the_python_path_and_equal_the_eager_answer(native_server, regions, references):
    client = grpcclient.InferenceServerClient(url=native_server.address)
    try:
        client.unregister_system_shared_memory()
        rng = np.random.default_rng(2)
        for case, (model, b, lq, lk, masked) in CASES.items():
            x = random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=masked)
            _check(_shm_infer(grpcclient, client, model, x, regions, tag=case), _want(references[model], x), case)
            client.unregister_system_shared_memory()
        status = client.get_system_shared_memory_status(as_json=True)
        assert not status.get("regions")
    finally:
        client.close()


def test_a_relayed_call_s_deadline_and_cancellation_reach_python(model_repository, regions):
    """ModelInfer calls whose output goes to a shared-memory region are relayed to the Python
    request path: a queued one whose deadline passes, and one the client cancels, leave the Python
    batcher's queue while the batch ahead of them is held."""
    import tritonclient.utils.shared_memory as shm

    rng = np.random.default_rng(3)
    x = _x(rng)
    size = x.nbytes  # (1, 4, 512) FP32 output, the query's size
    with GatedServer(model_repository, *NATIVE, "--allow-shared-memory") as server, server.channel() as channel:
        handle, relayed = _output_region(server.address, regions, "relay-out", size)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        held = stub.ModelInfer.future(relayed(x), timeout=WAIT_S)
        assert server.gate.wait_started() == 1
        late = stub.ModelInfer.future(relayed(x), timeout=5.0)
        _wait_metric(server, "attnserve_queue_depth", 1, model=MODEL)  # the Python batcher's queue
        with pytest.raises(grpc.RpcError) as exc:
            late.result()
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_metric(server, "attnserve_queue_depth", 0, model=MODEL)
        gone = stub.ModelInfer.future(relayed(x), timeout=WAIT_S)
        _wait_metric(server, "attnserve_queue_depth", 1, model=MODEL)
        gone.cancel()
        _wait_metric(server, "attnserve_queue_depth", 0, model=MODEL)
        _wait_metric(server, "attnserve_cancelled_requests_total", 1, model=MODEL, reason="client", stage="queued")
        assert not server.gate.has_started()
        server.gate.release()
        answer = held.result()
        assert [o.name for o in answer.outputs] == ["output"] and not any(answer.raw_output_contents)  # in the region
        got = shm.get_contents_as_numpy(handle, np.float32, [1, 4, 512])
        assert np.isfinite(got).all() and np.abs(got).sum() > 0
        text = _metrics(server)
        assert _sample(text, "attnserve_requests_total", model=MODEL, code="OK") == 1


def test_metadata_reaches_python_and_a_client_sent_peer_is_not_trusted(model_repository, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    x = _x(np.random.default_rng(4))
    proc = ServerProcess(model_repository, *NATIVE, "--auth-token-file", str(token), "--access-log")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert proc.health() == health_pb2.HealthCheckResponse.SERVING  # open without the token
            for call, request in ((stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest()),
                                  (stub.ModelInfer, _request(x))):
                with pytest.raises(grpc.RpcError) as exc:
                    call(request, timeout=WAIT_S)
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The token passes the plane and reaches the Python server's own check in the relayed metadata.
            with pytest.raises(grpc.RpcError) as exc:  # shared memory is off: Python's own answer
                stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=WAIT_S,
                                              metadata=[("authorization", "Bearer s3cret")])
            assert exc.value.code() != grpc.StatusCode.UNAUTHENTICATED, exc.value
            stub.ModelInfer(_request(x), timeout=WAIT_S,
                            metadata=[("authorization", "Bearer s3cret"), ("x-attnserve-peer", "ipv4:6.6.6.6:1")])
        log = proc.wait_for_log("method=ModelInfer", 2)  # the refusal's line and the call's
        line = next(line for line in log.splitlines() if "method=ModelInfer" in line and "status=OK" in line)
        assert "peer=ipv4:127.0.0.1:" in line and "6.6.6.6" not in log, line
    finally:
        proc.stop()


def test_a_streams_relayed_request_is_logged_as_the_stream_s_and_a_client_sent_method_is_not_trusted(
        model_repository, regions):
    """A stream's request with a shared-memory output, relayed to Python as a ModelInfer call: its
    access line says ModelStreamInfer, as the Python port's does; a unary call's header naming
    another method is dropped by the plane."""
    from tests.test_native_records import _wait_lines

    x = _x(np.random.default_rng(6))
    size = x.nbytes
    proc = ServerProcess(model_repository, *NATIVE, "--allow-shared-memory", "--access-log", "--log-format", "json")
    try:
        _, relayed = _output_region(proc.address, regions, "relay-stream-out", size)
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            (answer,) = stub.ModelStreamInfer(iter([relayed(x, "in-a-stream")]), timeout=WAIT_S)
            assert not answer.error_message and answer.infer_response.id == "in-a-stream"
            stub.ModelInfer(relayed(x, "unary"), timeout=WAIT_S, metadata=[("x-attnserve-method", "Forged")])
        lines = {line["request_id"]: line for line in _wait_lines(proc, 2) if line["request_id"]}
        assert (lines["in-a-stream"]["method"], lines["in-a-stream"]["status"]) == ("ModelStreamInfer", "OK"), lines
        assert (lines["unary"]["method"], lines["unary"]["status"]) == ("ModelInfer", "OK"), lines
        assert "Forged" not in proc.log()
    finally:
        proc.stop()


def test_bad_messages_to_a_relayed_method_get_clean_errors_and_the_server_serves_on(native_server):
    x = _x(np.random.default_rng(5))
    with native_server.channel() as channel:
        load = channel.unary_unary(f"/{SERVICE}/RepositoryModelLoad")  # bytes as they are
        with pytest.raises(grpc.RpcError) as exc:
            load(b"\xff\xfe garbage \x00", timeout=WAIT_S)
        assert exc.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.DEADLINE_EXCEEDED), exc.value
        with pytest.raises(grpc.RpcError) as exc:
            load(b"x" * (MAX_MESSAGE_BYTES + 1024), timeout=WAIT_S)  # over --max-message-bytes
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        unknown = channel.unary_unary("/no.Such/Method")
        with pytest.raises(grpc.RpcError) as exc:
            unknown(b"", timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert outputs_of(stub.ModelInfer(_request(x), timeout=WAIT_S))["output"].shape == (1, 4, 512)
    assert native_server.health() == health_pb2.HealthCheckResponse.SERVING


_WATCHER = """
import sys, threading, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
print(next(watch).status, flush=True)
hold = threading.Event()
def requests():
    yield reflection_pb2.ServerReflectionRequest(list_services="")
    hold.wait()  # the stream stays open, sending nothing more
answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests())
print(len(next(answers).list_services_response.service), flush=True)
sys.stdin.read()  # held open until killed
"""


def test_watch_sees_the_drain_and_a_client_gone_mid_stream_leaves_nothing_behind(model_repository):
    proc = ServerProcess(model_repository, *NATIVE)
    try:
        # A client killed while its Watch and its reflection stream are open: the server serves on.
        client = subprocess.Popen([sys.executable, "-c", _WATCHER, proc.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == str(health_pb2.HealthCheckResponse.SERVING)
        assert int(client.stdout.readline()) >= 3
        client.kill()
        client.wait()
        with proc.channel() as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=WAIT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert proc.health() == health_pb2.HealthCheckResponse.SERVING
            started = time.monotonic()
            proc.signal()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert list(watch) == []  # then the stream ends, with OK
        assert proc.wait(timeout=WAIT_S) == 0
        # The relayed streams held nothing: the plane's stop did not wait out its grace for them.
        assert time.monotonic() - started < 10.0, proc.log()
        assert "watch stream(s) ended" in proc.log()
    finally:
        proc.stop()
