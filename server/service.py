"""The Open Inference Protocol servicer: gRPC's adapter over server.answers (decode -> submit
-> encode, shared with the REST port); errors -> server.errors.

Also Triton's ModelConfig, ModelStatistics and RepositoryIndex extensions, which perf_analyzer
and tritonclient call. Every error becomes its status in server.errors: `_mapped_errors` for
the metadata RPCs, `_answered` for each inference request (ModelInfer's, and each of a stream's).
"""

from __future__ import annotations

import asyncio
import functools

from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.answers import Answers
from attnserve.server.errors import Status, abort

# Requests of one ModelStreamInfer stream in the server at once; reading pauses beyond it.
STREAM_WINDOW = 64


def _mapped_errors(rpc):
    """A unary RPC whose errors end the call with their status (server.errors)."""

    @functools.wraps(rpc)
    async def handler(self, request, context):
        try:
            return await rpc(self, request, context)
        except Exception as err:
            await abort(context, err)

    return handler


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, answers: Answers) -> None:
        """answers: the request path both transports share (server.answers)."""
        self._answers = answers

    # -- health and metadata -----------------------------------------------------------------

    @_mapped_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_mapped_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._answers.server_ready())

    @_mapped_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self._answers.model_ready(request.name, request.version))

    @_mapped_errors
    async def ServerMetadata(self, request, context):
        return self._answers.server_metadata()

    @_mapped_errors
    async def ModelMetadata(self, request, context):
        return self._answers.model_metadata(request.name, request.version)

    @_mapped_errors
    async def ModelConfig(self, request, context):
        return self._answers.model_config(request.name, request.version)

    @_mapped_errors
    async def RepositoryIndex(self, request, context):
        return self._answers.repository_index(request.repository_name, request.ready)

    @_mapped_errors
    async def RepositoryModelLoad(self, request, context):
        await self._answers.load(request.repository_name, request.model_name)
        return pb.RepositoryModelLoadResponse()

    @_mapped_errors
    async def RepositoryModelUnload(self, request, context):
        await self._answers.unload(request.repository_name, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    @_mapped_errors
    async def ModelStatistics(self, request, context):
        return self._answers.model_statistics(request.name, request.version)

    # -- inference ---------------------------------------------------------------------------

    async def _answered(self, request: codec.InferRequest | pb.ModelInferRequest, context
                        ) -> tuple[codec.InferResponse | None, Status]:
        return await self._answers.infer(request, context.time_remaining())

    async def ModelInfer(self, request, context):
        response, status = await self._answered(request, context)
        if response is None:
            await context.abort(status.code, status.details)
        return response

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests are read and submitted as they arrive, so the requests of one stream batch
        together (up to STREAM_WINDOW in the server at once); answers go back in request order.
        An error answers its request and the stream goes on; a message that does not parse
        ends the stream with INVALID_ARGUMENT after the answers before it."""
        answers: asyncio.Queue[asyncio.Future | None] = asyncio.Queue(maxsize=STREAM_WINDOW)
        reader = asyncio.create_task(self._read_stream(request_iterator, context, answers))
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
            await reader  # raises what ended the reading, if anything did
        finally:
            reader.cancel()
            while not answers.empty():
                pending = answers.get_nowait()
                if pending is not None:
                    pending.cancel()

    async def _read_stream(self, request_iterator, context, answers: asyncio.Queue) -> None:
        try:
            async for request in request_iterator:
                await answers.put(asyncio.ensure_future(self._stream_answer(request, context)))
        finally:
            await answers.put(None)

    async def _stream_answer(self, request: codec.InferRequest | pb.ModelInferRequest, context) -> pb.ModelStreamInferResponse:
        response, status = await self._answered(request, context)
        if response is None:  # the stream goes on
            return pb.ModelStreamInferResponse(
                error_message=status.stream_message(),
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id))
        return pb.ModelStreamInferResponse(infer_response=response.as_message())
