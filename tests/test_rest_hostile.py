"""The REST port against hostile and careless clients (issue 27; docs/rest-hardening.md): slow
request heads and the connection cap, bodies inside the memory budget, aiohttp's own refusals
as JSON, numbers JSON cannot carry, and client faults that log little and count apart."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import socket
import time

import numpy as np
import pytest
from attnserve.server.ratelimit import RateLimitedLog

from tests.oip import random_inputs
from tests.server_process import ServerProcess
from tests.test_rest import _post, _x_json

INFER = "/v2/models/cross_attention/infer"


def _raw(address: str, data: bytes, timeout_s: float = 30.0) -> bytes:
    """Send `data` on a new connection; everything the server sends until it closes."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def _status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, answer[:300]
    return int(head.split()[1]), json.loads(body)


def _metrics(proc: ServerProcess) -> str:
    return _post(f"127.0.0.1:{proc.metrics_port}", "/metrics", b"", method="GET")[2].decode()


def _metric(proc: ServerProcess, line_start: str) -> float:
    return sum(float(line.split()[-1]) for line in _metrics(proc).splitlines() if line.startswith(line_start))


# -- defect 4: slow heads and the connection cap ---------------------------------------------

@pytest.fixture(scope="module")
def capped_server(model_repository):
    """4 REST connections at most; a head may take a minute (only the cap is at play here)."""
    proc = ServerProcess(model_repository, "--max-http-connections", "4", "--http-header-timeout-s", "60")
    yield proc
    proc.stop()


def test_connections_that_never_finish_their_heads_cannot_hold_the_port(capped_server):
    """Twice the cap in connections that send half a head: a readiness probe is still served,
    and the oldest of them were closed (without an answer) to make room."""
    host, port = capped_server.http_address.split(":")
    held = []
    try:
        for _ in range(8):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            held.append(sock)
        status, _, answer = _post(capped_server.http_address, "/v2/health/ready", b"", method="GET")
        assert (status, json.loads(answer)) == (200, {"ready": True})
        assert _closed_without_an_answer(held[0])  # the oldest: closed for a newer one
        assert _metric(capped_server, "attnserve_http_evictions_total") >= 4
    finally:
        for sock in held:
            sock.close()


def test_connections_accepted_in_one_burst_count_against_the_cap_each():
    """asyncio accepts a burst of connections before it makes any of them: each one of the burst
    counts against the cap from its acceptance, so the port never holds more than the cap."""
    from attnserve.server.lifecycle import Admission, Arrivals, Draining
    from attnserve.server.metrics import Metrics
    from attnserve.server.models import ModelRegistry
    from attnserve.server.request_path import RequestPath
    from attnserve.server.rest import RestPort

    def connect_all(port: int, count: int) -> list[socket.socket]:
        """`count` connections, each established (in the listener's queue) before this returns:
        the event loop is not run meanwhile, so it finds them all at once."""
        socks = [socket.socket() for _ in range(count)]
        for sock in socks:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        for sock in socks:
            _, writable, _ = select.select([], [sock], [], 30)
            assert writable and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return socks

    async def until(predicate, what: str) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def main() -> tuple[int, int, int, int]:
        draining = Draining()
        request_path = RequestPath(ModelRegistry(), Metrics(), draining)
        rest = RestPort(request_path, Admission(Arrivals()), draining, None, 1 << 20, max_connections=4,
                        head_timeout_s=60)
        port = await rest.start("127.0.0.1", 0)
        held = []
        try:
            held += connect_all(port, 2)
            await until(lambda: rest.open_connections == 2, "the first two connections made")
            held += connect_all(port, 4)  # one burst, two over the cap
            await until(lambda: rest.evictions >= 2, "two evictions for the burst")
            burst = (rest.open_connections, rest.evictions)
            held += connect_all(port, 2)
            await until(lambda: rest.evictions >= 4, "two more evictions")
            return (*burst, rest.open_connections, rest.evictions)
        finally:
            for sock in held:
                sock.close()
            await rest.close(0)

    assert asyncio.run(main()) == (4, 2, 4, 4)


