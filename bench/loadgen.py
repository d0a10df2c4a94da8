"""A multi-process load generator for where perf_analyzer cannot run, and the pieces every
load generator here shares (bench.rest_loadgen, bench.scaling).

Each process holds its own channel (its own TCP connection) and keeps `concurrency / processes`
requests in flight with grpc.aio; latencies are gathered from all of them. Requests are built
once per process, so the generator spends its time on the wire, not in numpy.

The shared pieces: `shares` (a total split over processes), `fan_out` (spawned processes, an
optional start signal, their reports gathered), `closed_loops` (calls kept in flight until the
window closes) and `summary` (requests/s and latency percentiles).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Awaitable, Callable

import numpy as np

from bench.inprocess import Shape

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
MAX_PROCESSES = 4


def shares(total: int, parts: int) -> list[int]:
    """`total` split over `parts` as evenly as whole numbers allow, the larger shares first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def grpc_request(model: str, dims: tuple[int, int], shape: Shape, rng: np.random.Generator):
    """A ModelInferRequest of random query, key and value (raw contents), built once per process."""
    from attnserve.proto import inference_pb2 as pb

    q_dim, kv_dim = dims
    request = pb.ModelInferRequest(model_name=model)
    for name, array in (
        ("query", rng.standard_normal((shape.batch, shape.q_len, q_dim), dtype=np.float32)),
        ("key", rng.standard_normal((shape.batch, shape.k_len, kv_dim), dtype=np.float32)),
        ("value", rng.standard_normal((shape.batch, shape.k_len, kv_dim), dtype=np.float32)),
    ):
        request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


def grpc_send(stub, request) -> Callable[[], Awaitable[bool]]:
    """A send for closed_loops: one ModelInfer call of `request` on `stub`."""
    async def send() -> bool:
        await stub.ModelInfer(request, timeout=30)
        return True

    return send


async def closed_loops(sends: list[Callable[[], Awaitable[bool]]], seconds: float,
                       failures: tuple[type[BaseException], ...]) -> tuple[list[float], int]:
    """Each of `sends` in a loop of its own for `seconds`: one call in flight per send, the next
    sent once the last is answered. A send returns whether its call succeeded (or raises one of
    `failures`). Returns the latency of each call that succeeded and the count of the others."""
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def loop(send: Callable[[], Awaitable[bool]]) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                ok = await send()
            except failures:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    await asyncio.gather(*(loop(send) for send in sends))
    return latencies, errors


def fan_out(target, args: list[tuple], seconds: float, *, together: bool = False, on_start=None,
            on_stop=None) -> tuple[list[float], int, float]:
    """Run target(*a, queue) in one spawned process per a in args; each puts (latencies, errors)
    on the queue. With `together`, target(*a, ready, go, queue): each puts True on `ready` once
    warm and starts when `go` is set, once all are ready, so the measured windows coincide.
    on_start()/on_stop() are called as the window opens and once every process has reported.
    Returns every latency, the errors summed and the seconds from the start to the last report."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    signals = (ctx.Queue(), ctx.Event()) if together else ()
    procs = [ctx.Process(target=target, args=(*a, *signals, queue)) for a in args]
    for p in procs:
        p.start()
    try:
        if together:
            ready, go = signals
            for _ in procs:
                ready.get(timeout=120)
        if on_start is not None:
            on_start()
        started = time.perf_counter()
        if together:
            go.set()
        latencies: list[float] = []
        errors = 0
        for _ in procs:
            got, failed = queue.get(timeout=seconds + 120)
            latencies += got
            errors += failed
        wall_s = time.perf_counter() - started
        if on_stop is not None:
            on_stop()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # a process that did not report must not outlive the run
                p.kill()
    return latencies, errors, wall_s


def summary(latencies: list[float], errors: int, seconds: float) -> dict[str, float]:
    """Requests/s over `seconds`, p50/p90/p99 in ms (NaN when no call succeeded) and the errors."""
    ms = np.array(latencies or [float("nan")]) * 1000
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors,
    }


def _worker(address: str, model: str, dims: tuple[int, int], shape: Shape, in_flight: int,
            seconds: float, queue: multiprocessing.Queue) -> None:
    import grpc
    from attnserve.proto import inference_pb2_grpc as pb_grpc

    request = grpc_request(model, dims, shape, np.random.default_rng())

    async def main() -> tuple[list[float], int]:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(request)  # warm the connection
            return await closed_loops([grpc_send(stub, request)] * in_flight, seconds, (grpc.aio.AioRpcError,))

    queue.put(asyncio.run(main()))


def run(address: str, model: str, dims: tuple[int, int], shape: Shape, concurrency: int,
        seconds: float) -> dict[str, float]:
    processes = max(1, min(concurrency, MAX_PROCESSES))
    latencies, errors, _ = fan_out(_worker, [(address, model, dims, shape, n, seconds)
                                             for n in shares(concurrency, processes)], seconds)
    return summary(latencies, errors, seconds)
