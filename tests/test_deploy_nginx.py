"""The compose topology, run here without Docker: two real server replicas behind a real nginx
running deploy/nginx/nginx.conf, the very file docker-compose.yml mounts, for gRPC and for REST.

What the test changes, and only that: the three `listen` ports (to free loopback ports), and
upstream.conf and upstream-http.conf, the files nginx.conf includes inside its two upstream
blocks: the compose ones name the replicas by Docker's DNS name (`server replicas:8001 resolve
...`, `server replicas:8000 resolve ...`, with resolver 127.0.0.11); here each `server` line
becomes one line per replica's loopback address (its gRPC or its REST port) with the same
parameters (max_fails, fail_timeout), and the resolver lines are dropped (no Docker DNS here,
and `resolve` needs nginx >= 1.27.3 where Debian ships 1.22). nginx runs in the foreground with
a temporary directory as its prefix (`-p`), which holds its pid file and temp directories, as
/var/cache/nginx/ does in the container.

All traffic is to 127.0.0.1. `make test` installs nginx (Debian package) when it is missing.
"""

from __future__ import annotations

import http.client
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.oip import eager, random_inputs, rest_infer
from tests.server_process import REPO_ROOT, ServerProcess

NGINX_DIR = REPO_ROOT / "deploy" / "nginx"
NGINX_CONF = NGINX_DIR / "nginx.conf"
UPSTREAM_CONF = NGINX_DIR / "upstream.conf"
UPSTREAM_HTTP_CONF = NGINX_DIR / "upstream-http.conf"
HEALTHCHECK = REPO_ROOT / "deploy" / "healthcheck.py"
# The ports nginx.conf listens on: gRPC and REST (published by compose) and its own /healthz.
GRPC_LISTEN = 8001
HTTP_LISTEN = 8000
HEALTH_LISTEN = 8081
TOLERANCE = 1e-5
NGINX_START_TIMEOUT_S = 15.0
DIMS = {"self_attention": (512, 512), "cross_attention": (32, 32)}

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (`make test` installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_nginx_conf(text: str, grpc_port: int, http_port: int, health_port: int) -> str:
    """nginx.conf with its three listen ports moved to loopback ports; nothing else changes."""
    for port, new in ((GRPC_LISTEN, grpc_port), (HTTP_LISTEN, http_port), (HEALTH_LISTEN, health_port)):
        text, count = re.subn(rf"^(\s*)listen {port}\b", rf"\g<1>listen 127.0.0.1:{new}", text, flags=re.M)
        assert count == 1, f"nginx.conf should listen on {port} exactly once, found {count}"
    return text


def render_upstream_conf(text: str, addresses: list[str]) -> str:
    """upstream.conf with each `server NAME ...;` line replaced by one line per address (same
    parameters, minus `resolve`) and the resolver lines dropped."""
    lines, servers = [], 0
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip()
        if stripped.startswith(("resolver ", "resolver_timeout ")):
            continue
        match = re.fullmatch(r"server\s+(\S+)((?:\s+\S+)*)\s*;", stripped)
        if match:
            servers += 1
            params = " ".join(p for p in match.group(2).split() if p != "resolve")
            lines += [f"server {address} {params};" for address in addresses]
        else:
            lines.append(line)
    assert servers == 1, f"upstream.conf should have one server line, found {servers}"
    return "\n".join(lines) + "\n"


class NginxProcess:
    """nginx in the foreground with a new temporary directory as its prefix: pid file, temp dirs
    and the three config files live there; its stdout (access log) and stderr (error log) go to
    files. upstreams: the replicas' gRPC addresses; http_upstreams: their REST addresses.

    The directory is readable by all (removed by stop()): nginx started as root runs its workers
    as nobody, and they write REST request bodies over client_body_buffer_size into
    client_temp/ in it (pytest's own temporary directories are root's alone)."""

    def __init__(self, upstreams: list[str], http_upstreams: list[str]) -> None:
        self.prefix = prefix = Path(tempfile.mkdtemp(prefix="attnserve-nginx-"))
        prefix.chmod(0o755)
        conf_dir = prefix / "conf"
        conf_dir.mkdir(parents=True)
        self.port, self.http_port, self.health_port = free_port(), free_port(), free_port()
        self.conf = conf_dir / "nginx.conf"
        self.conf.write_text(render_nginx_conf(NGINX_CONF.read_text(), self.port, self.http_port, self.health_port))
        (conf_dir / "upstream.conf").write_text(render_upstream_conf(UPSTREAM_CONF.read_text(), upstreams))
        (conf_dir / "upstream-http.conf").write_text(render_upstream_conf(UPSTREAM_HTTP_CONF.read_text(),
                                                                          http_upstreams))
        self.access_log, self.error_log = prefix / "access.log", prefix / "error.log"
        self._out, self._err = open(self.access_log, "wb"), open(self.error_log, "wb")
        self.command = [NGINX, "-p", f"{prefix}/", "-c", str(self.conf), "-e", "stderr", "-g", "daemon off;"]
        self.proc = subprocess.Popen(self.command, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{self.http_port}"
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + NGINX_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx not answering within {NGINX_START_TIMEOUT_S}s:\n{self.logs()}")

    def logs(self) -> str:
        for f in (self._out, self._err):
            f.flush()
        return (f"--- error log\n{self.error_log.read_text(errors='replace')}"
                f"--- access log\n{self.access_log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests, then exit
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        self._err.close()
        shutil.rmtree(self.prefix, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(model_repository):
    # One ONNX Runtime thread each: two replicas, nginx and the test share two cores here.
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: ServerProcess(model_repository, "--intra-op-threads", "1",
                                                        "--grace-period-s", "10"), range(2)))
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def nginx(replicas):
    proc = NginxProcess([r.address for r in replicas],
                        [r.http_address for r in replicas])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(nginx):
    from attnserve.client import InferenceClient

    with InferenceClient(nginx.address, timeout_s=30.0) as c:
        yield c


def successes(replica: ServerProcess) -> int:
    """Inference requests a replica answered successfully (its own ModelStatistics)."""
    from attnserve.client import InferenceClient

    with InferenceClient(replica.address, timeout_s=10.0) as c:
        return sum(s.success_count for s in c.model_statistics())


def infer_and_check(client, eager_modules, model: str, rng, b: int, lq: int, lk: int, masked: bool,
                    outputs=("output", "attn_probs")) -> None:
    x = random_inputs(rng, b, lq, lk, *DIMS[model], masked=masked)
    got = client.infer(model, x["query"], x["key"], x["value"], mask=x["mask"], outputs=outputs)
    want = eager(eager_modules[model], **x)
    assert set(got) == set(outputs)
    for name in outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOLERANCE, err_msg=f"{model} {name}")


ACCESS_LINE = re.compile(r'" (\d{3}) grpc-status=(\S*) upstream=(.*) time=')


def retry_answers(access_log: str) -> list[str]:
    """The upstream that answered each call nginx passed on with a status our client retries:
    UNAVAILABLE (grpc-status 14, or an HTTP 502/503/504 of nginx's own, which gRPC clients read as
    UNAVAILABLE) or CANCELLED (grpc-status 1: gRPC core's answer to a call that reaches a replica
    in the instant its stop begins, before nginx has read the GOAWAY)."""
    answered = []
    for status, grpc_status, upstreams in ACCESS_LINE.findall(access_log):
        if grpc_status in ("14", "1") or status in ("502", "503", "504"):
            answered.append(upstreams.split(", ")[-1])  # after nginx's own retries, the last one answered
    return answered


def run_healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30)


