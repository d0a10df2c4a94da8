"""The native data plane keeps the last of the Python plane's memory bounds and cancel stages
(docs/memory.md, "The native data plane's memory bounds", and docs/native-data-plane.md, "Request control"):

- a native call with a deadline waits for memory within it, in one arrival order with the Python
  plane's waiters (the budget's one queue, in C++), counted where Python's waiters are; one
  without a deadline is shed at once with the Python plane's words, hint included; a waiting
  call whose deadline passes, or whose client cancels, leaves the queue at once;
- --max-queued-bytes refuses a native call with the Python plane's status and words;
- a native call whose client goes after it was answered, before its answer was sent, counts as
  cancelled at the `answered` stage (the Python port cannot see that case: grpc.aio).

Each is compared with the Python port in the same situation, on real `--data-plane native`
servers; work is held at the gate of tests/gated_server.py or by HTTP/2 flow control
(tests/h2_client.py), never by a guess of how long something takes. Skips where the extension is
not built (`make native`).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import zlib

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native
from attnserve.server.memory.costs import AttentionDims, request_cost
from attnserve.server.repository import read_model_spec

from attnserve.contract import OUTPUT_ONLY
from tests.gated_server import GatedServer
from tests.h2_client import RawGrpcClient
from tests.oip import infer_request, refusal
from tests.server_process import ServerProcess

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

MODEL = "self_attention"
WIDTH = 512
REACHED_WITHIN_S = 60.0  # a bound on waiting for a state the test caused, not a guess of speed
CALL_TIMEOUT_S = 120.0
INFER = "/inference.GRPCInferenceService/ModelInfer"
# Output only, scores-heavy: its inputs (what a waiter holds) are a small part of its cost, so two
# waiters fit the budget's waiting room while one such call is held.
BIG = (1, 1024, 1024)


def native_port(proc: ServerProcess) -> int:
    """Where native calls go: the server's gRPC port (the Python plane sits behind it: proc.python_target)."""
    return proc.port


def _channel(target: str) -> grpc.Channel:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    return grpc.insecure_channel(target, options=options)


def _stubs(proc: ServerProcess) -> tuple[dict, list[grpc.Channel]]:
    channels = [_channel(f"127.0.0.1:{native_port(proc)}"), _channel(proc.python_target)]
    return {"native": pb_grpc.GRPCInferenceServiceStub(channels[0]),
            "python": pb_grpc.GRPCInferenceServiceStub(channels[1])}, channels


