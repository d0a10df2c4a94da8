"""A model whose config.json has numbers a server cannot run with is not ready, with the reason;
the other models serve (before: ValueError / ZeroDivisionError at start, exit 1 for all)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from attnserve.client import InferenceClient
from attnserve.server.repository import ModelLoadError, read_model_spec

from tests.oip import eager
from tests.server_process import ServerProcess

GOOD = "cross_attention"
BIG = 10**30  # beyond int64: Python's json reads it whole
# name -> (section (None: top level), field, value, what the reason says)
BAD_CONFIGS = {
    "no_batch": ("batching", "max_batch_size", 0, "batching.max_batch_size must be an integer in "
                 "1..9223372036854775807 "
                 "sequences, got 0"),
    "no_heads": ("attention", "num_heads", 0, "attention.num_heads must be an integer in 1..536870911, got 0"),
    "negative_delay": ("batching", "max_queue_delay_ms", -1, "batching.max_queue_delay_ms must be a number in [0, "),
    "text_length": ("limits", "max_q_len", "long", "limits.max_q_len must be an integer in 1..536870911 positions, "
                    "got 'long'"),
    "wrong_width": ("attention", "query_dim", 64, "disagree with its attention dims"),
    # Each of these loaded before, then failed later: at the native plane's hand-over (a 500 on
    # every later load), in ModelMetadata (INTERNAL), or on every call.
    "platform_number": (None, "platform", 7, "platform must be 'onnxruntime_onnx' (ONNX Runtime serves every model), "
                        "got 7"),
    "huge_d_model": ("attention", "d_model", 10**12, "attention.d_model must be an integer in 1..536870911, got "
                     "1000000000000"),
    "negative_d_model": ("attention", "d_model", -5, "attention.d_model must be an integer in 1..536870911, got -5"),
    "huge_batch": ("batching", "max_batch_size", BIG, f"max_batch_size must be an integer in 1..9223372036854775807 "
                   f"sequences, got {BIG}"),
    "float_batch": ("batching", "max_batch_size", 1e30, "max_batch_size must be an integer in 1..9223372036854775807 "
                    "sequences, got 1e+30"),
    "half_batch": ("batching", "max_batch_size", 2.5, "got 2.5"),
    "bool_batch": ("batching", "max_batch_size", True, "got True"),
    "huge_delay": ("batching", "max_queue_delay_ms", 1e300, "max_queue_delay_ms must be a number in [0, "
                   "1125899906842.624] ms, got 1e+300"),
    "nan_delay": ("batching", "max_queue_delay_ms", math.nan, "got nan"),  # json writes NaN, and reads it
    "inf_delay": ("batching", "max_queue_delay_ms", math.inf, "got inf"),
    "huge_length": ("limits", "max_kv_len", BIG, "limits.max_kv_len must be an integer in 1..536870911"),
    "huge_crossover": ("crossover", "fused", BIG, "crossover.fused must be an integer in 0..536870911"),
    "float_heads": ("attention", "num_heads", 2.0, "attention.num_heads must be an integer in 1..536870911, got 2.0"),
    "huge_levels": ("dynamic_batching", "priority_levels", BIG, "dynamic_batching.priority_levels must be an integer "
                    "in 1..9223372036854775807"),
    "huge_timeout": ("dynamic_batching", "default_queue_policy", {"default_timeout_microseconds": BIG},
                     "default_timeout_microseconds must be an integer in 0..1125899906842623 microseconds"),
    "huge_versions": ("version_policy", "latest", {"num_versions": BIG}, "version_policy.latest.num_versions must be "
                      "an integer in 1..9223372036854775807"),
    # 32.0 equals 32 in Python, and then answered ModelMetadata with INTERNAL.
    "float_shape": (None, "inputs", lambda inputs: [inputs[0] | {"shape": [-1, -1, 32.0]}, *inputs[1:]],
                    "inputs[0].shape must be a list of integers, got [-1, -1, 32.0]"),
    "number_optional": (None, "inputs", lambda inputs: [*inputs[:3], inputs[3] | {"optional": 1}],
                        "inputs[3].optional must be true or false, got 1"),
}


def _copy_with(source, target, section, field, value):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    where = config if section is None else config.setdefault(section, {})
    where[field] = value(where[field]) if callable(value) else value
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


@pytest.mark.parametrize("policy, on_disk, served", [
    (None, (1, 2, 3), (3,)),
    ({"latest": {"num_versions": 2}}, (1, 2, 3), (2, 3)),
    ({"latest": {"num_versions": 5}}, (1, 2), (1, 2)),
    ({"all": {}}, (1, 2, 3), (1, 2, 3)),
    ({"specific": {"versions": [3, 1]}}, (1, 2, 3), (1, 3)),
])
def test_version_policy_chooses_the_versions(model_repository, tmp_path, policy, on_disk, served):
    """Triton's version_policy in config.json: latest N (default 1), all, specific."""
    from attnserve.server.repository import read_model_specs

    model = tmp_path / GOOD
    shutil.copytree(model_repository / GOOD, model)
    for v in on_disk:
        if v != 1:
            shutil.copytree(model / "1", model / str(v))
    config = json.loads((model / "config.json").read_text())
    if policy is not None:
        config["version_policy"] = policy
    (model / "config.json").write_text(json.dumps(config))
    specs = read_model_specs(model)
    assert tuple(s.version for s in specs) == served
    assert all(s.version_dir == model / str(s.version) for s in specs)
    assert read_model_spec(model).version == served[-1]
    assert tuple(s.version for s in read_model_specs(model, pinned_version=on_disk[0])) == (on_disk[0],)


