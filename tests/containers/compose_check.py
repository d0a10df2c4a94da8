"""docker-compose.yml run for real with podman-compose (`make test-containers`, after the images
are built): one PASS/FAIL line per property, exit 1 on the first failure, the containers' logs in
WORK/logs/ either way.

What differs from `docker compose up` here, and only that (an override file written into WORK):
nginx's image (a stand-in, localhost/attnserve-ci/nginx: no registry), its published port (a free
loopback port instead of 8001) and upstream.conf's resolver: Docker's embedded DNS is 127.0.0.1:1
... 127.0.0.11; podman's (aardvark-dns) answers on the network's gateway, so the project network
is made first with a fixed subnet and upstream.conf is mounted with `resolver GATEWAY` in place of
`resolver 127.0.0.11`; every other line of it, and nginx.conf, are the repository's files.

Health: podman 4.3 has no systemd here to run HEALTHCHECKs on a timer, and podman-compose ignores
`condition: service_healthy` before podman 4.6; so this runs each container's own HEALTHCHECK
(`podman healthcheck run`) until it reports healthy, the check Docker would run on its timer.
"""

from __future__ import annotations

import argparse
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

from tests.oip import eager, random_inputs  # noqa: E402

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
        self.port = free_port()
        upstream = (REPO / "deploy/nginx/upstream.conf").read_text()
        upstream, count = re.subn(r"^resolver 127\.0\.0\.11 ", f"resolver {GATEWAY} ", upstream, flags=re.M)
        assert count == 1, "upstream.conf should name Docker's resolver 127.0.0.11 once"
        (work / "upstream.conf").write_text(upstream)
        (work / "compose.override.yml").write_text(json.dumps({"services": {"nginx": {
            "image": nginx_image,
            "ports": [f"127.0.0.1:{self.port}:8001"],
            "volumes": [f"{REPO}/deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro",
                        f"{work.resolve()}/upstream.conf:/etc/nginx/upstream.conf:ro"],
        }}}, indent=2))
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


def address(container: str) -> str:
    ip = inspect(container, f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}')
    return f"{ip}:8001"


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


def check_drain(port: int, modules, victim: str) -> None:
    """Stop one replica (`podman stop`: SIGTERM, then its stop_grace_period) while calls go on."""
    from attnserve.client import InferenceClient

    check(inspect(victim, "{{.Config.StopSignal}}") in ("SIGTERM", "15"), f"{victim}: stop signal SIGTERM")
    # podman-compose applies stop_grace_period in its own stop/down (-t), not as the container's
    # stop timeout (podman's default, 10 s), so it is passed here as `docker stop` would use it.
    grace = str(yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["server"]["stop_grace_period"])
    grace_s = int(grace.removesuffix("s"))
    stop = threading.Event()
    errors: list[str] = []
    counts = [0, 0]

    def load(index: int) -> None:
        rng = np.random.default_rng(100 + index)
        with InferenceClient(f"127.0.0.1:{port}", timeout_s=30.0) as c:
            while not stop.is_set():
                try:
                    infer_and_check(c, modules, ("self_attention", "cross_attention")[counts[index] % 2], rng, 1, 6, 6, False)
                    counts[index] += 1
                except Exception as err:  # noqa: BLE001 - every failure is reported
                    errors.append(f"{type(err).__name__}: {err}")
            retries.append(c.retry_count)

    retries: list[int] = []
    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for_calls(counts, errors, 20)  # calls flowing through nginx before the signal
    sent_before = sum(counts)
    stopper = threading.Thread(target=lambda: podman("stop", "-t", str(grace_s), victim, check_rc=False, timeout=120))
    started = time.monotonic()
    stopper.start()
    deadline = started + 10
    draining_health = None
    while time.monotonic() < deadline and inspect(victim, "{{.State.Status}}") in ("running", "stopping"):
        logs = podman("logs", victim, check_rc=False)
        if "draining: readiness NOT_SERVING" in logs.stdout + logs.stderr:
            draining_health = podman("healthcheck", "run", victim, check_rc=False, timeout=30).returncode
            break
        time.sleep(0.2)
    stopper.join(timeout=120)
    stop_s = time.monotonic() - started
    after_stop = sum(counts)
    wait_for_calls(counts, errors, after_stop + 20)  # and after the replica is gone
    stop.set()
    for t in threads:
        t.join(timeout=60)
    exit_code = inspect(victim, "{{.State.ExitCode}}")
    check(exit_code == "0", f"{victim} drained and exited 0 after `podman stop -t {grace_s}` ({stop_s:.1f} s)",
          podman("logs", victim, check_rc=False).stderr[-3000:])
    if draining_health is not None:
        check(draining_health != 0, f"{victim} HEALTHCHECK failed while draining (readiness NOT_SERVING)")
    check(after_stop > sent_before and sum(counts) >= after_stop + 20 or errors,
          f"calls went on through the drain: {sent_before} before the stop, {after_stop - sent_before} during it, "
          f"{sum(counts) - after_stop} after")
    check(not errors, f"no call failed while {victim} drained (client retries: {sum(retries)})", "\n".join(errors[:10]))


