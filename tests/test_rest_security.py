"""TLS, mutual TLS and bearer tokens on the REST port: the same files and token as gRPC's
(tests/test_security.py), with tritonclient.http, curl and the standard library's https."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.oip import eager, random_inputs
from tests.server_process import ServerProcess
from tests.test_rest import _json_request
from tests.test_security import TOKEN, _cross, pki, token_file  # noqa: F401 (fixtures)

TOLERANCE = 1e-5
INFER = "/v2/models/cross_attention/infer"


@pytest.fixture(scope="module")
def tls_server(model_repository, pki, token_file):  # noqa: F811
    proc = ServerProcess(model_repository, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--auth-token-file", str(token_file), "--log-level", "DEBUG", "--access-log",
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    yield proc
    assert proc.stop() == 0
    assert TOKEN not in proc.log()


def _https(server, pki, path: str, body: bytes | None = None, token: str | None = None, cert=None):  # noqa: F811
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(*cert)
    connection = http.client.HTTPSConnection("127.0.0.1", server.http_port, context=context, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connection.request("GET" if body is None else "POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_tls_and_token_serve_tritonclient_http(tls_server, pki, eager_modules):  # noqa: F811
    x = _cross()
    client = httpclient.InferenceServerClient(tls_server.http_address, ssl=True,
                                              ssl_options={"ca_certs": str(pki.ca)})
    try:
        assert client.is_server_ready()  # health needs no token
        inputs = []
        for name in ("query", "key", "value", "mask"):
            tensor = httpclient.InferInput(name, list(x[name].shape), "BOOL" if name == "mask" else "FP32")
            tensor.set_data_from_numpy(x[name])
            inputs.append(tensor)
        result = client.infer("cross_attention", inputs, headers={"Authorization": f"Bearer {TOKEN}"})
        want = eager(eager_modules["cross_attention"], **x)["output"]
        assert float(np.max(np.abs(result.as_numpy("output") - want))) <= TOLERANCE
        with pytest.raises(InferenceServerException) as exc:
            client.infer("cross_attention", inputs)
        assert exc.value.status() == "401" and "bearer token" in exc.value.message()
    finally:
        client.close()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1]], ids=["none", "wrong", "longer", "shorter"])
@pytest.mark.parametrize("path", ["/v2", "/v2/models/cross_attention", "/v2/models/cross_attention/ready",
                                  "/v2/models/stats", "/v2/nope", INFER])
def test_every_path_but_health_refuses_a_missing_or_bad_token(tls_server, pki, token, path):  # noqa: F811
    body = _json_request(random_inputs(np.random.default_rng(0), 1, 2, 2, 32, 32)) if path == INFER else None
    status, headers, answer = _https(tls_server, pki, path, body, token=token)
    assert status == 401 and "bearer token" in json.loads(answer)["error"]
    assert headers["WWW-Authenticate"] == "Bearer"
    assert _https(tls_server, pki, "/v2/health/ready")[0] == 200


def test_curl_over_tls_with_the_token(tls_server, pki):  # noqa: F811
    done = subprocess.run(["curl", "-sS", "--cacert", str(pki.ca), "-H", f"Authorization: Bearer {TOKEN}",
                           f"https://localhost:{tls_server.http_port}/v2/models/cross_attention"],
                          capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout)["name"] == "cross_attention"
    plaintext = subprocess.run(["curl", "-sS", f"http://127.0.0.1:{tls_server.http_port}/v2/health/live"],
                               capture_output=True, text=True, timeout=30)
    assert '"live"' not in plaintext.stdout  # no plaintext beside TLS


def test_mutual_tls_requires_a_client_certificate(model_repository, pki):  # noqa: F811
    proc = ServerProcess(model_repository, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--tls-client-ca", str(pki.ca),
                         credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                                  pki.client_cert.read_bytes()))
    try:
        assert _https(proc, pki, "/v2/health/live", cert=(pki.client_cert, pki.client_key))[0] == 200
        for cert in (None, (pki.rogue_client_cert, pki.rogue_client_key)):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _https(proc, pki, "/v2/health/live", cert=cert)
    finally:
        assert proc.stop() == 0
