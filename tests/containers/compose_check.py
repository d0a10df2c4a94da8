"""docker-compose.yml run for real with podman-compose (`make test-containers`, after the images
are built): one PASS/FAIL line per property, exit 1 on the first failure, the containers' logs in
WORK/logs/ either way.

What differs from `docker compose up` here, and only that (an override file written into WORK):
nginx's image (a stand-in, localhost/attnserve-ci/nginx: no registry), its published ports (free
loopback ports instead of 8001 and 8000) and the resolver of upstream.conf and upstream-http.conf:
Docker's embedded DNS is 127.0.0.11; podman's (aardvark-dns) answers on the network's gateway, so
the project network is made first with a fixed subnet and both files are mounted with `resolver
GATEWAY` in place of `resolver 127.0.0.11`; every other line of them, and nginx.conf, are the
repository's files.

Health: podman 4.3 has no systemd here to run HEALTHCHECKs on a timer, and podman-compose ignores
`condition: service_healthy` before podman 4.6; so this runs each container's own HEALTHCHECK
(`podman healthcheck run`) until it reports healthy, the check Docker would run on its timer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.oip import eager, random_inputs, rest_infer  # noqa: E402

PROJECT = "attnserve"
NETWORK = f"{PROJECT}_default"
VOLUME = f"{PROJECT}_models"
SUBNET, GATEWAY = "10.89.231.0/24", "10.89.231.1"
TOLERANCE = 1e-5
DIMS = {"self_attention": (512, 512), "cross_attention": (32, 32)}
HEALTHY_TIMEOUT_S = 240.0
UID = "10001"


def log(message: str) -> None:
    print(message, flush=True)


class Failed(Exception):
    pass


def check(condition: bool, what: str, detail: str = "") -> None:
    if not condition:
        raise Failed(f"{what}{': ' + detail if detail else ''}")
    log(f"PASS: {what}")


def run(*cmd: str, check_rc: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check_rc and result.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def podman(*args: str, **kw) -> subprocess.CompletedProcess:
    return run("podman", *args, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Compose:
    def __init__(self, podman_compose: str, work: Path, nginx_image: str) -> None:
        self.work = work
        self.port, self.http_port = free_port(), free_port()  # nginx's gRPC and REST ports
        volumes = [f"{REPO}/deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro"]
        for name in ("upstream.conf", "upstream-http.conf"):
            upstream = (REPO / "deploy/nginx" / name).read_text()
            upstream, count = re.subn(r"^resolver 127\.0\.0\.11 ", f"resolver {GATEWAY} ", upstream, flags=re.M)
            assert count == 1, f"{name} should name Docker's resolver 127.0.0.11 once"
            (work / name).write_text(upstream)
            volumes.append(f"{work.resolve()}/{name}:/etc/nginx/{name}:ro")
        # YAML, for podman-compose's `!override`: its merge would add these ports to the file's
        # own (8001 and 8000 on every interface) instead of replacing them.
        (work / "compose.override.yml").write_text(
            f"services:\n  nginx:\n    image: {json.dumps(nginx_image)}\n"
            f"    ports: !override {json.dumps([f'127.0.0.1:{self.port}:8001', f'127.0.0.1:{self.http_port}:8000'])}\n"
            f"    volumes: {json.dumps(volumes)}\n")
        self.cmd = [podman_compose, "-f", str(REPO / "docker-compose.yml"), "-f", str(work / "compose.override.yml")]

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        result = run(*self.cmd, *args, check_rc=False, timeout=timeout)
        (self.work / "podman-compose.log").open("a").write(f"$ {' '.join(args)}\n{result.stdout}{result.stderr}\n")
        if result.returncode != 0:
            raise Failed(f"podman-compose {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
        return result

    def override_note(self) -> str:
        return (self.work / "compose.override.yml").read_text()


def containers(service: str) -> list[str]:
    out = podman("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                 "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}").stdout
    return sorted(out.split())


def inspect(container: str, fmt: str) -> str:
    return podman("inspect", "--format", fmt, container).stdout.strip()


def address(container: str, port: int = 8001) -> str:
    """The container's address on the project network: its gRPC port, or `port` (8000: REST)."""
    ip = inspect(container, f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}')
    return f"{ip}:{port}"


