"""Cancellation stops work (server.batcher, "Cancellation"; docs/scheduling.md): a call whose client
goes away leaves the queue at once, a run whose requests are all gone stops (ONNX Runtime's
RunOptions.terminate) and gives its memory back, a batch with a live request finishes for it.

Runs are held in flight by the server's own metrics (attnserve_runs_in_flight) on a long input,
or by tests.gated_server's gate: never by a sleep."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import urllib.request

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.batcher import Batcher, BatchPolicy
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.costs import Cost

from tests.gated_server import GatedServer
from tests.oip import infer_request, outputs_of
from tests.server_process import ServerProcess

MODEL = "self_attention"
LONG = (1, 8192, 512)  # the longest accepted: a run of it lasts well past the checks below
WAIT_S = 60.0  # only catches a hang


def _metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of `name` with exactly these labels in a /metrics text (0 when absent)."""
    for found in re.finditer(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or "")) == labels:
            return float(found.group(2))
    return 0.0


def _codes(text: str) -> set[str]:
    """The status codes attnserve_requests_total has counted for MODEL."""
    labels = (dict(re.findall(r'(\w+)="([^"]*)"', found)) for found in re.findall(
        r"^attnserve_requests_total{(.*)} \S+$", text, re.M))
    return {found["code"] for found in labels if found.get("model") == MODEL}


def _wait_metric(server: ServerProcess, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (got := _sample(_metrics(server), name, **labels)) != value:
        text = "\n".join(line for line in _metrics(server).splitlines() if line.startswith(name))
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, not {value}, after {WAIT_S}s:\n{text}"
        time.sleep(0.01)


def _cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, every thread): /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_over(pid: int, seconds: float) -> float:
    start = _cpu_s(pid)
    time.sleep(seconds)  # a measuring window, not a wait for a state
    return _cpu_s(pid) - start


def _running(server: ServerProcess) -> float:
    return _sample(_metrics(server), "attnserve_runs_in_flight", model=MODEL)


def _cancelled(server: ServerProcess, reason: str, stage: str) -> float:
    return _sample(_metrics(server), "attnserve_cancelled_requests_total", model=MODEL, reason=reason, stage=stage)


def _long_run_cpu_rate(server: ServerProcess) -> float:
    """CPU seconds per second the server spends while the long run computes (it still does after)."""
    window_s = 0.5
    rate = _cpu_over(server.proc.pid, window_s) / window_s
    assert _running(server) == 1, "the long run ended within the measuring window: nothing left to stop"
    return rate


def _assert_stopped(server: ServerProcess, during_rate: float) -> None:
    """The run stopped (at its next graph node: ONNX Runtime checks its terminate flag between
    nodes, docs/scheduling.md), then no CPU in the second after, and its memory back."""
    _wait_metric(server, "attnserve_runs_in_flight", 0, model=MODEL)
    after = _cpu_over(server.proc.pid, 1.0)
    assert after < 0.2 * during_rate, f"{after:.2f} CPU s in the second after the stop; {during_rate:.2f}/s running"
    _wait_metric(server, "attnserve_memory_reserved_bytes", 0)


@pytest.fixture(scope="module")
def long_input() -> np.ndarray:
    return np.random.default_rng(28).standard_normal(LONG, dtype=np.float32)


def test_a_cancelled_long_solo_run_stops_and_gives_its_memory_back(model_repository, long_input):
    server = ServerProcess(model_repository, "--intra-op-threads", "2")
    try:
        with server.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            x = long_input
            request = infer_request(MODEL, outputs=("output",), query=x, key=x, value=x)
            call = stub.ModelInfer.future(request, timeout=WAIT_S)
            _wait_metric(server, "attnserve_runs_in_flight", 1, model=MODEL)
            during = _long_run_cpu_rate(server)
            call.cancel()
            _assert_stopped(server, during)
            assert _cancelled(server, "client", "terminated") == 1
            text = _metrics(server)
            # Stopped, not failed: no error answer counted, nothing in the server log as one.
            assert _sample(text, "attnserve_requests_total", model=MODEL, code="CANCELLED") == 1
            assert _codes(text) == {"CANCELLED"}
        assert "failed" not in server.log()
    finally:
        server.stop()


def _rest_body(x: np.ndarray) -> tuple[bytes, int]:
    """A binary-tensor REST request of query = key = value = x; (body, its JSON part's length)."""
    raw = x.tobytes()
    header = json.dumps({
        "inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                    "parameters": {"binary_data_size": len(raw)}} for name in ("query", "key", "value")],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return header + raw * 3, len(header)


def test_a_rest_client_that_disconnects_stops_its_run(model_repository, long_input):
    server = ServerProcess(model_repository, "--intra-op-threads", "2")
    try:
        body, json_length = _rest_body(long_input)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=WAIT_S) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
                         f"Inference-Header-Content-Length: {json_length}\r\n"
                         "Content-Type: application/octet-stream\r\n\r\n".encode() + body)
            _wait_metric(server, "attnserve_runs_in_flight", 1, model=MODEL)
            during = _long_run_cpu_rate(server)
        _assert_stopped(server, during)
        assert _cancelled(server, "disconnect", "terminated") == 1
    finally:
        server.stop()


