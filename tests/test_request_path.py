"""Issue #17's cuts on the request path answer exactly what the paths they shortcut answer:
small runs on the engine's one-thread twins, the small-mask BOOL check; and the benchmark's two
derived goals are the issue's formulas."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.server import codec
from attnserve.server.engine import SMALL_RUN_MACS, Engine, choose_device, run_macs
from attnserve.server.repository import read_model_spec


def _feeds(spec, rng, b, lq, lk, mask=True):
    feeds = {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),  # (b, lq, query_dim)
             "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),  # (b, lk, kv_dim)
             "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32)}
    if mask:
        feeds["mask"] = rng.random((b, lq, lk)) < 0.7  # (b, lq, lk)
        feeds["mask"][0, 0] = False  # a fully masked row
    return feeds


@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_small_runs_on_the_one_thread_twin_answer_what_the_pool_answers(model_repository, model):
    spec = read_model_spec(model_repository / model)
    twinned = Engine(spec, choose_device("cpu"), small_run_macs=1 << 62)  # every run is small
    pooled = Engine(spec, choose_device("cpu"), small_run_macs=0)  # no twins
    rng = np.random.default_rng(17)
    runs = 0
    for b, lq, lk in ((1, 10, 10), (3, 7, 5), (2, 33, 17)):
        for mask in (True, False):
            feeds = _feeds(spec, rng, b, lq, lk, mask)
            for want_probs in (True, False):
                kind = twinned.graph_for(feeds, want_probs)
                got_out, got_probs = twinned.run(feeds, want_probs)
                want_out, want_probs_arr = pooled.run(feeds, want_probs)
                np.testing.assert_array_equal(got_out, want_out)  # bit for bit
                if want_probs:
                    np.testing.assert_array_equal(got_probs, want_probs_arr)
                runs += kind in ("all_outputs", "output_only")  # the unfused graphs have twins
    assert twinned.small_runs == runs > 0 and pooled.small_runs == 0


def test_only_runs_up_to_the_bound_take_the_twin(model_repository):
    spec = read_model_spec(model_repository / "self_attention")
    # The benchmark's request, (1, 10, 512) over 10 keys, is small; 32 of them merged are not.
    assert run_macs(spec, 1, 10, 10) <= SMALL_RUN_MACS < run_macs(spec, 32, 10, 10)
    engine = Engine(spec, choose_device("cpu"))
    rng = np.random.default_rng(3)
    engine.run(_feeds(spec, rng, 1, 10, 10), True)
    assert engine.small_runs == 1
    engine.run(_feeds(spec, rng, 32, 10, 10), True)
    assert engine.small_runs == 1 and engine.runs["all_outputs"] == 2
    # One intra-op thread asked for: the sessions are that already, no twins are opened.
    assert Engine(spec, choose_device("cpu"), intra_op_threads=1)._small == {}


@pytest.mark.parametrize("size", [100, codec._BOOL_TRANSLATE_MAX_BYTES + 100])
def test_bool_bytes_check_refuses_the_same_bytes_small_and_large(size):
    """Both sides of the size where the check changes method: 0 and 1 pass, any other byte is
    refused with its offset, wherever it is."""
    codec._check_bool_bytes("mask", bytes(size))
    codec._check_bool_bytes("mask", b"\x01" * size)
    for offset in (0, size // 2, size - 1):
        for byte in (0x02, 0x80, 0xFF):
            data = bytearray(np.random.default_rng(offset).integers(0, 2, size, dtype=np.uint8).tobytes())
            data[offset] = byte
            with pytest.raises(ValueError, match=f"byte {offset} is 0x{byte:02X}"):
                codec._check_bool_bytes("mask", bytes(data))


def test_bench_derived_goals_are_the_issues_formulas():
    from bench.__main__ import _derived_summary, derived

    in_process = {1: {"ms_per_call": 0.11, "requests_per_s": 9091.0}, 32: {"ms_per_call": 2.26, "requests_per_s": 14134.0}}
    floor = {1: {"p50_ms": 0.46, "requests_per_s": 2000.0}, 32: {"requests_per_s": 4669.0, "p50_ms": 6.0}}
    server = {1: {"p50_ms": 0.81, "requests_per_s": 1200.0}, 32: {"requests_per_s": 2692.0, "p50_ms": 11.0}}
    got = derived(in_process, server, floor)
    # The issue's own figures: 1 / (1/4,669 + 1/14,134) = 3,510 req/s; 0.46 + 0.11 = 0.57 ms.
    assert got["c32"]["ideal_requests_per_s"] == pytest.approx(3510, abs=1)
    assert got["c32"]["of_ideal"] == pytest.approx(0.77, abs=0.005)
    assert got["c1"]["goal_p50_ms"] == pytest.approx(0.67) and got["c1"]["added_ms"] == pytest.approx(0.24)
    summary = _derived_summary([got, derived(in_process, {1: {"p50_ms": 0.6}, 32: {"requests_per_s": 3300.0}}, floor)])
    assert summary["c32"]["of_ideal_per_round"] == pytest.approx([0.767, 0.940], abs=0.001)
    assert summary["c32"]["of_ideal"] == pytest.approx((0.767 + 0.940) / 2, abs=0.001)  # median of two
    assert summary["c32"]["met"] is False  # median 0.85 < 0.9
    assert summary["c1"]["added_ms"] == pytest.approx((0.24 + 0.03) / 2) and summary["c1"]["met"] is False
    assert derived(in_process, {1: server[1]}, {}) == {}  # no floor: no verdict