def _closed_without_an_answer(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (a FIN, or a reset) having sent nothing; waits for it."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def impatient_server(model_repository):
    proc = ServerProcess(model_repository, "--http-header-timeout-s", "1")
    yield proc
    proc.stop()


def test_a_head_that_takes_too_long_is_answered_408_and_closed(impatient_server):
    answer = _raw(impatient_server.http_address, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")
    status, document = _status_and_json(answer)
    assert status == 408 and "--http-header-timeout-s" in document["error"]
    assert _metric(impatient_server, "attnserve_http_head_timeouts_total") >= 1
    # A keep-alive connection between requests is not timed by it (its idle timer is KEEPALIVE_S).
    connection = http.client.HTTPConnection(impatient_server.http_address, timeout=30)
    try:
        for _ in range(2):
            connection.request("GET", "/v2/health/live")
            assert connection.getresponse().read() == b'{"live":true}'
    finally:
        connection.close()


# -- defect 6: bodies inside the memory budget -----------------------------------------------

MIB = 1 << 20


@pytest.fixture(scope="module")
def budget_server(model_repository):
    """A 64 MiB memory budget (56 MiB of it grantable: an eighth is the waiting room)."""
    proc = ServerProcess(model_repository, "--memory-limit-bytes", str(64 * MIB))
    yield proc
    proc.stop()


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout_s}s: {what}"
        time.sleep(0.02)


def test_a_body_being_received_holds_its_share_of_the_memory_budget(budget_server):
    """A body held half-sent reserves twice what has arrived (its chunks and their join); a second
    body that would take the budget past its limit is refused with 429 as it arrives, and the
    server's peak RSS stays within the budget."""
    host, port = budget_server.http_address.split(":")
    budget_server.reset_memory_peak()  # the peak from here on, not the start's or an earlier test's
    idle_kib = budget_server.memory_kib("VmRSS")
    first = socket.create_connection((host, int(port)), timeout=60)
    try:
        first.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (INFER.encode(), 25 * MIB))
        first.sendall(b" " * (24 * MIB))  # the last MiB is never sent while the second comes
        _wait_for(lambda: _metric(budget_server, "attnserve_memory_reserved_bytes") >= 48 * MIB,
                  "the first body's 24 MiB reserved twice")
        status, _, answer = _post(budget_server.http_address, INFER, b" " * (10 * MIB))
        assert status == 429 and "memory budget" in json.loads(answer)["error"], answer[:300]
    finally:
        first.close()
    _wait_for(lambda: _metric(budget_server, "attnserve_memory_reserved_bytes") == 0, "the budget given back")
    assert budget_server.memory_kib("VmHWM") - idle_kib < 96 * 1024  # KiB: the budget and some slack


def test_a_body_that_alone_could_never_fit_is_refused_before_it_is_held(budget_server):
    status, _, answer = _post(budget_server.http_address, INFER, b" " * (40 * MIB))  # x2 is over 64 MiB
    assert status == 400 and "--memory-limit-bytes" in json.loads(answer)["error"], answer[:300]


# -- defect 13: aiohttp's own refusals are JSON ----------------------------------------------

