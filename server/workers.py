"""Worker processes: `attnserve serve --workers N`, N processes serving the same ports.

    code = asyncio.run(supervise(config, argv, command))   # the parent: no ONNX Runtime, no model
    context = WorkerContext.from_env()                     # in a worker: its place in the server

One process runs one event loop, which keeps the server to a core or two on a many-core host.
The supervisor (this module, the parent process) starts N workers, each today's
whole server (app.Server: its event loop, batchers, ONNX Runtime sessions) on the same gRPC and
REST ports, and:
- shares the ports with SO_REUSEPORT: it binds each address itself, without listening, so that
  port 0 means one port for every worker and a port in use fails at once (exit 3); each worker
  binds the same address with SO_REUSEPORT and listens, and the kernel spreads new connections
  over the workers' listeners (gRPC Python cannot adopt a listening socket handed down, so the
  kernel's spreading is the one way for gRPC; REST, and --data-plane native's port, do the same). A gRPC channel is one
  connection, so one channel's calls all go to one worker (docs/server.md, Worker processes);
- serves the one /metrics of the server: the workers' collectors are in prometheus_client's
  multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a private directory), summed here, with this
  process's attnserve_worker_restarts_total; ModelStatistics is summed by whichever worker is
  asked (server.shared_stats, files in the same directory);
- splits what the process may use: intra-op threads (CPUs / N each, unless
  --intra-op-threads is given) and the memory budget (--memory-limit-bytes / N each, or each
  worker's default from a 1/N share);
- writes --ready-file once every worker is ready (their pids under "workers"); forwards SIGTERM,
  SIGINT and SIGHUP to every worker (each drains; a second signal hurries them) and exits 0
  once all have drained; restarts a worker that exits otherwise (logged, counted, after a
  back-off that grows while replacements die before they have served long).
A worker dies with its supervisor (PR_SET_PDEATHSIG: SIGTERM, so it drains).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from attnserve.server.config import ServerConfig
from attnserve.server.data_plane import DataPlaneUnavailable, choose_data_plane
from attnserve.server.listen import reserve_port

logger = logging.getLogger("attnserve.server.workers")

WORKER_ENV = "ATTNSERVE_WORKER_OF"  # set by the supervisor in each worker: JSON of WorkerContext
EXIT_CANNOT_START = 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0  # a worker that served this long before it died is restarted without delay growth
_PR_SET_PDEATHSIG = 1
RESTARTS_METRIC = "attnserve_worker_restarts"  # the supervisor's own series on /metrics (_total)
HUNG_METRIC = "attnserve_worker_hung"  # workers killed for missing a heartbeat (_total)


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows of the server it is part of."""

    directory: Path  # the supervisor's private directory: metrics and statistics files
    workers: int  # how many workers share the ports and the budget
    index: int
    heartbeat_fd: int | None = None  # the worker's end of its heartbeat socket (answer_heartbeats)

    @classmethod
    def from_env(cls, environ=os.environ) -> WorkerContext | None:
        text = environ.get(WORKER_ENV)
        if not text:
            return None
        data = json.loads(text)
        return cls(Path(data["directory"]), int(data["workers"]), int(data["index"]), data.get("heartbeat_fd"))

    def to_env(self) -> str:
        return json.dumps({"directory": str(self.directory), "workers": self.workers, "index": self.index,
                           "heartbeat_fd": self.heartbeat_fd})

    def answer_heartbeats(self, loop: asyncio.AbstractEventLoop) -> None:
        """Echo every heartbeat the supervisor sends, from `loop`: an answer proves the event loop
        that serves the calls runs, not merely that the process exists."""
        if self.heartbeat_fd is None:
            return
        sock = socket.socket(fileno=self.heartbeat_fd)
        sock.setblocking(False)
        _heartbeat_sockets.append(sock)  # held for the process's life

        def answer() -> None:
            try:
                data = sock.recv(64)
                if data:
                    sock.send(data)
                    return
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pass
            loop.remove_reader(sock.fileno())  # the supervisor is gone (PR_SET_PDEATHSIG stops us)

        loop.add_reader(sock.fileno(), answer)


_heartbeat_sockets: list[socket.socket] = []


