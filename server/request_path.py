"""What the server answers, whichever transport asked: the Open Inference Protocol's messages.

    request_path = RequestPath(registry, metrics, draining)
    request_path.server_ready()                            # health: bool
    request_path.model_metadata(name, version)            # pb.ModelMetadataResponse (and config, stats, index)
    response, status = await request_path.infer(request, time_remaining_s)  # decode -> batcher -> encode
    # cancelled: counted by why (cancel_reason: CLIENT, DISCONNECT for REST; DEADLINE) and where
    response.release()                                # once sent: its memory budget share back

Both transports are thin adapters over this one request path: the gRPC servicer (server.service)
returns these messages as they are; the REST port (server.rest) turns its JSON into a
pb.ModelInferRequest and these messages into JSON (server.rest_codec). Errors are raised as the
layers below raise them (ModelNotFound, ValueError, ...), except infer's, which come back as the
Status of server.errors with the outcome counted in the metrics.
"""

from __future__ import annotations

import asyncio
import time

from attnserve.proto import inference_pb2 as pb
from attnserve.server import __version__, codec, scheduling, shm
from attnserve.server.batcher import Stage
from attnserve.server.errors import CANCELLED, OK, Status, status_for
from attnserve.server.lifecycle import Draining
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelNotFound, ModelRegistry
from attnserve.server.quoting import quoted
from attnserve.server.repository import ModelSpec
from attnserve.server.tracing import Call, Calls

from attnserve.contract import TensorSpec

SERVER_NAME = "attnserve"
# "model_repository" also means load/unload; binary_tensor_data is the REST port's.
EXTENSIONS = ("model_configuration", "statistics", "model_repository", "binary_tensor_data")
SYSTEM_SHARED_MEMORY = "system_shared_memory"  # listed only with --allow-shared-memory
# Listed only with --data-plane native: a client (or a test) can tell which plane serves ModelInfer.
NATIVE_DATA_PLANE = "native_data_plane"
_DATA_TYPES = {"FP32": pb.TYPE_FP32, "BOOL": pb.TYPE_BOOL}
# Why a call was cancelled (attnserve_cancelled_requests_total's reason): its client cancelled it
# (gRPC), its deadline passed, its REST client closed the connection.
CLIENT, DEADLINE, DISCONNECT = "client", "deadline", "disconnect"
# Where, besides the batcher's stages (batcher.Stage): computed, the client gone before it was sent.
ANSWERED = "answered"
# A gRPC client's deadline runs out before the server's (which starts when the call arrives): the
# client's cancel at its deadline comes this early or less; a cancel that close to it counts as it.
_DEADLINE_SLACK_S = 0.5


def _tensor_metadata(t: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)


