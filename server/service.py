"""The Open Inference Protocol servicer: decode -> submit -> encode; errors -> server.errors.

Also Triton's ModelConfig and ModelStatistics extensions, which perf_analyzer and tritonclient
call. Protobuf stops here: below this module everything is numpy. Every error becomes its
status in server.errors: `_mapped_errors` for the metadata RPCs, `_answered` for each inference
request (ModelInfer's, and each of a stream's).
"""

from __future__ import annotations

import asyncio
import functools
import time

from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import __version__, codec
from attnserve.server.echo import echo
from attnserve.server.errors import CANCELLED, OK, Status, abort, status_for
from attnserve.server.batcher import Result
from attnserve.server.lifecycle import Draining, MemoryBudget
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelNotFound, ModelRegistry
from attnserve.contract import TensorSpec

SERVER_NAME = "attnserve"
# Requests of one ModelStreamInfer stream in the server at once; reading pauses beyond it.
STREAM_WINDOW = 64
# The share of the memory budget one stream's requests and unsent answers may hold before its
# reading pauses (one request always goes): a stream that stops reading holds no more.
STREAM_BUDGET_SHARE = 0.25
EXTENSIONS = ("model_configuration", "statistics")  # "model_repository" also means load/unload
# Triton's model states, as RepositoryIndex reports them.
READY, UNAVAILABLE = "READY", "UNAVAILABLE"


def _mapped_errors(rpc):
    """A unary RPC whose errors end the call with their status (server.errors)."""

    @functools.wraps(rpc)
    async def handler(self, request, context):
        try:
            return await rpc(self, request, context)
        except Exception as err:
            await abort(context, err)

    return handler


_DATA_TYPES = {"FP32": pb.TYPE_FP32, "BOOL": pb.TYPE_BOOL}


def _tensor_metadata(t: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)


