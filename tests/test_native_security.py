"""The native data plane's port with TLS, mutual TLS, bearer tokens and --workers.

The native port keeps the Python plane's promises (server.security, server.workers): the same
certificate and key (a plaintext call fails), client certificates required when a client CA is
given, every RPC (unknown ones too) refused UNAUTHENTICATED with the Python plane's words
without the exact `authorization: Bearer <token>` header, and the refusals logged. With
--workers 2 every worker serves its own native listener on the one native port: one channel
reaches one worker, a pool of channels reaches both (each call held at the gate, which names
its worker), and ModelStatistics and /metrics count every native call of both. Certificates
are made here by openssl (tests/tls_certs.py). Skips where the extension is not built.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.client import InferenceClient
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native
from attnserve.server.security import REFUSAL

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess
from tests.tls_certs import Pki, make_pki

WHY_NOT = native.why_unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

TOLERANCE = 1e-5
TOKEN = "attnserve-native-token-" + secrets.token_hex(16)  # no log line holds it by accident
MAX_CHANNELS = 40  # lanes tried to find the second worker (2 workers: 2**-39 to miss it)
# A refused handshake fails at once; this only keeps a slow machine's from reading as a deadline.
CALL_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(f"  {TOKEN}\n")  # surrounding whitespace is not part of the token
    path.chmod(0o600)
    return path


def _native_port(proc: ServerProcess) -> int:
    return proc.port


@pytest.fixture(scope="module")
def tls_server(model_repository, pki, token_file):
    """TLS and a token, logging all it can: the token must never show."""
    proc = ServerProcess(model_repository, "--data-plane", "native",
                         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--auth-token-file", str(token_file), "--log-level", "DEBUG", "--access-log", "true",
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    proc.native_port = _native_port(proc)
    yield proc
    assert proc.stop() == 0
    assert TOKEN not in proc.log()


@pytest.fixture(scope="module")
def mtls_server(model_repository, pki):
    proc = ServerProcess(model_repository, "--data-plane", "native",
                         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--tls-client-ca", str(pki.ca),
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                                  pki.client_cert.read_bytes()))
    proc.native_port = _native_port(proc)
    yield proc
    assert proc.stop() == 0


def _channel(port: int, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
               ("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, never another test's
    if credentials is None:
        return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                               options=[*options, ("grpc.ssl_target_name_override", "localhost")])


def _bearer(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _refusal(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)  # a streaming call fails when read
    return exc.value


def _close_to_eager(answer: pb.ModelInferResponse, x: dict, eager_modules, model: str) -> None:
    got, want = outputs_of(answer), eager(eager_modules[model], **x)
    for name in ("output", "attn_probs"):
        assert got[name].shape == want[name].shape
        assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE


def _cross(seed: int) -> dict:
    return random_inputs(np.random.default_rng(seed), 2, 5, 7, 32, 32, masked=True)


# -- TLS and the token ---------------------------------------------------------------------------

def test_the_native_port_serves_tls_with_the_token_and_refuses_plaintext(tls_server, pki, eager_modules):
    x = _cross(1)
    with _channel(tls_server.native_port, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest(), metadata=_bearer(), timeout=CALL_TIMEOUT_S).ready
        answer = stub.ModelInfer(infer_request("cross_attention", **x), metadata=_bearer(), timeout=CALL_TIMEOUT_S)
        _close_to_eager(answer, x, eager_modules, "cross_attention")
    with _channel(tls_server.native_port) as plaintext:  # the port speaks TLS only
        error = _refusal(pb_grpc.GRPCInferenceServiceStub(plaintext).ServerLive, pb.ServerLiveRequest(),
                         metadata=_bearer(), timeout=CALL_TIMEOUT_S)
        assert error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer wrong"),),
    (("authorization", f"Basic {TOKEN}"),),
    (("authorization", TOKEN),),
    (("authorization", "Bearer"),),
    (("authorization", f"Bearer {TOKEN} extra"),),
    (("authorization", f"Bearer {TOKEN}x"),),
    (("authorization", f"Bearer {TOKEN[:-1]}"),),
    (("authorization", f"Bearer {TOKEN.upper()}"),),
    (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")),  # one header, exactly
    (("x-api-key", TOKEN),),
], ids=["none", "wrong", "basic", "no-scheme", "scheme-only", "trailing-word", "longer", "shorter", "case",
        "twice", "other-header"])
def test_every_native_rpc_refuses_a_missing_or_bad_token_with_the_python_planes_words(tls_server, pki, metadata):
    x = _cross(2)
    with _channel(tls_server.native_port, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            (stub.ModelInfer, infer_request("cross_attention", **x)),
            (stub.ModelStreamInfer, iter([infer_request("cross_attention", **x)])),
            (stub.ServerLive, pb.ServerLiveRequest()),
            (stub.ServerReady, pb.ServerReadyRequest()),
            (stub.ModelReady, pb.ModelReadyRequest(name="cross_attention")),
            (stub.ServerMetadata, pb.ServerMetadataRequest()),
            (stub.ModelMetadata, pb.ModelMetadataRequest(name="cross_attention")),
            (stub.ModelStatistics, pb.ModelStatisticsRequest(name="cross_attention")),
            # Unknown to the native port: refused the same way, nothing tells an outsider what exists.
            (stub.RepositoryIndex, pb.RepositoryIndexRequest()),
            (channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod"), b""),
        ]
        for call, request in calls:
            error = _refusal(call, request, metadata=metadata, timeout=CALL_TIMEOUT_S)
            assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, REFUSAL), call


def test_the_bearer_scheme_is_any_case_and_native_refusals_are_logged(tls_server, pki):
    with _channel(tls_server.native_port, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert stub.ServerLive(pb.ServerLiveRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),),
                                   timeout=CALL_TIMEOUT_S).live
        _refusal(stub.ServerLive, pb.ServerLiveRequest(), timeout=CALL_TIMEOUT_S)
    # Counted and logged as the Python port's refusals are (at most a line per interval).
    tls_server.wait_for_log("without a valid bearer token (latest: /inference.GRPCInferenceService/")
    tls_server.wait_for_log("from the native port)")


def test_mutual_tls_on_the_native_port_requires_a_client_certificate_from_the_ca(mtls_server, pki, eager_modules):
    x = _cross(3)
    ca = pki.ca.read_bytes()
    with _channel(mtls_server.native_port, grpc.ssl_channel_credentials(
            ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes())) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(infer_request("cross_attention", **x), timeout=CALL_TIMEOUT_S)
        _close_to_eager(answer, x, eager_modules, "cross_attention")
    refused = {
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "another CA's": grpc.ssl_channel_credentials(ca, pki.rogue_client_key.read_bytes(),
                                                     pki.rogue_client_cert.read_bytes()),
    }
    for why, credentials in refused.items():
        with _channel(mtls_server.native_port, credentials) as channel:
            error = _refusal(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer,
                             infer_request("cross_attention", **x), timeout=CALL_TIMEOUT_S)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, why


# -- workers -------------------------------------------------------------------------------------

def _metrics(proc) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    """Until the state is reached (the workers copy their figures once a second), not a guess."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_workers_share_the_native_port_a_pool_reaches_both_and_the_counts_are_the_servers(
        model_repository, token_file, eager_modules):
    """--workers 2 with a plaintext native port and a token (on loopback). One channel: every
    call on one connection, so one worker. A pool of channels: each call on the next connection,
    held at the gate until it names its worker; both are reached. Every answer exact; then
    ModelStatistics (through the Python port) and /metrics count every native call of both, and
    both workers drain (exit 0)."""
    rng = np.random.default_rng(29)
    with GatedServer(model_repository, "--workers", "2", "--data-plane", "native",
                     "--max-batch-size", "1", "--auth-token-file", str(token_file), "--grace-period-s", "120",
                     "--warmup", "none") as proc:  # no warm-up: two workers start in half the time
        ready = json.loads(Path(proc.ready_file).read_text())
        workers, port = set(ready["workers"]), ready["grpc_port"]
        assert len(workers) == 2 and port
        proc.wait_for_log("data plane native")
        with _channel(port) as plaintext:
            error = _refusal(pb_grpc.GRPCInferenceServiceStub(plaintext).ModelInfer,
                             infer_request("self_attention", **random_inputs(rng, 1, 4, 3, 512, 512)),
                             timeout=CALL_TIMEOUT_S)
            assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        def one_call(client) -> int:
            x = random_inputs(rng, 1, 4, 3, 512, 512)
            call = client.infer_async("self_attention", **x)
            proc.gate.wait_started()
            pid = proc.gate.last_pid
            proc.gate.release()
            got = call.result(timeout=120)["output"]
            assert float(np.max(np.abs(got - eager(eager_modules["self_attention"], **x)["output"]))) <= TOLERANCE
            return pid

        calls = 0
        with InferenceClient(f"127.0.0.1:{port}", token=TOKEN, timeout_s=120) as single:
            pids = {one_call(single) for _ in range(4)}
            calls += 4
        assert len(pids) == 1, f"one channel reached {pids}"
        with InferenceClient(f"127.0.0.1:{port}", token=TOKEN, timeout_s=120, channels=MAX_CHANNELS) as pooled:
            pids = set()
            while pids != workers and calls < 4 + MAX_CHANNELS:
                pids.add(one_call(pooled))
                calls += 1
        assert pids == workers, f"{calls - 4} calls over {MAX_CHANNELS} channels reached only {pids}"

        def statistics():
            with proc.channel() as channel:  # the Python port, on whichever worker: the whole server's
                (stats,) = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                    pb.ModelStatisticsRequest(name="self_attention"), metadata=_bearer(), timeout=30).model_stats
            return stats

        # A worker reads the other's counts from its file, written once that worker's event loop
        # has counted the batch it just answered (docs/native-data-plane.md, "Metrics").
        _wait_until(lambda: statistics().inference_count >= calls)
        stats = statistics()
        assert (stats.inference_count, stats.execution_count) == (calls, calls)
        assert stats.inference_stats.success.count == calls
        ok = f'attnserve_requests_total{{code="OK",model="self_attention"}} {float(calls)}'
        _wait_until(lambda: ok in _metrics(proc))
        assert proc.stop() == 0
    assert TOKEN not in proc.log()


