"""A model whose config.json has numbers a server cannot run with is not ready, with the reason;
the other models serve (before: ValueError / ZeroDivisionError at start, exit 1 for all)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from attnserve.client import InferenceClient
from attnserve.server.repository import ModelLoadError, read_model_spec
from tests.oip import eager
from tests.server_process import ServerProcess

GOOD = "cross_attention"
# name -> (section, field, value, what the reason says)
BAD_CONFIGS = {
    "no_batch": ("batching", "max_batch_size", 0, "max_batch_size must be an integer >= 1, got 0"),
    "no_heads": ("attention", "num_heads", 0, "attention.num_heads must be an integer >= 1, got 0"),
    "negative_delay": ("batching", "max_queue_delay_ms", -1, "max_queue_delay_ms must be a number >= 0, got -1"),
    "text_length": ("limits", "max_q_len", "long", "max_q_len must be an integer >= 1, got 'long'"),
    "wrong_width": ("attention", "query_dim", 64, "disagree with its attention dims"),
}


def _copy_with(source, target, section, field, value):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.setdefault(section, {})[field] = value
    (target / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def repository(model_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-configs")
    shutil.copytree(model_repository / GOOD, root / GOOD)
    for name, (section, field, value, _reason) in BAD_CONFIGS.items():
        _copy_with(model_repository / GOOD, root / name, section, field, value)
    return root


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_read_model_spec_names_the_field(repository, name):
    with pytest.raises(ModelLoadError) as exc:
        read_model_spec(repository / name)
    assert BAD_CONFIGS[name][3] in str(exc.value) and "config.json" in str(exc.value)


def test_the_server_serves_the_good_model_and_reports_the_bad_ones(repository, eager_modules):
    proc = ServerProcess(repository)
    try:
        with InferenceClient(proc.address) as client:
            index = {entry.name: entry for entry in client.repository_index()}
            assert index[GOOD].ready
            for name, (*_where, reason) in BAD_CONFIGS.items():
                assert index[name].state == "UNAVAILABLE" and reason in index[name].reason, name
                assert not client.model_ready(name)
            rng = np.random.default_rng(3)
            q, kv = rng.standard_normal((2, 5, 32), np.float32), rng.standard_normal((2, 7, 32), np.float32)
            got = client.infer(GOOD, q, kv, kv)
            want = eager(eager_modules[GOOD], q, kv, kv)["output"]
            assert float(np.max(np.abs(got["output"] - want))) <= 1e-5
    finally:
        assert proc.stop() == 0
