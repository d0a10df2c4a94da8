"""Which data plane serves (server.data_plane; docs/native-data-plane.md, "Which plane serves").

--data-plane auto is the default: the native plane where attnserve.server._native loads, the
Python plane where it does not, the log saying which and why. Against real `attnserve serve`
processes, one process or a supervisor with workers; "where it does not load" is a real process
whose import of the extension fails as an unbuilt one's does (tests/server_process.py's
without_native_env), on a machine where it is built.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import attnserve.server
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import ServerConfig, load_config
from attnserve.server.data_plane import DataPlaneUnavailable, choose_data_plane, why_unavailable
from attnserve.server.request_path import NATIVE_DATA_PLANE

from tests.server_process import DATA_PLANE_ENV, REPO_ROOT, ServerProcess, without_native_env

WHY_NOT = why_unavailable()
needs_native = pytest.mark.skipif(WHY_NOT is not None, reason=f"the native data plane is not built: {WHY_NOT}")
FALLBACK = "data plane auto: the Python data plane serves; the native one is unavailable:"
NATIVE_LINE = "(data plane native, python behind it on unix:"
PYTHON_LINE = "(data plane python,"


def _extensions(proc: ServerProcess) -> list[str]:
    with proc.channel() as ch:
        return list(pb_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(pb.ServerMetadataRequest(),
                                                                          timeout=30).extensions)


@pytest.fixture
def no_native(monkeypatch):
    """This process as if the extension were not built (an import of it raises ImportError)."""
    monkeypatch.delattr(attnserve.server, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "attnserve.server._native", None)


# -- the setting -------------------------------------------------------------------------------------

def test_auto_is_the_default_and_the_setting_is_checked():
    assert ServerConfig().data_plane == "auto"
    assert load_config([], environ={}).data_plane == "auto"
    assert load_config([], environ={"ATTNSERVE_DATA_PLANE": "python"}).data_plane == "python"
    assert load_config(["--data-plane", "native"], environ={"ATTNSERVE_DATA_PLANE": "python"}).data_plane == "native"
    with pytest.raises(ValueError, match="data_plane must be one of auto, native, python, got 'rust'"):
        ServerConfig(data_plane="rust")


@needs_native
def test_auto_and_native_choose_the_native_plane_where_it_loads():
    assert choose_data_plane("auto") == ("native", None)
    assert choose_data_plane("native") == ("native", None)
    assert choose_data_plane("python") == ("python", None)


def test_without_the_extension_auto_falls_back_saying_why_and_native_refuses(no_native, caplog):
    with caplog.at_level(logging.INFO, logger="attnserve.server.data_plane"):
        plane, why = choose_data_plane("auto")
    assert plane == "python" and "make native" in why, why
    assert [r.getMessage() for r in caplog.records] == [f"{FALLBACK} {why}"]
    with pytest.raises(DataPlaneUnavailable, match=r"^--data-plane native: .*make native"):
        choose_data_plane("native")
    assert choose_data_plane("python") == ("python", None)


# -- a real server -----------------------------------------------------------------------------------

@needs_native
def test_the_default_serves_on_the_native_plane_and_says_so(model_repository, monkeypatch):
    monkeypatch.delenv(DATA_PLANE_ENV, raising=False)  # no --data-plane: the server's own default
    proc = ServerProcess(model_repository)
    try:
        log = proc.log()
        assert NATIVE_LINE in log and FALLBACK not in log, log
        assert NATIVE_DATA_PLANE in _extensions(proc)
        assert proc.python_target.startswith("unix:")  # the Python server behind the plane, off the port
    finally:
        proc.stop()


def test_without_the_extension_the_default_serves_on_the_python_plane_and_says_why(model_repository, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.delenv(DATA_PLANE_ENV, raising=False)
    proc = ServerProcess(model_repository, env=without_native_env(tmp_path))
    try:
        log = proc.log()
        assert FALLBACK in log and "build it with `make native`" in log, log
        assert log.count(FALLBACK) == 1 and PYTHON_LINE in log, log
        assert NATIVE_DATA_PLANE not in _extensions(proc)
        assert proc.python_target == proc.address
    finally:
        proc.stop()


def _serve_native_without_the_extension(model_repository, tmp_path, workers: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(model_repository),
                           "--host", "127.0.0.1", "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
                           "--workers", str(workers), "--data-plane", "native"],
                          cwd=REPO_ROOT, env={**os.environ, **without_native_env(tmp_path)}, capture_output=True,
                          text=True, timeout=120)


def test_native_asked_for_without_the_extension_refuses_to_start(model_repository, tmp_path):
    done = _serve_native_without_the_extension(model_repository, tmp_path, workers=1)
    assert done.returncode == 3, done.stderr
    assert "cannot start: --data-plane native: attnserve.server._native is not built or does not load" in done.stderr
    assert "build it with `make native`" in done.stderr and "serving" not in done.stderr, done.stderr


# -- workers -----------------------------------------------------------------------------------------

@needs_native
def test_the_supervisor_chooses_once_and_every_worker_serves_on_that_plane(model_repository, monkeypatch):
    monkeypatch.delenv(DATA_PLANE_ENV, raising=False)
    proc = ServerProcess(model_repository, "--workers", "2")
    try:
        log = proc.wait_for_log("serving with 2 workers")  # the supervisor logs it just after the ready file
        assert "(data plane native, REST" in log, log
        assert log.count(NATIVE_LINE) == 2, log  # each worker's own start line
        assert NATIVE_DATA_PLANE in _extensions(proc)
    finally:
        proc.stop()


def test_workers_asked_for_native_without_the_extension_are_refused_before_any_starts(model_repository, tmp_path):
    done = _serve_native_without_the_extension(model_repository, tmp_path, workers=2)
    assert done.returncode == 3, done.stderr
    assert "cannot start: --data-plane native: attnserve.server._native is not built" in done.stderr, done.stderr
    assert "[worker" not in done.stderr, done.stderr  # the supervisor refused: no worker started


# -- --version ---------------------------------------------------------------------------------------

def _version(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "attnserve", "--version"], cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.e2e
@needs_native
def test_version_names_the_default_plane():
    out = _version({})
    assert "native data plane: available (--data-plane native)" in out, out
    assert "serve's data plane by default (--data-plane auto): native" in out, out


@pytest.mark.e2e
def test_version_without_the_extension_names_the_python_plane_and_why(tmp_path):
    out = _version(without_native_env(tmp_path))
    assert "native data plane: unavailable: attnserve.server._native is not built" in out, out
    assert "serve's data plane by default (--data-plane auto): python" in out, out
