"""Hostile files in the model repository and behind the TLS and token flags, sent for real: a
FIFO (os.mkfifo), a symlink to /dev/zero, a file over its bound, JSON nested 100,000 deep, a
graph that is a FIFO, a model name with a newline and an escape sequence. Against real servers on
127.0.0.1, in explicit mode (a load refused while the other model serves) and at startup (the bad
models not ready, the good one serving), and at the CLI (exit 3 or 2 with one line naming the flag).
Without attnserve.files.read_bounded each of them hung the server, its loads or its start."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.files import MAX_JSON_BYTES, MAX_TOKEN_BYTES
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import REPO_ROOT, ServerProcess
from tests.tls_certs import make_pki
from tests.warmup_held_server import HeldWarmUpServer

pytestmark = pytest.mark.e2e

GOOD = "cross_attention"  # width 32: the cheap one
WIDTH = 32
TOLERANCE = 1e-5
DEEP = 100_000
CALL_S = 60  # every call is bounded: on the old code a refused file hung the server instead
HOSTILE_NAME = "bad\nname\x1b[31m"


def _fifo_config(model: Path) -> str:
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    return "not a regular file (a FIFO)"


def _zero_config(model: Path) -> str:
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    return "not a regular file (a character device)"


def _large_config(model: Path) -> str:
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text + " " * (MAX_JSON_BYTES + 1 - len(text.encode())))
    return f"larger than {MAX_JSON_BYTES} bytes"


def _deep_config(model: Path) -> str:
    (model / "config.json").write_text('{"attention": ' + "[" * DEEP + "]" * DEEP + "}")
    return "nested deeper than 64 levels"


def _fifo_graph(model: Path) -> str:
    (model / "1" / "model.onnx").unlink()
    os.mkfifo(model / "1" / "model.onnx")
    return "model.onnx: not a regular file (a FIFO)"


def _fifo_beside_graphs(model: Path) -> str:
    """A FIFO where a graph's external data could be: ONNX Runtime would open it by name."""
    os.mkfifo(model / "1" / "weights.bin")
    return "weights.bin: not a regular file (a FIFO)"


# The graph's refusals are the version's (version 1 UNAVAILABLE), config.json's the model's.
VERSION_OF = {"fifo_graph": "1", "fifo_beside_graphs": "1"}
HOSTILE = {"fifo_config": _fifo_config, "zero_config": _zero_config, "large_config": _large_config,
           "deep_config": _deep_config, "fifo_graph": _fifo_graph, "fifo_beside_graphs": _fifo_beside_graphs}


