"""`python -m bench.aio_floor [server flags]`: a bare grpc.aio server answering zeros, the Python floor.

No gate, batcher, codec or metrics: a `GRPCInferenceServiceServicer` on grpc.aio whose ModelInfer
parses the request (protobuf, as grpc.aio does for any servicer) and answers zeros of the
model's output shapes as raw contents. What a load generator measures against it is what
grpc.aio itself costs per call, the ceiling of any Python data plane on this machine (issue 26's
"bare grpc.aio" row); bench.native_floor is the same for gRPC's C++ core. ModelMetadata,
ModelConfig and ModelStatistics answer from the tables the real server would make (perf_analyzer
asks them). Writes --ready-file with {"grpc_port": port} and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys

import grpc
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.__main__ import configure_logging, start_on_huge_pages
from attnserve.server.config import load_config
from attnserve.server.engine import DeviceChoice
from attnserve.server.lifecycle import Draining
from attnserve.server.memory import heap
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelRegistry
from attnserve.server.repository import ModelSpec
from attnserve.server.request_path import RequestPath

from attnserve.files import write_json_atomic
from bench.floor import zeros


def zero_answer(request: pb.ModelInferRequest, spec: ModelSpec) -> pb.ModelInferResponse:
    """Zeros of the shapes the graph would return for `request`'s query and key, for the outputs
    it asks for (all of them when it names none)."""
    shapes = {i.name: list(i.shape) for i in request.inputs}
    b, lq, _ = shapes["query"]  # batch, query length, query_dim
    lk = shapes["key"][1]  # key length
    wanted = [o.name for o in request.outputs] or ["output", "attn_probs"]
    answer = pb.ModelInferResponse(model_name=spec.name, model_version=str(spec.version), id=request.id)
    for name in wanted:
        shape = [b, lq, spec.out_dim] if name == "output" else [b, spec.num_heads, lq, lk]
        answer.outputs.add(name=name, datatype="FP32", shape=shape)
        answer.raw_output_contents.append(bytes(4 * math.prod(shape)))
    return answer


class ZerosServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs perf_analyzer calls; every other one is grpc's UNIMPLEMENTED."""

    def __init__(self, path: RequestPath) -> None:
        self._path = path

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return self._path.server_metadata()

    async def ModelMetadata(self, request, context):
        return self._path.model_metadata(request.name, request.version)

    async def ModelConfig(self, request, context):
        return self._path.model_config(request.name, request.version)

    async def ModelStatistics(self, request, context):
        return self._path.model_statistics(request.name, request.version)

    async def ModelInfer(self, request, context):
        return zero_answer(request, self._path.spec(request.model_name, request.model_version))


async def serve(config) -> int:
    # Batches "computed" by zeros: no ONNX Runtime session is opened for the tables' sake.
    metrics = Metrics()
    registry = ModelRegistry.from_repository(config, DeviceChoice(("CPUExecutionProvider",), None), metrics,
                                             run_batch=zeros)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_message_bytes),
                                      ("grpc.max_send_message_length", config.max_message_bytes)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(ZerosServicer(RequestPath(registry, metrics, Draining())),
                                                       server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    if config.ready_file is not None:
        write_json_atomic(config.ready_file, {"grpc_port": port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    config = load_config(argv, prog="python -m bench.aio_floor")
    configure_logging(config)
    start_on_huge_pages()  # the server's heap settings (server.memory.heap): its answers are as large
    heap.configure_allocator()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