@pytest.mark.parametrize("policy, reason", [
    ({"latest": {"num_versions": 0}}, "num_versions must be an integer in 1..9223372036854775807, got 0"),
    ({"specific": {"versions": [1, 2**63]}}, "versions[] must be an integer in 1..9223372036854775807"),
    ({"specific": {"versions": []}}, "non-empty list of integers"),
    ({"specific": {"versions": [2]}}, "version(s) [2] of"),
    ({"newest": {}}, "must be latest, all or specific, got 'newest'"),
    ("latest", "version_policy must be one of"),
])
def test_a_bad_version_policy_is_a_load_error_naming_it(model_repository, tmp_path, policy, reason):
    from attnserve.server.repository import read_model_specs

    model = tmp_path / GOOD
    shutil.copytree(model_repository / GOOD, model)
    config = json.loads((model / "config.json").read_text())
    config["version_policy"] = policy
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as exc:
        read_model_specs(model)
    assert reason in str(exc.value)


# Loaded in explicit mode over a model that serves: each passed the old checks and, on the native
# plane, answered 500 (INTERNAL) there and for every later load and unload of any model until a restart.
EXPLICIT_BAD = ("huge_batch", "huge_delay", "platform_number", "huge_d_model", "float_shape")


def test_an_explicit_load_of_a_bad_config_is_refused_naming_the_field_and_breaks_nothing(
        model_repository, eager_modules, tmp_path):
    import grpc
    from attnserve.client import InferenceError

    other = "other"
    root = tmp_path / "models"
    shutil.copytree(model_repository / GOOD, root / GOOD)
    shutil.copytree(model_repository / GOOD, root / other)
    good_config = (root / GOOD / "config.json").read_text()
    rng = np.random.default_rng(5)
    q, kv = rng.standard_normal((2, 5, 32), np.float32), rng.standard_normal((2, 7, 32), np.float32)
    want = eager(eager_modules[GOOD], q, kv, kv)["output"]
    proc = ServerProcess(root, "--model-control-mode", "explicit", "--warmup", "none")
    try:
        with InferenceClient(proc.address) as client:
            for name in EXPLICIT_BAD:
                shutil.rmtree(root / GOOD)
                _copy_with(model_repository / GOOD, root / GOOD, *BAD_CONFIGS[name][:3])
                with pytest.raises(InferenceError) as exc:
                    client.load_model(GOOD, timeout_s=120)
                assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, (name, exc.value)
                assert BAD_CONFIGS[name][3] in str(exc.value) and "still serving version(s) [1]" in str(exc.value)
                # The version loaded before keeps serving, and the index says why the load failed.
                got = client.infer(GOOD, q, kv, kv)
                assert float(np.max(np.abs(got["output"] - want))) <= 1e-5, name
                assert client.model_metadata(GOOD).platform == "onnxruntime_onnx"
                entry = {e.name: e for e in client.repository_index()}[GOOD]
                assert BAD_CONFIGS[name][3] in entry.reason, name
                # Loads and unloads of the others go on (before: every one answered 500).
                client.unload_model(other, timeout_s=120)
                client.load_model(other, timeout_s=120)
                assert client.model_ready(other)
            (root / GOOD / "config.json").write_text(good_config)
            client.load_model(GOOD, timeout_s=120)
            assert client.model_ready(GOOD)
    finally:
        assert proc.stop() == 0