def _repository(tmp_path: Path, model_repository: Path, *bad: str) -> tuple[Path, dict[str, str]]:
    """GOOD, and a copy of it per name in `bad` spoilt as HOSTILE[name] says; {name: the refusal}."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(model_repository / GOOD, root / GOOD)
    why = {}
    for name in bad:
        shutil.copytree(model_repository / GOOD, root / name)
        why[name] = HOSTILE[name](root / name)
    return root, why


def _check_good_serves(channel: grpc.Channel, eager_modules) -> None:
    """Health answered and GOOD computing the right numbers."""
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    x = random_inputs(np.random.default_rng(5), 1, 4, 6, WIDTH, WIDTH)
    got = outputs_of(stub.ModelInfer(infer_request(GOOD, **x), timeout=CALL_S))["output"]
    assert float(np.max(np.abs(got - eager(eager_modules[GOOD], **x)["output"]))) <= TOLERANCE


def _index(stub) -> dict[str, list[tuple[str, str, str]]]:
    found: dict[str, list] = {}
    for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=CALL_S).models:
        found.setdefault(m.name, []).append((m.version, m.state, m.reason))
    return found


def test_hostile_files_are_refused_by_a_load_while_the_other_model_serves(model_repository, eager_modules, tmp_path):
    """Explicit mode: each spoilt copy of the model, loaded, is refused with INVALID_ARGUMENT naming
    the file and why, at once; health, inference on the good model and its unload and load go on."""
    root, _ = _repository(tmp_path, model_repository)
    proc = ServerProcess(root, "--model-control-mode", "explicit")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for name, spoil in HOSTILE.items():
                shutil.copytree(model_repository / GOOD, root / name)
                reason = spoil(root / name)
                with pytest.raises(grpc.RpcError) as exc:
                    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=CALL_S)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, exc.value.details())
                assert reason in exc.value.details(), name
                assert str(root / name) in exc.value.details(), name
                index = _index(stub)
                assert [(v, state) for v, state, _ in index[name]] == [(VERSION_OF.get(name, ""), "UNAVAILABLE")]
                assert reason in index[name][0][2]
                assert [(v, state) for v, state, _ in index[GOOD]] == [("1", "READY")]
                _check_good_serves(channel, eager_modules)
                # The registry's lock is free: the good model unloads and loads again.
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=GOOD), timeout=CALL_S)
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=GOOD), timeout=CALL_S)
                _check_good_serves(channel, eager_modules)
        assert proc.stop() == 0
    finally:
        proc.stop()


def test_hostile_files_at_startup_leave_their_models_not_ready_and_the_others_serving(model_repository,
                                                                                       eager_modules, tmp_path):
    """Startup (model control none): every spoilt model is not ready, the index says why; the good
    one serves. A name with a newline and an escape sequence is written quoted in the log."""
    root, why = _repository(tmp_path, model_repository, *HOSTILE)
    shutil.copytree(model_repository / GOOD, root / HOSTILE_NAME)
    why[HOSTILE_NAME] = _fifo_config(root / HOSTILE_NAME)
    proc = ServerProcess(root)
    try:
        with proc.channel() as channel:
            _check_good_serves(channel, eager_modules)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            index = _index(stub)
            assert sorted(index) == sorted([GOOD, *why])
            assert [(v, state) for v, state, _ in index[GOOD]] == [("1", "READY")]
            for name, reason in why.items():
                assert [(v, state) for v, state, _ in index[name]] == [(VERSION_OF.get(name, ""), "UNAVAILABLE")]
                assert reason in index[name][0][2], (name, index[name])
                assert not stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=CALL_S).ready
        log = proc.log()
        assert f"model {HOSTILE_NAME!r} is not ready" in log
        assert "\x1b" not in log and "bad\nname" not in log
        assert proc.stop() == 0
    finally:
        proc.stop()


def test_a_stop_does_not_wait_forever_behind_a_stuck_load(model_repository, tmp_path):
    """A load that never ends (its warm-up held by the test, as a FIFO once held ONNX Runtime's
    open): SIGTERM still stops the server, after a bounded wait for the load. (Before, the stop
    waited for the registry's lock, and the exit for the load's executor thread, forever.)"""
    root = tmp_path / "models"
    shutil.copytree(model_repository / GOOD, root / GOOD)
    with HeldWarmUpServer(root, "--model-control-mode", "explicit", "--grace-period-s", "0.5") as proc:
        proc.wait_held()
        proc.release()
        proc.wait_ready()
        shutil.copytree(root / GOOD / "1", root / GOOD / ".staging")
        (root / GOOD / ".staging").rename(root / GOOD / "2")
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            load = pool.submit(stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=GOOD),
                               timeout=CALL_S * 3)
            assert proc.wait_held() == (GOOD, 2)  # held until the test ends: the load never finishes
            proc.signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, proc.log()
            with pytest.raises(grpc.RpcError):
                load.result(timeout=CALL_S)
        assert "stopped after" in proc.log()


def _serve(model_repository: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                           "--host", "127.0.0.1", "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
                           "--workers", "1", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=CALL_S)


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file"])
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_tls_or_token_file_that_is_a_fifo_or_dev_zero_stops_the_start_with_one_line(model_repository, tmp_path,
                                                                                      flag, kind):
    pki = make_pki(tmp_path / "pki")
    hostile = tmp_path / "hostile"
    if kind == "fifo":
        os.mkfifo(hostile)
    else:
        hostile.symlink_to("/dev/zero")
    files = {"--tls-cert": pki.server_cert, "--tls-key": pki.server_key, "--tls-client-ca": pki.ca}
    files[flag] = hostile
    flags = [f for name, path in files.items() for f in (name, str(path))]
    done = _serve(model_repository, *flags)
    assert done.returncode == 3, done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    kind_text = "a FIFO" if kind == "fifo" else "a character device"
    assert len(lines) == 1 and f"cannot start: {flag} {hostile}: not a regular file ({kind_text})" in lines[0], lines
    assert "ready on" not in done.stderr  # refused before any model was loaded


def test_a_token_file_over_its_bound_is_refused(model_repository, tmp_path):
    token = tmp_path / "token"
    token.write_bytes(b"a" * (MAX_TOKEN_BYTES + 1))
    done = _serve(model_repository, "--auth-token-file", str(token))
    assert done.returncode == 3
    assert f"--auth-token-file {token}: larger than {MAX_TOKEN_BYTES} bytes" in done.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_the_client_refuses_a_hostile_token_or_tls_file(tmp_path, kind):
    """The client's --token-file (exit 2, one line) and TlsConfig's files (ValueError naming the file)."""
    from attnserve.client.options import TlsConfig

    hostile = tmp_path / "hostile"
    if kind == "fifo":
        os.mkfifo(hostile)
    else:
        hostile.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=f"cannot read TLS file {hostile}: not a regular file"):
        TlsConfig(ca_file=hostile).credentials()
    done = subprocess.run([sys.executable, "-m", "attnserve.client", "health", "--url", "127.0.0.1:1",
                           "--token-file", str(hostile)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=CALL_S)
    assert done.returncode == 2, done.stderr
    assert f"cannot read --token-file {hostile}: not a regular file" in done.stderr


def test_config_json_links_to_regular_files_still_load(model_repository, eager_modules, tmp_path):
    """Kubernetes mounts a ConfigMap as symlinks to regular files: those are read as before."""
    root, _ = _repository(tmp_path, model_repository)
    real = tmp_path / "configmap" / "..data" / "config.json"
    real.parent.mkdir(parents=True)
    real.write_text(json.dumps(json.loads((root / GOOD / "config.json").read_text())))
    (root / GOOD / "config.json").unlink()
    (root / GOOD / "config.json").symlink_to(real)
    proc = ServerProcess(root)
    try:
        with proc.channel() as channel:
            _check_good_serves(channel, eager_modules)
    finally:
        proc.stop()