def test_both_replicas_serve_correct_answers_through_nginx(nginx, replicas, client, eager_modules):
    before = [successes(r) for r in replicas]
    rng = np.random.default_rng(5)
    cases = [("self_attention", 1, 10, 10, False), ("cross_attention", 2, 256, 77, True),
             ("self_attention", 2, 7, 13, True), ("cross_attention", 1, 3, 77, False),
             ("self_attention", 1, 1, 1, False), ("cross_attention", 3, 16, 5, True)]
    try:
        for model, b, lq, lk, masked in cases:
            infer_and_check(client, eager_modules, model, rng, b, lq, lk, masked)
        # 4.9 MB of request (4 x 200 x 512 floats, three times): over nginx's 1 MiB default body
        # limit and gRPC's 4 MiB default message size.
        infer_and_check(client, eager_modules, "self_attention", rng, 4, 200, 200, False, outputs=("output",))
    except Exception:
        print(nginx.logs())
        raise
    served = [successes(r) - b for r, b in zip(replicas, before, strict=True)]
    print(f"calls served per replica: {served}")
    assert sum(served) == len(cases) + 1, served
    assert min(served) >= 2, f"round robin should spread {len(cases) + 1} calls over both replicas: {served}"
    assert client.retry_count == 0


def test_healthcheck_script_asks_the_health_service(nginx, replicas):
    for address in (replicas[0].address, replicas[1].address, nginx.address):
        result = run_healthcheck("--address", address)
        assert result.returncode == 0, result.stderr
    assert run_healthcheck("--address", replicas[0].address, "--service", "self_attention").returncode == 0
    unknown = run_healthcheck("--address", replicas[0].address, "--service", "no_such_model")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr
    closed = run_healthcheck("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert closed.returncode == 1 and "unhealthy" in closed.stderr


def rest_client(address: str):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url=address, connection_timeout=10.0, network_timeout=60.0)


