"""The drain on the REST port: readiness 503 at once, calls admitted during the drain delay, then
refused with 503 (never computed), and every admitted call answered, as on gRPC (test_drain.py).

Work in flight is held at the gate of tests/gated_server.py; the server's access log says when a
call's headers arrived ("http POST ..."), its drain lines when it reached each state.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal

import numpy as np

from tests.gated_server import GatedServer
from tests.oip import eager, random_inputs
from tests.test_rest import _json_request, _post

TOLERANCE = 1e-5
INFER_PATH = "/v2/models/self_attention/infer"
INFER_HEADERS = f"http POST {INFER_PATH}"  # the access log's line per REST call
REFUSING = "refusing new calls (UNAVAILABLE)"


def _request(rng):
    return random_inputs(rng, 2, 6, 5, 512, 512)


def _close(answer: bytes, x, eager_modules) -> bool:
    (output,) = json.loads(answer)["outputs"]
    got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
    want = eager(eager_modules["self_attention"], **x)["output"]
    return float(np.max(np.abs(got - want))) <= TOLERANCE


def test_sigterm_answers_every_admitted_rest_call_and_refuses_later_ones_with_503(model_repository, eager_modules):
    rng = np.random.default_rng(0)
    cases = [_request(rng) for _ in range(6)]
    with GatedServer(model_repository, "--max-batch-size", "2", "--access-log", "--grace-period-s", "120") as proc, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_post, proc.http_address, INFER_PATH, _json_request(x)) for x in cases]
        proc.gate.wait_started()
        proc.wait_for_log(INFER_HEADERS, count=6)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log(REFUSING)
        status, headers, answer = _post(proc.http_address, INFER_PATH, _json_request(_request(rng)))
        assert status == 503 and "shutting down" in json.loads(answer)["error"], answer
        assert headers.get("Connection") == "close"  # go to another replica
        assert _post(proc.http_address, "/v2/health/ready", b"", method="GET")[:1] == (503,)
        proc.gate.release(100)
        for x, future in zip(cases, futures, strict=True):
            status, _, answer = future.result(timeout=120)
            assert status == 200 and _close(answer, x, eager_modules), answer
        assert proc.wait(timeout=60) == 0, proc.log()


def test_rest_readiness_is_503_at_once_and_calls_are_admitted_during_the_drain_delay(model_repository, eager_modules):
    rng = np.random.default_rng(1)
    with GatedServer(model_repository, "--drain-delay-s", "600", "--access-log") as proc, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert _post(proc.http_address, "/v2/health/ready", b"", method="GET")[0] == 200
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("still admitting calls")
        status, _, answer = _post(proc.http_address, "/v2/health/ready", b"", method="GET")
        assert (status, json.loads(answer)) == (503, {"ready": False})
        assert _post(proc.http_address, "/v2/models/self_attention/ready", b"", method="GET")[0] == 503
        assert _post(proc.http_address, "/v2/health/live", b"", method="GET")[0] == 200
        x = _request(rng)
        future = pool.submit(_post, proc.http_address, INFER_PATH, _json_request(x))
        proc.gate.wait_started()  # admitted and computing, during the drain delay
        proc.gate.release()
        status, _, answer = future.result(timeout=120)
        assert status == 200 and _close(answer, x, eager_modules)
        assert proc.proc.poll() is None and REFUSING not in proc.log()
        proc.signal(signal.SIGTERM)  # a second signal ends the drain delay at once
        assert proc.wait(timeout=60) == 0, proc.log()


def test_a_rest_call_whose_body_is_still_arriving_at_sigterm_is_served(model_repository, eager_modules):
    """Its headers came before the signal, its body after the server began refusing: it was
    admitted (counted from its headers, as a gRPC call is), so the drain waits for it and serves it."""
    import socket

    x = _request(np.random.default_rng(2))
    body = _json_request(x)
    with GatedServer(model_repository, "--access-log", "--grace-period-s", "120") as proc:
        proc.gate.release(100)  # nothing to hold: the call is held by its own body
        with socket.create_connection(("127.0.0.1", proc.http_port), timeout=60) as conn:
            conn.sendall(f"POST {INFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:100])
            proc.wait_for_log(INFER_HEADERS)
            proc.signal(signal.SIGTERM)
            proc.wait_for_log(REFUSING)
            conn.sendall(body[100:])
            answer = b""
            while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _content_length(answer):
                chunk = conn.recv(1 << 16)
                assert chunk, answer
                answer += chunk
        head, payload = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200"), answer[:300]
        assert _close(payload, x, eager_modules)
        assert proc.wait(timeout=60) == 0, proc.log()


def _content_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return int(next(line.split(":", 1)[1] for line in head.split("\r\n") if line.startswith("content-length:")))
