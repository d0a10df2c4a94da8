"""Request control on the native data plane (docs/native-data-plane.md, "Request control"): the
Python plane's cancellation, deadlines and priorities (tests/test_cancellation.py,
tests/test_scheduling.py), carried by C++ with the same statuses, messages and metrics.

Against real `--data-plane native` servers whose batches wait at the gate of tests/gated_server.py:
what is asserted is what left the queue while a batch was held, the order batches formed in and
what was computed, never a guess of how long a run takes. Skips where the extension is not built.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native

from tests.gated_server import GatedServer
from tests.oip import infer_request, outputs_of

pytestmark = pytest.mark.skipif(native.why_unavailable() is not None, reason=str(native.why_unavailable()))

MODEL = "self_attention"
CONFIGURED = "cross_attention"  # its config.json here: three levels, default 2, a queue timeout
DEFAULT_TIMEOUT_US = 2_000_000
WAIT_S = 60.0  # only catches a hang
LONG = (1, 8192, 512)  # the longest accepted: its run lasts well past the checks below


# -- helpers ------------------------------------------------------------------------------------

def _scrape(proc: GatedServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of `name` with exactly these labels in a /metrics text (0 when absent)."""
    for found in re.finditer(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or "")) == labels:
            return float(found.group(2))
    return 0.0


