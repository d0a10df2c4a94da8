"""The server's choice among a version's graphs (server.graphs), on real ONNX Runtime sessions.

The engine's choice per run is read from `Engine.graph_for` and counted in `Engine.runs`, its
answers compared with the eager module. No timing: the crossover the export measured is read
back from the repository, never assumed.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from attnserve.server.engine import Engine, choose_device
from attnserve.server.graphs import GENERAL, KEY_PADDING, NO_MASK, GraphSet
from attnserve.server.repository import read_model_spec
from attnserve.server.tensors import Work, merge

from attnserve import contract
from tests.export_helpers import eager_output, max_abs, old_layout

PRESET_NAMES = ("self_attention", "cross_attention")
TOLERANCE = 1e-5



def test_graph_for_each_case():
    graphs = GraphSet(frozenset(contract.GRAPH_FILES), {contract.FUSED: 64, contract.FUSED_KEY_PADDING: 128})
    assert graphs.graph_for(NO_MASK, True, 4096, 4096) == contract.ALL_OUTPUTS  # attn_probs wanted
    assert graphs.graph_for(NO_MASK, False, 4096, 4096) == contract.FUSED
    assert graphs.graph_for(NO_MASK, False, 64, 64) == contract.FUSED  # at the crossover
    assert graphs.graph_for(NO_MASK, False, 63, 64) == contract.OUTPUT_ONLY  # below: sqrt(63 * 64) < 64
    assert graphs.graph_for(NO_MASK, False, 256, 16) == contract.FUSED  # sqrt(256 * 16) = 64
    assert graphs.graph_for(KEY_PADDING, False, 4096, 77) == contract.FUSED_KEY_PADDING
    assert graphs.graph_for(KEY_PADDING, False, 100, 100) == contract.OUTPUT_ONLY  # below 128
    assert graphs.graph_for(GENERAL, False, 4096, 4096) == contract.OUTPUT_ONLY
    assert graphs.graph_for(KEY_PADDING, True, 4096, 4096) == contract.ALL_OUTPUTS
    # What each run holds: nothing on the flash path, every score elsewhere.
    assert graphs.scores_held(2, 4096, 4096, NO_MASK, False) == 0
    assert graphs.scores_held(2, 4096, 4096, KEY_PADDING, False) == 2 * 4096 * 4096
    assert graphs.scores_held(2, 10, 10, NO_MASK, False) == 200  # below the crossover: the unfused graph
    # A version without the fused graphs (an older export): the unfused ones, as before.
    old = GraphSet(frozenset({contract.ALL_OUTPUTS, contract.OUTPUT_ONLY}))
    assert {old.graph_for(m, False, 4096, 4096) for m in (NO_MASK, KEY_PADDING, GENERAL)} == {contract.OUTPUT_ONLY}
    assert old.scores_held(1, 4096, 4096, NO_MASK, False) == 4096 * 4096
    with pytest.raises(ValueError, match="masking must be one of"):
        graphs.graph_for("causal", False, 1, 1)


def _work(spec, rng, b, lq, lk, mask=None, want_probs=False):
    return Work(rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
                rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
                rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32), mask, want_probs)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_engine_runs_the_chosen_graph_and_matches_eager(model_repository, eager_modules, name):
    """Each case through the batcher's merge and the real Engine: the graph it chose, counted in
    Engine.runs, and every request's rows equal to its own eager run."""
    spec = read_model_spec(model_repository / name)
    engine = Engine(spec, choose_device("cpu"))
    assert engine.graphs.kinds == frozenset(contract.GRAPH_FILES) and not engine.why_not_fused
    crossover = dict(spec.crossover)
    assert set(crossover) == set(contract.FUSED_KINDS)
    long = 2 * max(crossover.values())  # past both crossovers, whatever this machine measured
    rng = np.random.default_rng(11)
    key_mask = np.ones((2, long, long), np.bool_)
    key_mask[0, :, long // 2:] = False  # padding-like
    key_mask[1, :, : long // 3] = False
    fully = key_mask.copy()
    fully[1] = False  # item 1 attends no key: uniform rows, exact on the unfused graph only
    general = rng.random((2, long, long)) > 0.3
    all_true = np.ones((1, long, long), np.bool_)
    cases = {
        "no mask": ([_work(spec, rng, 2, long, long)], contract.FUSED),
        "a mask that masks nothing": ([_work(spec, rng, 1, long, long, all_true)], contract.FUSED),
        "key mask": ([_work(spec, rng, 2, long, long, key_mask)], contract.FUSED_KEY_PADDING),
        "key mask, one item fully masked": ([_work(spec, rng, 2, long, long, fully)], contract.OUTPUT_ONLY),
        "general mask": ([_work(spec, rng, 2, long, long, general)], contract.OUTPUT_ONLY),
        "attn_probs wanted": ([_work(spec, rng, 1, long, long, want_probs=True)], contract.ALL_OUTPUTS),
        "padded keys": ([_work(spec, rng, 1, long, long), _work(spec, rng, 1, long - 5, long - 3)],
                        contract.FUSED_KEY_PADDING),
        "padded queries only": ([_work(spec, rng, 1, long, long), _work(spec, rng, 2, long - 5, long)],
                                contract.FUSED),
        "padded, one general mask": ([_work(spec, rng, 1, long, long),
                                      _work(spec, rng, 1, long - 1, long - 2,
                                            rng.random((1, long - 1, long - 2)) > 0.5)],
                                     contract.OUTPUT_ONLY),
        "short": ([_work(spec, rng, 1, 1, 1)], contract.OUTPUT_ONLY),  # below any crossover (>= 16)
    }
    module = eager_modules[name]
    for case, (works, want_kind) in cases.items():
        feeds, _ = merge(works)
        want_probs = any(w.want_probs for w in works)
        assert engine.graph_for(feeds, want_probs) == want_kind, case
        before = engine.runs[want_kind]
        output, probs = engine.run(feeds, want_probs)
        assert engine.runs[want_kind] == before + 1, case
        start = 0
        for w in works:
            with torch.no_grad():
                want, want_p = module(torch.from_numpy(w.query), torch.from_numpy(w.key), torch.from_numpy(w.value),
                                      mask=None if w.mask is None else torch.from_numpy(w.mask))
            got = output[start:start + w.rows, : w.q_len]
            assert float(np.max(np.abs(got - want.numpy()))) <= TOLERANCE, case
            if w.want_probs:
                np.testing.assert_allclose(probs[start:start + w.rows, :, : w.q_len, : w.k_len], want_p.numpy(),
                                           atol=TOLERANCE, rtol=0)
            start += w.rows


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fully_masked_rows_are_uniform_whatever_the_scores(model_repository, eager_modules, name):
    """Inputs large enough that scaled scores pass 512: the key padding kernel adds -1e10 to them,
    and s - 1e10 no longer rounds to -1e10 itself (fp32 steps there are 1,024), so a fully masked
    row on it would not be the seeds' uniform distribution (measured: 0.9 off at 30x inputs).
    Such a request takes the unfused graph and equals eager; its partly masked rows would be exact
    on either."""
    spec = read_model_spec(model_repository / name)
    engine = Engine(spec, choose_device("cpu"))
    long = 2 * max(dict(spec.crossover).values())
    rng = np.random.default_rng(30)
    keep = np.ones((2, long, long), np.bool_)
    keep[0] = False  # every query row of item 0 masks every key
    keep[1, :, long // 2:] = False
    w = Work(30 * rng.standard_normal((2, long, spec.query_dim), dtype=np.float32),
             30 * rng.standard_normal((2, long, spec.kv_dim), dtype=np.float32),
             rng.standard_normal((2, long, spec.kv_dim), dtype=np.float32), keep, False)
    feeds, _ = merge([w])
    output, _ = engine.run(feeds, False)
    with torch.no_grad():
        want, _ = eager_modules[name](torch.from_numpy(w.query[:1]), torch.from_numpy(w.key[:1]),
                                      torch.from_numpy(w.value[:1]), mask=torch.from_numpy(keep[:1]))
    # Item 0 is uniform over its keys: the mean of its projected values, exactly as eager has it.
    assert float(np.max(np.abs(output[:1] - want.numpy()))) <= TOLERANCE
    assert engine.graph_for(feeds, False) == contract.OUTPUT_ONLY


def test_engine_on_an_old_layout_runs_the_unfused_graphs(model_repository, eager_modules, tmp_path, caplog):
    repo = old_layout(model_repository, "self_attention", tmp_path)
    spec = read_model_spec(repo / "self_attention")
    assert spec.crossover == ()
    with caplog.at_level(logging.WARNING, logger="attnserve.server.engine"):
        engine = Engine(spec, choose_device("cpu"))
    assert engine.graphs.kinds == {contract.ALL_OUTPUTS, contract.OUTPUT_ONLY}
    assert set(engine.why_not_fused) == set(contract.FUSED_KINDS)
    assert "model_fused.onnx not in version 1" in caplog.text
    rng = np.random.default_rng(2)
    works = [_work(spec, rng, 1, 300, 300)]
    feeds, _ = merge(works)
    assert engine.graph_for(feeds, False) == contract.OUTPUT_ONLY
    output, _ = engine.run(feeds, False)
    want = eager_output(eager_modules["self_attention"],
                        *(torch.from_numpy(getattr(works[0], n)) for n in ("query", "key", "value")))
    assert max_abs(output, want) <= TOLERANCE
    assert dict(engine.runs) == {contract.OUTPUT_ONLY: 1}


def test_a_fused_graph_that_does_not_load_is_skipped_with_the_reason(model_repository, tmp_path, caplog):
    shutil.copytree(model_repository / "cross_attention", tmp_path / "cross_attention")
    (tmp_path / "cross_attention" / "1" / contract.GRAPH_FUSED).write_bytes(b"not an onnx graph")
    with caplog.at_level(logging.WARNING, logger="attnserve.server.engine"):
        engine = Engine(read_model_spec(tmp_path / "cross_attention"), choose_device("cpu"))
    assert contract.FUSED not in engine.graphs.kinds and contract.FUSED_KEY_PADDING in engine.graphs.kinds
    assert "model_fused.onnx did not load" in engine.why_not_fused[contract.FUSED]
    assert "model_fused.onnx did not load" in caplog.text
