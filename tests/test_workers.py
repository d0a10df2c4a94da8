"""`attnserve serve --workers N` (server.workers): N real worker processes on one port.

Which worker a call reached is read from the gate (tests.gated_server): every worker is a gated
server and each held batch names its process. Each channel here is its own connection
(grpc.use_local_subchannel_pool), so the kernel places it on one worker for its whole life.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import ServerConfig
from attnserve.server.workers import BACKOFF_MAX_S, available_cpus, default_workers, restart_delay
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e  # starts supervisors and workers

TOLERANCE = 1e-5
MAX_CHANNELS = 40  # connections opened to find calls on every worker (2 workers: 2**-39 to miss one)
# Every call reaches the gate at once, whichever worker it is on (none waits behind a held batch).
FLAGS = ("--workers", "2", "--max-batch-size", "1", "--batches-in-flight", "16", "--grace-period-s", "120")
SERVING = health_pb2.HealthCheckResponse.SERVING


def _own_connection(proc) -> grpc.Channel:
    return proc.channel(**{"grpc.use_local_subchannel_pool": 1})


class _Held:
    """Calls held at the gate, by the worker (pid) they reached."""

    def __init__(self, proc: GatedServer, pool: concurrent.futures.Executor, rng: np.random.Generator) -> None:
        self.proc, self.pool, self.rng = proc, pool, rng
        self.by_pid: dict[int, list[tuple[grpc.Channel, concurrent.futures.Future, dict]]] = {}
        self.channels: list[grpc.Channel] = []

    def send(self) -> int:
        """One call on a new connection; once it is held at the gate, the pid of its worker."""
        channel = _own_connection(self.proc)
        self.channels.append(channel)
        x = random_inputs(self.rng, 1, 4, 3, 512, 512)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        future = self.pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x),
                                  timeout=120)
        self.proc.gate.wait_started()
        pid = self.proc.gate.last_pid
        self.by_pid.setdefault(pid, []).append((channel, future, x))
        return pid

    def on_every(self, pids: set[int], calls: int) -> None:
        """Send until every worker in `pids` holds at least `calls` calls."""
        for _ in range(MAX_CHANNELS):
            if all(len(self.by_pid.get(p, ())) >= calls for p in pids):
                return
            self.send()
        raise AssertionError(f"{MAX_CHANNELS} connections did not reach every worker: {self.by_pid.keys()}")

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _close(response, x, eager_modules) -> bool:
    want = eager(eager_modules["self_attention"], **x)["output"]
    return float(np.max(np.abs(outputs_of(response)["output"] - want))) <= TOLERANCE


def _metrics(proc) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def _ready(proc) -> dict:
    return json.loads(Path(proc.ready_file).read_text())


def test_sigkill_of_one_worker_fails_only_its_calls_and_it_is_replaced(model_repository, eager_modules):
    """Two workers, calls held on each; one worker is killed (SIGKILL). Its calls fail
    UNAVAILABLE, the other's are answered correctly, readiness never drops on the survivor's
    connection nor on new ones, a replacement comes up and serves, and /metrics counts it."""
    rng = np.random.default_rng(17)
    with GatedServer(model_repository, *FLAGS) as proc, concurrent.futures.ThreadPoolExecutor(48) as pool:
        pids = set(_ready(proc)["workers"])
        assert len(pids) == 2
        held = _Held(proc, pool, rng)
        held.on_every(pids, 2)
        victim, survivor = sorted(pids)
        watch_channel = held.by_pid[survivor][0][0]
        health = health_pb2_grpc.HealthStub(watch_channel)
        seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            # A check every 5 ms, not back to back: on one core a check storm kept the survivor
            # busy enough to starve the replacement's start (0.14 s of CPU in 60 s, once).
            while not stop.wait(0.005):
                seen.append(health.Check(health_pb2.HealthCheckRequest(), timeout=30).status)

        watcher = pool.submit(watch)
        try:
            _kill_and_replace(proc, held, victim, survivor, pids, eager_modules)
        finally:
            stop.set()  # the watch ends whatever failed
        watcher.result(timeout=60)
        assert seen and all(status == SERVING for status in seen), seen
        assert "attnserve_worker_restarts_total 1.0" in _metrics(proc)
        held.close()
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()


def _kill_and_replace(proc, held: _Held, victim: int, survivor: int, pids: set[int], eager_modules) -> None:
    """SIGKILL `victim`: its calls fail, the survivor's are answered, the replacement serves."""
    import os

    os.kill(victim, signal.SIGKILL)
    for _channel, future, _x in held.by_pid[victim]:
        err = future.exception(timeout=120)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    proc.wait_for_log(f"(pid {victim}) exited unexpectedly (signal SIGKILL)")
    proc.gate.release(len(held.by_pid[survivor]))
    for _channel, future, x in held.by_pid[survivor]:
        assert _close(future.result(timeout=120), x, eager_modules)
    # New connections go to the live listeners only: ready, whichever worker answers.
    for _ in range(8):
        with _own_connection(proc) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=30).status == SERVING
    proc.wait_for_log("replaced: pid")
    replacement = (set(_ready(proc)["workers"]) - pids).pop()
    assert survivor in _ready(proc)["workers"]
    for _ in range(MAX_CHANNELS):  # the replacement serves (a connection reaches it)
        pid = held.send()
        proc.gate.release()
        if pid == replacement:
            break
    else:
        raise AssertionError("no connection reached the replacement")
    channel, future, x = held.by_pid[replacement][0]
    assert _close(future.result(timeout=120), x, eager_modules)