def http_get(address: str, path: str) -> int:
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


REST_LINE = re.compile(r'" (\d{3}) rest upstream=(.*) upstream-status=(.*) time=')


def rest_retries(access_log: str) -> list[tuple[str, str]]:
    """(upstreams, their statuses) of each REST request nginx sent to more than one replica."""
    return [(upstreams, statuses) for _status, upstreams, statuses in REST_LINE.findall(access_log)
            if "," in statuses]


def test_rest_through_nginx_equals_eager_on_both_presets_and_is_balanced(nginx, replicas, eager_modules):
    """nginx's REST port (8000 in compose): readiness, and binary-tensor and JSON inference
    (tritonclient.http, unmodified) equal to eager PyTorch, spread over both replicas."""
    assert http_get(nginx.http_address, "/v2/health/ready") == 200
    before = [successes(r) for r in replicas]
    rng = np.random.default_rng(8)
    cases = [("self_attention", 1, 9, 9, False, True), ("cross_attention", 2, 256, 77, True, True),
             ("self_attention", 2, 5, 7, True, False), ("cross_attention", 1, 3, 77, False, False)]
    client = rest_client(nginx.http_address)
    try:
        for model, b, lq, lk, masked, binary in cases:
            x = random_inputs(rng, b, lq, lk, *DIMS[model], masked=masked)
            got, want = rest_infer(client, model, x, binary), eager(eager_modules[model], **x)
            for name in ("output", "attn_probs"):
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOLERANCE,
                                           err_msg=f"{model} {name} binary={binary}")
        # 4.9 MB of binary body: over nginx's default client_max_body_size (1 MiB) and its
        # client_body_buffer_size (nginx spills it to a temp file and passes it on whole).
        x = random_inputs(rng, 4, 200, 200, *DIMS["self_attention"])
        got = rest_infer(client, "self_attention", x, True, outputs=("output",))
        np.testing.assert_allclose(got["output"], eager(eager_modules["self_attention"], **x)["output"],
                                   rtol=0, atol=TOLERANCE)
    except Exception:
        print(nginx.logs())
        raise
    finally:
        client.close()
    served = [successes(r) - b for r, b in zip(replicas, before, strict=True)]
    print(f"REST calls served per replica: {served}")
    assert sum(served) == len(cases) + 1 and min(served) >= 2, served


def http_post(address: str, path: str, body: bytes = b"{}") -> int:
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_rest_503_that_is_no_drain_leaves_every_replica_in_rotation(nginx, replicas):
    """A 503 that every replica gives outside inference (here: a model load, which the model
    repository API refuses with UNAVAILABLE outside --model-control-mode explicit) reaches the
    client as the replicas' 503, every time, and REST goes on: nginx counts each 503 it retried as
    a failed attempt, so were 503 retried on every path, two such calls would leave no replica in
    rotation (nginx: 502 to every REST call for fail_timeout). nginx.conf retries 503 on
    inference only."""
    path = "/v2/repository/models/cross_attention/load"
    assert [http_post(r.http_address, path) for r in replicas] == [503, 503]
    assert [http_post(nginx.http_address, path) for _ in range(4)] == [503] * 4, nginx.logs()
    assert http_get(nginx.http_address, "/v2/health/ready") == 200, nginx.logs()
    assert http_get(nginx.http_address, "/v2/models/cross_attention/ready") == 200, nginx.logs()


def infer_once(address: str, model: str, x: dict) -> dict:
    from attnserve.client import InferenceClient

    with InferenceClient(address, timeout_s=60.0) as c:
        return c.infer(model, x["query"], x["key"], x["value"], mask=x["mask"], outputs=("output",))