def _request(shape: tuple[int, int, int], seed: str, request_id: str = "", outputs=("output",), **params):
    rows, lq, lk = shape
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    request = infer_request(MODEL, request_id=request_id, outputs=outputs,
                            query=rng.standard_normal((rows, lq, WIDTH), dtype=np.float32),
                            key=rng.standard_normal((rows, lk, WIDTH), dtype=np.float32),
                            value=rng.standard_normal((rows, lk, WIDTH), dtype=np.float32))
    for name, value in params.items():  # the schedule's parameters (`timeout` in microseconds)
        request.parameters[name].int64_param = value
    return request


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include these (0 when none)."""
    total = 0.0
    for found in re.finditer(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


def _until(proc: ServerProcess, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + REACHED_WITHIN_S
    while (got := _sample(proc.scrape(), name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, not {value}"
        time.sleep(0.01)


# -- memory waits ---------------------------------------------------------------------------------


def test_the_native_queue_of_waiters_keeps_the_python_budgets_rule():
    """_native.Budget (both planes' waiters, with the native plane) and the budget's own counter
    (without it) answer the same sequence of takes, waits, leaves and gives the same way."""
    from attnserve.server import _native
    from attnserve.server.memory.budget import _LocalCounter

    rng = np.random.default_rng(26)
    limit, room = 1000, 125
    counters = [_LocalCounter(limit, room), _native.Budget(limit, room)]
    held: list[int] = []  # bytes taken or granted, given back later
    waiting: dict[int, int] = {}  # ticket -> bytes
    for step in range(3000):
        op = rng.integers(4)
        if op == 0 or not (held or waiting):
            n, first, wait = int(rng.integers(1, 1000)), int(rng.integers(0, 80)), bool(rng.integers(2))
            got = [c.take(n, first, wait) for c in counters]
            if got[0] == 0:
                held.append(n)
            elif got[0] > 0:
                waiting[got[0]] = n
        elif op == 1 and waiting:
            ticket = list(waiting)[int(rng.integers(len(waiting)))]
            del waiting[ticket]
            got = [c.leave(ticket) for c in counters]
        elif held:
            n = held.pop(int(rng.integers(len(held))))
            got = [c.give(n) for c in counters]
        else:
            continue
        granted = [c.granted() for c in counters]
        for ticket in granted[0]:
            held.append(waiting.pop(ticket))
        state = [(c.reserved(), c.waiting_bytes(), c.waiters()) for c in counters]
        assert got[0] == got[1] and granted[0] == granted[1] and state[0] == state[1], (step, got, granted, state)


@pytest.fixture(scope="module")
def big_cost(model_repository):
    spec = read_model_spec(model_repository / MODEL)
    dims = AttentionDims(spec.query_dim, spec.kv_dim, spec.d_model or max(spec.query_dim, spec.kv_dim, spec.out_dim),
                         spec.out_dim, spec.num_heads)
    rows, lq, lk = BIG
    return request_cost(OUTPUT_ONLY, dims, rows, lq, lk, 4 * rows * (lq + 2 * lk) * WIDTH, False)


@pytest.fixture(scope="module")
def waiting_server(model_repository, big_cost):
    """One BIG call fits the budget, two do not; the waiting room (an eighth) holds two waiters' inputs."""
    limit = max(big_cost.total * 8 // 7 + 1, 8 * 2 * big_cost.inputs + 8)
    assert big_cost.total <= limit - limit // 8 < 2 * big_cost.total, (big_cost, limit)
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "1",
                     "--memory-limit-bytes", str(limit), "--grace-period-s", "120") as proc:
        yield proc


def _hold(pool, proc, stub, seed: str):
    """A BIG call, held at the gate once this returns."""
    held = pool.submit(stub.ModelInfer, _request(BIG, seed), timeout=CALL_TIMEOUT_S)
    assert proc.gate.wait_started() == 1
    return held


def _refusals_while_held(proc, holder: str, request, timeout: float | None) -> dict:
    """Each port's refusal of `request` while a BIG call that came by `holder`'s port is held
    (none of them computed), then the held call released and answered."""
    stubs, channels = _stubs(proc)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = _hold(pool, proc, stubs[holder], "held")
        refusals = {name: refusal(stub, request, timeout=timeout) for name, stub in stubs.items()}
        assert not proc.gate.has_started()
        proc.gate.release()
        held.result(timeout=CALL_TIMEOUT_S)
    for channel in channels:
        channel.close()
    return refusals


@pytest.mark.parametrize("order", [("native", "python"), ("python", "native")])
def test_native_and_python_waiters_are_served_in_one_arrival_order(waiting_server, order):
    """With a call held, a native call and a Python call with deadlines both wait (counted in
    attnserve_memory_waiters), and the budget grants them in arrival order, whichever plane each
    came by. Before: the native call was shed at once, or passed by the Python waiter."""
    proc = waiting_server
    _until(proc, "attnserve_memory_reserved_bytes", 0)
    waits = _sample(proc.scrape(), "attnserve_memory_waits_total")
    stubs, channels = _stubs(proc)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = _hold(pool, proc, stubs["native"], "held")
        first = pool.submit(stubs[order[0]].ModelInfer, _request(BIG, "first", "first"), timeout=CALL_TIMEOUT_S)
        _until(proc, "attnserve_memory_waiters", 1)
        second = pool.submit(stubs[order[1]].ModelInfer, _request(BIG, "second", "second"), timeout=CALL_TIMEOUT_S)
        _until(proc, "attnserve_memory_waiters", 2)
        assert not first.done() and not second.done()
        proc.gate.release()
        assert held.result(timeout=CALL_TIMEOUT_S).outputs[0].name == "output"
        assert proc.gate.wait_started() == 1  # the first waiter's run: the second still waits
        proc.gate.release()
        assert first.result(timeout=CALL_TIMEOUT_S).id == "first"
        assert not second.done()
        assert proc.gate.wait_started() == 1
        proc.gate.release()
        assert second.result(timeout=CALL_TIMEOUT_S).id == "second"
    for channel in channels:
        channel.close()
    text = proc.scrape()
    assert _sample(text, "attnserve_memory_waits_total") == waits + 2
    assert _sample(text, "attnserve_memory_waiters") == 0 and _sample(text, "attnserve_memory_waiting_bytes") == 0


def test_a_call_without_a_deadline_is_shed_with_the_python_planes_words(waiting_server, big_cost):
    """Both ports answer RESOURCE_EXHAUSTED with the same words, the deadline hint included."""
    proc = waiting_server
    _until(proc, "attnserve_memory_reserved_bytes", 0)
    refusals = _refusals_while_held(proc, "python", _request(BIG, "shed"), timeout=None)
    assert refusals["native"] == refusals["python"], refusals
    code, details = refusals["native"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(
        f"memory budget: {big_cost.total:,} of "), details
    assert details.endswith("; retry later (a request with a deadline waits within it)"), details


def test_a_waiting_call_past_its_timeout_is_refused_as_on_the_python_port(waiting_server, big_cost):
    """A `timeout` (the schedule's, 0.3 s) that passes while the call waits for memory: refused
    DEADLINE_EXCEEDED, never computed, with the batcher's words on both ports; counted in
    attnserve_memory_wait_timeouts_total."""
    proc = waiting_server
    _until(proc, "attnserve_memory_reserved_bytes", 0)
    timeouts = _sample(proc.scrape(), "attnserve_memory_wait_timeouts_total")
    refusals = _refusals_while_held(proc, "native", _request(BIG, "late", timeout=300_000), timeout=CALL_TIMEOUT_S)
    assert refusals["native"] == refusals["python"] == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"model {MODEL}: deadline passed while waiting for memory ({big_cost.total:,} bytes); not computed"), refusals
    assert _sample(proc.scrape(), "attnserve_memory_wait_timeouts_total") == timeouts + 2


def test_a_cancelled_waiting_call_leaves_the_queue_at_once(waiting_server):
    """The client cancels a native call waiting for memory: it leaves the budget's queue while the
    held call is still held, counted cancelled (client, queued) as on the Python port."""
    proc = waiting_server
    _until(proc, "attnserve_memory_reserved_bytes", 0)
    stubs, channels = _stubs(proc)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = _hold(pool, proc, stubs["python"], "held")
        for name in ("native", "python"):
            before = _sample(proc.scrape(), "attnserve_cancelled_requests_total", reason="client", stage="queued")
            waiting = stubs[name].ModelInfer.future(_request(BIG, f"cancelled {name}"), timeout=CALL_TIMEOUT_S)
            _until(proc, "attnserve_memory_waiters", 1)
            waiting.cancel()
            _until(proc, "attnserve_memory_waiters", 0)
            _until(proc, "attnserve_cancelled_requests_total", before + 1, reason="client", stage="queued")
        assert not proc.gate.has_started()
        proc.gate.release()
        held.result(timeout=CALL_TIMEOUT_S)
    for channel in channels:
        channel.close()
    _until(proc, "attnserve_memory_reserved_bytes", 0)


# -- --max-queued-bytes ----------------------------------------------------------------------------

SMALL = (1, 16, 16)  # 98,304 input bytes


QUEUE_BOUNDS = {
    "--max-queued-bytes": ("150000", f"model {MODEL}: 98,304 input bytes queued; this request's 98,304 would pass "
                                     "max_queued_bytes 150,000; retry later"),
    "--max-queue-size": ("1", f"model {MODEL}: 1 requests queued (max_queue_size 1); retry later"),
}


@pytest.mark.parametrize("flag", sorted(QUEUE_BOUNDS))
def test_the_queue_bounds_refuse_as_on_the_python_port(model_repository, flag):
    """With a batch held on each plane and one call queued behind it, a call that would pass
    --max-queued-bytes (or --max-queue-size) is refused RESOURCE_EXHAUSTED with the batcher's
    words on both ports."""
    value, words = QUEUE_BOUNDS[flag]
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "1",
                     flag, value, "--grace-period-s", "120") as proc:
        stubs, channels = _stubs(proc)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = []
            for name, stub in stubs.items():
                calls.append(pool.submit(stub.ModelInfer, _request(SMALL, f"held {name}"), timeout=CALL_TIMEOUT_S))
                proc.gate.wait_started()
            for name, stub in stubs.items():
                calls.append(pool.submit(stub.ModelInfer, _request(SMALL, f"queued {name}"), timeout=CALL_TIMEOUT_S))
            _until(proc, "attnserve_queue_depth", 2, model=MODEL)  # one queued on each plane: the gauge sums them
            _until(proc, "attnserve_native_in_flight", 2)
            refusals = {name: refusal(stub, _request(SMALL, "over"), timeout=CALL_TIMEOUT_S)
                        for name, stub in stubs.items()}
            proc.gate.release(4)
            assert all(c.result(timeout=CALL_TIMEOUT_S).outputs for c in calls)
        for channel in channels:
            channel.close()
    assert refusals["native"] == refusals["python"] == (grpc.StatusCode.RESOURCE_EXHAUSTED, words), refusals


