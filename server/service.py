"""The Open Inference Protocol servicer: gRPC's adapter over server.request_path (decode -> submit
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
from attnserve.server import codec
from attnserve.server.errors import CANCELLED, Status, abort
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.request_path import RequestPath
from attnserve.server.security import relayed_call
from attnserve.server.tracing import Call, carrier_of

# Requests of one ModelStreamInfer stream in the server at once; reading pauses beyond it.
STREAM_WINDOW = 64
# The share of the memory budget one stream's unsent answers may hold before its reading pauses
# (one request always goes): a stream that stops reading holds no more.
STREAM_BUDGET_SHARE = 0.25


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
    def __init__(self, request_path: RequestPath, budget: MemoryBudget | None = None, relayed: bool = False) -> None:
        """request_path: the request path both transports share (server.request_path).
        budget: the server's memory budget; a stream's share of it is bounded here.
        relayed: calls come from the native data plane's relay (server.security.relayed_call)."""
        self._request_path = request_path
        self._relayed = relayed
        self._stream_share = None if budget is None else int(budget.limit_bytes * STREAM_BUDGET_SHARE)

    # -- health and metadata -----------------------------------------------------------------

    @_mapped_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_mapped_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._request_path.server_ready())

    @_mapped_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self._request_path.model_ready(request.name, request.version))

    @_mapped_errors
    async def ServerMetadata(self, request, context):
        return self._request_path.server_metadata()

    @_mapped_errors
    async def ModelMetadata(self, request, context):
        return self._request_path.model_metadata(request.name, request.version)

    @_mapped_errors
    async def ModelConfig(self, request, context):
        return self._request_path.model_config(request.name, request.version)

    @_mapped_errors
    async def RepositoryIndex(self, request, context):
        return self._request_path.repository_index(request.repository_name, request.ready)

    @_mapped_errors
    async def RepositoryModelLoad(self, request, context):
        await self._request_path.load(request.repository_name, request.model_name)
        return pb.RepositoryModelLoadResponse()

    @_mapped_errors
    async def RepositoryModelUnload(self, request, context):
        await self._request_path.unload(request.repository_name, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    @_mapped_errors
    async def ModelStatistics(self, request, context):
        return self._request_path.model_statistics(request.name, request.version)

    # -- shared memory (Triton's extension; server.shm) ----------------------------------------

    @_mapped_errors
    async def SystemSharedMemoryStatus(self, request, context):
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self._request_path.shm_status(request.name):
            response.regions[region.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size))
        return response

    @_mapped_errors
    async def SystemSharedMemoryRegister(self, request, context):
        self._request_path.shm_register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_mapped_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        self._request_path.shm_unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_mapped_errors
    async def CudaSharedMemoryStatus(self, request, context):
        self._request_path.cuda_shm()

    @_mapped_errors
    async def CudaSharedMemoryRegister(self, request, context):
        self._request_path.cuda_shm()

    @_mapped_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        self._request_path.cuda_shm()

    # -- inference ---------------------------------------------------------------------------

    async def _answered(self, request: codec.InferRequest | pb.ModelInferRequest, context, call: Call | None = None
                        ) -> tuple[codec.InferResponse | None, Status]:
        return await self._request_path.infer(request, context.time_remaining(), call)

    def _call(self, method: str, request: codec.InferRequest | pb.ModelInferRequest, context) -> Call | None:
        """The call's record (span, access line: server.tracing), or None when nothing is recorded."""
        calls = self._request_path.calls
        if calls is None:
            return None
        peer, method = relayed_call(context, self._relayed, method)
        return calls.begin("grpc", method, peer, carrier_of(context.invocation_metadata()), _request_bytes(request))

    async def ModelInfer(self, request, context):
        call = self._call("ModelInfer", request, context)
        response, status = await self._answered(request, context, call)
        if response is None:
            # context.abort raises, and gRPC's handler keeps the exception in a reference cycle
            # with this call's frames, which hold the request, until the cyclic collector runs:
            # every refused large call would keep its tensors that long.
            _drop_contents(request)
            del request
            await context.abort(status.code, status.details)
        # The answer stays counted in the memory budget until the call is over: sent (a client
        # that does not read holds it until its deadline or its connection ends), or cancelled.
        if call is None:
            context.add_done_callback(lambda _context: response.release())
        else:
            size = _response_bytes(response)

            def done(context) -> None:
                response.release()
                call.finish(CANCELLED if context.cancelled() else status, size)

            context.add_done_callback(done)
        return response

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests are read and submitted as they arrive, so the requests of one stream batch
        together (up to STREAM_WINDOW in the server at once); answers go back in request order.
        An error answers its request and the stream goes on; a message that does not parse
        ends the stream with INVALID_ARGUMENT after the answers before it."""
        answers: asyncio.Queue[asyncio.Future | None] = asyncio.Queue(maxsize=STREAM_WINDOW)
        held = _StreamHold(self._stream_share)
        reader = asyncio.create_task(self._read_stream(request_iterator, context, answers, held))
        try:
            while (answer := await answers.get()) is not None:
                message, response = await answer
                try:
                    yield message  # resumes once gRPC has written it (HTTP/2 flow control)
                finally:
                    held.release(response)
            await reader  # raises what ended the reading, if anything did
        finally:
            reader.cancel()
            while not answers.empty():
                pending = answers.get_nowait()
                if pending is None:
                    continue
                if pending.done() and not pending.cancelled() and pending.exception() is None:
                    held.release(pending.result()[1])
                pending.cancel()

    async def _read_stream(self, request_iterator, context, answers: asyncio.Queue, held: _StreamHold) -> None:
        try:
            async for request in request_iterator:
                held.read()
                await answers.put(asyncio.ensure_future(self._stream_answer(request, context, held)))
                await held.room()  # this stream's share of the memory budget is full: stop reading
        finally:
            await answers.put(None)

    async def _stream_answer(self, request: codec.InferRequest | pb.ModelInferRequest, context, held: _StreamHold
                             ) -> tuple[pb.ModelStreamInferResponse, codec.InferResponse | None]:
        call = self._call("ModelStreamInfer", request, context)
        try:
            response, status = await self._answered(request, context, call)
        except BaseException:
            held.answered(None)
            raise
        held.answered(response)  # no longer in flight: held, until written
        if response is None:  # the stream goes on
            return pb.ModelStreamInferResponse(
                error_message=status.stream_message(),
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id)), None
        message = pb.ModelStreamInferResponse(infer_response=response.as_message())
        if call is not None:
            call.finish(status, message.ByteSize())
        return message, response


def _request_bytes(request: codec.InferRequest | pb.ModelInferRequest) -> int:
    if isinstance(request, codec.InferRequest):
        return request.message.ByteSize() + sum(len(raw) for raw in request.raw_input_contents)
    return request.ByteSize()


def _response_bytes(response: codec.InferResponse) -> int:
    return response.message.ByteSize() + sum(array.nbytes for array in response.raw_output_contents)


def _drop_contents(request: codec.InferRequest | pb.ModelInferRequest) -> None:
    if isinstance(request, codec.InferRequest):
        request.drop_contents()
    else:
        request.Clear()


class _StreamHold:
    """The memory one stream holds, against its share of the budget: its answers computed and
    not yet written, and its requests in flight, each counted at the largest reservation this
    stream has had (until one is known, a request is read only when none is in flight). Its
    reading pauses while they would hold more than the share (one request always goes): a stream
    that stops reading holds at most its share and one request, and other clients are served."""

    def __init__(self, share_bytes: int | None) -> None:
        self._share = share_bytes
        self._held: dict[int, int] = {}  # id(answer) -> its reserved bytes
        self._bytes = 0
        self._in_flight = 0  # requests read and not answered yet
        self._cost = 0  # the largest reservation of this stream's answers so far
        self._changed = asyncio.Event()

    def read(self) -> None:
        """A request was read: in flight until answered (answered())."""
        self._in_flight += 1

    def answered(self, answer: codec.InferResponse | None) -> None:
        """A request in flight is answered (`answer`, or None for an error): its answer held."""
        self._in_flight -= 1
        if answer is not None and answer.reservation is not None:
            self._held[id(answer)] = answer.reservation.nbytes
            self._bytes += answer.reservation.nbytes
            self._cost = max(self._cost, answer.reservation.nbytes)
        self._changed.set()

    def release(self, answer: codec.InferResponse | None) -> None:
        if answer is None:
            return
        answer.release()
        self._bytes -= self._held.pop(id(answer), 0)
        self._changed.set()

    def _full(self) -> bool:
        if self._share is None:
            return False
        if self._bytes > self._share:
            return True
        if not self._in_flight:
            return False
        return self._cost == 0 or self._bytes + self._in_flight * self._cost > self._share

    async def room(self) -> None:
        while self._full():
            self._changed.clear()
            await self._changed.wait()