def http_get(address: str, path: str, timeout: float = 10.0) -> int:
    connection = http.client.HTTPConnection(address, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


class BadGateway(RuntimeError):
    """nginx answered 502: it reached no replica for that request."""


def rest_json_infer(connection: http.client.HTTPConnection, model: str, x: dict) -> dict:
    """One JSON inference over REST with the standard library (for the load threads)."""
    from attnserve.contract import DATATYPES, INPUT_NAMES

    body = json.dumps({"inputs": [{"name": n, "shape": list(x[n].shape), "datatype": DATATYPES[n],
                                   "data": x[n].ravel().tolist()} for n in INPUT_NAMES if x.get(n) is not None],
                       "outputs": [{"name": "output"}]})
    connection.request("POST", f"/v2/models/{model}/infer", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    text = response.read()
    if response.status == 502:
        raise BadGateway(f"REST {model}: HTTP 502: {text[:300]!r}")
    if response.status != 200:
        raise RuntimeError(f"REST {model}: HTTP {response.status}: {text[:300]!r}")
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in json.loads(text)["outputs"]}


def wait_healthy(container: str) -> float:
    """Run the container's HEALTHCHECK until it passes; seconds it took."""
    start = time.monotonic()
    while True:
        result = podman("healthcheck", "run", container, check_rc=False, timeout=60)
        if result.returncode == 0:
            return time.monotonic() - start
        if inspect(container, "{{.State.Status}}") != "running":
            raise Failed(f"{container} stopped before it was healthy:\n{podman('logs', container).stderr[-3000:]}")
        if time.monotonic() - start > HEALTHY_TIMEOUT_S:
            raise Failed(f"{container} not healthy within {HEALTHY_TIMEOUT_S} s: {result.stdout}{result.stderr}")
        time.sleep(1)


def eager_modules() -> dict:
    from attnserve.export import checkpoint
    from attnserve.export.config import PRESETS

    # The export job's demo weights: deterministic, seed 0 (the same as `attnserve export`).
    return {name: checkpoint.demo_module(PRESETS[name], seed=0) for name in DIMS}


def infer_and_check(client, modules, model: str, rng, b: int, lq: int, lk: int, masked: bool) -> None:
    x = random_inputs(rng, b, lq, lk, *DIMS[model], masked=masked)
    got = client.infer(model, x["query"], x["key"], x["value"], mask=x["mask"], outputs=("output", "attn_probs"))
    want = eager(modules[model], **x)
    for name in ("output", "attn_probs"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOLERANCE, err_msg=f"{model} {name}")


def successes(container: str) -> int:
    """Inference calls a replica answered (its own ModelStatistics, asked on its network address)."""
    from attnserve.client import InferenceClient

    with InferenceClient(address(container), timeout_s=10.0) as c:
        return sum(s.success_count for s in c.model_statistics())


def check_export(modules) -> None:
    (export,) = containers("export")
    check(inspect(export, "{{.State.Status}}") == "exited" and inspect(export, "{{.State.ExitCode}}") == "0",
          "export job exited 0", podman("logs", export).stderr[-2000:])
    logs = podman("logs", export)
    text = logs.stdout + logs.stderr
    check(all(f"exporting {p}" in text for p in DIMS), "export job exported both presets into the volume", text[-2000:])
    check(inspect(export, "{{.Config.User}}") == f"{UID}:{UID}", f"export job ran as uid {UID}")
    mountpoint = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", VOLUME).stdout.strip())
    owners = {p.relative_to(mountpoint).as_posix(): p.stat().st_uid for p in mountpoint.rglob("*")}
    check(owners and set(owners.values()) == {int(UID)}, f"every file the export job wrote belongs to uid {UID}",
          str(owners))
    check(all((mountpoint / p / "1" / "model.onnx").is_file() for p in DIMS), "the volume holds <preset>/1/model.onnx")


def check_replica(container: str) -> None:
    took = wait_healthy(container)
    check(inspect(container, "{{.State.Health.Status}}") == "healthy",
          f"{container} healthy by its HEALTHCHECK (grpc.health.v1) after {took:.0f} s")
    check(podman("exec", container, "id", "-u").stdout.strip() == UID, f"{container} runs as uid {UID}")
    mounts = json.loads(inspect(container, "{{json .Mounts}}"))
    models = [m for m in mounts if m["Destination"] == "/models"]
    check(len(models) == 1 and models[0]["RW"] is False and models[0]["Name"] == VOLUME,
          f"{container} mounts the models volume read-only", str(models))
    write = podman("exec", container, "sh", "-c", "echo x > /models/probe", check_rc=False)
    check(write.returncode != 0 and "Read-only file system" in write.stderr,
          f"{container} cannot write into /models", write.stderr)


def check_balancing(client, modules, replicas: list[str], rng) -> None:
    before = {r: successes(r) for r in replicas}
    cases = [("self_attention", 1, 10, 10, False), ("cross_attention", 2, 256, 77, True),
             ("self_attention", 2, 7, 13, True), ("cross_attention", 1, 3, 77, False),
             ("self_attention", 1, 1, 1, False), ("cross_attention", 3, 16, 5, True)]
    for model, b, lq, lk, masked in cases:
        infer_and_check(client, modules, model, rng, b, lq, lk, masked)
    check(True, f"{len(cases)} calls through nginx equal eager PyTorch (atol {TOLERANCE}) on both presets")
    served = {r: successes(r) - before[r] for r in replicas}
    check(sum(served.values()) == len(cases) and min(served.values()) >= 1,
          f"nginx balanced the calls over the replicas: {served}", str(served))


def check_scale(compose: Compose, client, modules, rng) -> None:
    before = {c: inspect(c, "{{.Id}}") for c in containers("server")}
    compose("up", "-d", "--scale", "server=3")
    now = containers("server")
    added = [c for c in now if c not in before]
    check(len(now) == 3 and len(added) == 1, f"--scale server=3 added one replica: {added}", str(now))
    check(all(inspect(c, "{{.Id}}") == i for c, i in before.items()), "the running replicas were left running")
    (new,) = added
    check_replica(new)
    start, base = time.monotonic(), successes(new)
    while successes(new) == base:  # nginx re-resolves `replicas` every 5 s (upstream.conf)
        if time.monotonic() - start > 60:
            raise Failed(f"nginx sent no call to {new} within 60 s")
        infer_and_check(client, modules, "cross_attention", rng, 1, 4, 4, False)
    check(True, f"nginx reached the new replica {new} after {time.monotonic() - start:.1f} s")


def wait_for_calls(counts: list[int], errors: list[str], total: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(counts) < total and not errors:
        if time.monotonic() > deadline:
            raise Failed(f"only {sum(counts)} of {total} calls answered within {timeout_s} s")
        time.sleep(0.05)


def check_drain(port: int, http_port: int, modules, victim: str) -> None:
    """Stop one replica (`podman stop`: SIGTERM, then its stop_grace_period) while calls go on:
    two gRPC clients and one REST client (JSON), all through nginx."""
    from attnserve.client import InferenceClient

    check(inspect(victim, "{{.Config.StopSignal}}") in ("SIGTERM", "15"), f"{victim}: stop signal SIGTERM")
    # podman-compose applies stop_grace_period in its own stop/down (-t), not as the container's
    # stop timeout (podman's default, 10 s), so it is passed here as `docker stop` would use it.
    grace = str(yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["server"]["stop_grace_period"])
    grace_s = int(grace.removesuffix("s"))
    stop = threading.Event()
    errors: list[str] = []
    counts = [0, 0, 0]  # gRPC, gRPC, REST

    def load(index: int) -> None:
        rng = np.random.default_rng(100 + index)
        with InferenceClient(f"127.0.0.1:{port}", timeout_s=30.0) as c:
            while not stop.is_set():
                try:
                    infer_and_check(c, modules, ("self_attention", "cross_attention")[counts[index] % 2], rng, 1, 6, 6,
                                    False)
                    counts[index] += 1
                except Exception as err:  # noqa: BLE001 - every failure is reported
                    errors.append(f"{type(err).__name__}: {err}")
            retries.append(c.retry_count)

    def rest_load(index: int) -> None:
        rng = np.random.default_rng(100 + index)
        connection = http.client.HTTPConnection(f"127.0.0.1:{http_port}", timeout=30)
        while not stop.is_set():
            model = ("self_attention", "cross_attention")[counts[index] % 2]
            x = random_inputs(rng, 1, 5, 5, *DIMS[model])
            try:
                try:
                    got = rest_json_infer(connection, model, x)
                except BadGateway:
                    # nginx's own 502 (no replica reachable that moment: podman's DNS timed out
                    # as the replica left): retried once, as a REST client behind a balancer does.
                    rest_retries.append(1)
                    got = rest_json_infer(connection, model, x)
                np.testing.assert_allclose(got["output"], eager(modules[model], **x)["output"], rtol=0, atol=TOLERANCE)
                counts[index] += 1
            except Exception as err:  # noqa: BLE001 - every failure is reported
                errors.append(f"REST {type(err).__name__}: {err}")
                connection.close()
        connection.close()

    retries: list[int] = []
    rest_retries: list[int] = []
    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=rest_load, args=(2,)))
    for t in threads:
        t.start()
    wait_for_calls(counts, errors, 20)  # calls flowing through nginx before the signal
    sent_before, rest_before = sum(counts), counts[2]
    stopper = threading.Thread(target=lambda: podman("stop", "-t", str(grace_s), victim, check_rc=False, timeout=120))
    started = time.monotonic()
    stopper.start()
    deadline = started + 10
    draining_health = draining_rest_ready = None
    victim_rest = address(victim, 8000)
    while time.monotonic() < deadline and inspect(victim, "{{.State.Status}}") in ("running", "stopping"):
        logs = podman("logs", victim, check_rc=False)
        if "draining: readiness NOT_SERVING" in logs.stdout + logs.stderr:
            try:
                draining_rest_ready = http_get(victim_rest, "/v2/health/ready", timeout=3)
            except OSError as err:
                draining_rest_ready = f"{type(err).__name__}: {err}"
            draining_health = podman("healthcheck", "run", victim, check_rc=False, timeout=30).returncode
            break
        time.sleep(0.2)
    stopper.join(timeout=120)
    stop_s = time.monotonic() - started
    after_stop, rest_after_stop = sum(counts), counts[2]
    wait_for_calls(counts, errors, after_stop + 20)  # and after the replica is gone
    stop.set()
    for t in threads:
        t.join(timeout=60)
    exit_code = inspect(victim, "{{.State.ExitCode}}")
    check(exit_code == "0", f"{victim} drained and exited 0 after `podman stop -t {grace_s}` ({stop_s:.1f} s)",
          podman("logs", victim, check_rc=False).stderr[-3000:])
    if draining_health is not None:
        check(draining_health != 0, f"{victim} HEALTHCHECK failed while draining (readiness NOT_SERVING)")
        check(draining_rest_ready == 503, f"{victim} REST readiness (GET /v2/health/ready) 503 while draining",
              str(draining_rest_ready))
    else:
        log(f"NOTE: {victim} stopped before its drain could be seen; its readiness while draining was not asked")
    check(after_stop > sent_before and sum(counts) >= after_stop + 20 or errors,
          f"calls went on through the drain: {sent_before} before the stop, {after_stop - sent_before} during it, "
          f"{sum(counts) - after_stop} after")
    check(counts[2] > rest_after_stop > rest_before or errors,
          f"REST calls among them: {rest_before} before, {rest_after_stop - rest_before} during, "
          f"{counts[2] - rest_after_stop} after")
    (nginx,) = containers("nginx")
    access = podman("logs", nginx, check_rc=False).stdout
    retried = re.findall(r"rest upstream=(\S+), \S+ upstream-status=(\d+), (\d+)", access)
    log(f"NOTE: REST calls nginx sent to a second replica during the drain (first upstream, its status): "
        f"{[(u, first) for u, first, _ in retried] or 'none'}")
    check(not errors, f"no call failed while {victim} drained (client retries: gRPC {sum(retries)}, "
          f"REST after nginx's 502 {len(rest_retries)})", "\n".join(errors[:10]))


