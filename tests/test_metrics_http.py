"""The metrics port: /metrics only, bounded in connections and threads, clean startup errors."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from tests.server_process import ServerProcess, serve_with_port_taken


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@pytest.fixture(scope="module")
def metrics_server(model_repository):
    proc = ServerProcess(model_repository)
    yield proc
    proc.stop()


def test_only_metrics_is_served(metrics_server):
    port = metrics_server.metrics_port
    status, body = _get(port, "/metrics")
    assert status == 200 and b"# TYPE attnserve_requests_total counter" in body
    assert _get(port, "/metrics?name[]=attnserve_queue_depth")[0] == 200
    for path in ("/", "/healthz", "/v2/health/ready", "/metricsx"):
        status, body = _get(port, path)
        assert status == 404 and b"/metrics" in body, path
    assert _get(port, "/metrics", method="POST")[0] == 405
    status, body = _get(port, "/metrics", method="HEAD")
    assert status == 200 and body == b""


def test_unfinished_requests_start_no_threads(metrics_server):
    """300 connections that send half a request: the server's thread count stays where it was
    (prometheus_client's own server started one thread for each), and /metrics answers after."""
    pid = metrics_server.proc.pid
    before = _threads(pid)
    sockets = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", metrics_server.metrics_port), timeout=10)
            sockets.append(s)
            try:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never finished
            except OSError:
                pass  # beyond the connection bound the server closes at once
        # The server's event loop has seen them all once its health service (same loop) answers.
        assert metrics_server.health() == health_pb2.HealthCheckResponse.SERVING
        assert _threads(pid) <= before + 2, f"threads {before} -> {_threads(pid)}"
    finally:
        for s in sockets:
            s.close()
    assert _get(metrics_server.metrics_port, "/metrics")[0] == 200


def test_metrics_port_in_use_exits_3_with_one_line(model_repository):
    done, port = serve_with_port_taken(model_repository, "--metrics-port")
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"metrics port 127.0.0.1:{port}" in errors[0], done.stderr