def test_a_stopped_native_worker_is_replaced_on_the_shared_port_and_the_server_drains(model_repository):
    """SIGSTOP one of two workers: the watchdog (heartbeats answered by each worker's event loop)
    kills and replaces it; the replacement binds the shared native port again (else it could not
    start), every new connection to that port is served, and SIGTERM drains both (exit 0)."""
    proc = ServerProcess(model_repository, "--workers", "2", "--data-plane", "native",
                         "--worker-heartbeat-s", "0.2", "--worker-heartbeat-timeout-s", "10", "--warmup", "none")
    victim = None
    try:
        ready = json.loads(Path(proc.ready_file).read_text())
        port, victim = ready["grpc_port"], ready["workers"][0]
        listening = f"on 127.0.0.1:{port}, shared by the workers"
        proc.wait_for_log(listening, count=2)
        os.kill(victim, signal.SIGSTOP)
        proc.wait_for_log(f"(pid {victim}) missed its heartbeat", timeout_s=120)
        proc.wait_for_log("replaced: pid", timeout_s=120)
        proc.wait_for_log(listening, count=3)
        rng = np.random.default_rng(31)
        for _ in range(8):  # each its own connection: the kernel spreads them over both listeners
            with _channel(port) as channel:
                x = random_inputs(rng, 1, 4, 3, 512, 512)
                answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    infer_request("self_attention", outputs=("output",), **x), timeout=CALL_TIMEOUT_S)
                assert answer.outputs[0].name == "output"
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)  # never left stopped, whatever failed
            except ProcessLookupError:
                pass
        proc.stop()
