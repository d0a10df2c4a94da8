"""Which asynchronous HTTP library costs the server less per request: aiohttp or uvicorn+starlette.

    python bench/http_library.py [--requests 20000] [--concurrency 8]

Runs the same small handler (a POST whose JSON body is parsed and answered, as a REST
inference call's envelope is) under each library in its own process, on the plain asyncio
event loop the gRPC server runs on (no uvloop), and drives it from a separate process with
aiohttp's client over keep-alive connections. Reports the server process's CPU time per request
(user + system, from /proc: what the library costs on the loop it shares with gRPC, whatever
else the machine is doing) and the throughput. Needs aiohttp, uvicorn, httptools and starlette
in the interpreter that runs it (not attnserve's dependencies: run it from a scratch venv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

BODY = json.dumps({"id": "1", "inputs": [{"name": "query", "shape": [1, 2, 2], "datatype": "FP32",
                                         "data": [0.5, 1.5, 2.5, 3.5]}]}).encode()
PATH = "/v2/models/m/infer"


def _answer(document: dict) -> bytes:
    return json.dumps({"model_name": "m", "id": document.get("id", ""), "outputs": document["inputs"]}).encode()


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        return web.Response(body=_answer(json.loads(await request.read())), content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post(PATH, infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_starlette(port: int, http: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request) -> Response:
        return Response(_answer(json.loads(await request.body())), media_type="application/json")

    app = Starlette(routes=[Route(PATH, infer, methods=["POST"])])

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="none", http=http,
                                               access_log=False, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await task

    asyncio.run(main())


async def drive(port: int, requests: int, concurrency: int) -> float:
    import aiohttp

    url = f"http://127.0.0.1:{port}{PATH}"
    left = requests

    async def worker(session) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200, r.status
                await r.read()

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))  # warm-up too
        left = requests
        started = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.monotonic() - started


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(library: str, requests: int, concurrency: int) -> dict[str, float]:
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", library, "--port", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        asyncio.run(drive(port, 500, concurrency))  # warm-up: connections, caches
        before = _cpu_s(server.pid)
        wall = asyncio.run(drive(port, requests, concurrency))
        cpu = _cpu_s(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    return {"server_cpu_us_per_request": cpu / requests * 1e6, "requests_per_s": requests / wall}


LIBRARIES = ("aiohttp", "starlette+uvicorn[httptools]", "starlette+uvicorn[h11]")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    p.add_argument("--serve", choices=LIBRARIES, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve == "aiohttp":
        serve_aiohttp(args.port)
        return 0
    if args.serve:
        serve_starlette(args.port, "httptools" if "httptools" in args.serve else "h11")
        return 0
    import aiohttp  # noqa: E401 (their versions, for the report)
    import starlette
    import uvicorn

    print(f"aiohttp {aiohttp.__version__}, uvicorn {uvicorn.__version__}, starlette {starlette.__version__}; "
          f"{args.requests} requests per round at concurrency {args.concurrency}; load {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict[str, float]]] = {lib: [] for lib in LIBRARIES}
    for _ in range(args.rounds):
        for lib in LIBRARIES:
            results[lib].append(measure(lib, args.requests, args.concurrency))
    for lib, runs in results.items():
        cpu = sorted(r["server_cpu_us_per_request"] for r in runs)[len(runs) // 2]
        rps = sorted(r["requests_per_s"] for r in runs)[len(runs) // 2]
        print(f"{lib:>30}: server CPU {cpu:6.1f} us/request, {rps:7.0f} requests/s (median of {len(runs)})")
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
