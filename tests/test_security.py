"""TLS, mutual TLS and bearer tokens on a real server, with certificates made here by openssl.

One server serves TLS and demands a token (health and reflection stay open); another demands
client certificates (mutual TLS). Both are called with the project's client (sync, asyncio and
the CLI) and with raw grpc. Startup errors for bad TLS or token files are checked in-process
and once through `attnserve serve`.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from attnserve.client import AsyncInferenceClient, InferenceClient, InferenceError
from attnserve.client.options import RetryPolicy, TlsConfig
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import ServerConfig, load_config
from attnserve.server.security import BearerToken, SecurityError, bearer_token, read_token, server_credentials
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.oip import eager, infer_request, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess
from tests.tls_certs import Pki, make_pki

pytestmark = pytest.mark.e2e  # starts servers with TLS and tokens

TOLERANCE = 1e-5
# A token no log line could contain by accident.
TOKEN = "attnserve-test-token-" + secrets.token_hex(16)
NO_RETRY = RetryPolicy(max_attempts=1)
# The deadline of a call that must fail with UNAVAILABLE (a refused handshake): it fails at once,
# so this only keeps a slow machine's handshake from turning into DEADLINE_EXCEEDED.
REFUSED_CALL_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(f"  {TOKEN}\n")  # surrounding whitespace is not part of the token
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def tls_server(model_repository, pki, token_file):
    """TLS + bearer token, logging as much as it can (DEBUG, access log): the token must not show."""
    proc = ServerProcess(model_repository, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--auth-token-file", str(token_file), "--log-level", "DEBUG", "--access-log", "true",
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    yield proc
    assert proc.stop() == 0
    assert TOKEN not in proc.log()


@pytest.fixture(scope="module")
def mtls_server(model_repository, pki):
    proc = ServerProcess(model_repository, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--tls-client-ca", str(pki.ca),
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                                  pki.client_cert.read_bytes()))
    yield proc
    assert proc.stop() == 0


def _cross(seed: int = 0):
    return random_inputs(np.random.default_rng(seed), 2, 5, 7, 32, 32, masked=True)


def _assert_output_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


def _bearer(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)  # a streaming call fails when read
    return exc.value.code()


# -- TLS + token: the project's client ------------------------------------------------------

def test_client_with_tls_and_token_is_served(tls_server, pki, eager_modules):
    x = _cross(1)
    with InferenceClient(tls_server.address, tls=TlsConfig(ca_file=pki.ca), token=TOKEN, timeout_s=20) as client:
        assert client.server_ready() and client.model_ready("cross_attention")
        assert client.health_check() == "SERVING"
        out = client.infer("cross_attention", x["query"], x["key"], x["value"], mask=x["mask"],
                           outputs=("output", "attn_probs"))
    want = eager(eager_modules["cross_attention"], **x)
    _assert_output_close(out["output"], want["output"])
    _assert_output_close(out["attn_probs"], want["attn_probs"])


def test_async_client_with_tls_and_token_is_served(tls_server, pki, eager_modules):
    x = _cross(2)

    async def main():
        async with AsyncInferenceClient(tls_server.address, tls=TlsConfig(ca_file=pki.ca), token=TOKEN,
                                        timeout_s=20) as client:
            return await client.infer("cross_attention", x["query"], x["key"], x["value"], mask=x["mask"])

    out = asyncio.run(main())
    _assert_output_close(out["output"], eager(eager_modules["cross_attention"], **x)["output"])


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1]],
                         ids=["none", "wrong", "longer", "shorter"])
def test_client_without_the_right_token_is_unauthenticated(tls_server, pki, token):
    x = _cross(3)
    with InferenceClient(tls_server.address, tls=TlsConfig(ca_file=pki.ca), token=token, retry=NO_RETRY) as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("cross_attention", x["query"], x["key"], x["value"])
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in exc.value.details
        assert client.health_check() == "SERVING"  # the health service needs no token


def test_cli_with_tls_ca_and_token_file(tls_server, pki, token_file, tmp_path):
    def cli(command, *args):
        return subprocess.run([sys.executable, "-m", "attnserve", command, "--url", tls_server.address,
                               "--tls-ca", str(pki.ca), "--retries", "0", *args],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

    done = cli("health", "--token-file", str(token_file), "--model", "cross_attention")
    assert done.returncode == 0, done.stderr
    assert "health: SERVING" in done.stdout and "model cross_attention ready: true" in done.stdout
    done = cli("models", "--token-file", str(token_file), "--model", "cross_attention")
    assert done.returncode == 0 and "cross_attention" in done.stdout, done.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    done = cli("models", "--token-file", str(wrong), "--model", "cross_attention")
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr, (done.stdout, done.stderr)
    assert "not-the-token" not in done.stdout + done.stderr + tls_server.log()


# -- TLS + token: raw grpc ------------------------------------------------------------------

@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer wrong"),),
    (("authorization", f"Basic {TOKEN}"),),
    (("authorization", TOKEN),),
    (("authorization", "Bearer"),),
    (("authorization", "Bearer "),),
    (("authorization", f"Bearer {TOKEN} extra"),),
    (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")),  # one header, exactly
    (("x-api-key", TOKEN),),
], ids=["none", "wrong", "basic", "no-scheme", "scheme-only", "empty", "trailing-word", "twice", "other-header"])
def test_every_rpc_refuses_a_missing_or_bad_token(tls_server, metadata):
    x = _cross(4)
    with tls_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            (stub.ModelInfer, infer_request("cross_attention", **x)),
            (stub.ServerReady, pb.ServerReadyRequest()),
            (stub.ServerMetadata, pb.ServerMetadataRequest()),
            (stub.ModelMetadata, pb.ModelMetadataRequest(name="cross_attention")),
            (stub.ModelStatistics, pb.ModelStatisticsRequest()),
            (stub.ModelStreamInfer, iter([infer_request("cross_attention", **x)])),
        ]
        for call, request in calls:
            assert _code(call, request, metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
        # An unknown method is refused the same way: nothing tells an outsider what exists.
        unknown = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        assert _code(unknown, b"", metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED


def test_bearer_scheme_is_case_insensitive_and_token_is_exact(tls_server):
    with tls_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert stub.ServerLive(pb.ServerLiveRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),),
                                   timeout=10).live
        assert _code(stub.ServerLive, pb.ServerLiveRequest(), metadata=_bearer(TOKEN.upper()),
                     timeout=10) == grpc.StatusCode.UNAUTHENTICATED


def _access_lines(log: str, status: str) -> int:
    """ModelInfer's access lines (attnserve.access) with this status."""
    return len(re.findall(rf"attnserve\.access: .*method=ModelInfer .*status={status} ", log))


