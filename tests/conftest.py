"""Shared fixtures: a model repository with both presets, and a real server on loopback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server_process import ServerProcess

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