# -- the answered stage ------------------------------------------------------------------------------


def test_a_call_gone_before_its_answer_is_sent_counts_as_answered(model_repository):
    """A client that never opens its HTTP/2 window gets the first 64 KiB of a larger answer, then
    cancels: computed and answered, but never sent. The native port counts it in
    attnserve_cancelled_requests_total at the `answered` stage (its final status stays OK). The
    Python port cannot see this case: grpc.aio reports no cancel once the handler has returned
    (its done callback finds `cancelled()` false), so its count stays as it was."""
    request = _request((1, 64, 64), "answered", outputs=("output", "attn_probs")).SerializeToString()
    proc = ServerProcess(model_repository, "--data-plane", "native")
    try:
        for port, counted in ((native_port(proc), 1),):  # the Python plane sits behind a socket: not raw HTTP/2 here
            before = _sample(proc.scrape(), "attnserve_cancelled_requests_total", stage="answered")
            client = RawGrpcClient(port)
            try:
                sid = client.start_call(INFER, request, timeout_s=CALL_TIMEOUT_S)
                deadline = time.monotonic() + REACHED_WITHIN_S
                while not client.calls[sid].received:  # the answer's first bytes: it was answered
                    assert time.monotonic() < deadline and not client.calls[sid].ended
                    client.pump()
                client.cancel(sid)
                if counted:
                    _until(proc, "attnserve_cancelled_requests_total", before + counted, stage="answered")
            finally:
                client.close()
        _until(proc, "attnserve_memory_reserved_bytes", 0)  # both answers' memory went back
        assert _sample(proc.scrape(), "attnserve_cancelled_requests_total", stage="answered") == 1
        assert _sample(proc.scrape(), "attnserve_cancelled_requests_total", stage="answered", reason="client") == 1
    finally:
        proc.stop()