def check_rest(port: int, modules, rng) -> None:
    """nginx's REST port (8000, published): readiness, binary-tensor and JSON inference
    (tritonclient.http) on both presets equal to eager PyTorch, spread over the replicas."""
    import tritonclient.http as httpclient

    nginx_rest = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while (status := http_get(nginx_rest, "/v2/health/ready")) != 200:  # nginx resolves `replicas` every 5 s
        if time.monotonic() > deadline:
            raise Failed(f"GET /v2/health/ready through nginx answered {status} for 30 s")
        time.sleep(0.5)
    check(True, "GET /v2/health/ready through nginx's REST port: 200")
    replicas = containers("server")
    check(all(http_get(address(r, 8000), "/v2/health/ready") == 200 for r in replicas),
          f"each replica's own REST readiness is 200: {replicas}")
    before = {r: successes(r) for r in replicas}
    cases = [("self_attention", 1, 10, 10, False, True), ("cross_attention", 2, 256, 77, True, True),
             ("self_attention", 2, 7, 13, True, False), ("cross_attention", 1, 3, 77, False, False),
             ("self_attention", 1, 1, 1, False, True), ("cross_attention", 3, 16, 5, True, False)]
    client = httpclient.InferenceServerClient(url=nginx_rest, connection_timeout=10.0, network_timeout=60.0)
    try:
        for model, b, lq, lk, masked, binary in cases:
            x = random_inputs(rng, b, lq, lk, *DIMS[model], masked=masked)
            got, want = rest_infer(client, model, x, binary), eager(modules[model], **x)
            for name in ("output", "attn_probs"):
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOLERANCE,
                                           err_msg=f"REST {model} {name} binary={binary}")
    finally:
        client.close()
    check(True, f"{len(cases)} REST calls through nginx (binary tensors and JSON) equal eager PyTorch "
                f"(atol {TOLERANCE}) on both presets")
    served = {r: successes(r) - before[r] for r in replicas}
    check(sum(served.values()) == len(cases) and sum(n >= 1 for n in served.values()) >= 2,
          f"nginx balanced the REST calls over the replicas: {served}", str(served))