def test_refused_calls_never_reach_a_handler(tls_server):
    """Neither the servicer (request counters) nor the gate's access log sees
    a refused call; a large unauthenticated message is refused without being read."""
    x = _cross(5)
    metrics_url = f"http://127.0.0.1:{tls_server.metrics_port}/metrics"

    def requests_total() -> float:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
        return sum(float(v) for v in re.findall(r"^attnserve_requests_total\{[^}]*\} (\S+)$", text, re.M))

    before = requests_total()
    log_before = tls_server.log()
    big = infer_request("self_attention", **random_inputs(np.random.default_rng(6), 8, 1000, 1000, 512, 512))
    with tls_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):
            assert _code(stub.ModelInfer, infer_request("cross_attention", **x), timeout=10) \
                == grpc.StatusCode.UNAUTHENTICATED
        assert big.ByteSize() > 40 << 20
        assert _code(stub.ModelInfer, big, metadata=_bearer("bad"), timeout=30) == grpc.StatusCode.UNAUTHENTICATED
        stub.ModelInfer(infer_request("cross_attention", **x), metadata=_bearer(), timeout=10)
    assert requests_total() - before == 1  # the authorized call alone
    # Its access line alone says OK, the six refusals' say UNAUTHENTICATED. (The native plane hands its
    # calls' lines to the event loop in bulk: waited for.)
    deadline = time.monotonic() + 30
    while (_access_lines(log := tls_server.log(), "OK") - _access_lines(log_before, "OK") < 1
           or _access_lines(log, "UNAUTHENTICATED") - _access_lines(log_before, "UNAUTHENTICATED") < 6):
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.05)
    assert _access_lines(log, "OK") - _access_lines(log_before, "OK") == 1
    assert _access_lines(log, "UNAUTHENTICATED") - _access_lines(log_before, "UNAUTHENTICATED") == 6
    if "native_data_plane" not in _extensions(tls_server):  # the Python gate's arrival line (docs/tracing.md)
        rpc = "rpc /inference.GRPCInferenceService/ModelInfer"
        assert log.count(rpc) - log_before.count(rpc) == 1
    # The native port's refusals reach the log on the event loop's next sync of its counts: waited for.
    tls_server.wait_for_log("without a valid bearer token", timeout_s=30)


