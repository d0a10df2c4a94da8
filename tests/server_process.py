"""A real `attnserve serve` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 60.0
# Which data plane a test's server runs on unless the test passes --data-plane itself: unset, the
# server's default (auto: native where the extension loads); python or native, that plane
# (`make test-python-plane`; docs/testing.md).
DATA_PLANE_ENV = "ATTNSERVE_TEST_DATA_PLANE"
TEST_DATA_PLANES = ("python", "native")


def plane_from_env() -> str | None:
    """$ATTNSERVE_TEST_DATA_PLANE: python or native, or None (unset: the server's default)."""
    plane = os.environ.get(DATA_PLANE_ENV) or None
    if plane is not None and plane not in TEST_DATA_PLANES:
        raise ValueError(f"${DATA_PLANE_ENV} must be {' or '.join(TEST_DATA_PLANES)} (or unset: the server's "
                         f"default), got {plane!r}")
    return plane


def data_plane_args(extra_args: tuple[str, ...]) -> list[str]:
    """["--data-plane", X] from $ATTNSERVE_TEST_DATA_PLANE, or nothing when it is unset or the test chose its own."""
    plane = plane_from_env()
    if plane is None or any(arg == "--data-plane" or arg.startswith("--data-plane=") for arg in extra_args):
        return []
    return ["--data-plane", plane]


def without_native_env(directory: Path) -> dict[str, str]:
    """Environment for a Python process in which attnserve.server._native does not import, as where it
    is not built: a sitecustomize.py in `directory`, first on PYTHONPATH, maps it to None in sys.modules."""
    (directory / "sitecustomize.py").write_text(
        "import sys\nsys.modules['attnserve.server._native'] = None  # tests/server_process.py: as if not built\n")
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


class ServerProcess:
    """Starts the server with --port 0 and --http-port 0 and reads the bound ports from its --ready-file.

    For a TLS server pass `credentials` (grpc.ssl_channel_credentials): channel() and health()
    then use them (and `server_name`, the name to check in the server's certificate)."""

    COMMAND = ("-m", "attnserve", "serve")  # what runs, after the interpreter

    def __init__(self, model_repository: Path, *extra_args: str, env: dict[str, str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "localhost") -> None:
        self.credentials = credentials
        self.server_name = server_name
        self._workdir = Path(tempfile.mkdtemp(prefix="attnserve-test-"))
        self.ready_file = self._workdir / "ready.json"
        self.log_path = self._workdir / "server.log"
        args = [
            sys.executable, *self.COMMAND,
            "--model-repository", str(model_repository),
            "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--ready-file", str(self.ready_file),
            # No load balancer watches a test's server: stop at once unless a test asks for a delay.
            "--drain-delay-s", "0",
            # One process unless a test asks for more: the default follows the machine's CPUs.
            "--workers", "1",
            *data_plane_args(extra_args),
            *extra_args,
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port, self.http_port, self.metrics_port = self._wait_ready()
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{self.http_port}"  # the REST port (0: off)

    @property
    def python_target(self) -> str:
        """The Python gRPC server's own target: the port, or behind the native plane its private socket."""
        return json.loads(self.ready_file.read_text()).get("python_grpc", self.address)

    def _wait_ready(self) -> tuple[int, int, int]:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                return (int(info["grpc_port"]), int(info.get("http_port") or 0),
                        int(info.get("metrics_port") or 0))
            time.sleep(0.05)
        where = self.processes()
        self.proc.kill()
        raise RuntimeError(f"server not ready within {STARTUP_TIMEOUT_S}s:\n{self.log()}\n{where}")

    def channel(self, credentials: grpc.ChannelCredentials | None = None, **options: int) -> grpc.Channel:
        """A channel to the server: plaintext, or TLS with `credentials` (default: the server's)."""
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        opts += list(options.items())
        credentials = credentials or self.credentials
        if credentials is None:
            return grpc.insecure_channel(self.address, options=opts)
        opts.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(self.address, credentials, options=opts)

    def memory_kib(self, field: str = "VmHWM") -> int:
        """From /proc/<pid>/status: VmHWM (peak resident set so far) or VmRSS (now), in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"no {field} in /proc/{self.proc.pid}/status")

    def reset_memory_peak(self) -> None:
        """VmHWM := VmRSS (Linux's /proc/PID/clear_refs), so the next peak read is from here on."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def scrape(self) -> str:
        """The Prometheus exposition on the metrics port, as text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            return r.read().decode()

    def health(self, service: str = "") -> int:
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_for_log(self, text: str, count: int = 1, timeout_s: float = 60.0) -> str:
        """Wait until the server's log holds `text` `count` times (a state the server reached,
        not a guess of how long it takes); the log so far."""
        deadline = time.monotonic() + timeout_s
        while (log := self.log()).count(text) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} x{count} not in the server log "
                                     f"(exit status {self.proc.poll()}):\n{log}\n{self.processes()}")
            time.sleep(0.01)
        return log

    def processes(self) -> str:
        """Where the server's processes are, for a failure's message: each process of its tree
        (the supervisor's workers too) with its CPU seconds and its threads' states and kernel
        wait channels (/proc), so that a process that hangs says whether it runs, sleeps or waits
        in the kernel. Linux; elsewhere a line saying so."""
        if not Path("/proc/self/task").exists():
            return "(no /proc here: no process states)"
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        lines, tree = [], [self.proc.pid]
        while tree:
            pid = tree.pop()
            tree += children.get(pid, [])
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                threads = []
                for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
                    state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    threads.append(f"{state}:{(task / 'wchan').read_text() or '-'}")
                    if state == "D":  # in the kernel, uninterruptible: its kernel stack (root can read it)
                        try:
                            threads.append("[" + " < ".join(line.split()[-1] for line in
                                                            (task / "stack").read_text().splitlines()) + "]")
                        except OSError:
                            pass
            except OSError:
                continue
            cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            lines.append(f"pid {pid} state {fields[0]} cpu {cpu_s:.2f}s {cmd[:120]}\n  threads: {' '.join(threads)}")
        return "processes:\n" + "\n".join(lines)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def serve_with_port_taken(model_repository: Path, flag: str) -> tuple[subprocess.CompletedProcess, int]:
    """`attnserve serve` on 127.0.0.1 with `flag` (--http-port, --metrics-port) set to a port
    another socket listens on, every other port free or off; (the finished run, that port)."""
    import socket

    ports = {"--port": "0", "--http-port": "-1", "--metrics-port": "-1", "--workers": "1"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports[flag] = str(port)
        done = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                               "--host", "127.0.0.1", *(x for item in ports.items() for x in item)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    return done, port
