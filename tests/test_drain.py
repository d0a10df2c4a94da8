"""Stopping without losing accepted work: the drain window, GOAWAY, every stop signal, the grace
period, a second signal, Watch streams, deadlines and shedding while batches are held.

Work in flight is held at a gate the test controls (tests/gated_server.py), and the server's own
log says when it reached a state (its access log for a call's headers, its drain lines), so no
test guesses how long anything takes on this machine. Time is asserted only where time is the
feature (a grace period, a bound on the stop), with generous bounds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess

TOLERANCE = 1e-5
INFER_HEADERS = "rpc /inference.GRPCInferenceService/ModelInfer"  # the access log's line per call
REFUSING = "refusing new calls (UNAVAILABLE)"


def _request(rng, b=2, lq=6, lk=5):
    return random_inputs(rng, b, lq, lk, 512, 512)


def _close(response, x, eager_modules) -> bool:
    want = eager(eager_modules["self_attention"], **x)["output"]
    return float(np.max(np.abs(outputs_of(response)["output"] - want))) <= TOLERANCE


def _submit_all(pool, stub, cases, **kw):
    return [pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x), timeout=120, **kw)
            for x in cases]


def _code(future) -> grpc.StatusCode:
    err = future.exception(timeout=120)
    return grpc.StatusCode.OK if err is None else err.code()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_drains_every_accepted_request(model_repository, eager_modules, sig):
    """12 calls admitted (the gate saw their headers), the first batch held at the gate; then
    the signal. Every one of the 12 is answered correctly, a call made after is UNAVAILABLE,
    exit 0. SIGINT and SIGHUP drain exactly as SIGTERM does."""
    rng = np.random.default_rng(0)
    cases = [_request(rng) for _ in range(12)]
    with GatedServer(model_repository, "--max-batch-size", "2", "--access-log", "--grace-period-s", "120") as proc, \
            proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(12) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        futures = _submit_all(pool, stub, cases)
        proc.gate.wait_started()
        proc.wait_for_log(INFER_HEADERS, count=12)
        proc.signal(sig)
        proc.wait_for_log(REFUSING)
        assert f"{sig.name} received: draining" in proc.log()
        with pytest.raises(grpc.RpcError) as late:
            stub.ModelInfer(infer_request("self_attention", **_request(rng)), timeout=30)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.gate.release(100)
        for x, future in zip(cases, futures, strict=True):
            assert _close(future.result(timeout=120), x, eager_modules)
        assert proc.wait(timeout=60) == 0, proc.log()


def test_calls_are_admitted_during_the_drain_delay(model_repository, eager_modules):
    """After the signal readiness is NOT_SERVING at once, but a call made during the drain delay
    (a load balancer that has not seen the change yet) is admitted and answered."""
    rng = np.random.default_rng(1)
    with GatedServer(model_repository, "--drain-delay-s", "600", "--access-log") as proc, proc.channel() as channel, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("still admitting calls")
        assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name="self_attention"), timeout=10).ready
        x = _request(rng)
        (future,) = _submit_all(pool, stub, [x])
        proc.gate.wait_started()  # admitted and computing, during the drain delay
        proc.gate.release()
        assert _close(future.result(timeout=120), x, eager_modules)
        assert proc.proc.poll() is None and REFUSING not in proc.log()
        proc.signal(signal.SIGTERM)  # a second signal ends the drain delay at once
        assert proc.wait(timeout=60) == 0, proc.log()


def test_second_signal_stops_at_once_refusing_what_has_not_started(model_repository, eager_modules):
    """One batch running (held), three requests queued behind it. The first signal drains; the
    second stops at once: the running batch finishes, the queued ones are UNAVAILABLE (never
    computed), exit 0, without waiting for the 600 s grace period."""
    rng = np.random.default_rng(2)
    cases = [_request(rng) for _ in range(4)]
    with GatedServer(model_repository, "--max-batch-size", "2", "--grace-period-s", "600", "--access-log") as proc, \
            proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(4) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        (first,) = _submit_all(pool, stub, cases[:1])
        assert proc.gate.wait_started() == 2  # the first request's two rows run alone
        queued = _submit_all(pool, stub, cases[1:])
        proc.wait_for_log(INFER_HEADERS, count=4)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log(REFUSING)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("received again: stopping now")
        proc.gate.release(100)
        assert _close(first.result(timeout=120), cases[0], eager_modules)
        for future in queued:
            assert _code(future) == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in future.exception().details() or "closed" in future.exception().details()
        assert proc.wait(timeout=60) == 0, proc.log()


def test_grace_period_bounds_the_stop(model_repository, eager_modules):
    """The batch running when the grace period runs out finishes (it is held past it here);
    the requests queued behind it get UNAVAILABLE, never computed; exit 0."""
    rng = np.random.default_rng(3)
    cases = [_request(rng) for _ in range(3)]
    with GatedServer(model_repository, "--max-batch-size", "2", "--grace-period-s", "0.5", "--access-log") as proc, \
            proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(3) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        (first,) = _submit_all(pool, stub, cases[:1])
        proc.gate.wait_started()
        queued = _submit_all(pool, stub, cases[1:])
        proc.wait_for_log(INFER_HEADERS, count=3)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("grace period 0.5s over")
        proc.gate.release(100)
        assert _close(first.result(timeout=120), cases[0], eager_modules)
        assert [_code(f) for f in queued] == [grpc.StatusCode.UNAVAILABLE] * 2
        assert proc.wait(timeout=60) == 0, proc.log()


def test_a_request_whose_message_is_still_arriving_is_served(model_repository, eager_modules):
    """The call's headers reach the server before the signal, its message only after: the
    server waits for it and serves it. (ModelInfer called as client-streaming is the same bytes
    on the wire as unary, and lets the test hold the message back.)"""
    x = random_inputs(np.random.default_rng(4), 1, 4, 5, 512, 512)
    message = threading.Event()

    def held_back():
        message.wait(120)
        yield infer_request("self_attention", **x)

    proc = ServerProcess(model_repository, "--access-log", "--grace-period-s", "120")
    try:
        with proc.channel() as channel:
            call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            future = call.future(held_back(), timeout=120)
            proc.wait_for_log(INFER_HEADERS)  # headers are there, the message is not
            proc.signal(signal.SIGTERM)
            log = proc.wait_for_log(REFUSING)
            assert "finishing 1 call(s) in flight" in log
            assert proc.proc.poll() is None
            message.set()
            assert _close(future.result(timeout=120), x, eager_modules)
        assert proc.wait(timeout=60) == 0
    finally:
        message.set()
        proc.stop()


def test_a_call_whose_message_never_comes_stops_counting(model_repository):
    """Headers, then the client gives up: gRPC never runs its handler. The stop forgets it after
    a bound (lifecycle.Arrivals.TIMEOUT_S, 10 s), not the whole 600 s grace period."""
    proc = ServerProcess(model_repository, "--access-log", "--grace-period-s", "600")
    never = threading.Event()
    try:
        with proc.channel() as channel:
            call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            future = call.future(iter(lambda: never.wait(120), True), timeout=120)
            proc.wait_for_log(INFER_HEADERS)
            future.cancel()
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert time.monotonic() - started < 90, "waited for a call that will never arrive"
    finally:
        never.set()
        proc.stop()


def test_watch_streams_end_at_the_stop(model_repository):
    """An open grpc.health.v1 Watch (gRPC's client-side health checking keeps one) is told
    NOT_SERVING, then ends cleanly; it does not hold the stop for the 600 s grace period, and
    the log has no traceback."""
    proc = ServerProcess(model_repository, "--grace-period-s", "600")
    try:
        with proc.channel() as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            statuses = [next(watch).status]
            started = time.monotonic()
            proc.signal(signal.SIGTERM)
            statuses += [update.status for update in watch]  # ends: no exception
        assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
        assert proc.wait(timeout=120) == 0
        assert time.monotonic() - started < 90
        log = proc.log()
        assert "1 watch stream(s) ended" in log
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        proc.stop()


def test_deadline_passed_in_queue_is_never_computed(model_repository):
    """A request whose deadline passes while it waits behind a held batch is DEADLINE_EXCEEDED
    and never computed: the model's statistics count only the rows of the requests that ran."""
    rng = np.random.default_rng(5)
    with GatedServer(model_repository, "--max-batch-size", "8") as proc, proc.channel() as channel, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def stats():
            return stub.ModelStatistics(pb.ModelStatisticsRequest(name="self_attention")).model_stats[0]

        before = stats().inference_count
        (slow,) = _submit_all(pool, stub, [_request(rng, b=8)])
        proc.gate.wait_started()
        with pytest.raises(grpc.RpcError) as exc:  # queued behind the held batch: its deadline passes there
            stub.ModelInfer(infer_request("self_attention", **_request(rng, b=3)), timeout=0.5)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        proc.gate.release()
        slow.result(timeout=120)
        (marker,) = _submit_all(pool, stub, [_request(rng, b=1)])  # runs after the expired one would have
        proc.gate.wait_started()
        proc.gate.release()
        marker.result(timeout=120)
        assert stats().inference_count - before == 8 + 1  # the slow request's rows and the marker's


def test_queue_full_sheds_with_resource_exhausted(model_repository, eager_modules):
    """One batch held, a queue of one: of 12 calls the first runs, the next waits, the other 10
    are shed at once with RESOURCE_EXHAUSTED; the two served are correct."""
    rng = np.random.default_rng(6)
    cases = [_request(rng) for _ in range(12)]
    with GatedServer(model_repository, "--max-queue-size", "1", "--max-batch-size", "2") as proc, \
            proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(12) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        # The first one running before the others come: sent together, the second could find the
        # first still queued and be shed too.
        futures = _submit_all(pool, stub, cases[:1])
        proc.gate.wait_started()
        futures += _submit_all(pool, stub, cases[1:])
        shed = [f for f in futures if _code_when_done(f, futures) == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(shed) == 10 and all("max_queue_size" in f.exception().details() for f in shed)
        proc.gate.release(2)
        served = [(x, f) for x, f in zip(cases, futures, strict=True) if f not in shed]
        for x, future in served:
            assert _close(future.result(timeout=120), x, eager_modules)


def _code_when_done(future, futures, shed_expected: int = 10) -> grpc.StatusCode | None:
    """The code of `future` once `shed_expected` of `futures` have finished (the shed ones finish
    at once; the served ones wait for the gate)."""
    deadline = time.monotonic() + 120
    while sum(f.done() for f in futures) < shed_expected:
        assert time.monotonic() < deadline, "the queue bound shed nothing"
        time.sleep(0.01)
    return _code(future) if future.done() else None


def test_host_that_resolves_to_several_addresses_binds_all_or_refuses(model_repository):
    """--host localhost with the port taken on 127.0.0.1: exit 3 naming the address (it used to
    bind [::1] alone and serve as if all was well)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                               "--host", "localhost", "--port", str(port), "--http-port", "-1", "--metrics-port", "-1",
                               "--workers", "1"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert f"cannot listen on 127.0.0.1:{port} (--host localhost)" in done.stderr
    assert "Traceback" not in done.stderr


def test_host_localhost_serves_every_address_it_resolves_to(model_repository):
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}
    proc = ServerProcess(model_repository, "--host", "localhost")
    try:
        for address in sorted(addresses):
            target = f"[{address}]:{proc.port}" if ":" in address else f"{address}:{proc.port}"
            with grpc.insecure_channel(target) as channel:
                assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=30).live
    finally:
        proc.stop()


def test_calls_sent_just_before_the_signal_are_all_served(model_repository, eager_modules):
    """24 large calls sent, SIGTERM at once, with the default drain delay (5 s): the server sees
    every call's headers within the delay (readiness already NOT_SERVING), so all 24 are served
    correctly, exit 0. (Before the drain delay, 3 to 8 of them were refused under CPU load: the
    event loop had not yet looked at their headers when draining began.)"""
    rng = np.random.default_rng(7)
    cases = [random_inputs(rng, 4, 200, 200, 512, 512) for _ in range(24)]
    proc = ServerProcess(model_repository, "--drain-delay-s", "5")
    try:
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = _submit_all(pool, pb_grpc.GRPCInferenceServiceStub(channel), cases)
            proc.signal(signal.SIGTERM)
            for x, future in zip(cases, futures, strict=True):
                assert _close(future.result(timeout=120), x, eager_modules)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.stop()


def test_calls_core_holds_for_a_stalled_loop_are_refused_not_cancelled(model_repository, eager_modules):
    """The drain is refusing new calls, one admitted call holds it (at the gate). The server's
    event loop then stalls (as on a busy machine) while 16 calls arrive: gRPC's core takes them
    and holds them for the loop. The admitted call is released, the loop goes on, and the stop
    follows at once. Each of the 16 is answered UNAVAILABLE by the drain (retry elsewhere);
    none is CANCELLED by gRPC's stop (it cancels the calls core still holds when it begins:
    before the stop waited for the loop to have seen them all, most of the 16 were)."""
    rng = np.random.default_rng(8)
    held, *late = [_request(rng, b=1, lq=3, lk=3) for _ in range(17)]
    with GatedServer(model_repository, "--grace-period-s", "120") as proc, \
            proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(17) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        (first,) = _submit_all(pool, stub, [held])
        proc.gate.wait_started()
        proc.signal(signal.SIGTERM)
        proc.wait_for_log(REFUSING)
        proc.stall_loop()
        refused = _submit_all(pool, stub, late)
        proc.gate.release()  # the held call's batch finishes; its answer waits for the loop
        proc.gate.unstall_after(len(late))
        assert _close(first.result(timeout=120), held, eager_modules)
        codes = collections.Counter(_code(f).name for f in refused)
        assert codes == {"UNAVAILABLE": len(late)}, codes
        assert all("shutting down" in f.exception().details() for f in refused)
        assert proc.wait(timeout=60) == 0, proc.log()
