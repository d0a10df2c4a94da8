"""Server processes of their own: draining on SIGTERM, overload, deadlines, failed models, devices."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import ServerConfig, load_config
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess

TOLERANCE = 1e-5


def _heavy(rng, b=2, lq=300, lk=300):
    """A self_attention request that takes tens of milliseconds on two cores."""
    return random_inputs(rng, b, lq, lk, 512, 512)


def _close(got, want):
    return float(np.max(np.abs(got["output"] - want["output"]))) <= TOLERANCE


def test_sigterm_drains_every_accepted_request(model_repository, eager_modules):
    """Requests in flight at SIGTERM are all answered, correctly; one that starts after is refused
    with UNAVAILABLE (safe to retry elsewhere); nothing fails any other way; exit status 0."""
    # One request per run, one thread: 12 runs of tens of milliseconds each, one after another.
    proc = ServerProcess(model_repository, "--max-batch-size", "2", "--intra-op-threads", "1",
                         "--grace-period-s", "30")
    try:
        rng = np.random.default_rng(0)
        cases = [_heavy(rng) for _ in range(12)]
        finished_at = {}
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(12) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            def call(i):
                try:
                    return stub.ModelInfer(infer_request("self_attention", outputs=("output",), **cases[i]), timeout=60)
                finally:
                    finished_at[i] = time.monotonic()

            futures = [pool.submit(call, i) for i in range(len(cases))]
            time.sleep(0.2)  # the first batches are running, the rest queued
            sigterm_at = time.monotonic()
            proc.signal(signal.SIGTERM)
            time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as late:  # arrives after draining began
                stub.ModelInfer(infer_request("self_attention", **_heavy(rng, 1, 2, 2)), timeout=10)
            assert late.value.code() == grpc.StatusCode.UNAVAILABLE
            served_after_sigterm = 0
            for i, (x, future) in enumerate(zip(cases, futures)):
                err = future.exception()
                if err is not None:  # only a call that started after SIGTERM may be refused
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    continue
                assert _close(outputs_of(future.result()), eager(eager_modules["self_attention"], **x))
                served_after_sigterm += finished_at[i] > sigterm_at
        assert served_after_sigterm >= 1, "no request was in flight at SIGTERM: the test proves nothing"
        assert proc.wait(timeout=60) == 0, proc.log()
        assert "draining" in proc.log()
    finally:
        proc.stop()


def test_sigterm_serves_a_request_whose_bytes_are_still_arriving(model_repository, eager_modules):
    """The call's headers reach the server before SIGTERM, its message only after: it is served.
    (ModelInfer called as client-streaming is the same bytes on the wire as unary, but lets the
    test hold the message back.)"""
    proc = ServerProcess(model_repository)
    try:
        x = random_inputs(np.random.default_rng(10), 1, 4, 5, 512, 512)
        gate = threading.Event()

        def held_back():
            gate.wait(20)
            yield infer_request("self_attention", **x)

        with proc.channel() as channel:
            call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            future = call.future(held_back(), timeout=30)
            time.sleep(0.5)  # headers are there, the message is not
            proc.signal(signal.SIGTERM)
            time.sleep(0.5)
            assert proc.proc.poll() is None, "exited with an accepted call unanswered"
            gate.set()
            assert _close(outputs_of(future.result()), eager(eager_modules["self_attention"], **x))
        assert proc.wait(timeout=30) == 0
    finally:
        gate.set()
        proc.stop()


def test_call_abandoned_before_its_message_does_not_block_shutdown(model_repository):
    """A client that sends headers and gives up never reaches a handler; draining must not wait
    the whole grace period for it."""
    proc = ServerProcess(model_repository, "--grace-period-s", "60")
    try:
        with proc.channel() as channel:
            call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            never = threading.Event()
            future = call.future(iter(lambda: never.wait(30), True), timeout=30)
            time.sleep(0.5)
            future.cancel()
        time.sleep(0.2)
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=45) == 0
        assert time.monotonic() - started < 20, "waited for a call that will never arrive"
    finally:
        never.set()
        proc.stop()


def test_health_turns_not_serving_while_draining(model_repository):
    proc = ServerProcess(model_repository, "--max-batch-size", "1")
    try:
        rng = np.random.default_rng(1)
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(4) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # Rows of 8: the backlog must outlast the probes below (with 4 rows a fast machine
            # could finish it, and exit, before ServerReady is asked).
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", **_heavy(rng, 8)), timeout=60)
                       for _ in range(4)]
            time.sleep(0.15)
            proc.signal(signal.SIGTERM)
            time.sleep(0.05)
            assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready
            for f in futures:  # answered, or refused because it started after SIGTERM
                assert f.exception() is None or f.exception().code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()


def test_queue_full_sheds_with_resource_exhausted(model_repository, eager_modules):
    proc = ServerProcess(model_repository, "--max-queue-size", "1", "--max-batch-size", "2")
    try:
        rng = np.random.default_rng(2)
        cases = [_heavy(rng) for _ in range(12)]
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(12) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x),
                                   timeout=60) for x in cases]
            shed = served = 0
            for x, future in zip(cases, futures):
                err = future.exception()
                if err is None:
                    served += 1
                    assert _close(outputs_of(future.result()), eager(eager_modules["self_attention"], **x))
                else:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                    assert "max_queue_size" in err.details()
                    shed += 1
        assert shed >= 1 and served >= 1 and shed + served == 12
    finally:
        proc.stop()


def test_deadline_passed_in_queue_is_never_computed(model_repository):
    proc = ServerProcess(model_repository, "--max-batch-size", "1")
    try:
        rng = np.random.default_rng(3)
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            stats = lambda: stub.ModelStatistics(pb.ModelStatisticsRequest(name="self_attention")).model_stats[0]
            before = stats().inference_count
            slow = pool.submit(stub.ModelInfer, infer_request("self_attention", **_heavy(rng, 8, 400, 400)), timeout=60)
            time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as exc:
                stub.ModelInfer(infer_request("self_attention", **_heavy(rng, 3, 2, 2)), timeout=0.02)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            slow.result()
            time.sleep(0.1)
            assert stats().inference_count - before == 8  # the slow request's rows alone
    finally:
        proc.stop()


def test_model_that_fails_to_load_is_not_ready_and_others_serve(model_repository, tmp_path, eager_modules):
    repository = tmp_path / "models"
    shutil.copytree(model_repository, repository)
    (repository / "cross_attention" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    proc = ServerProcess(repository)
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert not stub.ModelReady(pb.ModelReadyRequest(name="cross_attention")).ready
            assert stub.ModelReady(pb.ModelReadyRequest(name="self_attention")).ready
            assert stub.ServerReady(pb.ServerReadyRequest()).ready
            x = random_inputs(np.random.default_rng(4), 1, 3, 3, 32, 32)
            with pytest.raises(grpc.RpcError) as exc:
                stub.ModelInfer(infer_request("cross_attention", **x))
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not ready" in exc.value.details()
            y = random_inputs(np.random.default_rng(5), 1, 3, 3, 512, 512)
            got = outputs_of(stub.ModelInfer(infer_request("self_attention", **y)))
            assert _close(got, eager(eager_modules["self_attention"], **y))
        assert proc.health("cross_attention") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "model cross_attention is not ready" in proc.log()
    finally:
        proc.stop()


def test_missing_graph_is_reported(model_repository, tmp_path):
    repository = tmp_path / "models"
    shutil.copytree(model_repository, repository)
    (repository / "cross_attention" / "1" / "model.onnx").unlink()
    proc = ServerProcess(repository)
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert not stub.ModelReady(pb.ModelReadyRequest(name="cross_attention")).ready
        assert "no version directory with model.onnx" in proc.log()
    finally:
        proc.stop()


def _run_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnserve", "serve", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


def test_device_cuda_without_cuda_refuses_to_start(model_repository):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA: the refusal path cannot be shown here")
    done = _run_server("--model-repository", str(model_repository), "--device", "cuda", "--port", "0",
                       "--metrics-port", "-1")
    assert done.returncode == 3
    assert "CUDAExecutionProvider not in" in done.stderr


def test_device_auto_falls_back_to_cpu_and_says_why(model_repository):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA")
    proc = ServerProcess(model_repository, "--device", "auto")
    try:
        assert proc.health() == health_pb2.HealthCheckResponse.SERVING
        assert "serving on CPU because CUDAExecutionProvider not in" in proc.log()
    finally:
        proc.stop()


def test_port_in_use_is_a_clear_error(server, model_repository):
    done = _run_server("--model-repository", str(model_repository), "--host", "127.0.0.1",
                       "--port", str(server.port), "--metrics-port", "-1")
    assert done.returncode == 3
    assert "cannot start" in done.stderr


# -- configuration --------------------------------------------------------------------------

def test_flags_beat_environment_beats_defaults():
    env = {"ATTNSERVE_PORT": "9000", "ATTNSERVE_MAX_BATCH_SIZE": "8", "ATTNSERVE_DEVICE": "auto",
           "ATTNSERVE_MODEL_VERSIONS": "self_attention=2", "ATTNSERVE_ACCESS_LOG": "true"}
    config = load_config(["--max-batch-size", "4"], env)
    assert config.port == 9000 and config.max_batch_size == 4 and config.device == "auto"
    assert config.pinned_versions == {"self_attention": 2} and config.access_log
    assert load_config([], {}) == ServerConfig()


@pytest.mark.parametrize("argv, env, message", [
    (["--device", "tpu"], {}, "device must be one of"),
    (["--max-batch-size", "0"], {}, "max_batch_size must be >= 1"),
    ([], {"ATTNSERVE_PORT": "eighty"}, "ATTNSERVE_PORT"),
    ([], {"ATTNSERVE_MODEL_VERSIONS": "x"}, "NAME=VERSION"),
])
def test_bad_configuration_exits_2(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load_config(argv, env)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_log_level_is_a_usage_error_not_a_traceback():
    done = _run_server("--log-level", "verbose")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: attnserve serve")
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == ["attnserve serve: error: log_level must be one of DEBUG, INFO, WARNING, ERROR (any case), "
                      "got 'verbose'"]


@pytest.mark.parametrize("level", ["debug", "Warning", "ERROR"])
def test_log_level_is_any_case(level):
    assert load_config(["--log-level", level], {}).log_level == level


def test_every_setting_has_a_parser_for_its_type():
    from attnserve.server.config import _FIELD_PARSERS

    assert set(_FIELD_PARSERS) == {f.name for f in dataclasses.fields(ServerConfig)}
    env = {"ATTNSERVE_MAX_QUEUE_DELAY_MS": "2.5", "ATTNSERVE_READY_FILE": "/tmp/r.json",
           "ATTNSERVE_MAX_BATCH_SIZE": "3", "ATTNSERVE_LOG_LEVEL": "warning", "ATTNSERVE_ACCESS_LOG": "off"}
    config = load_config([], env)
    assert (config.max_queue_delay_ms, config.ready_file, config.max_batch_size, config.log_level,
            config.access_log) == (2.5, Path("/tmp/r.json"), 3, "warning", False)


def test_help_names_every_environment_variable():
    done = _run_server("--help")
    assert done.returncode == 0
    for f in dataclasses.fields(ServerConfig):
        assert f"ATTNSERVE_{f.name.upper()}" in done.stdout


def test_grace_period_bounds_the_stop(model_repository):
    """With more queued work than the grace period allows, the server still exits 0 soon after
    it: running batches finish, queued requests get UNAVAILABLE (never computed, retryable)."""
    proc = ServerProcess(model_repository, "--max-batch-size", "1", "--intra-op-threads", "1",
                         "--grace-period-s", "0.2")
    try:
        rng = np.random.default_rng(11)
        cases = [_heavy(rng, 1, 1200, 1200) for _ in range(12)]  # ~0.1 s each, one at a time
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(12) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x),
                                   timeout=60) for x in cases]
            time.sleep(0.3)
            sigterm_at = time.monotonic()
            proc.signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            stopped_in = time.monotonic() - sigterm_at
            codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures]
        assert stopped_in < 5, f"took {stopped_in:.1f}s for a 0.2 s grace period"
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        assert grpc.StatusCode.UNAVAILABLE in codes, "no queued request was refused when the grace period ran out"
    finally:
        proc.stop()