def _duration(d) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics, draining: Draining,
                 budget: MemoryBudget | None = None) -> None:
        """draining: the server's (shared with server.gate): not ready from SIGTERM on.
        budget: the server's memory budget; a stream's share of it is bounded here."""
        self._registry = registry
        self._metrics = metrics
        self._draining = draining
        self._stream_share = None if budget is None else int(budget.limit_bytes * STREAM_BUDGET_SHARE)

    # -- health and metadata -----------------------------------------------------------------

    @_mapped_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_mapped_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=not self._draining.active and bool(self._registry.loaded))

    @_mapped_errors
    async def ModelReady(self, request, context):
        ready = self._registry.ready(request.name, request.version)
        return pb.ModelReadyResponse(ready=ready and not self._draining.active)

    @_mapped_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    @_mapped_errors
    async def ModelMetadata(self, request, context):
        spec = self._registry.get(request.name, request.version).spec
        return pb.ModelMetadataResponse(
            name=spec.name, versions=[str(spec.version)], platform=spec.platform,
            inputs=[_tensor_metadata(t) for t in spec.inputs], outputs=[_tensor_metadata(t) for t in spec.outputs])

    @_mapped_errors
    async def ModelConfig(self, request, context):
        spec = self._registry.get(request.name, request.version).spec
        config = pb.ModelConfig(
            name=spec.name, platform=spec.platform, backend="onnxruntime",
            max_batch_size=0,  # the batch dim is explicit in every shape; the server batches itself
            input=[pb.ModelInput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape, optional=t.optional)
                   for t in spec.inputs],
            output=[pb.ModelOutput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape)
                    for t in spec.outputs])
        return pb.ModelConfigResponse(config=config)

    @_mapped_errors
    async def RepositoryIndex(self, request, context):
        """Every model of the repository: READY with its version, or UNAVAILABLE with the reason
        it failed to load (`ready: true` asks for the ready ones only)."""
        if request.repository_name:
            raise ModelNotFound(f"unknown repository {echo(request.repository_name)}: this server serves "
                                "one, ask with an empty repository_name")
        response = pb.RepositoryIndexResponse()
        for name in sorted({*self._registry.loaded, *self._registry.failed}):
            model = self._registry.loaded.get(name)
            if model is not None:
                response.models.add(name=name, version=str(model.spec.version), state=READY)
            elif not request.ready:
                response.models.add(name=name, state=UNAVAILABLE, reason=self._registry.failed[name])
        return response

    @_mapped_errors
    async def ModelStatistics(self, request, context):
        names = [request.name] if request.name else sorted(self._registry.loaded)
        response = pb.ModelStatisticsResponse()
        for name in names:
            spec = self._registry.get(name, request.version).spec
            s = self._metrics.statistics[name]
            response.model_stats.add(
                name=name, version=str(spec.version), last_inference=s.last_inference_ms,
                inference_count=s.inference_count, execution_count=s.execution_count,
                inference_stats=pb.InferStatistics(
                    success=_duration(s.success), fail=_duration(s.fail), queue=_duration(s.queue),
                    compute_input=_duration(s.compute_input), compute_infer=_duration(s.compute_infer),
                    compute_output=_duration(s.compute_output)),
                batch_stats=[pb.InferBatchStatistics(
                    batch_size=size, compute_input=_duration(d.compute_input),
                    compute_infer=_duration(d.compute_infer), compute_output=_duration(d.compute_output))
                    for size, d in sorted(s.batches.items())])
        return response

    # -- inference ---------------------------------------------------------------------------

    async def _infer(self, request: pb.ModelInferRequest, time_remaining: float | None
                     ) -> tuple[pb.ModelInferResponse, Result]:
        """The response, and the Result whose memory reservation the caller releases once the
        response is sent."""
        # Draining is decided per call when its headers arrive (server.gate), not here: a
        # call admitted before SIGTERM is served even if its message arrives after. No await
        # before submit: lifecycle.Arrivals counts a request as on its way until its handler
        # starts, and the batcher must find it queued from then on.
        model = self._registry.get(request.model_name, request.model_version)
        decoded = codec.decode(request, model.spec, model.limits)
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        result = await model.batcher.submit(decoded.work, deadline)
        try:
            return codec.encode(request, decoded, result, model.spec.version), result
        except BaseException:
            result.release()
            raise

    def _metric_label(self, model_name: str) -> str:
        # Only known names become label values: a client must not grow the metrics without bound.
        known = model_name in self._registry.loaded or model_name in self._registry.failed
        return model_name if known else "_unknown"

    async def _answered(self, request: pb.ModelInferRequest, context
                        ) -> tuple[pb.ModelInferResponse | None, Status, Result | None]:
        """One inference request: its response, OK and its Result (release its memory once the
        response is sent), or None, the status for what was raised and None. Its outcome is
        counted in the metrics either way; cancelled (the client went away), it is counted as
        CANCELLED and the cancellation goes on."""
        started = time.monotonic()
        status = CANCELLED
        try:
            response, result = await self._infer(request, context.time_remaining())
            status = OK
            return response, status, result
        except Exception as err:
            status = status_for(err)
            return None, status, None
        finally:
            self._metrics.request_done(self._metric_label(request.model_name), status.code.name,
                                       time.monotonic() - started)

    async def ModelInfer(self, request, context):
        response, status, result = await self._answered(request, context)
        if response is None:
            await context.abort(status.code, status.details)
        # The answer stays counted in the memory budget until the call is over: sent (a client
        # that does not read holds it until its deadline or its connection ends), or cancelled.
        context.add_done_callback(lambda _context: result.release())
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
                response, result = await answer
                try:
                    yield response  # resumes once gRPC has written it (HTTP/2 flow control)
                finally:
                    held.release(result)
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

    async def _read_stream(self, request_iterator, context, answers: asyncio.Queue, held: "_StreamHold") -> None:
        try:
            async for request in request_iterator:
                await answers.put(asyncio.ensure_future(self._stream_answer(request, context, held)))
                await held.room()  # this stream's share of the memory budget is full: stop reading
        finally:
            await answers.put(None)

    async def _stream_answer(self, request: pb.ModelInferRequest, context, held: "_StreamHold"
                             ) -> tuple[pb.ModelStreamInferResponse, Result | None]:
        response, status, result = await self._answered(request, context)
        if response is None:  # the stream goes on
            return pb.ModelStreamInferResponse(
                error_message=status.stream_message(),
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id)), None
        held.hold(result)
        return pb.ModelStreamInferResponse(infer_response=response), result


class _StreamHold:
    """The memory one stream's answers hold (computed, not yet written), against its share of
    the budget: its reading pauses while it holds more (one answer always goes)."""

    def __init__(self, share_bytes: int | None) -> None:
        self._share = share_bytes
        self._held: dict[int, int] = {}  # id(result) -> its reserved bytes
        self._bytes = 0
        self._changed = asyncio.Event()

    def hold(self, result: Result) -> None:
        if result.reservation is not None:
            self._held[id(result)] = result.reservation.nbytes
            self._bytes += result.reservation.nbytes

    def release(self, result: Result | None) -> None:
        if result is None:
            return
        result.release()
        self._bytes -= self._held.pop(id(result), 0)
        self._changed.set()

    async def room(self) -> None:
        while self._share is not None and self._bytes > self._share:
            self._changed.clear()
            await self._changed.wait()