def _wait_metric(proc: GatedServer, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (got := _sample(_scrape(proc), name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, not {value}, after {WAIT_S}s"
        time.sleep(0.01)


def _in_flight(proc: GatedServer, calls: int) -> None:
    """Wait until the native plane holds `calls` calls, queued or computing (the state reached)."""
    _wait_metric(proc, "attnserve_native_in_flight", calls)


def _cancelled(proc: GatedServer, reason: str, stage: str, model: str = MODEL) -> float:
    return _sample(_scrape(proc), "attnserve_cancelled_requests_total", model=model, reason=reason, stage=stage)


def _codes(proc: GatedServer, code: str, model: str = MODEL) -> float:
    return _sample(_scrape(proc), "attnserve_requests_total", model=model, code=code)


WIDTH = {MODEL: 512, CONFIGURED: 32}  # both presets' query_dim = kv_dim (export/config.py)


def _inputs(rows: int, width: int = 512, length: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows * 100 + length)
    return {name: rng.standard_normal((rows, length, width), dtype=np.float32) for name in ("query", "key", "value")}


def _request(rows: int, model: str = MODEL, **parameters: tuple[str, object]) -> pb.ModelInferRequest:
    request = infer_request(model, **_inputs(rows, WIDTH[model]))
    for name, (kind, value) in parameters.items():
        if kind is None:
            request.parameters[name].SetInParent()  # an InferParameter holding nothing
        else:
            setattr(request.parameters[name], kind, value)
    return request


def _statistics(proc: GatedServer, model: str = MODEL) -> tuple[int, int]:
    """(inference_count, execution_count): the Python port's Triton statistics, which count native batches."""
    with proc.channel() as ch:
        (stats,) = pb_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            pb.ModelStatisticsRequest(name=model), timeout=WAIT_S).model_stats
    return stats.inference_count, stats.execution_count


def _wait_statistics(proc: GatedServer, want: tuple[int, int], model: str = MODEL) -> None:
    deadline = time.monotonic() + WAIT_S  # a batch's figures reach the event loop just after its answers
    while (got := _statistics(proc, model)) != want:
        assert time.monotonic() < deadline, f"statistics of {model}: {got}, not {want}"
        time.sleep(0.01)


def _repository(root: Path, model_repository: Path) -> Path:
    """The exported models (versions linked); CONFIGURED's config.json with a dynamic_batching section."""
    for model_dir in sorted(p for p in model_repository.iterdir() if (p / "config.json").exists()):
        target = root / model_dir.name
        target.mkdir(parents=True)
        config = json.loads((model_dir / "config.json").read_text())
        if model_dir.name == CONFIGURED:
            config["dynamic_batching"] = {"priority_levels": 3, "default_priority_level": 2, "default_queue_policy": {
                "default_timeout_microseconds": DEFAULT_TIMEOUT_US}}
        (target / "config.json").write_text(json.dumps(config))
        for version in model_dir.iterdir():
            if version.name.isdigit():
                (target / version.name).symlink_to(version, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def gated(model_repository, tmp_path_factory):
    """One batch at a time, aging by 2 batches; CONFIGURED with its own schedule policy."""
    repository = _repository(tmp_path_factory.mktemp("control") / "models", model_repository)
    with GatedServer(repository, "--data-plane", "native", "--max-batch-size", "1",
                     "--priority-aging-batches", "2") as proc:
        proc.native_port = proc.port
        with grpc.insecure_channel(f"127.0.0.1:{proc.native_port}") as ch:
            proc.native = pb_grpc.GRPCInferenceServiceStub(ch)
            yield proc
            assert not proc.gate.has_started(), "a test left a batch at the gate"


@pytest.fixture
def pool():
    with futures.ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def _hold(gated: GatedServer, pool: futures.ThreadPoolExecutor, model: str = MODEL) -> futures.Future:
    """A 1-row call whose batch is held at the gate (released by the test)."""
    held = pool.submit(gated.native.ModelInfer, _request(1, model), timeout=WAIT_S)
    assert gated.gate.wait_started() == 1
    return held


# -- cancellation ---------------------------------------------------------------------------------

def test_a_cancelled_queued_call_and_stream_leave_the_queue_at_once(gated, pool):
    before = _cancelled(gated, "client", "queued"), _codes(gated, "CANCELLED")
    held = _hold(gated, pool)
    queued = gated.native.ModelInfer.future(_request(2), timeout=WAIT_S)
    _in_flight(gated, 2)
    queued.cancel()
    _in_flight(gated, 1)  # gone while the batch ahead is still held, not when the queue moves

    closed = threading.Event()

    def requests():  # one request, then the stream stays open until the test is done with it
        yield _request(3)
        closed.wait(WAIT_S)

    stream = gated.native.ModelStreamInfer(requests(), timeout=WAIT_S)
    _in_flight(gated, 2)
    stream.cancel()
    closed.set()
    _in_flight(gated, 1)

    assert (_cancelled(gated, "client", "queued"), _codes(gated, "CANCELLED")) == (before[0] + 2, before[1] + 2)
    gated.gate.release()
    assert outputs_of(held.result())["output"].shape == (1, 4, 512)
    _in_flight(gated, 0)
    assert not gated.gate.has_started()  # neither cancelled call ever reached a run


# -- deadlines ------------------------------------------------------------------------------------

def test_a_timeout_shorter_than_the_queue_ahead_is_refused_unrun(gated, pool):
    _wait_statistics(gated, _statistics(gated))  # settled before counting
    before = _statistics(gated)
    held = _hold(gated, pool)
    with pytest.raises(grpc.RpcError) as exc:
        gated.native.ModelInfer(_request(2, timeout=("int64_param", 1000)), timeout=WAIT_S)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The timer's words (server.batcher._expire): refused while the batch ahead is held.
    assert re.fullmatch(r"deadline passed after \d+\.\d{3}s in the queue of model self_attention "
                        r"\(0 requests still queued\); not computed", exc.value.details()), exc.value.details()
    (answer,) = gated.native.ModelStreamInfer(iter([_request(3, timeout=("uint64_param", 1000))]), timeout=WAIT_S)
    assert answer.error_message.startswith("DEADLINE_EXCEEDED: deadline passed after"), answer.error_message
    assert not held.done()
    gated.gate.release()
    held.result()
    _wait_statistics(gated, (before[0] + 1, before[1] + 1))  # only the held request's one row was computed
    assert not gated.gate.has_started()


def test_a_queued_call_whose_grpc_deadline_passes_leaves_the_queue_at_once(gated, pool):
    def gone() -> float:
        return _cancelled(gated, "deadline", "queued") + _codes(gated, "DEADLINE_EXCEEDED")

    before = gone()
    held = _hold(gated, pool)
    late = gated.native.ModelInfer.future(_request(2), timeout=2.0)
    _in_flight(gated, 2)
    with pytest.raises(grpc.RpcError) as exc:
        late.result()
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _in_flight(gated, 1)  # gone while the batch ahead is still held
    # Whichever comes first takes it out: gRPC's cancel at the deadline (counted cancelled,
    # deadline, queued) or the plane's own timer at the same deadline (DEADLINE_EXCEEDED).
    deadline = time.monotonic() + WAIT_S
    while (left := gone() - before) != 1:
        assert left == 0 and time.monotonic() < deadline, left
        time.sleep(0.01)
    assert not gated.gate.has_started()
    gated.gate.release()
    held.result()


def test_the_models_default_queue_timeout_and_levels_come_from_its_config(gated, pool):
    held = _hold(gated, pool, CONFIGURED)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:  # no `timeout` of its own: the model's applies
        gated.native.ModelInfer(_request(1, CONFIGURED), timeout=WAIT_S)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "not computed" in exc.value.details()
    assert time.monotonic() - started >= DEFAULT_TIMEOUT_US / 1e6 - 0.05  # not refused before its time
    with pytest.raises(grpc.RpcError) as exc:
        gated.native.ModelInfer(_request(1, CONFIGURED, priority=("uint64_param", 4)), timeout=WAIT_S)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == ("parameter 'priority': this model has priority levels 1..3 "
                                   "(1 the highest, 0 its default 2), got 4")
    assert not held.done()
    gated.gate.release()
    held.result()
    assert not gated.gate.has_started()


# -- priorities -----------------------------------------------------------------------------------

def test_higher_priority_leaves_first_behind_a_held_batch(gated, pool):
    calls = [_hold(gated, pool)]
    # Low priority first (2 and 3 rows: the batch's rows tell which ran), then high (4: the default, 5).
    for rows, priority in ((2, ("uint64_param", 2)), (3, ("int64_param", 2)), (4, None), (5, ("uint64_param", 1))):
        parameters = {"priority": priority} if priority else {}
        calls.append(pool.submit(gated.native.ModelInfer, _request(rows, **parameters), timeout=WAIT_S))
        _in_flight(gated, len(calls))
    order = []
    for _ in range(4):
        gated.gate.release()
        order.append(gated.gate.wait_started())
    gated.gate.release()
    for call in calls:
        call.result()
    assert order == [4, 5, 2, 3]


def test_a_low_priority_request_is_not_starved(gated, pool):
    """--priority-aging-batches 2: the low request (2 rows) runs third among a stream of high ones
    (1 row), one queued before each batch forms; without aging it would never run among them."""
    calls = [_hold(gated, pool)]
    calls.append(pool.submit(gated.native.ModelInfer, _request(2, priority=("uint64_param", 2)), timeout=WAIT_S))
    _in_flight(gated, 2)
    order = []
    for _ in range(5):
        calls.append(pool.submit(gated.native.ModelInfer, _request(1), timeout=WAIT_S))
        _in_flight(gated, 3)
        gated.gate.release()
        order.append(gated.gate.wait_started())
    gated.gate.release()
    assert gated.gate.wait_started() == 1  # the last high one
    gated.gate.release()
    for call in calls:
        call.result()
    assert order == [1, 1, 2, 1, 1]
    _in_flight(gated, 0)


def test_malformed_schedule_parameters_get_the_python_planes_words_and_unknown_ones_are_ignored(gated):
    cases = [{"priority": ("string_param", "high")}, {"priority": ("string_param", "it's")},
             {"priority": ("bool_param", True)}, {"timeout": ("double_param", 1.5)},
             {"timeout": ("double_param", 1e20)}, {"timeout": ("double_param", 0.0001)},
             {"timeout": ("int64_param", -5)}, {"priority": ("int64_param", -1)}, {"priority": (None, None)},
             {"priority": ("uint64_param", 3)}, {"priority": ("uint64_param", 2**64 - 1)},
             # Past the planes' longest timer (attnserve.ranges.QUEUE_TIMEOUT_US), once read as no timeout.
             {"timeout": ("uint64_param", 2**50)}, {"timeout": ("int64_param", 2**63 - 1)},
             {"timeout": ("uint64_param", 2**64 - 1)},
             {"priority": ("uint64_param", 1), "timeout": ("int64_param", 2**50)}]
    with gated.channel() as ch:
        python = pb_grpc.GRPCInferenceServiceStub(ch)
        for parameters in cases:
            got = []
            for stub in (gated.native, python):
                with pytest.raises(grpc.RpcError) as exc:
                    stub.ModelInfer(_request(1, **parameters), timeout=WAIT_S)
                got.append((exc.value.code(), exc.value.details()))
            assert got[0] == got[1] and got[0][0] == grpc.StatusCode.INVALID_ARGUMENT, (parameters, got)
            if parameters.get("timeout", ("",))[0].endswith("int64_param") and parameters["timeout"][1] >= 2**50:
                assert got[0][1] == ("parameter 'timeout' must be an integer in 0..1125899906842623 microseconds, "
                                     f"got {parameters['timeout'][1]}"), got
    gated.gate.release()  # the next batch computes at once
    ignored = gated.native.ModelInfer(_request(1, sequence_id=("string_param", "x"), timeout=("int64_param", 0),
                                               priority=("int64_param", 0)), timeout=WAIT_S)
    assert outputs_of(ignored)["output"].shape == (1, 4, 512)
    assert gated.gate.wait_started() == 1  # the batch that ran it, released above
    gated.gate.release()  # the longest timeout taken: served as any
    longest = gated.native.ModelInfer(_request(1, timeout=("uint64_param", 2**50 - 1)), timeout=WAIT_S)
    assert outputs_of(longest)["output"].shape == (1, 4, 512)
    assert gated.gate.wait_started() == 1


# -- stopping runs --------------------------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, every thread): /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_over(pid: int, seconds: float) -> float:
    start = _cpu_s(pid)
    time.sleep(seconds)  # a measuring window, not a wait for a state
    return _cpu_s(pid) - start


def test_cancelled_runs_stop_and_a_batch_with_a_live_call_computes_it_exactly(model_repository):
    rng = np.random.default_rng(28)
    a, b, blocker = (rng.standard_normal((1, 16, 512), dtype=np.float32) for _ in range(3))
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "2",
                     "--intra-op-threads", "2") as proc:
        port = proc.port
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)

            def send(x, **kwargs):
                request = infer_request(MODEL, query=x, key=x, value=x, **kwargs)
                return stub.ModelInfer.future(request, timeout=WAIT_S)

            # A batch of two, one cancelled while it runs: it computes on for the other, exactly.
            first = send(blocker)
            assert proc.gate.wait_started() == 1
            cancelled, live = send(a), send(b)
            _in_flight(proc, 3)
            proc.gate.release()
            first.result()
            assert proc.gate.wait_started() == 2  # a and b, merged
            cancelled.cancel()
            _wait_metric(proc, "attnserve_cancelled_requests_total", 1, model=MODEL, reason="client", stage="running")
            proc.gate.release()
            together = outputs_of(live.result())["output"]
            alone = send(b)
            assert proc.gate.wait_started() == 1
            proc.gate.release()
            np.testing.assert_array_equal(together, outputs_of(alone.result())["output"])

            # A held batch whose only call goes: stopped before it computes, nobody told an error.
            gone = send(a)
            assert proc.gate.wait_started() == 1
            gone.cancel()
            _wait_metric(proc, "attnserve_cancelled_requests_total", 1, model=MODEL, reason="client",
                         stage="terminated")
            proc.gate.release()
            _in_flight(proc, 0)

            # A long solo run, cancelled while it computes: it stops, and nothing computes after.
            x = rng.standard_normal(LONG, dtype=np.float32)
            long_call = send(x, outputs=("output",))
            assert proc.gate.wait_started() == 1
            proc.gate.release()  # it computes from now on
            # Cancelled at once: milliseconds after the release, against a run of the longest length
            # accepted (a window measured first let a fast machine finish the run before the cancel).
            long_call.cancel()
            _wait_metric(proc, "attnserve_cancelled_requests_total", 2, model=MODEL, reason="client",
                         stage="terminated")
            _in_flight(proc, 0)  # the run returned: what it held is freed
            after = _cpu_over(proc.proc.pid, 1.0)
            # A run computing on would hold at least a core for that second; the idle server, next to nothing.
            assert after < 0.2, f"{after:.2f} CPU s in the second after the stop: the run computed on"

            text = _scrape(proc)
            assert _sample(text, "attnserve_requests_total", model=MODEL, code="OK") == 3
            assert _sample(text, "attnserve_requests_total", model=MODEL, code="CANCELLED") == 3
            after_all = send(b)  # the model serves on
            assert proc.gate.wait_started() == 1
            proc.gate.release()
            np.testing.assert_array_equal(outputs_of(after_all.result())["output"], together)
            # Computed: the blocker, a + b, b alone and the last; the two stopped runs inferred nothing.
            _wait_statistics(proc, (5, 4))
        assert "failed" not in proc.log()
