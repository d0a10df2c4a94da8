"""The ONNX Runtime engine's two ways to run: plain session.run (CPU) and I/O binding (what
CUDA uses, taken here on the CPU provider so CI proves the code path without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.server.engine import Engine, choose_device
from attnserve.server.repository import read_model_spec


@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_io_binding_gives_the_plain_runs_answers(model_repository, model):
    spec = read_model_spec(model_repository / model)
    plain = Engine(spec, choose_device("cpu"))
    bound = Engine(spec, choose_device("cpu"), io_binding=True)
    assert not plain._io_binding and bound._io_binding  # CPU default: plain runs
    rng = np.random.default_rng(5)
    b, lq, lk = 3, 11, 6
    mask = rng.random((b, lq, lk)) < 0.7
    mask[0, 0] = False  # a fully masked row
    feeds = {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
             "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
             "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
             "mask": mask}
    for want_probs in (True, False):
        want_out, want_probs_arr = plain.run(feeds, want_probs)
        got_out, got_probs = bound.run(feeds, want_probs)
        assert got_out.shape == (b, lq, spec.out_dim) and got_out.dtype == np.float32
        np.testing.assert_array_equal(got_out, want_out)
        if want_probs:
            assert got_probs.shape == (b, spec.num_heads, lq, lk)
            np.testing.assert_array_equal(got_probs, want_probs_arr)
        else:
            assert got_probs is None and want_probs_arr is None


@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_io_binding_takes_the_fused_graphs_too(model_repository, model):
    """The CUDA path (I/O binding) on every graph a run can choose, here on the CPU provider."""
    from attnserve import contract

    spec = read_model_spec(model_repository / model)
    plain = Engine(spec, choose_device("cpu"))
    bound = Engine(spec, choose_device("cpu"), io_binding=True)
    rng = np.random.default_rng(6)
    b, lq, lk = 2, 300, 200
    base = {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
            "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
            "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32)}
    key_padding = np.ones((b, lk), np.int32)
    key_padding[0, 150:] = 0
    for feeds in (base, base | {contract.KEY_PADDING_MASK: key_padding}):
        kind = plain.graph_for(feeds, False)
        assert bound.graph_for(feeds, False) == kind
        np.testing.assert_array_equal(bound.run(feeds, False)[0], plain.run(feeds, False)[0])
        assert bound.runs == plain.runs
