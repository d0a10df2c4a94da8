"""The load generators (bench.loadgen, bench.rest_loadgen, bench.scaling) and the pieces they
share: every call a generator counts as answered is one the server counts as a success, over
gRPC and REST. Their speed is not asserted on: `make bench` reports it."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc

from bench import loadgen, rest_loadgen, scaling
from bench.inprocess import Shape

MODEL = "cross_attention"
DIMS = (32, 32)  # the preset's query_dim, kv_dim
SHAPE = Shape(1, 4, 4)
WINDOW_S = 0.3
WAIT_S = 60.0


def test_shares_split_a_total_as_evenly_as_whole_numbers_allow():
    assert loadgen.shares(32, 4) == [8, 8, 8, 8]
    assert loadgen.shares(7, 3) == [3, 2, 2]
    assert loadgen.shares(2, 4) == [1, 1, 0, 0]


def test_summary_of_a_window_without_an_answer_is_nan_not_a_crash():
    got = loadgen.summary([], 3, 2.0)
    assert got["requests_per_s"] == 0 and got["errors"] == 3
    assert all(math.isnan(got[k]) for k in ("p50_ms", "p90_ms", "p99_ms"))
    got = loadgen.summary([0.001, 0.002, 0.003, 0.004], 0, 2.0)
    assert got["requests_per_s"] == 2.0 and got["p50_ms"] == pytest.approx(2.5)


def test_closed_loops_count_each_call_once_as_answered_or_failed():
    """Sends that succeed, answer not-OK, or raise a listed failure: each call lands in exactly
    one of the two counts, whatever the window let through; any other exception is the caller's."""
    made = {"ok": 0, "not ok": 0, "raised": 0}

    async def ok() -> bool:
        made["ok"] += 1
        await asyncio.sleep(0)
        return True

    async def not_ok() -> bool:
        made["not ok"] += 1
        await asyncio.sleep(0)
        return False

    async def raises() -> bool:
        made["raised"] += 1
        await asyncio.sleep(0)
        raise ConnectionError("refused")

    latencies, errors = asyncio.run(loadgen.closed_loops([ok, ok, not_ok, raises], 0.05, (ConnectionError,)))
    assert len(latencies) == made["ok"] and errors == made["not ok"] + made["raised"]
    assert all(t >= 0 for t in latencies)

    async def broken() -> bool:
        raise ValueError("not a failure of the call")

    with pytest.raises(ValueError):
        asyncio.run(loadgen.closed_loops([broken], 0.05, (ConnectionError,)))


def _successes(server) -> int:
    with server.channel() as ch:
        (stats,) = pb_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            pb.ModelStatisticsRequest(name=MODEL), timeout=WAIT_S).model_stats
    return stats.inference_stats.success.count


def _successes_reach(server, want: int) -> int:
    """The server's success count once it has reached `want` (its statistics follow the answers),
    or as it stands after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while (got := _successes(server)) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_the_grpc_load_generator_counts_what_the_server_answered(server):
    before = _successes(server)
    got = loadgen.run(server.address, MODEL, DIMS, SHAPE, 3, WINDOW_S)
    assert set(got) == {"requests_per_s", "p50_ms", "p90_ms", "p99_ms", "errors"} and got["errors"] == 0
    answered = round(got["requests_per_s"] * WINDOW_S)
    warm_ups = 3  # one per process, one process per call in flight up to MAX_PROCESSES
    assert _successes_reach(server, before + answered + warm_ups) == before + answered + warm_ups


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_the_rest_load_generator_opens_its_window_once_all_are_warm(server, binary):
    before = _successes(server)
    warm_ups = 3  # every connection of every process, before the window opens
    events: list[tuple[str, int]] = []
    got = rest_loadgen.run(server.http_address, MODEL, DIMS, SHAPE, 3, WINDOW_S, binary=binary,
                           on_start=lambda: events.append(("start", _successes_reach(server, before + warm_ups))),
                           on_stop=lambda: events.append(("stop", _successes(server))))
    assert got["errors"] == 0 and [e for e, _ in events] == ["start", "stop"]
    assert events[0][1] == before + warm_ups  # every process warm, and none sends before the window opens
    answered = got["requests"]
    assert _successes_reach(server, before + answered + warm_ups) == before + answered + warm_ups
    assert got["requests_per_s"] * WINDOW_S <= answered  # over the measured wall time, at least the window


def test_the_scaling_generator_spreads_calls_over_its_connections(server):
    before = _successes(server)
    got = scaling.drive(server.address, MODEL, DIMS, SHAPE, 3, 2, WINDOW_S)
    assert got["errors"] == 0 and got["loadgen_cpu_s"] > 0
    answered = round(got["requests_per_s"] * WINDOW_S)
    warm_ups = 2  # one per connection
    assert _successes_reach(server, before + answered + warm_ups) == before + answered + warm_ups
