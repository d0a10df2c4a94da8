"""The synchronous client: numpy in, numpy out, one error type.

    with InferenceClient("127.0.0.1:8001,127.0.0.1:8002", timeout_s=10) as client:
        out = client.infer("self_attention", q, k, v, mask=m, outputs=("output", "attn_probs"))
        out["output"]       # (b, lq, out_dim) float32
        client.retry_count  # UNAVAILABLE (or server-CANCELLED) answers retried so far
        call = client.infer_async(...)   # InferCall: result(timeout), done(), cancel()
        with client.stream() as stream: stream.submit(...)  # ModelStreamInfer: a future each

Every RPC goes through `_call`: it applies the deadline (the client's default or the call's
`timeout_s`, covering all attempts), the bearer token, the retry policy (UNAVAILABLE, and CANCELLED
from the server: errors.RETRYABLE_CODES), and turns `grpc.RpcError` into
`InferenceError(code, details)`. Safe to share between threads.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from attnserve.client import codec
from attnserve.client.calls import InferCall
from attnserve.client.errors import InferenceError, remaining_or_expired
from attnserve.client.options import DEFAULT_URL, ClientOptions
from attnserve.client.pool import ChannelPool
from attnserve.client.stream import DEFAULT_MAX_IN_FLIGHT, InferStream
from attnserve.proto import inference_pb2 as pb
from grpc_health.v1 import health_pb2


class InferenceClient:
    """A channel to one or more servers (round robin), and the Open Inference Protocol calls.

    `InferenceClient(url, timeout_s=30.0, max_message_bytes=64 MiB, tls=TlsConfig(...),
    token="...", retry=RetryPolicy(...), channels=1, compression=None)`, or
    `InferenceClient(ClientOptions(...))`. `channels=N` opens N connections, one per call in turn
    (client.pool: reaches every worker of a `--workers` server); `compression="gzip"` compresses
    requests.
    """

    def __init__(self, url: str | ClientOptions = DEFAULT_URL, **settings: Any) -> None:
        self.options = ClientOptions.build(url, **settings)
        self._metadata = self.options.call_metadata()
        self._pool = ChannelPool(self.options)
        self._lock = threading.Lock()
        self._retries = 0
        self._closed = False  # a call close() cancelled is not sent again

    # -- lifecycle ---------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        for channel in self._pool.channels:
            channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def retry_count(self) -> int:
        """How many times a call was sent again (after UNAVAILABLE or CANCELLED), over this client's life."""
        with self._lock:
            return self._retries

    # -- the funnel --------------------------------------------------------

    def _budget(self, timeout_s: float | None) -> float:
        budget_s = self.options.timeout_s if timeout_s is None else timeout_s
        if not budget_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {budget_s}")
        return budget_s

    def _call(self, method: str, request: Any, timeout_s: float | None, *, retry: bool = True) -> Any:
        """method: "infer.<RPC>" or "health.<RPC>", called on the pool's next lane at each attempt."""
        budget_s = self._budget(timeout_s)
        deadline = time.monotonic() + budget_s
        rpc_of = operator.attrgetter(method)
        retries_done = 0
        while True:
            try:
                return rpc_of(self._pool.next())(request, timeout=remaining_or_expired(deadline, budget_s),
                                                metadata=self._metadata)
            except grpc.RpcError as err:
                error = InferenceError.from_rpc_error(err)
            delay = (self.options.retry.delay_before_retry(error, retries_done, deadline - time.monotonic())
                     if retry and not self._closed else None)
            if delay is None:
                raise error
            time.sleep(delay)
            retries_done += 1
            self._count_retry()

    def _count_retry(self) -> None:
        with self._lock:
            self._retries += 1

    # -- health and metadata -----------------------------------------------
    # Probes are not retried: they report the state now, which is what their callers ask.

    def server_live(self, *, timeout_s: float | None = None) -> bool:
        return self._call("infer.ServerLive", pb.ServerLiveRequest(), timeout_s, retry=False).live

    def server_ready(self, *, timeout_s: float | None = None) -> bool:
        return self._call("infer.ServerReady", pb.ServerReadyRequest(), timeout_s, retry=False).ready

    def model_ready(self, model: str, version: str = "", *, timeout_s: float | None = None) -> bool:
        request = pb.ModelReadyRequest(name=model, version=version)
        return self._call("infer.ModelReady", request, timeout_s, retry=False).ready

    def health_check(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN' or 'UNKNOWN'."""
        response = self._call("health.Check", health_pb2.HealthCheckRequest(service=service), timeout_s,
                              retry=False)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def server_metadata(self, *, timeout_s: float | None = None) -> codec.ServerMetadata:
        return codec.parse_server_metadata(self._call("infer.ServerMetadata", pb.ServerMetadataRequest(), timeout_s))

    def model_metadata(self, model: str, version: str = "", *, timeout_s: float | None = None) -> codec.ModelMetadata:
        request = pb.ModelMetadataRequest(name=model, version=version)
        return codec.parse_model_metadata(self._call("infer.ModelMetadata", request, timeout_s))

    def repository_index(self, *, ready_only: bool = False,
                         timeout_s: float | None = None) -> list[codec.ModelIndexEntry]:
        """The models the server knows, with their state (Triton's RepositoryIndex)."""
        request = pb.RepositoryIndexRequest(ready=ready_only)
        return codec.parse_repository_index(self._call("infer.RepositoryIndex", request, timeout_s))

    # Not retried: UNAVAILABLE here means the server's model control mode forbids it.
    def load_model(self, model: str, *, timeout_s: float | None = None) -> None:
        """Load or reload `model` from the server's repository (Triton's RepositoryModelLoad;
        the server needs --model-control-mode explicit)."""
        self._call("infer.RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=model), timeout_s,
                   retry=False)

    def unload_model(self, model: str, *, timeout_s: float | None = None) -> None:
        """Stop serving `model`; calls in flight finish (Triton's RepositoryModelUnload)."""
        self._call("infer.RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model), timeout_s,
                   retry=False)

    def model_statistics(self, model: str = "", version: str = "", *,
                         timeout_s: float | None = None) -> list[codec.ModelStatistics]:
        """Cumulative counters of one model (or of every model when `model` is empty)."""
        request = pb.ModelStatisticsRequest(name=model, version=version)
        return codec.parse_model_statistics(self._call("infer.ModelStatistics", request, timeout_s))

    # -- inference ---------------------------------------------------------

    def infer(
        self,
        model: str,
        query: Any,
        key: Any,
        value: Any,
        mask: Any = None,
        outputs: Sequence[str] = ("output",),
        *,
        model_version: str = "",
        timeout_s: float | None = None,
        priority: int = 0,
        timeout_us: int = 0,
    ) -> dict[str, Any]:
        """The requested outputs by name, as read-only numpy arrays (empty `outputs`: all of them)."""
        return self.infer_result(model, query, key, value, mask, outputs,
                                 model_version=model_version, timeout_s=timeout_s,
                                 priority=priority, timeout_us=timeout_us).outputs

    def infer_result(
        self,
        model: str,
        query: Any,
        key: Any,
        value: Any,
        mask: Any = None,
        outputs: Sequence[str] = ("output",),
        *,
        model_version: str = "",
        timeout_s: float | None = None,
        priority: int = 0,
        timeout_us: int = 0,
    ) -> codec.InferResult:
        """Like `infer`, with the model name and version that answered."""
        outputs = tuple(outputs)
        inputs = codec.validate_inputs(query, key, value, mask)
        request = codec.build_infer_request(model, inputs, outputs, model_version=model_version,
                                            priority=priority, timeout_us=timeout_us)
        result = codec.parse_infer_response(self._call("infer.ModelInfer", request, timeout_s), outputs)
        codec.check_output_shapes(result.outputs, inputs)
        return result

    def infer_async(
        self,
        model: str,
        query: Any,
        key: Any,
        value: Any,
        mask: Any = None,
        outputs: Sequence[str] = ("output",),
        *,
        model_version: str = "",
        timeout_s: float | None = None,
        priority: int = 0,
        timeout_us: int = 0,
    ) -> InferCall:
        """`infer` without waiting: an `InferCall` whose `result(timeout)` is `infer`'s answer, with
        `done()` and `cancel()` (which cancels the gRPC call: the server stops waiting for it).
        Same deadline, retries and errors as `infer`."""
        outputs = tuple(outputs)
        inputs = codec.validate_inputs(query, key, value, mask)
        request = codec.build_infer_request(model, inputs, outputs, model_version=model_version,
                                            priority=priority, timeout_us=timeout_us)

        def start(remaining_s: float) -> grpc.Future:
            return self._pool.next().infer.ModelInfer.future(request, timeout=remaining_s, metadata=self._metadata)

        def finish(response: pb.ModelInferResponse) -> dict[str, Any]:
            result = codec.parse_infer_response(response, outputs)
            codec.check_output_shapes(result.outputs, inputs)
            return result.outputs

        return InferCall(start, finish, self.options.retry, self._budget(timeout_s),
                         on_retry=self._count_retry, closed=lambda: self._closed)

    def stream(self, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, timeout_s: float | None = None) -> InferStream:
        """One ModelStreamInfer call for many requests, on the pool's next channel:

            with client.stream(max_in_flight=32) as stream:
                futures = [stream.submit("self_attention", q, k, v) for q, k, v in items]
            outputs = [f.result() for f in futures]   # each `infer`'s answer, or its InferenceError

        At most `max_in_flight` requests are unanswered at once (`submit` waits for room). A
        failed request fails its own future and the stream goes on. timeout_s: a deadline for the
        whole stream (None, the default: none; bound each wait with `result(timeout)`). Streams
        are not retried: a stream that breaks fails the requests still in it."""
        return InferStream(self._pool.next().infer.ModelStreamInfer, metadata=self._metadata,
                           timeout_s=timeout_s, max_in_flight=max_in_flight)