def run_on_loopback(name: str, image: str, *env: str) -> int:
    """Start `image` detached on the host network, listening on 127.0.0.1 at free ports; its gRPC port."""
    ports = {"PORT": free_port(), "HTTP_PORT": free_port(), "METRICS_PORT": free_port()}
    podman("run", "-d", "--name", name, "--network", "host", "-e", "ATTNSERVE_HOST=127.0.0.1",
           *[f"--env=ATTNSERVE_{k}={v}" for k, v in ports.items()], *env, "-v", f"{VOLUME}:/models:ro", image)
    return ports["PORT"]


def check_calls_equal_eager(port: int, modules, rng, who: str) -> None:
    from attnserve.client import InferenceClient

    with InferenceClient(f"127.0.0.1:{port}", timeout_s=30.0) as client:
        infer_and_check(client, modules, "self_attention", rng, 2, 7, 13, True)
        infer_and_check(client, modules, "cross_attention", rng, 1, 16, 5, False)
    check(True, f"{who} equal eager PyTorch (atol {TOLERANCE}) on both presets")


def check_cuda_image_without_cuda(modules, rng) -> None:
    """The CUDA image on its stand-in base: onnxruntime-gpu lists CUDAExecutionProvider, whose
    library cannot load there (no CUDA or cuDNN libraries). With ATTNSERVE_DEVICE=cuda (the
    image's) the server exits 3 saying why; with auto it serves on CPU, saying why, on the native
    data plane (built in the image's build stage), and its calls equal eager PyTorch."""
    name = "attnserve-ci-cuda-standin"
    podman("rm", "-f", "-t", "0", name, check_rc=False)
    try:
        run = podman("run", "--name", name, "--network", "none", "--no-healthcheck", "-v", f"{VOLUME}:/models:ro",
                     "attnserve:cuda-standin", check_rc=False, timeout=180)
        text = run.stdout + run.stderr
        lines = [line for line in text.splitlines() if "cannot start:" in line]
        check(run.returncode == 3 and len(lines) == 1
              and "CUDAExecutionProvider is listed but cannot run here" in lines[0]
              and "libcublasLt.so.12" in lines[0],
              "attnserve:cuda-standin (ATTNSERVE_DEVICE=cuda) exits 3 with one line naming the library that does "
              f"not load: {lines[0].split('cannot start: ', 1)[-1][:200] if lines else ''}",
              f"exit {run.returncode}: {text[-1500:]}")
        podman("rm", "-f", "-t", "0", name, check_rc=False)
        port = run_on_loopback(name, "attnserve:cuda-standin", "-e", "ATTNSERVE_DEVICE=auto")
        took = wait_healthy(name)
        # Healthy once its models serve; the start line ("serving 2 model(s)") follows it.
        deadline = time.monotonic() + 60
        while not re.search(r"serving 2 model\(s\)", text := container_log(name)) and time.monotonic() < deadline:
            time.sleep(0.5)
        check("device auto: serving on CPU because CUDAExecutionProvider is listed but cannot run here" in text
              and re.search(r"serving 2 model\(s\)", text) is not None,
              f"attnserve:cuda-standin with ATTNSERVE_DEVICE=auto serves both models on CPU, saying why "
              f"(healthy after {took:.0f} s)", text[-1500:])
        check("data plane native, python behind it" in text,
              "attnserve:cuda-standin serves on the native data plane by default", text[-1500:])
        check_calls_equal_eager(port, modules, rng, "attnserve:cuda-standin's calls")
    finally:
        podman("rm", "-f", "-t", "0", name, check_rc=False)


