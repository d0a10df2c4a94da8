"""ModelStreamInfer: many requests over one call, each answered by its own future.

    with client.stream(max_in_flight=32) as stream:          # InferenceClient
        future = stream.submit("self_attention", q, k, v)     # concurrent.futures.Future
    future.result()["output"]

    async with client.stream() as stream:                    # AsyncInferenceClient
        future = await stream.submit("self_attention", q, k, v)   # asyncio.Future
    (await future)["output"]

Each request carries an id of its own and its answer is matched by it (the protocol echoes it).
A request the server refuses comes back as an answer with `error_message` ("CODE: details"):
its future fails with that InferenceError and the stream goes on. At most `max_in_flight`
requests are unanswered at once: `submit` waits for room, so a fast producer holds bounded
memory. close() (the context's normal exit) sends the end of the requests and waits for every
answer; cancel() (an exception leaving the context) ends the call at once and fails what is
unanswered with CANCELLED. A stream that ends with a status fails its unanswered requests
with it, and later submits raise it. Streams are not retried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from attnserve.client import codec
from attnserve.client.errors import InferenceError
from attnserve.proto import inference_pb2 as pb

# The server reads up to 64 requests of one stream at once (server.service.STREAM_WINDOW);
# more in flight than that only waits in HTTP/2's buffers.
DEFAULT_MAX_IN_FLIGHT = 64
CANCELLED_BY_CALLER = "the stream was cancelled by the caller"


@dataclass(slots=True)
class _Pending:
    future: Any  # concurrent.futures.Future or asyncio.Future
    outputs: tuple[str, ...]
    inputs: dict[str, Any]


def _outcome(message: pb.ModelStreamInferResponse, pending: _Pending) -> tuple[Any, InferenceError | None]:
    """The request's answer, or its error, from the stream's message for it."""
    if message.error_message:
        return None, InferenceError.from_stream_message(message.error_message)
    try:
        result = codec.parse_infer_response(message.infer_response, pending.outputs)
        codec.check_output_shapes(result.outputs, pending.inputs)
    except InferenceError as err:
        return None, err
    return result.outputs, None


class _Requests:
    """What both streams share: the window, the ids, and the registry of unanswered requests.
    The caller holds its own lock (threading or asyncio) around every method but `build`."""

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.pending: dict[str, _Pending] = {}
        self.closing = False
        self.error: InferenceError | None = None  # what ended the stream, once it ended
        self._ids = itertools.count()

    @staticmethod
    def build(model: str, query: Any, key: Any, value: Any, mask: Any, outputs: Sequence[str],
              model_version: str) -> tuple[dict[str, Any], tuple[str, ...], pb.ModelInferRequest]:
        outputs = tuple(outputs)
        inputs = codec.validate_inputs(query, key, value, mask)
        return inputs, outputs, codec.build_infer_request(model, inputs, outputs, model_version=model_version)

    def has_room(self) -> bool:
        return len(self.pending) < self.max_in_flight or self.closing or self.error is not None

    def check_open(self) -> None:
        if self.closing:
            raise RuntimeError("submit() on a stream already closed")
        if self.error is not None:
            raise self.error

    def register(self, request: pb.ModelInferRequest, request_id: str | None, pending: _Pending) -> None:
        if request_id is None:
            while (request_id := f"attnserve-{next(self._ids)}") in self.pending:
                pass
        elif not request_id:
            raise ValueError("request_id must not be empty (answers are matched by it)")
        elif request_id in self.pending:
            raise ValueError(f"request_id {request_id!r} is already in flight on this stream")
        request.id = request_id
        self.pending[request_id] = pending

    def answered(self, message: pb.ModelStreamInferResponse) -> _Pending:
        """The request the message answers, no longer pending; InferenceError for an unknown id."""
        pending = self.pending.pop(message.infer_response.id, None)
        if pending is None:
            raise InferenceError(grpc.StatusCode.INTERNAL,
                                 f"the stream answered request id {message.infer_response.id!r}, "
                                 f"which is not in flight ({len(self.pending)} are)")
        return pending

    def end(self, error: InferenceError) -> list[_Pending]:
        """The stream is over: `error` for later submits; the unanswered requests, to fail."""
        if self.error is None:
            self.error = error
        unanswered = list(self.pending.values())
        self.pending.clear()
        return unanswered


def _unanswered(count: int) -> InferenceError:
    return InferenceError(grpc.StatusCode.INTERNAL, f"the stream ended with {count} requests unanswered")


def _ended() -> InferenceError:
    return InferenceError(grpc.StatusCode.CANCELLED, "the stream has ended")


class InferStream:
    """One ModelStreamInfer call of the sync client (`InferenceClient.stream`). Thread-safe."""

    def __init__(self, rpc: Callable[..., Any], *, metadata: tuple[tuple[str, str], ...],
                 timeout_s: float | None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self._requests = _Requests(max_in_flight)
        self._cond = threading.Condition()
        self._outbox: queue.SimpleQueue[pb.ModelInferRequest | None] = queue.SimpleQueue()
        self._call = rpc(self._sent(), timeout=timeout_s, metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="attnserve-stream", daemon=True)
        self._reader.start()

    def __enter__(self) -> InferStream:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is not None:
            self.cancel()
        self.close()

    @property
    def in_flight(self) -> int:
        """Requests sent (or being sent) and not yet answered."""
        with self._cond:
            return len(self._requests.pending)

    def submit(self, model: str, query: Any, key: Any, value: Any, mask: Any = None,
               outputs: Sequence[str] = ("output",), *, model_version: str = "", request_id: str | None = None,
               wait_s: float | None = None) -> concurrent.futures.Future:
        """Send one request; its future's result is `infer`'s answer (the outputs by name), its
        exception the InferenceError the server answered it with. Waits for room in the window
        at most `wait_s` seconds (None: until there is room): TimeoutError then, nothing sent.
        request_id: the request's id (default: one made here); unique among those in flight."""
        inputs, outputs, request = _Requests.build(model, query, key, value, mask, outputs, model_version)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # one request of a stream cannot be cancelled alone
        with self._cond:
            if not self._cond.wait_for(self._requests.has_room, timeout=wait_s):
                raise TimeoutError(f"{self._requests.max_in_flight} requests in flight (max_in_flight): "
                                   f"no room within {wait_s} s")
            self._requests.check_open()
            self._requests.register(request, request_id, _Pending(future, outputs, inputs))
            self._outbox.put(request)  # in order, under the lock: ids reach the wire as registered
        return future

    def close(self, timeout_s: float | None = None) -> None:
        """End the requests and wait (at most `timeout_s`, then cancel) for every answer."""
        with self._cond:
            if not self._requests.closing:
                self._requests.closing = True
                self._outbox.put(None)
            self._cond.notify_all()
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            self.cancel()
            self._reader.join()

    def cancel(self) -> None:
        """End the call now: what is unanswered fails with CANCELLED."""
        self._call.cancel()
        self._reader.join()

    def _sent(self) -> Iterator[pb.ModelInferRequest]:
        while (request := self._outbox.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for message in self._call:
                self._answer(message)
            with self._cond:
                error = _unanswered(len(self._requests.pending)) if self._requests.pending else _ended()
        except grpc.RpcError as err:
            error = InferenceError.from_rpc_error(err)
            if error.code == grpc.StatusCode.CANCELLED and self._call.cancelled():
                error = InferenceError(grpc.StatusCode.CANCELLED, CANCELLED_BY_CALLER)
        except InferenceError as err:  # an answer for no request: the stream cannot be trusted
            self._call.cancel()
            error = err
        except Exception as err:  # noqa: BLE001 - whatever it was, no future may be left waiting
            self._call.cancel()
            error = InferenceError(grpc.StatusCode.UNKNOWN, f"the stream's reader failed: {err!r}")
        with self._cond:
            unanswered = self._requests.end(error)
            self._cond.notify_all()
        self._outbox.put(None)  # gRPC's sending thread stops waiting for requests
        for pending in unanswered:
            pending.future.set_exception(error)

    def _answer(self, message: pb.ModelStreamInferResponse) -> None:
        with self._cond:
            pending = self._requests.answered(message)
            self._cond.notify_all()
        value, error = _outcome(message, pending)
        if error is None:
            pending.future.set_result(value)
        else:
            pending.future.set_exception(error)


class AsyncInferStream:
    """One ModelStreamInfer call of the asyncio client (`AsyncInferenceClient.stream`); one event loop."""

    def __init__(self, call: grpc.aio.StreamStreamCall, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self._requests = _Requests(max_in_flight)
        self._cond = asyncio.Condition()
        self._writing = asyncio.Lock()  # grpc.aio takes one write at a time
        self._call = call
        self._reader = asyncio.ensure_future(self._read())

    async def __aenter__(self) -> AsyncInferStream:
        return self

    async def __aexit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is not None:
            await self.cancel()
        await self.close()

    @property
    def in_flight(self) -> int:
        return len(self._requests.pending)

    async def submit(self, model: str, query: Any, key: Any, value: Any, mask: Any = None,
                     outputs: Sequence[str] = ("output",), *, model_version: str = "",
                     request_id: str | None = None, wait_s: float | None = None) -> asyncio.Future:
        """As InferStream.submit; returns once the request is written, with its future."""
        inputs, outputs, request = _Requests.build(model, query, key, value, mask, outputs, model_version)
        future = asyncio.get_running_loop().create_future()
        async with self._cond:
            try:
                if not self._requests.has_room():  # wait_for(..., 0) would time out even with room
                    await asyncio.wait_for(self._cond.wait_for(self._requests.has_room), wait_s)
            except TimeoutError:
                raise TimeoutError(f"{self._requests.max_in_flight} requests in flight (max_in_flight): "
                                   f"no room within {wait_s} s") from None
            self._requests.check_open()
            self._requests.register(request, request_id, _Pending(future, outputs, inputs))
        # Written outside the condition: a write that waits for flow control must not stop the
        # reader (answers are matched by id, so the order of writes does not matter).
        async with self._writing:
            try:
                await self._call.write(request)
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # the call has ended: the reader fails this request with the call's status
        return future

    async def close(self) -> None:
        """End the requests and wait for every answer."""
        async with self._cond:
            closing, self._requests.closing = self._requests.closing, True
            self._cond.notify_all()
        if not closing:
            async with self._writing:
                try:
                    await self._call.done_writing()
                except (grpc.RpcError, asyncio.InvalidStateError):
                    pass  # already ended: the reader has its status
        await asyncio.shield(self._reader)

    async def cancel(self) -> None:
        """End the call now: what is unanswered fails with CANCELLED."""
        self._call.cancel()
        await asyncio.shield(self._reader)

    async def _read(self) -> None:
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                async with self._cond:
                    pending = self._requests.answered(message)
                    self._cond.notify_all()
                value, error = _outcome(message, pending)
                if not pending.future.done():
                    if error is None:
                        pending.future.set_result(value)
                    else:
                        pending.future.set_exception(error)
            error = _unanswered(len(self._requests.pending)) if self._requests.pending else _ended()
        except asyncio.CancelledError:
            if not self._call.cancelled():
                raise  # this task itself was cancelled (the loop is ending), not the call
            error = InferenceError(grpc.StatusCode.CANCELLED, CANCELLED_BY_CALLER)
        except grpc.RpcError as err:
            error = InferenceError.from_rpc_error(err)
            if error.code == grpc.StatusCode.CANCELLED and self._call.cancelled():
                error = InferenceError(grpc.StatusCode.CANCELLED, CANCELLED_BY_CALLER)
        except InferenceError as err:  # an answer for no request: the stream cannot be trusted
            self._call.cancel()
            error = err
        async with self._cond:
            unanswered = self._requests.end(error)
            self._cond.notify_all()
        for pending in unanswered:
            if not pending.future.done():
                pending.future.set_exception(error)
