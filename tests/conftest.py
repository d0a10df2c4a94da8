"""Shared fixtures: a model repository with both presets, and a real server on loopback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server_process import DATA_PLANE_ENV, ServerProcess, plane_from_env

PRESET_NAMES = ("self_attention", "cross_attention")
# A repository exported elsewhere, for a virtualenv without the exporter (onnx, onnxscript):
# `make test-deps-oldest` exports with the main .venv and points its suite here.
MODEL_REPOSITORY_ENV = "ATTNSERVE_TEST_MODEL_REPOSITORY"
DEMO_WEIGHTS = {"source": "demo", "seed": 0}


def _exported_repository(root: Path) -> Path:
    """`root`, once it is checked to hold every preset with the demo weights the tests compare against."""
    for name in PRESET_NAMES:
        exports = sorted((root / name).glob("[0-9]*/export.json"))
        if not exports:
            raise pytest.UsageError(f"${MODEL_REPOSITORY_ENV}={root}: no {name}/<version>/export.json; "
                                    f"export it: attnserve export --preset {name} --repository {root}")
        weights = json.loads(exports[-1].read_text())["weights"]
        if {k: weights.get(k) for k in DEMO_WEIGHTS} != DEMO_WEIGHTS:
            raise pytest.UsageError(f"{exports[-1]}: weights {weights}, expected the demo weights {DEMO_WEIGHTS} "
                                    "that the tests' eager modules use")
    return root


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """Both presets exported once per session with the demo weights (seed 0), as `make serve` does,
    or the repository named by $ATTNSERVE_TEST_MODEL_REPOSITORY, exported so beforehand."""
    if os.environ.get(MODEL_REPOSITORY_ENV):
        return _exported_repository(Path(os.environ[MODEL_REPOSITORY_ENV]))
    from attnserve.export import checkpoint
    from attnserve.export.config import PRESETS
    from attnserve.export.onnx_export import export_model

    root = tmp_path_factory.mktemp("models")
    for name in PRESET_NAMES:
        module = checkpoint.demo_module(PRESETS[name], seed=0)
        export_model(module, root, name, weights={"source": "demo", "seed": 0})
    return root


@pytest.fixture(scope="session")
def eager_modules():
    """The eager PyTorch modules behind `model_repository`, by model name."""
    from attnserve.export import checkpoint
    from attnserve.export.config import PRESETS

    return {name: checkpoint.demo_module(PRESETS[name], seed=0) for name in PRESET_NAMES}


@pytest.fixture(scope="session")
def server(model_repository) -> ServerProcess:
    """One shared server process for tests that do not change its state."""
    proc = ServerProcess(model_repository)
    yield proc
    proc.stop()


# -- test tiers -------------------------------------------------------------------------------
# `e2e` marks a test that starts a server, a subprocess or a container, or needs the session's
# exported models: `make test-fast` runs the others. A test gets it from its module's or its own
# `pytest.mark.e2e`, or here, from any of these fixtures (directly or through another fixture).
E2E_FIXTURES = frozenset({"model_repository", "server"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    _servers_on_the_chosen_plane(items)


# -- the data plane -----------------------------------------------------------------------------
# The test servers serve on the server's default plane (auto: native where the extension loads)
# unless $ATTNSERVE_TEST_DATA_PLANE says python or native (tests/server_process.py). In CI an e2e
# suite whose servers would fall back to the Python plane stops before it runs: else it would pass
# on the wrong plane.

def _servers_on_the_chosen_plane(items) -> None:
    if not _no_skip() or plane_from_env() == "python" or not any(i.get_closest_marker("e2e") for i in items):
        return
    from attnserve.server.data_plane import why_unavailable

    why = why_unavailable()
    if why is not None:
        raise pytest.UsageError(
            f"${NO_SKIP_ENV} is set and the native data plane does not load, so these tests' servers would serve "
            f"on the Python plane instead: {why}. Build it (make native), or choose the Python plane on purpose: "
            f"{DATA_PLANE_ENV}=python (make test-python-plane)")


# -- unexpected skips -----------------------------------------------------------------------------
# With $ATTNSERVE_TEST_NO_SKIP set (`make test` sets it from $CI), a skipped test fails the run
# unless it is a CUDA test on a machine without CUDA: a test that skips in CI proves nothing.
NO_SKIP_ENV = "ATTNSERVE_TEST_NO_SKIP"


# bench.ort_c's C program needs ONNX Runtime's C headers, which no registry here serves (the wheel
# ships none): its tests build it only where they were fetched (docs/performance.md, bench.ort_c).
ORT_C_HEADERS_MISSING = "ONNX Runtime's C headers are not available"


def skip_is_expected(nodeid: str, reason: str) -> bool:
    """Only the CUDA tests may skip (tests/test_cuda.py, or a skip whose reason names CUDA), and
    bench.ort_c's where ONNX Runtime's C headers are missing."""
    if nodeid.startswith("tests/test_bench_ort_c.py") and ORT_C_HEADERS_MISSING in reason:
        return True
    return nodeid.startswith("tests/test_cuda.py") or "cuda" in reason.lower()


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


_unexpected_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not skip_is_expected(report.nodeid, reason):
            _unexpected_skips.append((report.nodeid, reason))


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_ENV, "").lower() in ("1", "true", "yes")


def pytest_sessionfinish(session, exitstatus):
    if _no_skip() and _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _no_skip() and _unexpected_skips:
        terminalreporter.section("unexpected skips", sep="=", red=True, bold=True)
        for nodeid, reason in _unexpected_skips:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line(f"${NO_SKIP_ENV} is set and only CUDA tests may skip: this run fails")
