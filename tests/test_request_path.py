"""Issue #17's cut on the request path answers exactly what the path it shortcuts answers (the
small-mask BOOL check); and the benchmark's two derived goals are the issue's formulas."""

from __future__ import annotations

import numpy as np
import pytest
from attnserve.server import codec


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

    in_process = {1: {"ms_per_call": 0.11, "requests_per_s": 9091.0},
                  32: {"ms_per_call": 2.26, "requests_per_s": 14134.0}}
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