REFUSALS = {  # case -> (bytes sent, HTTP status, text in the error)
    "not HTTP": (b"GARBAGE\r\n\r\n", 400, "not valid HTTP/1.1"),
    "Content-Length and Transfer-Encoding (smuggling)": (
        b"POST /v2/models/cross_attention/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "Transfer-Encoding"),
    "a header field too long": (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 9000 + b"\r\n\r\n",
                                431, "8,190 bytes"),
    "too many headers": (b"GET /v2/health/live HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100))
                         + b"\r\n", 431, "64 headers"),
    "a request line too long": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "8,190 bytes"),
    "an unsupported encoding": (b"POST /v2/models/cross_attention/infer HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Encoding: zstd\r\nContent-Length: 2\r\n\r\n{}", 415, "gzip or deflate"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_the_frameworks_refusals_are_json_with_the_tables_status(server, case):
    sent, expected, text = REFUSALS[case]
    status, document = _status_and_json(_raw(server.http_address, sent))
    assert status == expected and text in document["error"], document
    assert "install" not in document["error"].lower()


# -- defects 10, 11, 12: numbers JSON cannot carry, nesting --------------------------------

def _with_key_data(data) -> bytes:
    return json.dumps(_x_json(key={"data": data})).encode()


def _mask(data) -> bytes:
    return json.dumps(_x_json(extra={"name": "mask", "datatype": "BOOL", "shape": [1, 2, 2], "data": data})).encode()


BAD_NUMBERS = {  # case -> (body, text in the error)
    "deep nesting": (b"[" * 100_000, "nested too deeply"),
    "deep nesting in data": (_with_key_data([]).replace(b'"data": []', b'"data": ' + b"[" * 100_000), "nested too"),
    "10**400": (_with_key_data([10**400] + [0.0] * 63), "input 'key'"),
    "2**64": (_with_key_data([2**64] + [0.0] * 63), "input 'key'"),
    "1e39 (past float32)": (_with_key_data([1e39] + [0.0] * 63), "input 'key'"),
    "NaN": (_with_key_data([0.0] * 63 + [float("nan")]), "input 'key'"),
    "Infinity": (_with_key_data([float("inf")] + [0.0] * 63), "input 'key'"),
    "-Infinity": (_with_key_data([float("-inf")] + [0.0] * 63), "input 'key'"),
    "1e999": (_with_key_data([0.0] * 64).replace(b"0.0]", b"1e999]"), "input 'key'"),
    "[null]": (_with_key_data([None] * 64), "input 'key'"),
    "BOOL null": (_mask(None), "input 'mask'"),
    "BOOL {}": (_mask({}), "input 'mask'"),
}


@pytest.mark.parametrize("case", list(BAD_NUMBERS))
def test_numbers_json_cannot_carry_and_deep_nesting_are_400_naming_the_input(server, case):
    body, text = BAD_NUMBERS[case]
    status, headers, answer = _post(server.http_address, INFER, body)
    assert status == 400 and headers["Content-Type"].startswith("application/json"), answer[:300]
    assert text in json.loads(answer)["error"], answer[:300]


def _strict(text: bytes) -> object:
    def refuse(token: str):
        raise AssertionError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_outputs_are_written_as_strings_in_strict_json(server):
    """NaN in a binary input gives NaN outputs; their JSON `data` is strict JSON ("NaN" strings,
    as protobuf's JSON mapping writes them), which numpy reads back as nan."""
    x = random_inputs(np.random.default_rng(27), 1, 2, 2, 32, 32)
    x["query"][0, 0, 0] = np.nan
    inputs, tail = [], b""
    for name in ("query", "key", "value"):
        raw = x[name].astype("<f4").tobytes()
        inputs.append({"name": name, "shape": list(x[name].shape), "datatype": "FP32",
                       "parameters": {"binary_data_size": len(raw)}})
        tail += raw
    head = json.dumps({"inputs": inputs, "outputs": [{"name": "output"}]}).encode()
    status, _, answer = _post(server.http_address, INFER, head + tail,
                              {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200, answer[:300]
    data = _strict(answer)["outputs"][0]["data"]
    assert "NaN" in data and np.isnan(np.array(data, dtype=np.float32)).any()


# -- defect 9: client faults log little, and count apart ------------------------------------

def test_client_faults_log_a_few_lines_without_tracebacks_and_never_count_as_internal(model_repository):
    proc = ServerProcess(model_repository)
    try:
        before = len(proc.log())
        for _ in range(30):
            _raw(proc.http_address, b"GARBAGE\r\n\r\n")
            assert _post(proc.http_address, INFER, _with_key_data([None] * 64))[0] == 400
        host, port = proc.http_address.split(":")
        for _ in range(10):  # a body cut off: the client goes away mid-body, once the server reads it
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{" % INFER.encode())
                _wait_for(lambda: _metric(proc, "attnserve_memory_reserved_bytes") > 0, "the body being read")
            _wait_for(lambda: _metric(proc, "attnserve_memory_reserved_bytes") == 0, "the body given up")
        _wait_for(lambda: _metric(proc, 'attnserve_requests_total{code="CANCELLED"') == 10, "10 cancelled")
        assert _metric(proc, 'attnserve_requests_total{code="INVALID_ARGUMENT"') == 30
        assert _metric(proc, 'attnserve_requests_total{code="INTERNAL"') == 0
        added = proc.log()[before:]
        assert "Traceback" not in added and "ERROR" not in added, added[:2000]
        assert len(added) < 4000, added  # at most a burst of one-line refusals
    finally:
        proc.stop()


def test_the_rate_limited_log_reports_what_it_dropped(caplog):
    now = [0.0]
    limited = RateLimitedLog(burst=2, interval_s=10.0, clock=lambda: now[0])
    log = logging.getLogger("tests.ratelimit")
    with caplog.at_level(logging.INFO, logger="tests.ratelimit"):
        results = [limited.log(log, logging.INFO, "refused %d", i) for i in range(5)]
        now[0] = 10.0
        limited.log(log, logging.INFO, "refused %d", 5)
    assert results == [True, True, False, False, False]
    assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1",
                                                        "refused 5 [3 similar lines dropped]"]
    assert limited.dropped_total == 3
