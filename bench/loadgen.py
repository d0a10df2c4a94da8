"""A multi-process load generator for where perf_analyzer cannot run.

Each process holds its own channel (its own TCP connection) and keeps `concurrency / processes`
requests in flight with grpc.aio; latencies are gathered from all of them. Requests are built
once per process, so the generator spends its time on the wire, not in numpy.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import numpy as np

from bench.inprocess import Shape


def _worker(address: str, model: str, dims: tuple[int, int], shape: Shape, in_flight: int,
            seconds: float, queue: multiprocessing.Queue) -> None:
    import grpc
    from attnserve.proto import inference_pb2 as pb
    from attnserve.proto import inference_pb2_grpc as pb_grpc

    q_dim, kv_dim = dims
    rng = np.random.default_rng()
    request = pb.ModelInferRequest(model_name=model)
    for name, array in (
        ("query", rng.standard_normal((shape.batch, shape.q_len, q_dim), dtype=np.float32)),
        ("key", rng.standard_normal((shape.batch, shape.k_len, kv_dim), dtype=np.float32)),
        ("value", rng.standard_normal((shape.batch, shape.k_len, kv_dim), dtype=np.float32)),
    ):
        request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())

    async def main() -> tuple[list[float], int]:
        latencies: list[float] = []
        errors = 0
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(request)  # warm the connection
            stop_at = time.perf_counter() + seconds

            async def loop() -> None:
                nonlocal errors
                while time.perf_counter() < stop_at:
                    started = time.perf_counter()
                    try:
                        await stub.ModelInfer(request, timeout=30)
                    except grpc.aio.AioRpcError:
                        errors += 1
                        continue
                    latencies.append(time.perf_counter() - started)

            await asyncio.gather(*(loop() for _ in range(in_flight)))
        return latencies, errors

    queue.put(asyncio.run(main()))


def fan_out(target, args: list[tuple], seconds: float) -> tuple[list[float], int]:
    """Run target(*a, queue) in one spawned process per a in args; each puts (latencies, errors)
    on the queue. Returns every latency and the errors summed."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue)) for a in args]
    for p in procs:
        p.start()
    latencies: list[float] = []
    errors = 0
    for _ in procs:
        got, failed = queue.get(timeout=seconds + 120)
        latencies += got
        errors += failed
    for p in procs:
        p.join()
    return latencies, errors


def run(address: str, model: str, dims: tuple[int, int], shape: Shape, concurrency: int,
        seconds: float) -> dict[str, float]:
    processes = max(1, min(concurrency, 4))
    share = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    latencies, errors = fan_out(_worker, [(address, model, dims, shape, n, seconds) for n in share], seconds)
    ms = np.array(latencies) * 1000
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors,
    }
