"""Shared fixtures: a model repository with both presets, and a real server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server_process import ServerProcess

PRESET_NAMES = ("self_attention", "cross_attention")


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """Both presets exported once per session with the demo weights (seed 0), as `make serve` does."""
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
