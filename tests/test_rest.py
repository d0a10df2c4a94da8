"""The HTTP/REST port against a real server: NVIDIA's tritonclient.http (unmodified), curl, and
raw HTTP from the standard library; KServe's InferenceRESTClient is checked by
`make test-ecosystem` (tests/compat/ecosystem_check.py: kserve cannot install beside our dev
extra, whose grpcio-tools pin it conflicts with).

Both presets, JSON and binary tensors, masks, both outputs: the same numbers as eager PyTorch
(1e-5) and exactly the gRPC path's. Errors: `{"error": ...}` with the HTTP column of
server.errors' table. Bounds: the body limit (inflated too), headers. TLS, bearer tokens, the
access log and the metrics as on gRPC. The drain is in tests/test_rest_drain.py.
"""

from __future__ import annotations

import gzip
import http.client
import json
import subprocess
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from attnserve.contract import DATATYPES, INPUT_NAMES, OUTPUT_NAMES
from tests.conftest import PRESET_NAMES
from tests.oip import CASES, WIDTHS, eager, random_inputs
from tests.server_process import ServerProcess, serve_with_port_taken

pytestmark = pytest.mark.e2e  # starts servers

TOLERANCE = 1e-5
HEADER_LENGTH = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def rest(server):
    client = httpclient.InferenceServerClient(url=server.http_address)
    yield client
    client.close()


def _inputs(module, x: dict, binary: bool) -> list:
    inputs = []
    for name in INPUT_NAMES:
        if x.get(name) is None:
            continue
        tensor = module.InferInput(name, list(x[name].shape), DATATYPES[name])
        if module is httpclient:
            tensor.set_data_from_numpy(x[name], binary_data=binary)
        else:
            tensor.set_data_from_numpy(x[name])
        inputs.append(tensor)
    return inputs


def _rest_infer(client, model: str, x: dict, binary: bool = True, outputs=OUTPUT_NAMES, **kwargs) -> dict:
    requested = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    result = client.infer(model, _inputs(httpclient, x, binary), outputs=requested, **kwargs)
    return {name: result.as_numpy(name) for name in outputs}


def _grpc_infer(address: str, model: str, x: dict) -> dict:
    with grpcclient.InferenceServerClient(url=address) as client:
        result = client.infer(model, _inputs(grpcclient, x, True),
                              outputs=[grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES])
        return {name: result.as_numpy(name) for name in OUTPUT_NAMES}


def _post(address: str, path: str, body: bytes, headers: dict | None = None, method: str = "POST"
          ) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection(address, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _json_request(x: dict, outputs=("output",)) -> bytes:
    return json.dumps({
        "id": "json-1",
        "inputs": [{"name": n, "shape": list(x[n].shape), "datatype": DATATYPES[n], "data": x[n].tolist()}
                   for n in INPUT_NAMES if x.get(n) is not None],
        "outputs": [{"name": n} for n in outputs]}).encode()


# -- numbers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_gets_eager_numbers_and_the_grpc_paths(rest, server, eager_modules, binary):
    rng = np.random.default_rng(42)
    for case, (model, b, lq, lk, masked) in CASES.items():
        x = random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=masked, fully_masked_row=masked)
        got = _rest_infer(rest, model, x, binary=binary, request_id=case)
        want = eager(eager_modules[model], **x)
        via_grpc = _grpc_infer(server.address, model, x)
        for name in OUTPUT_NAMES:
            assert got[name].shape == want[name].shape, (case, name)
            err = float(np.max(np.abs(got[name] - want[name])))
            assert err <= TOLERANCE, f"{case} {name}: max abs error {err}"
            np.testing.assert_array_equal(got[name], via_grpc[name], err_msg=f"{case} {name}: REST != gRPC")