def container_log(name: str) -> str:
    logs = podman("logs", name, check_rc=False)
    return logs.stdout + logs.stderr


def check_native_plane(modules, rng) -> None:
    """The serving image's default data plane, the native one (the extension built in its build stage,
    only its run-time libraries shipped; --data-plane auto): --version says the plane is available and
    the default, the server started with no data plane setting says it serves on it, and calls on its
    port equal eager PyTorch. On the host network, on free loopback ports."""
    name = "attnserve-ci-native"
    version = podman("run", "--rm", "--network", "none", "--no-healthcheck", "--entrypoint", "attnserve",
                     "attnserve:cpu", "--version").stdout
    check("native data plane: available (--data-plane native)" in version
          and "serve's data plane by default (--data-plane auto): native" in version,
          "attnserve:cpu --version: the native data plane is available and the default", version)
    podman("rm", "-f", "-t", "0", name, check_rc=False)
    try:
        port = run_on_loopback(name, "attnserve:cpu")
        took = wait_healthy(name)
        line = "data plane native, python behind it"
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S  # the start line follows the last model's warm-up
        while line not in (text := container_log(name)) and time.monotonic() < deadline:
            time.sleep(0.5)
        check(line in text,
              f"attnserve:cpu serves on the native plane by default (healthy after {took:.0f} s)",
              text[-1500:])
        check_calls_equal_eager(port, modules, rng, "calls on the container's port")
    finally:
        podman("rm", "-f", "-t", "0", name, check_rc=False)


