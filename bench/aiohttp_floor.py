"""`python -m bench.aiohttp_floor`: a bare aiohttp server answering REST inference with zeros.

The REST analogue of bench.aio_floor: `POST /v2/models/{model}/infer` with binary tensor data
(or JSON) is read, its JSON header parsed, and zeros of the model's output shapes sent back as
binary data. No gate, batcher, codec or metrics: what aiohttp itself costs per call on the plain
asyncio loop, to set beside the server's REST port (bench.goals, "REST: the decision" in
docs/record/rest.md). It answers inference only, so it is driven by bench.rest_loadgen,
not perf_analyzer. Writes --ready-file with {"http_port": port} and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
from pathlib import Path

from aiohttp import web
from attnserve.server.repository import model_names, read_model_spec

from attnserve.files import write_json_atomic

HEADER_LENGTH = "Inference-Header-Content-Length"


def zero_outputs(document: dict, out_dim: int, num_heads: int) -> list[tuple[str, list[int]]]:
    """The outputs a request asks for (both when it names none), with their shapes."""
    shapes = {i["name"]: i["shape"] for i in document["inputs"]}
    b, lq, _ = shapes["query"]  # batch, query length, query_dim
    lk = shapes["key"][1]  # key length
    wanted = [o["name"] for o in document.get("outputs", [])] or ["output", "attn_probs"]
    return [(n, [b, lq, out_dim] if n == "output" else [b, num_heads, lq, lk]) for n in wanted]


def app(repository: Path) -> web.Application:
    specs = {name: read_model_spec(repository / name) for name in model_names(repository)}

    async def infer(request: web.Request) -> web.Response:
        spec = specs[request.match_info["model"]]
        body = await request.read()
        length = int(request.headers.get(HEADER_LENGTH, len(body)))
        outputs = zero_outputs(json.loads(body[:length]), spec.out_dim, spec.num_heads)
        header = json.dumps({"model_name": spec.name, "model_version": str(spec.version), "outputs": [
            {"name": n, "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": 4 * math.prod(shape)}}
            for n, shape in outputs]}).encode()
        data = header + bytes(sum(4 * math.prod(shape) for _, shape in outputs))
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(len(header))})

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_post("/v2/models/{model}/infer", infer)
    return application


async def serve(repository: Path, host: str, port: int, ready_file: Path | None) -> int:
    runner = web.AppRunner(app(repository), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    if ready_file is not None:
        write_json_atomic(ready_file, {"http_port": bound})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aiohttp_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-repository", type=Path, default=Path("models"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", type=Path)
    args = p.parse_args(argv)
    return asyncio.run(serve(args.model_repository, args.host, args.port, args.ready_file))


if __name__ == "__main__":
    sys.exit(main())