@pytest.fixture(scope="module")
def wide_json(model_repository):
    """A REST client of a server whose JSON limit is raised (--max-json-bytes 64 MiB)."""
    proc = ServerProcess(model_repository, "--max-json-bytes", str(64 << 20))
    client = httpclient.InferenceServerClient(url=proc.http_address)
    yield client
    client.close()
    proc.stop()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_large_answer_has_the_eager_numbers(request, eager_modules, binary):
    """An answer of 1 MiB or more: server.codec.encode leaves its raw outputs out of the message
    (the gRPC wire path writes them itself); the REST answer is built from those arrays. (As
    JSON it is over the default --max-json-bytes: a server that allows it.)"""
    client = request.getfixturevalue("rest" if binary else "wide_json")
    x = random_inputs(np.random.default_rng(11), 2, 300, 40, 512, 512, masked=True)  # output 1.2 MB
    got = _rest_infer(client, "self_attention", x, binary=binary)
    want = eager(eager_modules["self_attention"], **x)
    for name in OUTPUT_NAMES:
        assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE, name


def test_json_over_the_limit_is_refused_pointing_to_binary_data(rest, server, eager_modules):
    """JSON is parsed and written on the event loop (json holds it about 12 ms per MiB read, 28
    written, every other call waits): a request with more than --max-json-bytes (8 MiB) of JSON
    is 400 before it is parsed; one whose answer's JSON data could be over it is 400 before it
    is computed; both name the limit and binary data. The same answer as binary is served."""
    x = random_inputs(np.random.default_rng(12), 4, 300, 40, 512, 512)
    body = json.dumps({"inputs": [{"name": n, "shape": list(x[n].shape), "datatype": "FP32",
                                   "data": x[n].ravel().tolist()}
                                  for n in ("query", "key", "value")]}).encode()
    assert len(body) > 8 << 20
    status, _, answer = _post(server.http_address, "/v2/models/self_attention/infer", body)
    error = json.loads(answer)["error"]
    assert status == 400 and f"{len(body):,} bytes of JSON" in error and "--max-json-bytes" in error, error
    assert "binary_data_size" in error, error

    json_output = [httpclient.InferRequestedOutput("output", binary_data=False)]
    with pytest.raises(InferenceServerException) as exc:
        rest.infer("self_attention", _inputs(httpclient, x, True), outputs=json_output)
    assert exc.value.status() == "400" and "--max-json-bytes" in exc.value.message(), exc.value.message()
    assert f"{4 * 300 * 512:,} values (output)" in exc.value.message(), exc.value.message()
    assert "binary_data" in exc.value.message(), exc.value.message()
    got = _rest_infer(rest, "self_attention", x, binary=True, outputs=("output",))
    assert float(np.max(np.abs(got["output"] - eager(eager_modules["self_attention"], **x)["output"]))) <= TOLERANCE


def test_binary_inputs_with_json_outputs_and_one_output(rest, eager_modules):
    x = random_inputs(np.random.default_rng(3), 2, 9, 4, 32, 32, masked=True)
    requested = [httpclient.InferRequestedOutput("output", binary_data=False)]
    result = rest.infer("cross_attention", _inputs(httpclient, x, True), outputs=requested)
    assert result.get_output("attn_probs") is None and "data" in result.get_output("output")
    err = float(np.max(np.abs(result.as_numpy("output") - eager(eager_modules["cross_attention"], **x)["output"])))
    assert err <= TOLERANCE


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_answers(rest, eager_modules, algorithm):
    x = random_inputs(np.random.default_rng(4), 2, 6, 6, 512, 512, masked=True)
    got = _rest_infer(rest, "self_attention", x, request_compression_algorithm=algorithm,
                      response_compression_algorithm=algorithm)
    want = eager(eager_modules["self_attention"], **x)
    for name in OUTPUT_NAMES:
        assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE


def test_curl_json_inference_compressed_both_ways(server, eager_modules, tmp_path):
    x = random_inputs(np.random.default_rng(5), 1, 3, 4, 32, 32, masked=True)
    (tmp_path / "request.json.gz").write_bytes(gzip.compress(_json_request(x, outputs=OUTPUT_NAMES)))
    done = subprocess.run(
        ["curl", "-sS", "--compressed", "-D", str(tmp_path / "headers"), "-H", "Content-Type: application/json",
         "-H", "Content-Encoding: gzip", "--data-binary", f"@{tmp_path / 'request.json.gz'}",
         f"http://{server.http_address}/v2/models/cross_attention/infer"],
        capture_output=True, timeout=60, check=True)
    encoding = [line for line in (tmp_path / "headers").read_text().lower().splitlines() if "content-encoding" in line]
    assert encoding in (["content-encoding: gzip"], ["content-encoding: deflate"])  # curl inflated it
    answer = json.loads(done.stdout)
    assert answer["model_name"] == "cross_attention" and answer["id"] == "json-1"
    want = eager(eager_modules["cross_attention"], **x)
    for output in answer["outputs"]:
        got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
        assert float(np.max(np.abs(got - want[output["name"]]))) <= TOLERANCE


def test_binary_answer_layout_by_hand(server):
    """binary_data_output for every output: the JSON head, then the tensors back to back."""
    x = random_inputs(np.random.default_rng(6), 1, 2, 3, 32, 32)
    head = json.dumps({"parameters": {"binary_data_output": True}, "inputs": [
        {"name": n, "shape": list(x[n].shape), "datatype": "FP32", "parameters": {"binary_data_size": x[n].nbytes}}
        for n in ("query", "key", "value")]}).encode()
    body = head + b"".join(x[n].astype("<f4").tobytes() for n in ("query", "key", "value"))
    status, headers, answer = _post(server.http_address, "/v2/models/cross_attention/infer", body,
                                    {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"})
    assert status == 200, answer
    json_length = int(headers[HEADER_LENGTH])
    document = json.loads(answer[:json_length])
    sizes = [o["parameters"]["binary_data_size"] for o in document["outputs"]]
    assert [o["name"] for o in document["outputs"]] == list(OUTPUT_NAMES)
    assert sizes == [1 * 2 * 32 * 4, 1 * 2 * 2 * 3 * 4] and json_length + sum(sizes) == len(answer)


# -- health, metadata, extensions ------------------------------------------------------------

def test_tritonclient_http_health_and_metadata(rest):
    assert rest.is_server_live() and rest.is_server_ready()
    metadata = rest.get_server_metadata()
    assert metadata["name"] == "attnserve" and "binary_tensor_data" in metadata["extensions"]
    for model in PRESET_NAMES:
        assert rest.is_model_ready(model) and rest.is_model_ready(model, model_version="1")
        assert not rest.is_model_ready(model, model_version="99")
        meta = rest.get_model_metadata(model)
        assert [i["name"] for i in meta["inputs"]] == list(INPUT_NAMES) and meta["versions"] == ["1"]
        assert rest.get_model_metadata(model, model_version="1") == meta
        config = rest.get_model_config(model)
        assert config["name"] == model and config["max_batch_size"] == 0
        assert [i["data_type"] for i in config["input"]] == ["TYPE_FP32"] * 3 + ["TYPE_BOOL"]
    _rest_infer(rest, "cross_attention", random_inputs(np.random.default_rng(0), 1, 3, 3, 32, 32))
    stats = rest.get_inference_statistics("cross_attention")["model_stats"][0]
    assert stats["inference_count"] >= 1 and isinstance(stats["inference_stats"]["success"]["ns"], int)
    every = rest.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} >= set(PRESET_NAMES)


def test_repository_index_get_and_post(rest, server):
    index = rest.get_model_repository_index()
    assert {m["name"]: m["state"] for m in index if m["name"] in PRESET_NAMES} == dict.fromkeys(PRESET_NAMES, "READY")
    status, _, body = _post(server.http_address, "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and json.loads(body) == index
    status, _, body = _post(server.http_address, "/v2/repository/index", b"", method="GET")
    assert status == 200 and json.loads(body) == index


def test_curl_health_answers_kserve_and_probes(server):
    def curl(path):
        done = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", f"http://{server.http_address}{path}"],
                              capture_output=True, text=True, timeout=30, check=True)
        body, code = done.stdout.rsplit("\n", 1)
        return int(code), json.loads(body)

    assert curl("/v2/health/live") == (200, {"live": True})
    assert curl("/v2/health/ready") == (200, {"ready": True})
    assert curl("/v2/models/self_attention/ready") == (200, {"name": "self_attention", "ready": True})
    assert curl("/v2")[1]["name"] == "attnserve"


# -- errors ----------------------------------------------------------------------------------

def _x_json(extra: dict | None = None, **changes) -> dict:
    x = random_inputs(np.random.default_rng(8), 1, 2, 2, 32, 32)
    document = json.loads(_json_request(x))
    document["inputs"] += [extra] if extra else []
    for tensor in document["inputs"]:
        tensor.update(changes.get(tensor["name"], {}))
    return document


_PAST = json.dumps({"inputs": [{"name": "query", "shape": [1, 2, 32], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 256}}]}).encode()
ERRORS = {  # case -> (path, body, headers, HTTP status, text in the error)
    "unknown model": ("/v2/models/nope/infer", json.dumps(_x_json()).encode(), {}, 404, "unknown model 'nope'"),
    "unknown version": ("/v2/models/cross_attention/versions/7/infer", json.dumps(_x_json()).encode(), {}, 404,
                        "version '7' is not loaded"),
    "not json": ("/v2/models/cross_attention/infer", b"{nope", {}, 400, "does not parse"),
    "not an object": ("/v2/models/cross_attention/infer", b"[1, 2]", {}, 400, "must be a JSON object"),
    "wrong width": ("/v2/models/cross_attention/infer",
                    json.dumps(_x_json(query={"shape": [1, 1, 64], "data": [0.0] * 64})).encode(), {}, 400,
                    "expected shape [batch, length, 32]"),
    "too few values": ("/v2/models/cross_attention/infer", json.dumps(_x_json(key={"data": [1.0]})).encode(), {},
                       400, "needs 64 values in data, got 1"),
    "strings as FP32": ("/v2/models/cross_attention/infer", json.dumps(_x_json(key={"data": ["a"] * 64})).encode(),
                        {}, 400, "FP32 data must be numbers"),
    "ragged data": ("/v2/models/cross_attention/infer", json.dumps(_x_json(key={"data": [[1.0], [1.0, 2.0]]})).encode(),
                    {}, 400, "not a regular array"),
    "numbers as BOOL": ("/v2/models/cross_attention/infer", json.dumps(_x_json(
        extra={"name": "mask", "datatype": "BOOL", "shape": [1, 2, 2], "data": [1, 0, 1, 1]})).encode(), {}, 400,
        "BOOL data must be true/false"),
    "wrong datatype": ("/v2/models/cross_attention/infer", json.dumps(_x_json(key={"datatype": "FP16"})).encode(),
                       {}, 400, "expected datatype FP32, got 'FP16'"),
    "data and binary_data_size": ("/v2/models/cross_attention/infer", json.dumps(
        _x_json(key={"parameters": {"binary_data_size": 256}})).encode(), {}, 400, "use one"),
    "binary size past the body": ("/v2/models/cross_attention/infer", _PAST + b"\0" * 100,
                                  {HEADER_LENGTH: str(len(_PAST))}, 400, "runs past the body's binary section"),
    "header length past the body": ("/v2/models/cross_attention/infer", b"{}", {HEADER_LENGTH: "99"}, 400,
                                    "the body has 2 bytes"),
    "header length not a number": ("/v2/models/cross_attention/infer", b"{}", {HEADER_LENGTH: "x"}, 400,
                                   "must be an integer"),
    "bytes left over": ("/v2/models/cross_attention/infer", json.dumps(_x_json()).encode() + b"xx",
                        {HEADER_LENGTH: str(len(json.dumps(_x_json())))}, 400, "2 bytes of binary data"),
    "corrupt gzip": ("/v2/models/cross_attention/infer", b"\x1f\x8b\x08garbage", {"Content-Encoding": "gzip"}, 400,
                     "cannot be read"),
    "unknown path": ("/v1/models/cross_attention:predict", b"{}", {}, 404, "no such endpoint"),
    "wrong method": ("/v2/health/ready", b"{}", {}, 405, "takes GET, not POST"),
    "bad index body": ("/v2/repository/index", b'{"ready": 3}', {}, 400, '{"ready": true|false}'),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_json_with_the_status_tables_http_status(server, case):
    path, body, headers, status, text = ERRORS[case]
    got, response_headers, answer = _post(server.http_address, path, body, headers)
    assert got == status, answer
    assert response_headers["Content-Type"].startswith("application/json")
    assert text in json.loads(answer)["error"], answer


def test_tritonclient_http_raises_with_status_and_message(rest):
    x = random_inputs(np.random.default_rng(9), 1, 2, 2, 512, 512)
    with pytest.raises(InferenceServerException) as exc:
        _rest_infer(rest, "cross_attention", x)  # 512 wide, the model takes 32
    assert exc.value.status() == "400" and "expected shape [batch, length, 32]" in exc.value.message()


# -- bounds ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(model_repository):
    """A body limit of 1 MiB (--max-message-bytes), and the access log."""
    proc = ServerProcess(model_repository, "--max-message-bytes", str(1 << 20), "--access-log")
    yield proc
    proc.stop()


def test_a_body_over_the_limit_is_413(small_server):
    status, _, answer = _post(small_server.http_address, "/v2/models/cross_attention/infer", b" " * (2 << 20))
    assert status == 413 and "1,048,576-byte limit" in json.loads(answer)["error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_decompression_bomb_is_refused_at_the_limit_without_inflating_it(small_server, encoding):
    """512 MiB of zeros in ~0.5 MB: refused with 413 once the inflated body passes 1 MiB; the
    server's peak memory does not grow by anything like the inflated size."""
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    bomb = compress(b"\0" * (512 << 20), 9)
    assert len(bomb) < (1 << 20)  # the compressed body is within the limit
    before = small_server.memory_kib("VmHWM")
    status, _, answer = _post(small_server.http_address, "/v2/models/cross_attention/infer", bomb,
                              {"Content-Encoding": encoding})
    assert status == 413 and "inflated" in json.loads(answer)["error"], answer
    assert small_server.memory_kib("VmHWM") - before < 64 << 10  # KiB: far below 512 MiB
    assert _post(small_server.http_address, "/v2/health/live", b"", method="GET")[0] == 200


def test_oversized_headers_are_refused(small_server):
    status, _, _ = _post(small_server.http_address, "/v2/health/live", b"", {"X-Big": "x" * 20000}, method="GET")
    assert status in (400, 431)


def test_access_log_and_metrics_count_rest_requests(small_server):
    x = random_inputs(np.random.default_rng(10), 1, 2, 2, 32, 32)
    assert _post(small_server.http_address, "/v2/models/cross_attention/infer", _json_request(x))[0] == 200
    assert _post(small_server.http_address, "/v2/models/cross_attention/infer", b"{nope")[0] == 400
    small_server.wait_for_log("http POST /v2/models/cross_attention/infer", count=2)
    metrics = _post(f"127.0.0.1:{small_server.metrics_port}", "/metrics", b"", method="GET")[2].decode()
    assert 'attnserve_requests_total{code="OK",model="cross_attention"}' in metrics
    assert 'attnserve_requests_total{code="INVALID_ARGUMENT",model="cross_attention"}' in metrics


def test_http_port_off(model_repository):
    proc = ServerProcess(model_repository, "--http-port", "-1")
    try:
        assert proc.http_port == 0 and "REST off" in proc.log()
    finally:
        assert proc.stop() == 0


def test_rest_port_in_use_is_a_clear_error_exit_3(model_repository):
    done, port = serve_with_port_taken(model_repository, "--http-port")
    assert done.returncode == 3, done.stderr
    assert f"HTTP/REST port: cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