def ready_through(client, quiet: bool = True):
    """ServerReady through nginx; False (or, quiet=False, the error) while nginx answers 502:
    no replica resolved yet (podman's DNS may not answer for the first seconds)."""
    try:
        return client.server_ready(timeout_s=5.0)
    except Exception as err:  # noqa: BLE001 - attnserve.client.InferenceError (UNAVAILABLE from nginx)
        return False if quiet else f"{type(err).__name__}: {err}"


def remove_project() -> None:
    """Whatever an earlier run left: the project's containers (a scaled-up replica is one that
    `down` of the plain file does not know), its volume and its network."""
    names = podman("ps", "-a", "--sort", "created", "--format", "{{.Names}}",
                   "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
    for name in reversed(names):  # newest first: podman-compose makes each depend on what it needs
        podman("rm", "-f", "-t", "0", name)
    podman("volume", "rm", "-f", VOLUME, check_rc=False)
    podman("network", "rm", "-f", NETWORK, check_rc=False)


def save_logs(work: Path) -> None:
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    for name in podman("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                       "--format", "{{.Names}}", check_rc=False).stdout.split():
        result = podman("logs", name, check_rc=False)
        (logs / f"{name}.log").write_text(result.stdout + result.stderr)
    log(f"container logs: {logs}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--podman-compose", required=True)
    parser.add_argument("--nginx-image", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="leave the containers and the volume")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "podman-compose.log").write_text("")
    compose = Compose(args.podman_compose, args.work, args.nginx_image)
    from attnserve.client import InferenceClient

    start = time.monotonic()
    try:
        remove_project()
        podman("network", "create", "--subnet", SUBNET, "--gateway", GATEWAY, NETWORK)
        compose("up", "-d")
        log(f"podman-compose up -d: {time.monotonic() - start:.0f} s")
        modules = eager_modules()
        check_export(modules)
        replicas = containers("server")
        check(len(replicas) == 2, f"two server replicas: {replicas}")
        for replica in replicas:
            check_replica(replica)
        (nginx,) = containers("nginx")
        nginx_health = podman("healthcheck", "run", nginx, check_rc=False)
        check(nginx_health.returncode == 0, f"{nginx} healthy by its healthcheck (wget /healthz)", nginx_health.stderr)
        rng = np.random.default_rng(7)
        with InferenceClient(f"127.0.0.1:{compose.port}", timeout_s=30.0) as client:
            deadline = time.monotonic() + 60
            while not ready_through(client):  # nginx resolves `replicas` every 5 s
                if time.monotonic() > deadline:
                    raise Failed(f"no server ready through nginx within 60 s: {ready_through(client, quiet=False)}")
                time.sleep(0.5)
            check_balancing(client, modules, replicas, rng)
            check_scale(compose, client, modules, rng)
            check_rest(compose.http_port, modules, rng)
            check_drain(compose.port, compose.http_port, modules, replicas[0])
        check_cuda_image_without_cuda(modules, rng)
        check_native_plane(modules, rng)
    except Exception as err:  # noqa: BLE001 - Failed, AssertionError, or a client's own: logs kept either way
        log(f"FAIL: {type(err).__name__ + ': ' if not isinstance(err, Failed) else ''}{err}")
        save_logs(args.work)
        return 1
    finally:
        log(f"compose checks: {time.monotonic() - start:.0f} s")
    save_logs(args.work)
    if not args.keep:
        compose("down", "-v", timeout=300)
        remove_project()
    return 0


if __name__ == "__main__":
    sys.exit(main())