# -- how many ------------------------------------------------------------------------------------


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity, and its cgroup's quota (v2 cpu.max, v1
    cpu.cfs_quota_us / cpu.cfs_period_us) rounded up, whichever is less."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def _cgroup_quota(root: Path) -> float | None:
    try:
        text = (root / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


CPUS_PER_WORKER = 2  # one event loop keeps a core or two busy (docs/server.md, Worker processes)
# Workers per CPU at most: each is a whole server (its event loop, its own ONNX Runtime sessions
# and memory); beyond this many they only share the same cores, and starting them takes minutes.
MAX_WORKERS_PER_CPU = 4
EXIT_BAD_FLAG = 2  # argparse's status for a bad flag


def max_workers(cpus: int | None = None) -> int:
    """The ceiling on --workers: MAX_WORKERS_PER_CPU per CPU this process may use."""
    return MAX_WORKERS_PER_CPU * (available_cpus() if cpus is None else cpus)


def workers_over_ceiling(workers: int, cpus: int | None = None) -> str | None:
    """The refusal of a worker count over the ceiling (None: within it)."""
    cpus = available_cpus() if cpus is None else cpus
    ceiling = max_workers(cpus)
    if workers <= ceiling:
        return None
    return (f"--workers (ATTNSERVE_WORKERS) {workers} is over the ceiling of {ceiling}: {MAX_WORKERS_PER_CPU} per CPU "
            f"this process may use ({cpus}, its affinity and cgroup quota); each worker is a whole server with its "
            f"own sessions and memory, and more than that only share the same cores")


def default_workers(config: ServerConfig, cpus: int | None = None) -> int:
    """--workers when not given: one per CPUS_PER_WORKER CPUs; 1 in explicit model control mode
    (a load through one worker would not reach the others)."""
    if config.workers is not None:
        return config.workers
    if config.model_control_mode == "explicit" or config.allow_shared_memory:
        return 1  # loads and registered regions live in one process
    return max(1, (available_cpus() if cpus is None else cpus) // CPUS_PER_WORKER)


# -- the supervisor ---------------------------------------------------------------------------


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def restart_delay(quick_deaths: int) -> float:
    """Seconds before a worker is restarted, after `quick_deaths` exits in a row that came
    before it had served STABLE_S (0: it had served long): 0.5, 0.5, 1, 2, ... up to 30."""
    return min(BACKOFF_MIN_S * 2 ** max(quick_deaths - 1, 0), BACKOFF_MAX_S)


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.generation = 0
        self.ready_at: float | None = None
        self.quick_deaths = 0  # exits in a row before serving STABLE_S
        self.heartbeat: socket.socket | None = None  # the supervisor's end of its heartbeat socket
        self.hung = False  # killed by the watchdog (its exit is logged as such)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Supervisor:
    def __init__(self, config: ServerConfig, argv: list[str], command: list[str], workers: int) -> None:
        self.config = config
        self.argv = argv
        self.command = command
        self.count = workers
        self.directory = Path(tempfile.mkdtemp(prefix="attnserve-workers-"))
        self.workers = [_Worker(i) for i in range(workers)]
        self.draining = False
        self.hurried = False
        self.restarts = None  # prometheus Counter, once the metrics are set up
        self.hung = None  # prometheus Counter: workers the watchdog killed
        self._changed = asyncio.Event()
        self._held: list[socket.socket] = []
        self._endpoint = None
        self.grpc_port = self.http_port = self.metrics_port = None
        # --data-plane auto chosen once here and given to every worker, so that all serve on one plane.
        self.data_plane: str | None = None

    # -- setup --
    def _worker_args(self, worker: _Worker) -> list[str]:
        cfg = self.config
        args = [*self.argv, "--workers", "1", "--data-plane", self.data_plane, "--port", str(self.grpc_port),
                "--http-port", str(self.http_port if self.http_port is not None else -1),
                "--metrics-port", "-1", "--ready-file", str(self._ready_path(worker))]
        if cfg.intra_op_threads == 0:
            args += ["--intra-op-threads", str(max(1, available_cpus() // self.count))]
        if cfg.memory_limit_bytes is not None:
            args += ["--memory-limit-bytes", str(max(1, cfg.memory_limit_bytes // self.count))]
        return args

    def _ready_path(self, worker: _Worker) -> Path:
        return self.directory / f"ready-{worker.index}-{worker.generation}.json"

    def _setup_metrics(self) -> None:
        from attnserve.server.metrics_http import MetricsEndpoint
        from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
        from prometheus_client.multiprocess import MultiProcessCollector

        disable_created_metrics()  # as the workers' (server.metrics)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.directory / "prometheus"))
        self.restarts = Counter(RESTARTS_METRIC, "Worker processes restarted after an unexpected exit.",
                                registry=registry)
        self.hung = Counter(HUNG_METRIC, "Worker processes killed (then replaced) for missing a heartbeat: "
                            "their event loop stopped answering.", registry=registry)
        self._endpoint = MetricsEndpoint(registry)

    async def start_ports(self) -> None:
        cfg = self.config
        (self.directory / "prometheus").mkdir()
        self.grpc_port, held = reserve_port(cfg.host, cfg.port)
        self._held += held
        if cfg.http_port >= 0:
            try:
                self.http_port, held = reserve_port(cfg.host, cfg.http_port)
            except OSError as err:
                raise OSError(f"HTTP/REST port: {err}") from None
            self._held += held
        self._setup_metrics()
        if cfg.metrics_port >= 0:
            try:
                self.metrics_port = await self._endpoint.start(cfg.host, cfg.metrics_port)
            except OSError as err:
                raise OSError(f"metrics port {cfg.host}:{cfg.metrics_port}: {err.strerror or err}") from None

    # -- workers --
    async def _spawn(self, worker: _Worker) -> None:
        worker.generation += 1
        worker.ready_at = None
        worker.hung = False
        if worker.heartbeat is not None:
            worker.heartbeat.close()
        worker.heartbeat, theirs = socket.socketpair()
        worker.heartbeat.setblocking(False)
        context = WorkerContext(self.directory, self.count, worker.index, theirs.fileno())
        env = {**os.environ, WORKER_ENV: context.to_env(),
               "PROMETHEUS_MULTIPROC_DIR": str(self.directory / "prometheus")}
        try:
            worker.proc = await asyncio.create_subprocess_exec(
                *self.command, *self._worker_args(worker), env=env, preexec_fn=_die_with_parent,
                pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        logger.info("worker %d starting (pid %d)", worker.index, worker.proc.pid)
        if self.draining:  # the stop signal came while it was being started
            worker.proc.send_signal(signal.SIGTERM)

    async def _until_ready(self, worker: _Worker) -> int | None:
        """None once the worker wrote its ready file; its exit status if it exited first."""
        proc, path = worker.proc, self._ready_path(worker)
        exited = asyncio.ensure_future(proc.wait())
        try:
            while not path.exists():
                if exited.done() or self.draining:
                    if not exited.done():
                        return None
                    return exited.result()
                await asyncio.wait((exited,), timeout=0.05)
        finally:
            if not exited.done():
                exited.cancel()
        worker.ready_at = time.monotonic()
        return None

    def _write_ready_file(self) -> None:
        if self.config.ready_file is None:
            return
        from attnserve.files import write_json_atomic

        write_json_atomic(self.config.ready_file, {
            "grpc_port": self.grpc_port, "http_port": self.http_port, "metrics_port": self.metrics_port,
            "pid": os.getpid(),
            "workers": [w.proc.pid for w in self.workers if w.proc is not None],
            "workers_dir": str(self.directory)})  # each worker's statistics file (shared_stats.gather_by_pid)

    async def _keep(self, worker: _Worker) -> int:
        """Run the worker (already started and ready), replacing it whenever it exits
        unexpectedly, until the drain; its last exit status."""
        from prometheus_client import multiprocess

        while True:
            watchdog = asyncio.ensure_future(self._watch(worker))
            try:
                code = await worker.proc.wait()
            finally:
                watchdog.cancel()
            multiprocess.mark_process_dead(worker.proc.pid, str(self.directory / "prometheus"))
            if self.draining:
                return code
            served = time.monotonic() - worker.ready_at if worker.ready_at is not None else 0.0
            worker.quick_deaths = 0 if served >= STABLE_S else worker.quick_deaths + 1
            delay = restart_delay(worker.quick_deaths)
            self.restarts.inc()
            how = f"signal {_signal_name(-code)}" if code < 0 else f"status {code}"
            if worker.hung:
                how += ", killed by the watchdog: it missed a heartbeat"
            logger.error("worker %d (pid %d) exited unexpectedly (%s) after %.1fs serving; restarting it in %.1fs",
                         worker.index, worker.proc.pid, how, served, delay)
            if await self._wait_drain(delay):
                return code
            await self._spawn(worker)
            status = await self._until_ready(worker)
            if self.draining and worker.ready_at is None:
                return await worker.proc.wait()
            if status is None:
                self._write_ready_file()  # before the log line, which tests wait for
                logger.info("worker %d replaced: pid %d ready", worker.index, worker.proc.pid)

    async def _watch(self, worker: _Worker) -> None:
        """The liveness watchdog of a ready worker: every worker_heartbeat_s a byte on its
        heartbeat socket, which its event loop must echo within worker_heartbeat_timeout_s; one
        that does not (stopped, hung, its loop blocked) is killed (SIGKILL) and, its exit seen by
        _keep, replaced. Not while the server drains: a draining worker is waited for."""
        loop = asyncio.get_running_loop()
        sock, proc = worker.heartbeat, worker.proc
        beat = 0
        while True:
            await asyncio.sleep(self.config.worker_heartbeat_s)
            if self.draining or proc.returncode is not None:
                return
            beat = (beat + 1) % 256
            try:
                await loop.sock_sendall(sock, bytes([beat]))
                deadline = loop.time() + self.config.worker_heartbeat_timeout_s
                while True:  # an answer to an earlier beat may come first, late
                    answer = await asyncio.wait_for(loop.sock_recv(sock, 64), max(deadline - loop.time(), 0))
                    if not answer or answer[-1] == beat:
                        break
            except (TimeoutError, OSError):
                answer = None
            if answer or self.draining or proc.returncode is not None:
                continue
            worker.hung = True
            self.hung.inc()
            logger.error("worker %d (pid %d) missed its heartbeat (no answer within %.1fs): killing it",
                         worker.index, proc.pid, self.config.worker_heartbeat_timeout_s)
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            return

    async def _wait_drain(self, delay_s: float) -> bool:
        """Sleep delay_s; True (at once) if the drain begins meanwhile."""
        deadline = time.monotonic() + delay_s
        while not self.draining and (left := deadline - time.monotonic()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass
        return self.draining

    def signal(self, sig: signal.Signals) -> None:
        if self.draining:
            self.hurried = True
            logger.warning("%s received again: every worker stops now", sig.name)
        else:
            logger.info("%s received: every worker drains", sig.name)
        self.draining = True
        self._forward(sig)

    def _forward(self, sig: signal.Signals) -> None:
        self._changed.set()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.returncode is None:
                try:
                    worker.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.signal, sig)
        try:
            self.data_plane, _why_not_native = choose_data_plane(self.config.data_plane)
            await self.start_ports()
        except (DataPlaneUnavailable, OSError) as err:
            logger.error("cannot start: %s", err)
            return EXIT_CANNOT_START
        if self.draining:
            return 0
        for worker in self.workers:
            if self.draining:  # a stop signal while they start: start no more
                break
            await self._spawn(worker)
        started = [w for w in self.workers if w.proc is not None]
        statuses = await asyncio.gather(*(self._until_ready(w) for w in started))
        failed = [(w, s) for w, s in zip(started, statuses, strict=True) if s is not None]
        if failed and not self.draining:
            worker, status = failed[0]
            logger.error("cannot start: worker %d exited with status %d before it was ready", worker.index, status)
            self.draining = self.hurried = True
            self._forward(signal.SIGTERM)
            await asyncio.gather(*(w.proc.wait() for w in started))
            return EXIT_CANNOT_START
        if self.draining:
            codes = await asyncio.gather(*(w.proc.wait() for w in started))
            logger.info("stopped while starting: %d of %d workers had been started (exit statuses %s)",
                        len(started), self.count, codes)
            return 0
        if not self.draining:
            self._write_ready_file()
            logger.info("serving with %d workers (pids %s) on %s:%d (data plane %s, REST %s, metrics %s)", self.count,
                        [w.proc.pid for w in self.workers], self.config.host, self.grpc_port, self.data_plane,
                        self.http_port or "off", self.metrics_port or "off")
        codes = await asyncio.gather(*(self._keep(w) for w in self.workers))
        logger.info("every worker stopped (exit statuses %s)", codes)
        return 0 if all(c == 0 for c in codes) else 1

    async def close(self) -> None:
        for worker in self.workers:
            if worker.heartbeat is not None:
                worker.heartbeat.close()
        if self._endpoint is not None:
            await self._endpoint.close()
        for sock in self._held:
            sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


async def supervise(config: ServerConfig, argv: list[str], command: list[str], workers: int) -> int:
    """Run `command argv` as `workers` worker processes (see the module's docstring); the exit
    status: 0 after every worker drained, 2 for a worker count over the ceiling
    (workers_over_ceiling), 3 if the server cannot start."""
    refusal = workers_over_ceiling(workers)
    if refusal is not None:
        print(f"attnserve serve: error: {refusal}", file=sys.stderr)
        return EXIT_BAD_FLAG
    supervisor = Supervisor(config, argv, command, workers)
    try:
        return await supervisor.run()
    finally:
        await supervisor.close()


__all__ = ["WorkerContext", "available_cpus", "default_workers", "max_workers", "supervise"]