def test_sigterm_drains_every_worker(model_repository, eager_modules):
    """Calls held on both workers, then SIGTERM to the supervisor: every worker refuses new
    calls (UNAVAILABLE) and answers every accepted one, and the server exits 0."""
    rng = np.random.default_rng(18)
    with GatedServer(model_repository, *FLAGS) as proc, concurrent.futures.ThreadPoolExecutor(48) as pool:
        pids = set(_ready(proc)["workers"])
        held = _Held(proc, pool, rng)
        held.on_every(pids, 1)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("refusing new calls (UNAVAILABLE)", count=2)
        assert proc.log().count("SIGTERM received: draining") == 2
        for _ in range(4):
            with _own_connection(proc) as channel:
                with pytest.raises(grpc.RpcError) as late:
                    pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                        infer_request("self_attention", **random_inputs(rng, 1, 4, 3, 512, 512)), timeout=30)
                assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.gate.release(100)
        for calls in held.by_pid.values():
            for _channel, future, x in calls:
                assert _close(future.result(timeout=120), x, eager_modules)
        held.close()
        assert proc.wait(timeout=60) == 0, proc.log()
        assert "every worker stopped (exit statuses [0, 0])" in proc.log()


def test_a_failed_wait_names_every_process_of_the_server_and_its_threads_states(model_repository):
    """The harness's message when a server does not reach a state (tests.server_process,
    `processes`): the supervisor and each worker, with CPU seconds and each thread's state and
    kernel wait channel, so that a hang seen once in CI says where it waits."""
    with GatedServer(model_repository, *FLAGS) as proc:
        workers = _ready(proc)["workers"]
        with pytest.raises(AssertionError) as failed:
            proc.wait_for_log("a line no server writes", timeout_s=0.0)
        message = str(failed.value)
        for pid in (proc.proc.pid, *workers):
            assert f"pid {pid} state " in message, message
        assert message.count("threads: ") == 1 + len(workers)
        assert "tests.gated_server" in message


def test_model_statistics_and_metrics_are_the_whole_servers(model_repository):
    """Calls answered by both workers: ModelStatistics asked through either worker, and the one
    /metrics, count every call of both."""
    rng = np.random.default_rng(19)
    with GatedServer(model_repository, *FLAGS) as proc, concurrent.futures.ThreadPoolExecutor(48) as pool:
        pids = set(_ready(proc)["workers"])
        held = _Held(proc, pool, rng)
        held.on_every(pids, 2)
        calls = sum(len(c) for c in held.by_pid.values())
        proc.gate.release(calls)
        for group in held.by_pid.values():
            for _channel, future, _x in group:
                future.result(timeout=120)
        for pid, group in held.by_pid.items():  # asked through a connection on each worker
            stub = pb_grpc.GRPCInferenceServiceStub(group[0][0])

            def statistics(stub=stub):
                asked = pb.ModelStatisticsRequest(name="self_attention")
                (stats,) = stub.ModelStatistics(asked, timeout=30).model_stats
                assert (stats.inference_count, stats.execution_count) <= (calls, calls)
                return stats

            # Another worker's native batch is in the sum once its event loop has counted it, just
            # after the answer (docs/native-data-plane.md, "TLS, tokens and workers"): the sum reaches every call.
            _wait_until(lambda statistics=statistics: statistics().inference_count == calls)
            stats = statistics()
            assert (stats.inference_count, stats.execution_count) == (calls, calls), pid
            assert stats.inference_stats.success.count == calls
            assert stats.inference_stats.queue.count == calls
            assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(1, calls)]
            assert 0 < len(group) < calls  # this worker alone served fewer
        # Native calls' final statuses reach the supervisor's files once a second (docs/native-data-plane.md).
        answered = f'attnserve_requests_total{{code="OK",model="self_attention"}} {float(calls)}'
        _wait_until(lambda: answered in _metrics(proc))
        text = _metrics(proc)
        assert "attnserve_worker_restarts_total 0.0" in text
        # The memory budget's figures are each worker's, copied into the shared files once a
        # second: the whole server's limit, and nothing reserved once every call is answered.
        limit = _metric(text, "attnserve_memory_limit_bytes")
        assert limit > 0 and _metric(text, "attnserve_receive_slots") >= 2
        assert _metric(text, "attnserve_memory_waits_total") == 0
        _wait_until(lambda: _metric(_metrics(proc), "attnserve_memory_reserved_bytes") == 0)
        held.close()


