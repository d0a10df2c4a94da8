"""A multi-process REST load generator: POST /v2/models/{m}/infer, binary tensor data or JSON.

perf_analyzer sends REST requests as binary tensor data only; this sends either (the same zeros), in the style of
bench.loadgen: processes of aiohttp keep-alive connections, each holding its share of the
concurrency in flight, bodies built once per process. The processes warm up first, then all start
on one signal, so the caller can read the server's CPU time over exactly the measured window
(`on_start`, `on_stop`). Both outputs are asked for, as perf_analyzer does.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from bench import loadgen
from bench.inprocess import Shape

HEADER_LENGTH = "Inference-Header-Content-Length"  # the binary tensor data extension's header
OUTPUTS = ("output", "attn_probs")


def body(model: str, dims: tuple[int, int], shape: Shape, binary: bool) -> tuple[bytes, dict]:
    """A request's body and headers: zeros in every input, the mask too, as perf_analyzer's
    `--input-data zero` sends them (bench.perf_analyzer), so that every side runs the same graph."""
    q_dim, kv_dim = dims
    arrays = {"query": np.zeros((shape.batch, shape.q_len, q_dim), np.float32),
              "key": np.zeros((shape.batch, shape.k_len, kv_dim), np.float32),
              "value": np.zeros((shape.batch, shape.k_len, kv_dim), np.float32),
              "mask": np.zeros((shape.batch, shape.q_len, shape.k_len), np.bool_)}
    inputs = []
    for name, array in arrays.items():
        entry = {"name": name, "shape": list(array.shape), "datatype": "BOOL" if array.dtype == np.bool_ else "FP32"}
        if binary:
            entry["parameters"] = {"binary_data_size": array.nbytes}
        else:
            entry["data"] = array.ravel().tolist()
        inputs.append(entry)
    header = json.dumps({"inputs": inputs, "outputs": [{"name": n, "parameters": {"binary_data": binary}}
                                                       for n in OUTPUTS]}).encode()
    if not binary:
        return header, {"Content-Type": "application/json"}
    raw = b"".join(a.tobytes() for a in arrays.values())
    return header + raw, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def _worker(address: str, model: str, dims: tuple[int, int], shape: Shape, binary: bool, in_flight: int,
            seconds: float, ready, go, queue) -> None:
    import aiohttp

    data, headers = body(model, dims, shape, binary)
    url = f"http://{address}/v2/models/{model}/infer"

    async def main() -> tuple[list[float], int]:
        connector = aiohttp.TCPConnector(limit=in_flight)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def once() -> bool:
                async with session.post(url, data=data, headers=headers) as r:
                    await r.read()
                    return r.status == 200

            await asyncio.gather(*(once() for _ in range(in_flight)))  # warm every connection
            ready.put(True)
            await asyncio.to_thread(go.wait)
            return await loadgen.closed_loops([once] * in_flight, seconds, (aiohttp.ClientError,))

    queue.put(asyncio.run(main()))


def run(address: str, model: str, dims: tuple[int, int], shape: Shape, concurrency: int, seconds: float,
        binary: bool = True, on_start=None, on_stop=None) -> dict[str, float]:
    """One concurrency level against the REST port at `address`; on_start()/on_stop() are called
    just as the measured window opens and once every process has reported."""
    processes = max(1, min(concurrency, loadgen.MAX_PROCESSES))
    latencies, errors, wall_s = loadgen.fan_out(
        _worker, [(address, model, dims, shape, binary, n, seconds) for n in loadgen.shares(concurrency, processes)],
        seconds, together=True, on_start=on_start, on_stop=on_stop)
    return loadgen.summary(latencies, errors, wall_s) | {"requests": len(latencies)}