def _duration(d) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class RequestPath:
    def __init__(self, registry: ModelRegistry, metrics: Metrics, draining: Draining,
                 calls: Calls | None = None, shared_memory: shm.SystemSharedMemory | None = None,
                 data_plane: str = "python", why_no_cuda_shm: str | None = None) -> None:
        """draining: the server's (shared with the gates): not ready from SIGTERM on.
        calls: what each call records (spans, access lines: server.tracing); None: nothing.
        shared_memory: the registered regions (--allow-shared-memory); None: the extension is off.
        data_plane: --data-plane; "native" is listed in ServerMetadata's extensions (NATIVE_DATA_PLANE).
        why_no_cuda_shm: what the CUDA shared memory calls answer (shm.why_no_cuda)."""
        self._why_no_cuda_shm = why_no_cuda_shm or shm.why_no_cuda(on_cuda=False)
        self._registry = registry
        self._metrics = metrics
        self._draining = draining
        self.calls = calls if calls is not None and calls.on else None
        self.shared_memory = shared_memory
        self.data_plane = data_plane

    # -- health and metadata -----------------------------------------------------------------

    def server_ready(self) -> bool:
        return not self._draining.active and bool(self._registry.ready_names())

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for a model that failed to load, or while draining; ModelNotFound if unknown."""
        return self._registry.ready(name, version) and not self._draining.active

    def server_metadata(self) -> pb.ServerMetadataResponse:
        extensions = EXTENSIONS + ((SYSTEM_SHARED_MEMORY,) if self.shared_memory is not None else ()) + (
            (NATIVE_DATA_PLANE,) if self.data_plane == "native" else ())
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=extensions)

    # -- shared memory (Triton's extension; server.shm) ----------------------------------------

    def _regions(self) -> shm.SystemSharedMemory:
        if self.shared_memory is None:
            raise shm.SharedMemoryUnavailable(shm.WHY_OFF)
        return self.shared_memory

    def shm_status(self, name: str = "") -> list[shm.RegionStatus]:
        return self._regions().status(name)

    def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._regions().register(name, key, offset, byte_size)

    def shm_unregister(self, name: str = "") -> None:
        self._regions().unregister(name)

    def cuda_shm(self) -> None:
        """CUDA shared memory is not served by this build: always SharedMemoryUnavailable, saying why."""
        raise shm.SharedMemoryUnavailable(self._why_no_cuda_shm)

    def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        spec = self._registry.get(name, version).spec
        versions = [version] if version else [str(v) for v in self._registry.versions(spec.name)]
        return pb.ModelMetadataResponse(
            name=spec.name, versions=versions, platform=spec.platform,
            inputs=[_tensor_metadata(t) for t in spec.inputs], outputs=[_tensor_metadata(t) for t in spec.outputs])

    def spec(self, name: str, version: str = "") -> ModelSpec:
        """The model's spec (ModelNotFound if unknown)."""
        return self._registry.get(name, version).spec

    def model_config(self, name: str, version: str = "") -> pb.ModelConfigResponse:
        spec = self._registry.get(name, version).spec
        config = pb.ModelConfig(
            name=spec.name, platform=spec.platform, backend="onnxruntime",
            max_batch_size=0,  # the batch dim is explicit in every shape; the server batches itself
            input=[pb.ModelInput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape, optional=t.optional)
                   for t in spec.inputs],
            output=[pb.ModelOutput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape)
                    for t in spec.outputs],
            dynamic_batching=_dynamic_batching(spec.queue_policy))
        return pb.ModelConfigResponse(config=config)

    def repository_index(self, repository_name: str = "", ready_only: bool = False) -> pb.RepositoryIndexResponse:
        """Every model version the server knows: READY, or UNAVAILABLE with the reason (failed
        to load, unloaded, not loaded); ready_only: the ready ones only."""
        _check_repository(repository_name)
        response = pb.RepositoryIndexResponse()
        for entry in self._registry.index(ready_only=ready_only):
            response.models.add(name=entry.name, version=entry.version, state=entry.state, reason=entry.reason)
        return response

    async def load(self, repository_name: str, model_name: str) -> None:
        """Load (or reload: a new version swaps in without a failed call) one model."""
        _check_repository(repository_name)
        await self._registry.load(model_name)

    async def unload(self, repository_name: str, model_name: str) -> None:
        _check_repository(repository_name)
        await self._registry.unload(model_name)

    def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        names = [name] if name else self._registry.ready_names()
        response = pb.ModelStatisticsResponse()
        for name in names:
            spec = self._registry.get(name, version).spec
            s = self._metrics.model_statistics(name)  # every worker's, summed
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

    async def _infer(self, request: codec.InferRequest | pb.ModelInferRequest, deadline: float | None,
                     call: Call | None, stage: Stage) -> codec.InferResponse:
        # Draining is decided per call when its headers arrive (server.gate, server.rest), not
        # here: a call admitted before SIGTERM is served even if its message arrives after. No
        # await before submit: lifecycle.Arrivals counts a request as on its way until its
        # handler starts, and the batcher must find it queued from then on.
        if call is not None:
            call.request(request.model_name, request.model_version, request.id)
        model = self._registry.get(request.model_name, request.model_version)
        # Triton's schedule policy (`priority`, `timeout`): checked before any tensor is read.
        schedule = scheduling.request_schedule(request.parameters, model.spec.queue_policy)
        lease = self.shared_memory.lease() if self.shared_memory is not None else None
        result = None
        try:
            decoded = codec.decode(request, model.spec, model.limits, lease)
            # The earlier of the call's deadline and its schedule `timeout` (refused unrun once passed).
            if schedule.timeout_s is not None:
                deadline = scheduling.earliest(deadline, time.monotonic() + schedule.timeout_s)
            if call is None:
                result = await model.batcher.submit(decoded.work, deadline, priority=schedule.priority, stage=stage)
            else:
                call.decoded(decoded.work)
                result = await model.batcher.submit(decoded.work, deadline, call.span, schedule.priority, stage)
                call.computed(result.queue_s, result.compute_s, result.batch_requests, model.spec.version)
            stage.name = ANSWERED
            try:
                if decoded.shm_outputs:  # the batch wrote them into the region (server.tensors.compute_batch)
                    if not decoded.work.written:
                        raise RuntimeError("the batch returned without writing the outputs into their region")
                    refused = decoded.shm_refusal()  # the object shrunk under the region: this request alone
                    if refused is not None:
                        raise refused
                    self._metrics.shared_memory_outputs(decoded.work.written, len(decoded.shm_outputs))
                response = codec.encode(request, decoded, result, model.spec.version)
                if call is not None:
                    call.encoded()
                return response
            except BaseException:
                result.release()  # its memory reservation: no answer will carry it
                raise
        finally:
            if lease is not None:
                answered = result is not None  # its batch is done with its buffers: they are reused
                decoded = result = None
                lease.release(answered)

    def _metric_label(self, model_name: str) -> str:
        # Only known names become label values: a client must not grow the metrics without bound.
        return model_name if self._registry.known(model_name) else "_unknown"

    async def infer(self, request: codec.InferRequest | pb.ModelInferRequest, time_remaining: float | None,
                    call: Call | None = None, cancel_reason: str = CLIENT) -> tuple[codec.InferResponse | None, Status]:
        """One inference request: its response and OK, or None and the status for what was
        raised. Its outcome is counted in the metrics either way; cancelled (the client went
        away), it is counted as CANCELLED, and by why (`cancel_reason`, or DEADLINE at or near
        the deadline) and where it was, and the cancellation goes on. The caller calls the
        response's `release()` once it is sent: until then it is counted in the memory budget.
        call (from self.calls.begin): recorded; finished here unless OK (then the transport
        finishes it once the answer is sent, with its size)."""
        started = time.monotonic()
        deadline = None if time_remaining is None else started + time_remaining
        stage = Stage()
        status = CANCELLED
        try:
            response = await self._infer(request, deadline, call, stage)
            status = OK
            return response, status
        except asyncio.CancelledError:
            near = deadline is not None and time.monotonic() >= deadline - _DEADLINE_SLACK_S
            reason = DEADLINE if near else cancel_reason
            self._metrics.request_cancelled(self._metric_label(request.model_name), reason, stage.name)
            raise
        except Exception as err:
            status = status_for(err)
            return None, status
        finally:
            self.request_done(request.model_name, status, started, call if status is not OK else None)

    def request_done(self, model_name: str, status: Status, started: float, call: Call | None = None) -> None:
        """Count one inference request's outcome (also a REST one refused before it parsed);
        `call`, if given, is over: finished with this status."""
        self._metrics.request_done(self._metric_label(model_name), status.code.name, time.monotonic() - started)
        if call is not None:
            if not call.model:
                call.model = model_name
            call.finish(status)


def _dynamic_batching(policy: scheduling.QueuePolicy) -> pb.ModelDynamicBatching:
    """config.json's dynamic_batching as Triton's ModelConfig reports it (defaults filled in)."""
    return pb.ModelDynamicBatching(
        priority_levels=policy.priority_levels, default_priority_level=policy.default_priority_level,
        default_queue_policy=pb.ModelQueuePolicy(timeout_action=pb.ModelQueuePolicy.REJECT,
                                                 default_timeout_microseconds=policy.default_timeout_us,
                                                 allow_timeout_override=policy.allow_timeout_override))


def _check_repository(name: str) -> None:
    if name:
        raise ModelNotFound(f"unknown repository {quoted(name)}: this server serves one, "
                            "ask with an empty repository_name")