def _metric(text: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0] == name]
    return value


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "attnserve", "serve", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, env", [(["--workers", "0"], {}), (["--workers", "-2"], {}),
                                       ([], {"ATTNSERVE_WORKERS": "0"}), (["--workers", "two"], {})])
def test_bad_worker_counts_are_flag_errors(args, env):
    done = _serve("--model-repository", "nowhere", *args, env=env)
    assert done.returncode == 2, done.stderr
    assert "workers" in done.stderr.lower()


def test_explicit_model_control_with_several_workers_is_refused():
    done = _serve("--model-repository", "nowhere", "--workers", "2", "--model-control-mode", "explicit")
    assert done.returncode == 2
    assert "would not change the others'" in done.stderr


def test_a_worker_that_cannot_start_stops_the_server_with_status_3(tmp_path):
    done = _serve("--model-repository", str(tmp_path), "--workers", "2", "--host", "127.0.0.1", "--port", "0",
                  "--http-port", "0", "--metrics-port", "0")
    assert done.returncode == 3, done.stderr
    assert "holds no model" in done.stderr and "worker 0 exited with status 3" in done.stderr


def test_a_port_in_use_is_refused_with_status_3(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve("--model-repository", str(tmp_path), "--workers", "2", "--host", "127.0.0.1",
                      "--port", str(port), "--http-port", "-1", "--metrics-port", "-1")
    assert done.returncode == 3, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_default_worker_count_follows_the_cpus_the_process_may_use(tmp_path):
    assert default_workers(ServerConfig(), cpus=16) == 8
    assert default_workers(ServerConfig(), cpus=3) == 1
    assert default_workers(ServerConfig(), cpus=1) == 1
    assert default_workers(ServerConfig(workers=5), cpus=1) == 5
    assert default_workers(ServerConfig(model_control_mode="explicit"), cpus=16) == 1
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # a quota of 2.5 CPUs: 3
    assert available_cpus(tmp_path) == min(3, available_cpus(tmp_path / "none"))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == available_cpus(tmp_path / "none")


def test_restarts_back_off_while_replacements_keep_dying():
    assert [restart_delay(n) for n in range(5)] == [0.5, 0.5, 1.0, 2.0, 4.0]
    assert restart_delay(100) == BACKOFF_MAX_S


def test_workers_stop_when_their_supervisor_is_killed(model_repository):
    """SIGKILL of the supervisor: every worker gets SIGTERM (PR_SET_PDEATHSIG), drains and exits."""
    import os
    import time

    proc = ServerProcess(model_repository, "--workers", "2")
    workers: list[int] = []
    try:
        workers = _ready(proc)["workers"]
        proc.proc.kill()
        proc.proc.wait(timeout=30)
        for pid in workers:
            deadline = time.monotonic() + 60
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # a worker's parent is gone: init reaps it once it has drained
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert proc.log().count("SIGTERM received: draining") == 2
    finally:
        proc.stop()
        for pid in workers:  # none is left behind by a failure here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_scaling_benchmark_reports_each_workers_share(model_repository, tmp_path):
    """bench.scaling at a small size: one row per worker count, with requests per worker that
    add up to what the load generator got answered."""
    done = subprocess.run([sys.executable, "-m", "bench.scaling", "--repository", str(model_repository),
                           "--workers", "2", "--concurrency", "2", "--connections", "2", "--seconds", "0.5",
                           "--no-perf-analyzer", "--output", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert row["workers"] == 2 and row["errors"] == 0 and len(row["requests_per_worker"]) == 2
    assert row["requests_per_s"] > 0 and row["loadgen_cpu_s"] > 0 and row["server_cpu_s"] > 0
    # CPUs kept busy: CPU seconds over the row's own wall time, at most what the machine has
    assert row["wall_s"] >= 0.5 and row["server_cpus"] == pytest.approx(row["server_cpu_s"] / row["wall_s"])
    assert 0 < row["loadgen_cpus"] <= os.cpu_count() + 0.5
    answered = round(row["requests_per_s"] * 0.5)
    assert sum(row["requests_per_worker"]) >= answered  # the worker counts include the calls still in the window's end


# -- hung workers, the ceiling, a stop while starting (issue 27) --------------------------------


def test_a_stopped_worker_misses_its_heartbeat_and_is_killed_replaced_and_counted(model_repository):
    """SIGSTOP one of two workers (its event loop can answer nothing: what a hung worker does):
    the supervisor's watchdog kills and replaces it, counts it in attnserve_worker_hung_total,
    and every new connection is served again (before, about half of them went to the stopped
    worker and hung)."""
    proc = ServerProcess(model_repository, "--workers", "2", "--worker-heartbeat-s", "0.2",
                         "--worker-heartbeat-timeout-s", "10")
    try:
        pids = _ready(proc)["workers"]
        victim = pids[0]
        os.kill(victim, signal.SIGSTOP)
        proc.wait_for_log(f"(pid {victim}) missed its heartbeat", timeout_s=120)
        proc.wait_for_log("replaced: pid", timeout_s=120)
        assert victim not in _ready(proc)["workers"] and pids[1] in _ready(proc)["workers"]
        text = _metrics(proc)
        assert "attnserve_worker_hung_total 1.0" in text and "attnserve_worker_restarts_total 1.0" in text, text
        rng = np.random.default_rng(3)
        for _ in range(8):  # each its own connection: the kernel spreads them over both listeners
            with _own_connection(proc) as channel:
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=30).status == SERVING
                x = random_inputs(rng, 1, 4, 3, 512, 512)
                answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    infer_request("self_attention", outputs=("output",), **x), timeout=30)
                assert answer.outputs[0].name == "output"
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.log()
    finally:
        try:
            os.kill(victim, signal.SIGKILL)  # never left stopped, whatever failed
        except ProcessLookupError:
            pass
        proc.stop()


def test_a_worker_count_over_the_ceiling_is_a_flag_error_naming_it():
    from attnserve.server.workers import max_workers

    ceiling = max_workers()
    assert ceiling + 2 <= 1024, "the test needs a count over the ceiling and within --workers' range"
    for args, env in ((["--workers", str(ceiling + 1)], {}), ([], {"ATTNSERVE_WORKERS": str(ceiling + 2)})):
        done = _serve("--model-repository", "nowhere", *args, env=env)
        assert done.returncode == 2, done.stderr
        assert f"over the ceiling of {ceiling}" in done.stderr and "per CPU" in done.stderr, done.stderr
        assert "starting" not in done.stderr  # refused before any worker started
    done = _serve("--model-repository", "nowhere", env={"ATTNSERVE_WORKERS": "100000"})  # past the range itself
    assert done.returncode == 2 and "ATTNSERVE_WORKERS must be an integer in 1..1024" in done.stderr, done.stderr


def test_a_stop_signal_while_workers_start_starts_no_more_and_exits(tmp_path):
    """SIGTERM (the supervisor's handler, as the signal calls it) right after the first of 8
    workers is started: no other is started, the first is stopped, and the supervisor returns.
    The workers are stand-ins that would sleep for two minutes."""
    import asyncio

    from attnserve.server.workers import Supervisor

    config = ServerConfig(model_repository=tmp_path, host="127.0.0.1", port=0, http_port=-1, metrics_port=-1)
    supervisor = Supervisor(config, [], [sys.executable, "-c", "import time; time.sleep(120)"], 8)
    spawned = []
    real_spawn = supervisor._spawn

    async def spawn_then_signal(worker):
        await real_spawn(worker)
        spawned.append(worker.proc)
        supervisor.signal(signal.SIGTERM)  # the signal arrives while the workers are being started

    supervisor._spawn = spawn_then_signal

    async def main():
        try:
            return await asyncio.wait_for(supervisor.run(), 60)
        finally:
            await supervisor.close()

    code = asyncio.run(main())
    assert len(spawned) == 1, len(spawned)
    assert all(p.returncode is not None for p in spawned)
    assert code == 0