def test_rest_calls_through_nginx_skip_a_draining_replica(model_repository, replicas, eager_modules):
    """A replica drains while one call it admitted is held in flight (tests/gated_server.py),
    so it stays up refusing: its own readiness and inference answer 503, and REST calls through
    nginx all succeed: nginx sends the ones it chose the draining replica for again to the other
    (proxy_next_upstream http_503). Once the held call is answered the replica exits 0, and calls
    still succeed (the connection is refused: the next replica)."""
    from tests.gated_server import GatedServer

    survivor = replicas[1]  # test_service_goes_on_when_a_replica_stops stops replicas[0]
    rng = np.random.default_rng(9)
    with GatedServer(model_repository, "--intra-op-threads", "1", "--grace-period-s", "60") as draining, \
            ThreadPoolExecutor(1) as pool:
        proc = NginxProcess([draining.address, survivor.address],
                            [draining.http_address, survivor.http_address])
        client = rest_client(proc.http_address)
        try:
            held_x = random_inputs(rng, 1, 4, 4, *DIMS["cross_attention"])
            held = pool.submit(infer_once, draining.address, "cross_attention", held_x)
            draining.gate.wait_started()
            draining.signal(signal.SIGTERM)
            draining.wait_for_log("refusing new calls (UNAVAILABLE); finishing 1 call(s)")
            assert http_get(draining.http_address, "/v2/health/ready") == 503
            status = http_get(draining.http_address, "/v2/models/cross_attention/ready")
            assert status == 503, "a draining replica's models are not ready"
            for i in range(4):
                model = ("self_attention", "cross_attention")[i % 2]
                x = random_inputs(rng, 1, 6, 5, *DIMS[model], masked=bool(i % 2))
                got, want = rest_infer(client, model, x, bool(i < 2)), eager(eager_modules[model], **x)
                for name in ("output", "attn_probs"):
                    np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOLERANCE)
            deadline = time.monotonic() + 20  # nginx logs a request as it finalizes it
            while not (retried := rest_retries(proc.access_log.read_text())):
                assert time.monotonic() < deadline, proc.logs()
                time.sleep(0.05)
            assert all(upstreams.startswith(draining.http_address) and statuses.startswith("503")
                       for upstreams, statuses in retried), retried
            draining.gate.release()
            got = held.result(timeout=60)
            np.testing.assert_allclose(got["output"], eager(eager_modules["cross_attention"], **held_x)["output"],
                                       rtol=0, atol=TOLERANCE)
            assert draining.wait(timeout=60) == 0, draining.log()
            for _ in range(2):
                x = random_inputs(rng, 1, 3, 3, *DIMS["cross_attention"])
                got = rest_infer(client, "cross_attention", x, True, outputs=("output",))
                np.testing.assert_allclose(got["output"], eager(eager_modules["cross_attention"], **x)["output"],
                                           rtol=0, atol=TOLERANCE)
        except Exception:
            print(proc.logs())
            raise
        finally:
            client.close()
            proc.stop()
    print(f"REST calls nginx sent again to the other replica: {retried}")


def test_service_goes_on_when_a_replica_stops(nginx, replicas, client, eager_modules):
    """SIGTERM one replica: calls through nginx keep succeeding with correct answers. While it
    drains, it answers UNAVAILABLE and the client retries (as it retries the CANCELLED that gRPC's
    core gives a call arriving in the instant its stop begins: seen once in CI); once it is gone,
    nginx moves each call to the other replica itself (grpc_next_upstream error), so the client
    sees no error at all."""
    stopped, survivor = replicas
    survivor_before = successes(survivor)
    rng = np.random.default_rng(6)
    sent = 0
    try:
        stopped.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while stopped.proc.poll() is None and time.monotonic() < deadline and sent < 20:
            infer_and_check(client, eager_modules, "cross_attention", rng, 1, 8, 8, False)
            sent += 1
        assert stopped.wait(timeout=20) == 0, stopped.log()
        retries_while_draining = client.retry_count
        for i in range(6):
            infer_and_check(client, eager_modules, ("self_attention", "cross_attention")[i % 2], rng, 1, 5, 9, True)
            sent += 1
    except Exception:
        print(nginx.logs())
        raise
    print(f"{sent} calls after SIGTERM, {retries_while_draining} client retries while draining; "
          f"access log:\n{nginx.access_log.read_text()}")
    assert client.retry_count == retries_while_draining, "after the replica exited nginx should retry, not the client"
    # How many calls met the draining replica depends on how long its drain took next to a call:
    # no bound on that. What holds on any machine: each client retry answers one UNAVAILABLE (or
    # CANCELLED) that nginx passed on from the stopped replica, and nothing else made the client retry.
    deadline = time.monotonic() + 20  # nginx logs a call as it finalizes it: wait for the lines
    while len(told_to_retry := retry_answers(nginx.access_log.read_text())) < retries_while_draining:
        assert time.monotonic() < deadline, told_to_retry
        time.sleep(0.05)
    assert len(told_to_retry) == retries_while_draining, told_to_retry
    assert all(upstream == stopped.address for upstream in told_to_retry), told_to_retry
    # A call the stopped replica admitted just before its signal arrived may have been its last.
    assert sent - 1 <= successes(survivor) - survivor_before <= sent
    assert run_healthcheck("--address", nginx.address).returncode == 0