def test_a_batch_with_a_live_request_computes_it_exactly(model_repository):
    """Two requests in one held batch, one cancelled: the run goes on and the other's answer is
    the one it gets alone; then a held batch whose only request is cancelled is stopped unseen."""
    rng = np.random.default_rng(5)
    a, b, blocker = (rng.standard_normal((1, 16, 512), dtype=np.float32) for _ in range(3))
    with GatedServer(model_repository, "--max-batch-size", "2") as server, server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def send(x):
            return stub.ModelInfer.future(infer_request(MODEL, query=x, key=x, value=x), timeout=WAIT_S)

        first = send(blocker)
        assert server.gate.wait_started() == 1
        cancelled, live = send(a), send(b)
        _wait_metric(server, "attnserve_queue_depth", 2, model=MODEL)
        server.gate.release()
        first.result()
        assert server.gate.wait_started() == 2  # a and b, merged
        cancelled.cancel()
        _wait_metric(server, "attnserve_cancelled_requests_total", 1, model=MODEL, reason="client", stage="running")
        server.gate.release()
        together = outputs_of(live.result())["output"]
        alone = send(b)
        assert server.gate.wait_started() == 1
        server.gate.release()
        np.testing.assert_array_equal(together, outputs_of(alone.result())["output"])

        # A held batch of one whose request goes: stopped before it computes, nobody told an error.
        gone = send(a)
        assert server.gate.wait_started() == 1
        gone.cancel()
        _wait_metric(server, "attnserve_cancelled_requests_total", 1, model=MODEL, reason="client", stage="terminated")
        server.gate.release()
        _wait_metric(server, "attnserve_runs_in_flight", 0, model=MODEL)
        text = _metrics(server)
        assert _sample(text, "attnserve_requests_total", model=MODEL, code="OK") == 3
        assert _sample(text, "attnserve_requests_total", model=MODEL, code="CANCELLED") == 2
        assert _codes(text) == {"OK", "CANCELLED"}
        _wait_metric(server, "attnserve_memory_reserved_bytes", 0)
        after = send(b)  # the model serves on
        assert server.gate.wait_started() == 1
        server.gate.release()
        np.testing.assert_array_equal(outputs_of(after.result())["output"], together)


def test_a_queued_call_whose_deadline_passes_leaves_the_queue_at_once(model_repository):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 16, 512), dtype=np.float32)
    with GatedServer(model_repository) as server, server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        held = stub.ModelInfer.future(infer_request(MODEL, query=x, key=x, value=x), timeout=WAIT_S)
        assert server.gate.wait_started() == 1
        late = stub.ModelInfer.future(infer_request(MODEL, query=x, key=x, value=x), timeout=5.0)
        _wait_metric(server, "attnserve_queue_depth", 1, model=MODEL)
        with pytest.raises(grpc.RpcError) as exc:
            late.result()
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Gone from the queue while the batch ahead of it is still held: not when the queue moves.
        # Whichever comes first takes it out: the client's cancel at its deadline (counted cancelled,
        # deadline, queued) or the server's own timer at the same deadline (DEADLINE_EXCEEDED).
        _wait_metric(server, "attnserve_queue_depth", 0, model=MODEL)
        deadline = time.monotonic() + WAIT_S
        while True:
            text = _metrics(server)
            left = (_sample(text, "attnserve_cancelled_requests_total", model=MODEL, reason="deadline", stage="queued"),
                    _sample(text, "attnserve_requests_total", model=MODEL, code="DEADLINE_EXCEEDED"))
            if sum(left) == 1:
                break
            assert sum(left) == 0 and time.monotonic() < deadline, (left, text)
            time.sleep(0.01)
        assert not server.gate.has_started()
        server.gate.release()
        held.result()


# -- the batcher alone: its queue and its memory, with the test's gated run (tests.test_batcher) ---


class _FlatCosting:
    """Every request costs the same: what each holds is then a count."""

    COST = Cost(inputs=1000, run=2000, answer=500)

    def cost(self, work) -> Cost:
        return self.COST

    def batch_run(self, rows: int, q_len: int, k_len: int, masking: str, want_probs: bool) -> int:
        return rows * self.COST.run


def test_a_cancelled_request_leaves_the_queue_at_once_and_a_running_ones_memory_waits_for_its_run():
    from tests.test_batcher import Model, make_work, stop, wait_until

    async def main():
        model = Model()
        budget = MemoryBudget(1 << 30)
        batcher = Batcher("test", model, BatchPolicy(max_queue_delay_s=0.0), budget=budget, costing=_FlatCosting())
        batcher.start()
        try:
            model.hold()
            running = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(1)
            queued = asyncio.create_task(batcher.submit(make_work()))
            await wait_until(lambda: batcher.queue_depth == 1)
            one = _FlatCosting.COST.total
            assert budget.reserved_bytes == 2 * one
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            # Out of the queue while the batch ahead still runs, not when the queue next moves.
            assert batcher.queue_depth == 0 and budget.reserved_bytes == one
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            assert budget.reserved_bytes == one  # the run (not stoppable here) still holds its memory
            model.open()
            await wait_until(lambda: budget.reserved_bytes == 0)
            assert len(model.calls) == 1  # the cancelled queued request was never computed
        finally:
            await stop(batcher, model)

    asyncio.run(main())
