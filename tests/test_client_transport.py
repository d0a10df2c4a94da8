"""The client's transport rules over real gRPC on loopback, against a small scripted servicer.

The scripted servicer is a real grpc server (real HTTP/2, real TLS): it is used where the real
server cannot be made to behave on cue: answer UNAVAILABLE exactly n times, stall past a deadline,
record the metadata it received, and serve TLS with a client-certificate check.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from attnserve.client import AsyncInferenceClient, InferenceClient, InferenceError, RetryPolicy, TlsConfig
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc

from tests.tls_certs import Pki, make_pki

pytestmark = pytest.mark.e2e  # starts scripted gRPC servers

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)


class ScriptedServicer(pb_grpc.GRPCInferenceServiceServicer):
    """ModelInfer echoes `query` as `output`, after failing the first `fail_times` calls with `code`."""

    def __init__(self, fail_times: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 hold: threading.Event | None = None) -> None:
        """hold: ModelInfer waits for this event (set by the test) before it answers."""
        self.fail_times, self.code, self.hold = fail_times, code, hold
        self.calls = 0
        self.arrived = threading.Event()  # set once a ModelInfer call has come
        self.metadata: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def ModelInfer(self, request, context):
        with self._lock:
            self.calls += 1
            call = self.calls
            self.metadata.append(dict(context.invocation_metadata()))
        self.arrived.set()
        if call <= self.fail_times:
            if self.code == grpc.StatusCode.CANCELLED:
                context.cancel()  # what gRPC's core does to a call that arrives as its stop begins
                return pb.ModelInferResponse()
            context.abort(self.code, f"scripted failure {call}")
        if self.hold is not None:
            self.hold.wait(60)
        query = request.inputs[0]
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="7")
        response.outputs.add(name="output", datatype="FP32", shape=query.shape)
        response.raw_output_contents.append(request.raw_input_contents[0])
        return response

    def ServerLive(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.ServerLiveResponse(live=True)


def _serve(servicer, credentials=None, host="127.0.0.1"):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    address = f"{host}:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    return server, port


@pytest.fixture
def scripted():
    started = []

    def start(servicer, **kw):
        server, port = _serve(servicer, **kw)
        started.append(server)
        return port

    yield start
    for server in started:
        server.stop(grace=None)


Q = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
KV = np.ones((2, 5, 4), dtype=np.float32)


def test_unavailable_is_retried_and_counted(scripted):
    servicer = ScriptedServicer(fail_times=2)
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
        out = client.infer("m", Q, KV, KV)
        np.testing.assert_array_equal(out["output"], Q)
        assert client.retry_count == 2 and servicer.calls == 3


def test_retries_stop_at_max_attempts(scripted):
    servicer = ScriptedServicer(fail_times=100)
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("m", Q, KV, KV)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and exc.value.details == "scripted failure 4"
    assert servicer.calls == 4


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INTERNAL])
def test_other_errors_are_not_retried(scripted, code):
    servicer = ScriptedServicer(fail_times=1, code=code)
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("m", Q, KV, KV)
        assert client.retry_count == 0
    assert exc.value.code == code and servicer.calls == 1


def test_a_call_the_server_cancelled_is_sent_again(scripted):
    """CANCELLED from the server (gRPC core's answer to a call that arrives as its stop begins)
    is retried like UNAVAILABLE."""
    servicer = ScriptedServicer(fail_times=1, code=grpc.StatusCode.CANCELLED)
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
        np.testing.assert_array_equal(client.infer("m", Q, KV, KV)["output"], Q)
        assert client.retry_count == 1 and servicer.calls == 2


def test_a_call_the_client_cancelled_by_closing_is_not_sent_again(scripted):
    """close() while a call is in flight cancels it (CANCELLED): that one is raised, not retried."""
    hold = threading.Event()
    servicer = ScriptedServicer(hold=hold)
    port = scripted(servicer)
    client = InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.infer("m", Q, KV, KV)
        except BaseException as err:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert servicer.arrived.wait(30), "the call never reached the server"
        client.close()
        caller.join(30)
        assert not caller.is_alive(), "the cancelled call hangs"
    finally:
        hold.set()
    assert len(outcome) == 1 and isinstance(outcome[0], InferenceError), outcome
    assert outcome[0].code == grpc.StatusCode.CANCELLED
    assert client.retry_count == 0 and servicer.calls == 1


def test_infer_async_retries_unavailable_by_the_same_policy(scripted):
    servicer = ScriptedServicer(fail_times=2)
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
        call = client.infer_async("m", Q, KV, KV)
        np.testing.assert_array_equal(call.result(timeout=30)["output"], Q)
        assert client.retry_count == 2 and servicer.calls == 3 and call.done() and not call.cancelled()


def test_infer_async_cancel_stops_the_retries_too(scripted):
    """The first attempt is refused (UNAVAILABLE); the retry is held by the server: cancel() ends
    it, and no attempt follows (the servicer saw two calls, the client no third)."""
    hold = threading.Event()
    servicer = ScriptedServicer(fail_times=1, hold=hold)
    port = scripted(servicer)
    try:
        with InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
            call = client.infer_async("m", Q, KV, KV)
            deadline = time.monotonic() + 30
            while servicer.calls < 2 and time.monotonic() < deadline:  # the retry has reached the server
                time.sleep(0.01)
            assert servicer.calls == 2
            assert call.cancel()
            with pytest.raises(InferenceError) as exc:
                call.result(timeout=30)
            assert exc.value.code == grpc.StatusCode.CANCELLED and client.retry_count == 1
    finally:
        hold.set()
    assert servicer.calls == 2


def test_infer_async_after_close_fails_cancelled_and_is_not_sent(scripted):
    servicer = ScriptedServicer()
    port = scripted(servicer)
    client = InferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY)
    client.close()
    call = client.infer_async("m", Q, KV, KV)
    with pytest.raises(InferenceError) as exc:
        call.result(timeout=30)
    assert exc.value.code == grpc.StatusCode.CANCELLED and "closed" in exc.value.details
    assert servicer.calls == 0


def test_async_client_retries_the_same_way(scripted):
    servicer = ScriptedServicer(fail_times=1)
    port = scripted(servicer)

    async def main():
        async with AsyncInferenceClient(f"127.0.0.1:{port}", retry=FAST_RETRY) as client:
            out = await client.infer("m", Q, KV, KV)
            return out, client.retry_count

    out, retries = asyncio.run(main())
    np.testing.assert_array_equal(out["output"], Q)
    assert retries == 1 and servicer.calls == 2


def test_the_deadline_covers_the_call_and_can_be_overridden(scripted):
    """The server holds the call until the test releases it: the client's 0.2 s deadline ends it
    (well before the server's hold of up to 60 s), and a per-call timeout overrides the default."""
    hold = threading.Event()
    port = scripted(ScriptedServicer(hold=hold))
    try:
        with InferenceClient(f"127.0.0.1:{port}", timeout_s=0.2) as client:
            started = time.monotonic()
            with pytest.raises(InferenceError) as exc:
                client.infer("m", Q, KV, KV)
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 30, "the deadline did not end the call"
            hold.set()
            assert client.infer("m", Q, KV, KV, timeout_s=30)["output"].shape == Q.shape  # per-call override
    finally:
        hold.set()


def test_bearer_token_is_sent_on_every_call(scripted):
    servicer = ScriptedServicer()
    port = scripted(servicer)
    with InferenceClient(f"127.0.0.1:{port}", token="t0ken") as client:
        client.server_live()
        client.infer("m", Q, KV, KV)
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer t0ken", "Bearer t0ken"]
    assert servicer.metadata[0]["user-agent"].startswith("attnserve-client/")


def test_a_malformed_response_is_an_inference_error(scripted):
    class Short(ScriptedServicer):
        def ModelInfer(self, request, context):
            response = super().ModelInfer(request, context)
            response.raw_output_contents[0] = response.raw_output_contents[0][:-1]
            return response

    port = scripted(Short())
    with InferenceClient(f"127.0.0.1:{port}") as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("m", Q, KV, KV)
    assert exc.value.code == grpc.StatusCode.INTERNAL and "expected 96 bytes, got 95" in exc.value.details


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Pki:
    """A CA, a server certificate for localhost, and a client certificate (tests/tls_certs.py, as
    test_security.py makes them: a machine without openssl fails these tests, it does not skip them)."""
    return make_pki(tmp_path_factory.mktemp("tls"))


def test_certificates_without_openssl_fail_rather_than_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no openssl on it
    with pytest.raises(RuntimeError, match="openssl command, which is not on PATH"):
        make_pki(tmp_path / "pki")


@pytest.fixture
def mtls_port(scripted, certs):
    credentials = grpc.ssl_server_credentials(
        [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(), require_client_auth=True)
    return scripted(ScriptedServicer(), credentials=credentials)


def test_mtls_round_trip(certs, mtls_port):
    tls = TlsConfig(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
    with InferenceClient(f"localhost:{mtls_port}", tls=tls, timeout_s=5) as client:
        np.testing.assert_array_equal(client.infer("m", Q, KV, KV)["output"], Q)
    # An IP literal in the url, the certificate's name given separately.
    tls_by_ip = TlsConfig(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key,
                          server_name="localhost")
    with InferenceClient(f"127.0.0.1:{mtls_port}", tls=tls_by_ip, timeout_s=5) as client:
        assert client.server_live()


def test_mtls_refuses_a_client_without_a_certificate(certs, mtls_port):
    with InferenceClient(f"localhost:{mtls_port}", tls=TlsConfig(ca_file=certs.ca), timeout_s=5,
                         retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(InferenceError) as exc:
            client.server_live()
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_refuses_a_server_certificate_for_another_name(certs, mtls_port):
    tls = TlsConfig(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key,
                    server_name="not-localhost")
    with InferenceClient(f"localhost:{mtls_port}", tls=tls, timeout_s=5, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(InferenceError) as exc:
            client.server_live()
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
