"""Handlers that parse their own messages, so a message that does not parse is INVALID_ARGUMENT.

    handler = tolerant_handler(method, handler)  # built once per method by server.gate

gRPC's own answer to a message that does not parse is UNKNOWN, with a traceback logged per
message. Here the deserializer never raises: it hands the handler a _Malformed in place of the
request, and the handler's own call answers it (so the call counts as started and finished for
draining). In a request stream, the malformed message ends the stream where the handler reads
it, after the handler's answers to the messages before it.

Only the kinds of handler this server registers are wrapped (SUPPORTED_KINDS; see app.py):
coroutine unary-unary (the inference service, Health/Check), coroutine unary-stream
(Health/Watch, which writes with context.write) and async-generator stream-stream
(ModelStreamInfer, reflection). Any other kind is refused at startup, naming the method.
Handlers are rebuilt with grpc's public *_rpc_method_handler constructors.

An inference request's `parameters` are bounded before they are parsed (bounded_infer_request):
each entry of a map is its own record on the wire, so a message of a million of them costs
seconds of the event loop to scan or parse, every other client waiting (docs/hardening-grpc-workers.md).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from attnserve.proto import inference_pb2 as pb
from attnserve.proto.wire import FieldsOverLimit, check_fields
from attnserve.server.errors import MalformedMessage, abort

UNARY_UNARY, UNARY_STREAM, STREAM_STREAM = "unary_unary", "unary_stream", "stream_stream"
SUPPORTED_KINDS = frozenset({(UNARY_UNARY, "coroutine"), (UNARY_STREAM, "coroutine"),
                             (STREAM_STREAM, "async generator")})


def handler_kind(handler: grpc.RpcMethodHandler) -> tuple[str, str]:
    """(which of the four behaviours it sets, what kind of function that is)."""
    for kind in (UNARY_UNARY, UNARY_STREAM, "stream_unary", STREAM_STREAM):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            if inspect.isasyncgenfunction(behaviour):
                return kind, "async generator"
            return kind, "coroutine" if inspect.iscoroutinefunction(behaviour) else "function"
    return "none", "none"


# Entries of one `parameters` map of an inference request (the request's, an input's, an
# output's), and the wire bytes of the request's own: the protocol's parameters are a few flags.
MAX_PARAMETERS = 64
MAX_PARAMETERS_BYTES = 16 << 10
# Top-level fields of one inference request message: a few scalars, inputs, outputs, raw contents.
MAX_REQUEST_FIELDS = 4096
# Below this a message is parsed by protobuf in C at once (bounded by the size, the scan in Python
# would cost more than it saves); its parameters are counted after (codec.WIRE_MIN_BYTES too).
PRESCAN_MIN_BYTES = 1 << 20


def _check_parameters(parameters, where: str) -> None:
    if len(parameters) > MAX_PARAMETERS:
        raise FieldsOverLimit(
            f"{where}: {len(parameters):,} `parameters` entries, over the limit of {MAX_PARAMETERS:,}")


def bounded_infer_request(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """The deserializer of ModelInfer / ModelStreamInfer, refusing a request whose `parameters`
    are over MAX_PARAMETERS entries (or MAX_PARAMETERS_BYTES, or MAX_REQUEST_FIELDS fields in
    all) with FieldsOverLimit: a large message before it is parsed, a small one (bounded by its
    size) right after protobuf's parse."""

    def parse(data: bytes) -> Any:
        if len(data) >= PRESCAN_MIN_BYTES:
            check_fields(pb.ModelInferRequest, data, {"parameters": (MAX_PARAMETERS, MAX_PARAMETERS_BYTES)},
                         MAX_REQUEST_FIELDS, "the inference request")
        request = deserializer(data)
        message = getattr(request, "message", request)  # codec.InferRequest holds its protobuf part
        _check_parameters(message.parameters, "the inference request")
        for tensor in message.inputs:
            _check_parameters(tensor.parameters, f"input {tensor.name[:64]!r}")
        for tensor in message.outputs:
            _check_parameters(tensor.parameters, f"output {tensor.name[:64]!r}")
        return request

    return parse


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as err:  # protobuf's DecodeError, or anything a deserializer raises
            return _Malformed(err)

    return parse


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise MalformedMessage(request.error)
        yield request


def tolerant_handler(method: str, handler: grpc.RpcMethodHandler,
                     bound: Callable[[Callable[[bytes], Any]], Callable[[bytes], Any]] | None = None
                     ) -> grpc.RpcMethodHandler:
    """The same handler, parsing its own messages. Raises TypeError for a kind it does not wrap.
    bound: wraps the deserializer (bounded_infer_request for the inference methods)."""
    kind = handler_kind(handler)
    if kind not in SUPPORTED_KINDS:
        raise TypeError(f"{method}: a {kind[1]} {kind[0]} handler; the gate serves "
                        f"{', '.join(sorted(f'{f} {k}' for k, f in SUPPORTED_KINDS))} handlers")
    deserializer = handler.request_deserializer or (lambda data: data)
    parse = _tolerant(deserializer if bound is None else bound(deserializer))
    serialize = handler.response_serializer
    if kind[0] == UNARY_UNARY:
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Malformed):
                await abort(context, MalformedMessage(request.error))
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse,
                                                   response_serializer=serialize)
    if kind[0] == UNARY_STREAM:
        inner_writer = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Malformed):
                await abort(context, MalformedMessage(request.error))
            return await inner_writer(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse,
                                                    response_serializer=serialize)
    inner_stream = handler.stream_stream

    async def stream_stream(requests, context):
        try:
            async for response in inner_stream(_checked(requests), context):
                yield response
        except MalformedMessage as err:
            await abort(context, err)

    return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=parse,
                                                 response_serializer=serialize)