# REST (being built elsewhere): once the server has a REST port, expose it in the Dockerfiles and
# docker-compose.yml, and check here, the same way as gRPC: the HEALTHCHECK or a probe on it, nginx
# balancing it over the replicas, and answers equal to eager PyTorch.
def check_rest() -> None:
    log("SKIP: REST: the server has no REST port yet (tests/containers/compose_check.py, check_rest)")


def check_cuda_image_without_cuda() -> None:
    """The CUDA image on its stand-in base (no CUDA libraries) must not serve on CPU unnoticed."""
    name = "attnserve-ci-cuda-standin"
    podman("rm", "-f", "-t", "0", name, check_rc=False)
    podman("run", "-d", "--name", name, "--network", "none", "-v", f"{VOLUME}:/models:ro", "attnserve:cuda-standin")
    try:
        deadline = time.monotonic() + 120
        while True:
            logs = podman("logs", name, check_rc=False)
            text = logs.stdout + logs.stderr
            status = inspect(name, "{{.State.Status}}")
            if status == "exited" or "serving 0 model(s)" in text or time.monotonic() > deadline:
                break
            time.sleep(1)
        if status == "exited":
            code = inspect(name, "{{.State.ExitCode}}")
            check(code == "3" and "CUDA" in text, "attnserve:cuda-standin refuses to start without CUDA: exit 3",
                  f"exit {code}: {text[-1500:]}")
            return
        health = podman("healthcheck", "run", name, check_rc=False, timeout=60)
        check("DeviceUnavailable" in text and health.returncode != 0,
              "attnserve:cuda-standin (ATTNSERVE_DEVICE=cuda, no CUDA libraries) does not serve on CPU: "
              "its models are not ready (DeviceUnavailable) and its HEALTHCHECK fails", text[-1500:])
        log("NOTE: it kept running with no model ready rather than exiting 3 as deploy/Dockerfile.cuda says "
            "(onnxruntime-gpu lists CUDAExecutionProvider, whose library then fails to load)")
    finally:
        podman("rm", "-f", "-t", "0", name, check_rc=False)


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
            deadline = time.monotonic() + 30
            while not client.server_ready(timeout_s=5.0):  # nginx resolves `replicas` every 5 s
                if time.monotonic() > deadline:
                    raise Failed("no server ready through nginx within 30 s")
                time.sleep(0.5)
            check_balancing(client, modules, replicas, rng)
            check_scale(compose, client, modules, rng)
            check_drain(compose.port, modules, replicas[0])
            check_rest()
        check_cuda_image_without_cuda()
    except (Failed, AssertionError) as err:
        log(f"FAIL: {err}")
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
