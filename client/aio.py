"""The asyncio client: the sync client's API as coroutines, over grpc.aio and the same codec.

    async with AsyncInferenceClient("127.0.0.1:8001", timeout_s=10) as client:
        out = await client.infer("cross_attention", q, k, v)

Create it inside the running event loop that uses it (grpc.aio channels belong to one loop).
`_call` is the funnel, with the same deadline, token, retry and error rules as `client.py`.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Sequence
from typing import Any

import grpc
from attnserve.client import codec
from attnserve.client.errors import InferenceError, remaining_or_expired
from attnserve.client.options import DEFAULT_URL, ClientOptions
from attnserve.client.pool import ChannelPool
from attnserve.client.stream import DEFAULT_MAX_IN_FLIGHT, AsyncInferStream
from attnserve.proto import inference_pb2 as pb
from grpc_health.v1 import health_pb2


class AsyncInferenceClient:
    """`AsyncInferenceClient(url, **settings)` takes the same settings as `InferenceClient`."""

    def __init__(self, url: str | ClientOptions = DEFAULT_URL, **settings: Any) -> None:
        self.options = ClientOptions.build(url, **settings)
        self._metadata = self.options.call_metadata()
        self._pool = ChannelPool(self.options, aio=True)
        self._retries = 0  # one event loop: no lock needed
        self._closed = False  # a call close() cancelled is not sent again

    async def close(self) -> None:
        self._closed = True
        for channel in self._pool.channels:
            await channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def retry_count(self) -> int:
        """How many times a call was sent again (after UNAVAILABLE or CANCELLED), over this client's life."""
        return self._retries

    async def _call(self, method: str, request: Any, timeout_s: float | None, *, retry: bool = True,
                    metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """method: "infer.<RPC>" or "health.<RPC>", called on the pool's next lane at each attempt."""
        rpc_of = operator.attrgetter(method)
        budget_s = self.options.timeout_s if timeout_s is None else timeout_s
        if not budget_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {budget_s}")
        deadline = time.monotonic() + budget_s
        retries_done = 0
        while True:
            try:
                return await rpc_of(self._pool.next())(request, timeout=remaining_or_expired(deadline, budget_s),
                                 metadata=self._metadata + metadata if metadata else self._metadata)
            except grpc.RpcError as err:  # grpc.aio.AioRpcError
                error = InferenceError.from_rpc_error(err)
            delay = (self.options.retry.delay_before_retry(error, retries_done, deadline - time.monotonic())
                     if retry and not self._closed else None)
            if delay is None:
                raise error
            await asyncio.sleep(delay)
            retries_done += 1
            self._retries += 1

    async def server_live(self, *, timeout_s: float | None = None) -> bool:
        return (await self._call("infer.ServerLive", pb.ServerLiveRequest(), timeout_s, retry=False)).live

    async def server_ready(self, *, timeout_s: float | None = None) -> bool:
        return (await self._call("infer.ServerReady", pb.ServerReadyRequest(), timeout_s, retry=False)).ready

    async def model_ready(self, model: str, version: str = "", *, timeout_s: float | None = None) -> bool:
        request = pb.ModelReadyRequest(name=model, version=version)
        return (await self._call("infer.ModelReady", request, timeout_s, retry=False)).ready

    async def health_check(self, service: str = "", *, timeout_s: float | None = None) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self._call("health.Check", request, timeout_s, retry=False)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def server_metadata(self, *, timeout_s: float | None = None) -> codec.ServerMetadata:
        response = await self._call("infer.ServerMetadata", pb.ServerMetadataRequest(), timeout_s)
        return codec.parse_server_metadata(response)

    async def model_metadata(self, model: str, version: str = "", *,
                             timeout_s: float | None = None) -> codec.ModelMetadata:
        request = pb.ModelMetadataRequest(name=model, version=version)
        return codec.parse_model_metadata(await self._call("infer.ModelMetadata", request, timeout_s))

    async def repository_index(self, *, ready_only: bool = False,
                               timeout_s: float | None = None) -> list[codec.ModelIndexEntry]:
        """The models the server knows, with their state (Triton's RepositoryIndex)."""
        request = pb.RepositoryIndexRequest(ready=ready_only)
        return codec.parse_repository_index(await self._call("infer.RepositoryIndex", request, timeout_s))

    async def model_statistics(self, model: str = "", version: str = "", *,
                               timeout_s: float | None = None) -> list[codec.ModelStatistics]:
        request = pb.ModelStatisticsRequest(name=model, version=version)
        return codec.parse_model_statistics(await self._call("infer.ModelStatistics", request, timeout_s))

    # -- system shared memory (Triton's extension; attnserve.client.shm) ------------------------

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0, *,
                                            timeout_s: float | None = None) -> None:
        request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        await self._call("infer.SystemSharedMemoryRegister", request, timeout_s, retry=False)

    async def unregister_system_shared_memory(self, name: str = "", *, timeout_s: float | None = None) -> None:
        request = pb.SystemSharedMemoryUnregisterRequest(name=name)
        await self._call("infer.SystemSharedMemoryUnregister", request, timeout_s, retry=False)

    async def system_shared_memory_status(self, name: str = "", *, timeout_s: float | None = None) -> list[str]:
        """The names of the regions registered on the server (`name`: that one, or NOT registered: an error)."""
        request = pb.SystemSharedMemoryStatusRequest(name=name)
        return list((await self._call("infer.SystemSharedMemoryStatus", request, timeout_s)).regions)

    async def model_infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None = None,
                          metadata: tuple[tuple[str, str], ...] = ()) -> pb.ModelInferResponse:
        """One ModelInfer call with a request built elsewhere (attnserve.client.shm's), with the
        same deadline, retries and errors as infer(); metadata is sent besides the client's own."""
        return await self._call("infer.ModelInfer", request, timeout_s, metadata=tuple(metadata))

    async def infer(
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
        result = await self.infer_result(model, query, key, value, mask, outputs,
                                         model_version=model_version, timeout_s=timeout_s,
                                         priority=priority, timeout_us=timeout_us)
        return result.outputs

    async def infer_result(
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
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> codec.InferResult:
        """metadata: sent with this call besides the client's own (a `traceparent`: client.tracecontext)."""
        outputs = tuple(outputs)
        inputs = codec.validate_inputs(query, key, value, mask)
        request = codec.build_infer_request(model, inputs, outputs, model_version=model_version,
                                            priority=priority, timeout_us=timeout_us)
        response = await self._call("infer.ModelInfer", request, timeout_s, metadata=tuple(metadata))
        result = codec.parse_infer_response(response, outputs)
        codec.check_output_shapes(result.outputs, inputs)
        return result

    def stream(self, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, timeout_s: float | None = None,
               metadata: tuple[tuple[str, str], ...] = ()) -> AsyncInferStream:
        """One ModelStreamInfer call for many requests, on the pool's next channel (see
        `InferenceClient.stream`); call it inside the event loop:

            async with client.stream(max_in_flight=32) as stream:
                futures = [await stream.submit("self_attention", q, k, v) for q, k, v in items]
            outputs = [await f for f in futures]
        """
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        call = self._pool.next().infer.ModelStreamInfer(timeout=timeout_s, metadata=self._metadata + tuple(metadata))
        return AsyncInferStream(call, max_in_flight)
