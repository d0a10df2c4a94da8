"""Server processes of their own: failed models, devices, ports, configuration. (Draining, signals,
deadlines and shedding with work held in flight: tests/test_drain.py.)"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import ServerConfig, load_config
from grpc_health.v1 import health_pb2

from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e  # starts server processes

TOLERANCE = 1e-5


def _close(got, want):
    return float(np.max(np.abs(got["output"] - want["output"]))) <= TOLERANCE


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
    return subprocess.run([sys.executable, "-m", "attnserve", "serve", "--workers", "1", *args], cwd=REPO_ROOT,
                          capture_output=True,
                          text=True, timeout=60)


def test_device_cuda_without_cuda_refuses_to_start(model_repository):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA: the refusal path cannot be shown here")
    done = _run_server("--model-repository", str(model_repository), "--device", "cuda", "--port", "0",
                       "--http-port", "-1", "--metrics-port", "-1")
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
                       "--port", str(server.port), "--http-port", "-1", "--metrics-port", "-1")
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


def test_switches_and_model_control():
    """--access-log is a switch (a value too); --model-control-mode and its poll period."""
    assert load_config(["--access-log"], {}).access_log
    assert not load_config(["--access-log", "false"], {}).access_log
    assert not load_config([], {}).access_log
    assert load_config([], {}).model_control_mode == "none"
    config = load_config(["--repository-poll-secs", "2.5"], {"ATTNSERVE_MODEL_CONTROL_MODE": "poll"})
    assert (config.model_control_mode, config.repository_poll_secs) == ("poll", 2.5)


@pytest.mark.parametrize("argv, env, message", [
    (["--device", "tpu"], {}, "device must be one of"),
    (["--model-control-mode", "auto"], {}, "model_control_mode must be one of none, explicit, poll"),
    (["--repository-poll-secs", "0"], {}, "--repository-poll-secs must be a number in [0.001, "),
    (["--max-batch-size", "0"], {}, "--max-batch-size must be an integer in 1.."),
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


