"""The ONNX Runtime engine's two ways to run: plain session.run (CPU) and I/O binding (what
CUDA uses, taken here on the CPU provider so CI proves the code path without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from attnserve.server.engine import SOLO_SPIN_US, Engine, choose_device
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


def test_cuda_probe_graph_runs_on_cpu():
    """server.cuda_probe writes its one-node graph as protobuf bytes by hand: ONNX Runtime
    computes y = -x with them."""
    import onnxruntime
    from attnserve.server.cuda_probe import probe_model

    session = onnxruntime.InferenceSession(probe_model(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.array([2.5], np.float32)})
    assert y.tolist() == [-2.5]


def test_cuda_probe_graph_is_valid_onnx():
    """onnx's checker accepts the probe's hand-written bytes (onnx is the exporter's dependency:
    the test-deps-* virtualenvs, which run this file, do not have it)."""
    onnx = pytest.importorskip("onnx")

    from attnserve.server.cuda_probe import probe_model

    onnx.checker.check_model(onnx.load_from_string(probe_model()), full_check=True)


def test_cuda_probe_says_why_a_session_would_not_run_on_cuda():
    """Here the session asked for CUDA runs on CPU (no CUDAExecutionProvider, or one whose
    libraries or GPU are missing): the probe says so. On a GPU machine, test_cuda.py asserts None."""
    import onnxruntime
    from attnserve.server.cuda_probe import why_cuda_cannot_run

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers() and why_cuda_cannot_run() is None:
        pytest.skip("CUDA runs here (tests/test_cuda.py covers it)")
    why = why_cuda_cannot_run()
    assert why is not None and "CUDAExecutionProvider" in why and "CPUExecutionProvider" in why, why


@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_solo_sessions_spin_and_give_the_same_answers(model_repository, model):
    """The solo sessions (server.engine: pool threads that spin) are the unfused graphs', and
    answer bit for bit as the regular ones; a run on another graph, or on an engine without
    them, takes the regular session."""
    import dataclasses

    from attnserve.contract import ALL_OUTPUTS, FUSED, FUSED_KEY_PADDING, OUTPUT_ONLY

    # The crossover the export measured depends on the machine's speed and load (a loaded run
    # recorded one above the (2, 300, 200) run below): this test's own, so that run is fused.
    spec = dataclasses.replace(read_model_spec(model_repository / model),
                               crossover=((FUSED, 16), (FUSED_KEY_PADDING, 64)))
    solo = Engine(spec, choose_device("cpu"), solo=True)
    plain = Engine(spec, choose_device("cpu"))
    assert solo.has_solo_sessions and not plain.has_solo_sessions
    assert set(solo._solo_sessions) == {ALL_OUTPUTS, OUTPUT_ONLY}
    for session in solo._solo_sessions.values():
        assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert session.get_session_options().get_session_config_entry(
            "session.intra_op.spin_duration_us") == str(SOLO_SPIN_US)  # not ONNX Runtime's 20-40 ms
    for session in solo._sessions.values():
        assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    rng = np.random.default_rng(8)
    unfused_runs = 0
    for b, lq, lk in ((1, 10, 10), (2, 300, 200)):  # unfused, then fused unless attn_probs are asked for
        feeds = {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
                 "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
                 "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32)}
        for want_probs in (True, False):
            unfused_runs += solo.graph_for(feeds, want_probs) in (ALL_OUTPUTS, OUTPUT_ONLY)
            want = plain.run(feeds, want_probs)
            for got in (solo.run_solo(feeds, want_probs), plain.run(feeds, want_probs, solo=True)):
                np.testing.assert_array_equal(got[0], want[0])
                if want_probs:
                    np.testing.assert_array_equal(got[1], want[1])
    assert unfused_runs == 3  # the fused graph ran once: (2, 300, 200) without attn_probs
    assert solo.solo_runs == unfused_runs and plain.solo_runs == 0


def test_one_intra_op_thread_has_no_solo_sessions(model_repository):
    """One thread is no pool: nothing would spin, so no second copy of the graphs is opened."""
    spec = read_model_spec(model_repository / "self_attention")
    assert not Engine(spec, choose_device("cpu"), intra_op_threads=1, solo=True).has_solo_sessions
    assert Engine(spec, choose_device("cpu"), intra_op_threads=2, solo=True).has_solo_sessions
