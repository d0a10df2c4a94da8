"""`python -m bench.native_floor [server flags]`: a C++ gRPC server answering zeros, the native floor.

The native data plane (server.native, attnserve.server._native) with its zeros switch on: the
same callback server, proto, parsing and contract checks, and every ModelInfer answered with
zeros of the right shapes in the handler itself, Python never called. What a load generator
measures against it is what gRPC's C++ core costs per call on this machine, the floor under any
native data plane; bench.floor is the same for the Python stack. ModelMetadata, ModelConfig and
ModelStatistics answer from the tables the real server would make (perf_analyzer asks them).
Writes --ready-file with {"grpc_port": the native port} and serves until SIGTERM or SIGINT.

`--handoff` (first): each call is answered from one thread of the plane's own instead of gRPC's,
as the native plane's runner threads answer: the floor plus the cost of that handoff.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from attnserve.server.__main__ import configure_logging, start_on_huge_pages
from attnserve.server.config import load_config
from attnserve.server.engine import DeviceChoice
from attnserve.server.lifecycle import Draining
from attnserve.server.memory import heap
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelRegistry
from attnserve.server.native import NativePlane, why_unavailable
from attnserve.server.request_path import RequestPath

from attnserve.files import write_json_atomic
from bench.floor import zeros


def zeros_plane(config) -> NativePlane:
    """The native plane answering zeros for `config`'s models, not started."""
    metrics = Metrics()
    # Batches "computed" by zeros: no ONNX Runtime session is opened for the tables' sake.
    registry = ModelRegistry.from_repository(config, DeviceChoice(("CPUExecutionProvider",), None), metrics,
                                             run_batch=zeros)
    return NativePlane(config, registry, RequestPath(registry, metrics, Draining()), zeros=True)


async def serve(config, handoff: bool = False) -> int:
    why = why_unavailable()
    if why is not None:
        print(f"python -m bench.native_floor: {why}", file=sys.stderr)
        return 2
    plane = zeros_plane(config)
    if handoff:
        plane.answer_from_own_thread()
    port = plane.start()
    if config.ready_file is not None:
        write_json_atomic(config.ready_file, {"grpc_port": port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.to_thread(plane.stop, 1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    handoff = argv[:1] == ["--handoff"]
    config = load_config(argv[handoff:], prog="python -m bench.native_floor")
    configure_logging(config)
    start_on_huge_pages()  # the server's heap settings (server.memory.heap): its answers are as large
    heap.configure_allocator()
    return asyncio.run(serve(config, handoff))


if __name__ == "__main__":
    sys.exit(main())
