"""The benchmark runs end to end (briefly): a real server, the fallback load generator, a real
in-process ONNX Runtime measurement, JSON and PNG out. Its figures are not asserted on: speed is
reported by `make bench`, not judged by unit tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_process import REPO_ROOT

pytestmark = pytest.mark.e2e  # runs the benchmark's processes


def test_bench_runs_and_writes_its_report(model_repository, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--repository", str(model_repository), "--models", "cross_attention",
         "--concurrency", "1,2", "--seconds", "0.5", "--load-generator", "python", "--rounds", "2",
         "--output", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    data = report["models"]["cross_attention"]
    assert set(data["in_process"]) == {"1", "8", "32", "64"}
    assert set(data["server"]) == {"1", "2"}
    assert set(data["floor"]) == {"1", "2"}  # the same stack without a model, same levels
    for level in [*data["server"].values(), *data["floor"].values()]:
        assert level["requests_per_s"] > 0 and level["errors"] == 0
        assert 0 < level["p50_ms"] <= level["p99_ms"]
    assert data["server_streaming"] == {} and data["server_http"] == {}  # perf_analyzer alone drives these
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goal c32 throughput" not in done.stdout  # no level 32 was run: no verdict printed for it
    assert "÷ in-proc b32" in done.stdout and "floor: same stack, no model" in done.stdout
    # Two alternating rounds, each with its own in-process, server and floor figures; the table
    # is their medians. Issue #17's c1 goal is derived (level 1 ran), its c32 goal is not.
    assert report["rounds"] == 2 and len(data["rounds"]) == 2
    assert report["machine"]["cpu_model"] and report["machine"]["cores"] >= 1
    for got in data["rounds"]:
        assert set(got["in_process"]) == {"1", "8", "32", "64"}
        assert set(got["server"]) == set(got["floor"]) == {"1", "2"}
        assert set(got["derived"]) == {"c1"}
    assert data["derived"]["c1"]["goal_added_ms"] == 0.1 and len(data["derived"]["c1"]["added_ms_per_round"]) == 2
    assert "goal c1 p50 <= floor p50 + b1 call + 0.1 ms" in done.stdout
    assert report["machine"]["cpu_model"] in done.stdout
    # Time-to-ready: the process's and each model's, warm-up included (server.warmup).
    ready = report["time_to_ready"]
    assert ready["process_s"] > 0 and set(ready["models_s"]) == {"cross_attention", "self_attention"}
    assert "time-to-ready: " in done.stdout and "cross_attention " in done.stdout


def test_the_floor_computes_zeros_of_the_graphs_shapes(model_repository):
    import numpy as np
    from attnserve.server.repository import read_model_spec

    from bench.floor import zeros

    spec = read_model_spec(model_repository / "cross_attention")  # out_dim 32, 2 heads
    run = zeros(spec)
    feeds = {"query": np.ones((3, 5, 32), np.float32), "key": np.ones((3, 7, 32), np.float32),
             "value": np.ones((3, 7, 32), np.float32), "mask": np.ones((3, 5, 7), np.bool_)}
    output, attn_probs = run(feeds, True)
    assert output.shape == (3, 5, spec.out_dim) and attn_probs.shape == (3, spec.num_heads, 5, 7)
    assert output.dtype == attn_probs.dtype == np.float32 and not output.any() and not attn_probs.any()
    assert run(feeds, False)[1] is None


def test_sweep_runs_each_configuration_in_its_own_process(model_repository, tmp_path):
    """Two short lengths of cross_attention, every side (no figure asserted: the sweep reports
    speed and memory, the tests do not judge them), through `python -m bench --sweep`."""
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--sweep", "--repository", str(model_repository), "--models",
         "cross_attention", "--lengths", "16,64", "--budget-s", "0.05", "--max-quadratic-scores", "2000",
         "--output", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "sweep.json").read_text())["models"]["cross_attention"]
    assert set(rows) == {"16", "64"} and rows["64"]["shape"] == [1, 64, 77]
    for length, row in rows.items():
        for side in ("eager_sdpa", "ort_fused", "server", *(("eager_seed", "ort_unfused") if length == "16" else ())):
            assert row[side].get("ms", 0) > 0 and row[side]["peak_rss_increase_mb"] >= 0, (length, side, row[side])
        assert row["server"]["attnserve_client_ms"] > 0
    # 64 x 77 scores are over --max-quadratic-scores 2000: the quadratic sides are skipped, and say so.
    assert rows["64"]["eager_seed"] == rows["64"]["ort_unfused"] == {"skipped": "Lq*Lk > 2,000"}
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "time per request / peak RSS increase" in done.stdout
