"""bench.stages: the per-request stage figures from the plane's counters, and a tiny real run
(its report's structure, not its speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import stages
from tests.server_process import REPO_ROOT

COUNTERS = {"requests": 40, "refused": 0, "batches": 10, "rows": 80, "check_ns": 400_000, "queue_ns": 4_000_000,
            "merge_ns": 800_000, "python_ns": 8_000_000, "split_ns": 400_000, "finish_ns": 2_000_000}


def test_each_stage_is_per_request_and_the_runner_share_per_batch():
    got = stages.per_request(COUNTERS, wall_s=0.05)
    assert got["check_us"] == 10 and got["queue_us"] == 100 and got["python_us"] == 200 and got["finish_us"] == 50
    assert got["requests_per_batch"] == 4 and got["rows_per_batch"] == 8
    assert got["runner_us_per_batch"] == pytest.approx(1120)  # merge + python + split + finish, over 10 batches
    assert got["runner_busy"] == pytest.approx(0.224)  # 11.2 ms of the runners' time in a 50 ms window


def test_the_counters_are_read_from_the_last_stopped_line():
    log = ("... INFO attnserve.server.native: native data plane stopped: {'requests': 1, 'batches': 1}\n"
           f"... INFO attnserve.server.native: native data plane stopped: {COUNTERS!r}\n")
    assert stages.counters_from_log(log) == COUNTERS
    with pytest.raises(RuntimeError, match="logged no counters"):
        stages.counters_from_log("... INFO attnserve.server.app: stopped after 0.11s\n")


@pytest.mark.e2e  # starts servers
def test_a_tiny_stages_run_writes_its_report(model_repository, tmp_path):
    from attnserve.server.native import why_unavailable

    if why_unavailable() is not None:
        pytest.skip(f"the native plane is not built: {why_unavailable()}")
    done = subprocess.run(
        [sys.executable, "-m", "bench.stages", "--repository", str(model_repository), "--models", "self_attention",
         "--levels", "1,4", "--batches-in-flight", "1,2", "--seconds", "0.3", "--load-generator", "python",
         "--output", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "stages-cpu.json").read_text())
    assert [(r["batches_in_flight"], r["concurrency"]) for r in report["rows"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for row in report["rows"]:
        assert row["requests"] > 0 and row["requests_per_s"] > 0, row
        assert all(row[f"{stage}_us"] >= 0 for stage in stages.STAGES), row
        assert row["python_us"] > 0 and row["requests_per_batch"] >= 1, row
