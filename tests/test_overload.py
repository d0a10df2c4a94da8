"""Overload, bounded: far more concurrent requests than a small queue holds. Each one is served
correctly or shed with RESOURCE_EXHAUSTED; none is lost (no other status); the server's
resident memory stays under a stated bound.

One server with a queue of 4 requests and 1 MiB per model: small requests meet the count bound,
larger ones the byte bound. Figures (served / shed / lost, peak resident memory) are printed
(`pytest -s`) and, when ATTNSERVE_FIGURES is set, appended to that file as JSON lines.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs

QUEUE_SIZE = 4
QUEUED_BYTES = 1 << 20
MAX_BATCH = 4
CONCURRENCY = 64
TOLERANCE = 1e-5
MIB = 1024  # KiB


@pytest.fixture(scope="module")
def overload_server(model_repository):
    # Batches wait at a gate the test opens one batch at a time (tests/gated_server.py): the queue
    # is full because the test holds the model, not because this machine computes slower than it
    # sends (pinned to one core, it did not).
    proc = GatedServer(model_repository, "--max-queue-size", str(QUEUE_SIZE), "--max-queued-bytes",
                       str(QUEUED_BYTES), "--max-batch-size", str(MAX_BATCH), "--intra-op-threads", "1")
    yield proc
    proc.gate.release(10_000)
    assert proc.stop() == 0, proc.log()[-3000:]
    proc.gate.close()


def _hammer(proc, model: str, cases: list[dict], wants: list[dict], waves: int, capacity: int) -> dict:
    """`waves` bursts of CONCURRENCY requests, cycling over `cases`; counts every outcome.

    In each burst the first batch is held at the gate until every request the server cannot
    hold (more than `capacity`: the batch running and the queue behind it) has been answered;
    then the held ones are let through one batch at a time."""
    counts = {"served": 0, "shed": 0, "lost": 0, "shed_by": {"max_queue_size": 0, "max_queued_bytes": 0}}
    lost = []
    requests = [infer_request(model, outputs=("output",), **x) for x in cases]
    with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        started = time.monotonic()
        for wave in range(waves):
            indices = [wave * CONCURRENCY + i for i in range(CONCURRENCY)]
            futures = [pool.submit(stub.ModelInfer, requests[i % len(cases)], timeout=120) for i in indices]
            proc.gate.wait_started()  # the first batch runs, held
            _wait_until(lambda futures=futures: sum(f.done() for f in futures) >= CONCURRENCY - capacity)
            while True:  # one batch through the gate at a time, until every call is answered
                proc.gate.release()
                if _wait_until(lambda futures=futures: all(f.done() for f in futures) or proc.gate.has_started()):
                    if all(f.done() for f in futures) and not proc.gate.has_started():
                        break
                    proc.gate.wait_started()
            for i, future in zip(indices, futures, strict=True):
                err = future.exception()
                if err is None:
                    got = outputs_of(future.result())["output"]
                    assert float(np.max(np.abs(got - wants[i % len(cases)]["output"]))) <= TOLERANCE
                    counts["served"] += 1
                elif err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    counts["shed"] += 1
                    for bound in counts["shed_by"]:
                        counts["shed_by"][bound] += f"{bound} " in err.details()
                else:
                    counts["lost"] += 1
                    lost.append((err.code(), err.details()))
        counts["seconds"] = round(time.monotonic() - started, 2)
    assert not lost, lost[:5]
    return counts


def _wait_until(condition, timeout_s: float = 120.0) -> bool:
    """Poll `condition` (a state, not a duration) until it holds; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the state was not reached: a call hangs"
        time.sleep(0.005)
    return True


def test_overload_is_shed_nothing_is_lost_and_memory_stays_bounded(overload_server, eager_modules):
    proc = overload_server
    rng = np.random.default_rng(0)
    # Small requests (cross_attention, about 60 KB, but 150 to 170 keys: slower to compute than
    # to send): four fill the queue long before its 1 MiB does.
    small = [random_inputs(rng, 1, int(rng.integers(150, 170)), int(rng.integers(150, 170)), 32, 32)
             for _ in range(16)]
    small_wants = [eager(eager_modules["cross_attention"], **x) for x in small]
    # Larger ones (self_attention, 1 x 96 x 512 floats in each of three tensors: 590 KB): a
    # second would pass the 1 MiB byte bound before four fill the queue.
    large = [random_inputs(rng, 1, 96, 96, 512, 512) for _ in range(4)]
    large_wants = [eager(eager_modules["self_attention"], **x) for x in large]
    _hammer(proc, "cross_attention", small[:2], small_wants[:2], 1, QUEUE_SIZE + MAX_BATCH)  # warm up
    _hammer(proc, "self_attention", large[:1], large_wants[:1], 1, 1 + MAX_BATCH)
    idle_kib = proc.memory_kib("VmRSS")

    # Capacity: a batch of up to MAX_BATCH requests running, and behind it QUEUE_SIZE small
    # requests, or one large one (a second would pass the 1 MiB).
    by_count = _hammer(proc, "cross_attention", small, small_wants, 6, QUEUE_SIZE + MAX_BATCH)
    by_bytes = _hammer(proc, "self_attention", large, large_wants, 3, 1 + MAX_BATCH)
    peak_kib = proc.memory_kib("VmHWM")

    # What the server may hold on top of idle: each of the 64 calls in flight has its message
    # twice at most (the received bytes, then the parsed request): 2 x 64 x 590 KB = 75 MB;
    # plus the 1 MiB queue and one batch (under 5 MB). The bound is three times the messages,
    # plus the queue, the batch and 64 MiB for threads and allocator slack (measured here: 100
    # to 180 MiB over idle). What it guards against: anything sized by a request's claims
    # rather than its bytes, or a queue that grows with the load.
    request_kib = large[0]["query"].nbytes * 3 // 1024
    bound_kib = idle_kib + 3 * 2 * CONCURRENCY * request_kib + QUEUED_BYTES // 1024 + 5 * MIB + 64 * MIB
    figures = {"test": "overload", "requests": 9 * CONCURRENCY, "concurrency": CONCURRENCY, "by_count": by_count,
               "by_bytes": by_bytes, "idle_rss_kib": idle_kib, "peak_rss_kib": peak_kib, "bound_kib": bound_kib}
    print(f"\noverload figures: {json.dumps(figures, sort_keys=True)}")
    if os.environ.get("ATTNSERVE_FIGURES"):
        with open(os.environ["ATTNSERVE_FIGURES"], "a") as f:
            f.write(json.dumps({"at": time.time(), **figures}, sort_keys=True) + "\n")

    for counts, bound in ((by_count, "max_queue_size"), (by_bytes, "max_queued_bytes")):
        assert counts["lost"] == 0
        assert counts["served"] >= 1 and counts["shed"] >= 1, counts
        assert counts["shed_by"][bound] >= 1, counts  # the bound the test meant to reach was met
    assert by_count["served"] + by_count["shed"] == 6 * CONCURRENCY
    assert by_bytes["served"] + by_bytes["shed"] == 3 * CONCURRENCY
    assert peak_kib <= bound_kib, figures
