"""Every error a call can meet, mapped to its gRPC status once: one table, one function.

    status = status_for(err)     # Status(code, details); anything not in the table is INTERNAL
    await abort(context, err)    # a call ends with status_for(err)
    status.stream_message()      # "CODE: details": a ModelStreamInferResponse's error_message

The servicer (unary RPCs, stream answers, metadata RPCs), the gate (token, draining) and the
parsing layer all answer through here. The layers below raise their own exceptions and know
nothing of gRPC; the exceptions defined here are those of the gRPC edge itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import grpc

from attnserve.server.batcher import BatcherClosed, BatchFailed, DeadlineExpired, QueueFull
from attnserve.server.echo import capped
from attnserve.server.lifecycle import MemoryExhausted, MemoryTooLarge
from attnserve.server.models import ModelNotFound, ModelUnavailable

logger = logging.getLogger(__name__)


class Unauthenticated(Exception):
    """The call lacks the bearer token the server requires (server.security)."""


class ShuttingDown(Exception):
    """An inference call that started after the server began draining; never computed."""


class MalformedMessage(Exception):
    """A request message that does not parse as its RPC's request type (server.parsing)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"the request message does not parse: {type(error).__name__}: {error}")


# The most specific class in an error's MRO decides. Anything else is INTERNAL.
_STATUS: dict[type[BaseException], grpc.StatusCode] = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # codec.decode: the request does not fit the model
    MalformedMessage: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    ModelUnavailable: grpc.StatusCode.UNAVAILABLE,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MemoryExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,  # the memory budget is spent now: retry later
    MemoryTooLarge: grpc.StatusCode.INVALID_ARGUMENT,  # could never fit the budget (a ValueError too)
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    BatcherClosed: grpc.StatusCode.UNAVAILABLE,  # never computed: safe to retry elsewhere
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,  # likewise
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    BatchFailed: grpc.StatusCode.INTERNAL,  # details: its public message; logged by the batcher
}


@dataclass(frozen=True, slots=True)
class Status:
    code: grpc.StatusCode
    details: str

    def stream_message(self) -> str:
        """The status as ModelStreamInfer reports a failed request, in its answer's error_message."""
        return f"{self.code.name}: {self.details}"


OK = Status(grpc.StatusCode.OK, "")
CANCELLED = Status(grpc.StatusCode.CANCELLED, "the client went away")


def status_for(err: BaseException) -> Status:
    """The status a client gets for `err`. An INTERNAL error is logged here with its traceback,
    unless it was already (BatchFailed.logged); the client is told that it failed and where to
    look, never the internals (paths, ONNX Runtime's text)."""
    code = next((_STATUS[cls] for cls in type(err).__mro__ if cls in _STATUS), grpc.StatusCode.INTERNAL)
    if code is not grpc.StatusCode.INTERNAL:
        return Status(code, capped(str(err)))  # whatever quoted the client, the trailer stays small
    if isinstance(err, BatchFailed):
        if not err.logged:
            logger.error("internal error: %s", err, exc_info=err)
        return Status(code, err.public)
    logger.error("internal error: %s", err, exc_info=err)
    return Status(code, f"internal error ({type(err).__name__}); the server log has the details")


async def abort(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End the call with the status for `err`. Never returns: context.abort raises."""
    status = status_for(err)
    await context.abort(status.code, status.details)