def _extensions(server: ServerProcess) -> list[str]:
    """ServerMetadata's extensions (`native_data_plane` while the native plane serves)."""
    with server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return list(stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=_bearer(), timeout=10).extensions)


def test_health_and_reflection_need_no_token(tls_server):
    with tls_server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "cross_attention", "inference.GRPCInferenceService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "inference.GRPCInferenceService" in names


def test_plaintext_client_cannot_talk_to_tls_server(tls_server):
    with grpc.insecure_channel(tls_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert _code(health.Check, health_pb2.HealthCheckRequest(),
                     timeout=REFUSED_CALL_TIMEOUT_S) == grpc.StatusCode.UNAVAILABLE
    with InferenceClient(tls_server.address, token=TOKEN, retry=NO_RETRY, timeout_s=REFUSED_CALL_TIMEOUT_S) as client:
        with pytest.raises(InferenceError) as exc:
            client.server_live()
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_certificate_fails(tls_server, pki):
    with InferenceClient(tls_server.address, tls=TlsConfig(ca_file=pki.rogue_ca), token=TOKEN, retry=NO_RETRY,
                         timeout_s=REFUSED_CALL_TIMEOUT_S) as client:
        with pytest.raises(InferenceError) as exc:
            client.health_check()
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    # The certificate names localhost and 127.0.0.1, nothing else.
    wrong_name = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(tls_server.address, wrong_name,
                             options=[("grpc.ssl_target_name_override", "attnserve.example")]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert _code(health.Check, health_pb2.HealthCheckRequest(),
                     timeout=REFUSED_CALL_TIMEOUT_S) == grpc.StatusCode.UNAVAILABLE


# -- mutual TLS -----------------------------------------------------------------------------

def test_mtls_client_with_certificate_is_served(mtls_server, pki, eager_modules):
    x = _cross(7)
    tls = TlsConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    with InferenceClient(mtls_server.address, tls=tls, timeout_s=20) as client:
        out = client.infer("cross_attention", x["query"], x["key"], x["value"], mask=x["mask"])
    _assert_output_close(out["output"], eager(eager_modules["cross_attention"], **x)["output"])
    done = subprocess.run([sys.executable, "-m", "attnserve", "health", "--url", mtls_server.address,
                           "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key",
                           str(pki.client_key)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "health: SERVING" in done.stdout, done.stderr


@pytest.mark.parametrize("who", ["no-certificate", "other-ca", "plaintext"])
def test_mtls_refuses_clients_without_a_trusted_certificate(mtls_server, pki, who):
    if who == "no-certificate":
        tls = TlsConfig(ca_file=pki.ca)
    elif who == "other-ca":
        tls = TlsConfig(ca_file=pki.ca, cert_file=pki.rogue_client_cert, key_file=pki.rogue_client_key)
    else:
        tls = None
    with InferenceClient(mtls_server.address, tls=tls, retry=NO_RETRY, timeout_s=REFUSED_CALL_TIMEOUT_S) as client:
        for probe in (client.server_live, client.health_check):  # mTLS guards the transport: health too
            with pytest.raises(InferenceError) as exc:
                probe()
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE


# -- configuration and startup errors -------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "server.pem"], "needs both --tls-cert and --tls-key"),
    (["--tls-key", "server.key"], "needs both --tls-cert and --tls-key"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca (mutual TLS) needs --tls-cert"),
])
def test_incomplete_tls_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load_config(argv, {})
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_security_settings_from_environment(tmp_path):
    env = {"ATTNSERVE_TLS_CERT": "/c.pem", "ATTNSERVE_TLS_KEY": "/k.pem", "ATTNSERVE_TLS_CLIENT_CA": "/ca.pem",
           "ATTNSERVE_AUTH_TOKEN_FILE": "/t"}
    config = load_config([], env)
    assert (str(config.tls_cert), str(config.tls_key), str(config.tls_client_ca), str(config.auth_token_file)) == \
        ("/c.pem", "/k.pem", "/ca.pem", "/t")


def test_bad_tls_and_token_files_are_clear_startup_errors(pki, tmp_path):
    missing = tmp_path / "missing.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    cases = [
        (ServerConfig(tls_cert=missing, tls_key=pki.server_key), "--tls-cert"),
        (ServerConfig(tls_cert=pki.server_cert, tls_key=missing), "--tls-key"),
        (ServerConfig(tls_cert=pki.server_cert, tls_key=pki.client_key), "matching"),  # another key
        (ServerConfig(tls_cert=garbage, tls_key=pki.server_key), "--tls-cert"),
        (ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=garbage), "--tls-client-ca"),
        (ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=missing), "--tls-client-ca"),
    ]
    for config, flag in cases:
        with pytest.raises(SecurityError, match=re.escape(flag)):
            server_credentials(config)
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(pki.server_key), "-out", str(encrypted), "-aes256",
                    "-passout", "pass:secret"], check=True, capture_output=True, timeout=30)
    with pytest.raises(SecurityError, match="unencrypted"):
        server_credentials(ServerConfig(tls_cert=pki.server_cert, tls_key=encrypted))
    assert server_credentials(ServerConfig()) is None
    assert server_credentials(ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key)) is not None
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    for path, why in ((missing, "cannot read"), (empty, "empty"), (spaced, "one word")):
        with pytest.raises(SecurityError, match=why):
            bearer_token(ServerConfig(auth_token_file=path))
    assert bearer_token(ServerConfig()) is None
    good = tmp_path / "good"
    good.write_text("\n\tabc.DEF-123_~+/=\r\n")
    assert read_token(good) == b"abc.DEF-123_~+/="
    assert "abc" not in repr(bearer_token(ServerConfig(auth_token_file=good)))


def test_server_with_unreadable_tls_file_exits_3_before_loading_models(model_repository, tmp_path):
    done = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                           "--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--workers", "1",
                           "--tls-cert", str(tmp_path / "nope.pem"),
                           "--tls-key", str(tmp_path / "nope.key")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "cannot start: --tls-cert" in done.stderr and "nope.pem" in done.stderr
    assert "ready on" not in done.stderr  # no model was loaded


def test_token_is_compared_in_constant_time(monkeypatch):
    """The token is checked with hmac.compare_digest, even when the scheme is wrong."""
    import hmac

    import attnserve.server.security as security

    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    check = BearerToken(b"secret")
    assert check.authorized((("authorization", "Bearer secret"),))
    assert not check.authorized((("authorization", "Basic secret"),))
    assert not check.authorized((("authorization", "Bearer nope"),))
    assert len(seen) == 3 and all(b == b"secret" for _, b in seen)
