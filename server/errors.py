"""Every error a call can meet, mapped to its status once: one table, one function.

    status = status_for(err)     # Status(code, details, http); anything not in the table is INTERNAL
    await abort(context, err)    # a gRPC call ends with status_for(err)
    status.stream_message()      # "CODE: details": a ModelStreamInferResponse's error_message
    status.http                  # the HTTP status the REST port (server.rest) answers with

The table has two columns: the gRPC status, and the HTTP status of the same error on the REST
port (docs/protocol.md's table). The servicer (unary RPCs, stream answers, metadata RPCs), the gate
(token, draining), the parsing layer and the REST adapter all answer through here. The layers
below raise their own exceptions and know nothing of gRPC or HTTP; the exceptions defined here
are those of the edges themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from attnserve.server.batcher import BatcherClosed, BatchFailed, DeadlineExpired, QueueFull
from attnserve.server.memory.budget import MemoryExhausted, MemoryTooLarge
from attnserve.server.models import ModelControlDisabled, ModelLoadFailed, ModelNotFound, ModelUnavailable
from attnserve.server.quoting import bounded_details
from attnserve.server.ratelimit import CLIENT_ERRORS
from attnserve.server.shm import SharedMemoryExhausted, SharedMemoryUnavailable

logger = logging.getLogger(__name__)


class Unauthenticated(Exception):
    """The call lacks the bearer token the server requires (server.security)."""


class ShuttingDown(Exception):
    """An inference call that started after the server began draining; never computed."""


class MalformedMessage(Exception):
    """A request message that does not parse as its RPC's request type (server.parsing)."""

    def __init__(self, error: Exception) -> None:
        # A refusal the deserializer makes on purpose (codec.TypedContentsTooLarge) says why itself.
        refused = getattr(error, "refused_before_parsing", False)
        super().__init__(str(error) if refused
                         else f"the request message does not parse: {type(error).__name__}: {error}")


class BodyTooLarge(Exception):
    """A REST request body over --max-message-bytes (inflated, when it came compressed)."""


class ClientGone(Exception):
    """The client went away before its request was read whole (a REST body cut off)."""


class NoSuchEndpoint(LookupError):
    """A REST path or method this server does not serve (gRPC's UNIMPLEMENTED)."""

    def __init__(self, message: str, http: int = 404) -> None:
        super().__init__(message)
        self.http = http  # 404 for an unknown path, 405 for a known path with another method


_S = grpc.StatusCode
# The most specific class in an error's MRO decides. Anything else is INTERNAL (500).
# NOT_FOUND is 404 (Triton answers 400 for an unknown model; tritonclient.http reads the body's
# error either way). RESOURCE_EXHAUSTED is 429 for a full queue or a spent memory budget (retry
# later) and 413 for a body too large (do not retry); UNAVAILABLE's 503 says: never computed,
# retry elsewhere.
_STATUS: dict[type[BaseException], tuple[grpc.StatusCode, int]] = {
    ValueError: (_S.INVALID_ARGUMENT, 400),  # codec.decode: the request does not fit the model
    MalformedMessage: (_S.INVALID_ARGUMENT, 400),
    ModelNotFound: (_S.NOT_FOUND, 404),
    NoSuchEndpoint: (_S.UNIMPLEMENTED, 404),  # or 405: NoSuchEndpoint.http
    ModelUnavailable: (_S.UNAVAILABLE, 503),
    # Model repository API (Triton's codes): load/unload outside explicit mode is UNAVAILABLE; a
    # load that fails (what served before still serves) is INVALID_ARGUMENT, with the reason.
    ModelControlDisabled: (_S.UNAVAILABLE, 503),
    ModelLoadFailed: (_S.INVALID_ARGUMENT, 400),
    QueueFull: (_S.RESOURCE_EXHAUSTED, 429),
    BodyTooLarge: (_S.RESOURCE_EXHAUSTED, 413),
    MemoryExhausted: (_S.RESOURCE_EXHAUSTED, 429),  # the memory budget is spent now: retry later
    MemoryTooLarge: (_S.INVALID_ARGUMENT, 400),  # could never fit the budget (a ValueError too)
    DeadlineExpired: (_S.DEADLINE_EXCEEDED, 504),
    BatcherClosed: (_S.UNAVAILABLE, 503),  # never computed: safe to retry elsewhere
    ShuttingDown: (_S.UNAVAILABLE, 503),  # likewise
    SharedMemoryUnavailable: (_S.UNAVAILABLE, 503),  # an extension off here (server.shm says why)
    SharedMemoryExhausted: (_S.RESOURCE_EXHAUSTED, 429),  # regions, bytes or fds spent now: retry later
    Unauthenticated: (_S.UNAUTHENTICATED, 401),
    ClientGone: (_S.CANCELLED, 499),  # nobody reads the answer; counted apart from server faults
    BatchFailed: (_S.INTERNAL, 500),  # details: its public message; logged by the batcher
}


@dataclass(frozen=True, slots=True)
class Status:
    code: grpc.StatusCode
    details: str
    http: int = 500  # the same status on the REST port

    def stream_message(self) -> str:
        """The status as ModelStreamInfer reports a failed request, in its answer's error_message."""
        return f"{self.code.name}: {self.details}"


OK = Status(grpc.StatusCode.OK, "", 200)
CANCELLED = Status(grpc.StatusCode.CANCELLED, "the client went away", 499)  # nginx's code; nobody reads it


# Each code's HTTP status, where a status is known by its code alone (a native call's record):
# the first the table above gives it (RESOURCE_EXHAUSTED: 429, a full queue or spent budget).
_HTTP_OF_CODE: dict[grpc.StatusCode, int] = {_S.OK: 200}
for _code, _http in _STATUS.values():
    _HTTP_OF_CODE.setdefault(_code, _http)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_of_code(code: int, details: str) -> Status:
    """The Status of a gRPC status code's number and its details (the HTTP status from the table)."""
    status_code = _CODES.get(code, _S.UNKNOWN)
    return Status(status_code, details, _HTTP_OF_CODE.get(status_code, 500))


def status_for(err: BaseException) -> Status:
    """The status a client gets for `err`. An INTERNAL error is logged here with its traceback,
    unless it was already (BatchFailed.logged); the client is told that it failed and where to
    look, never the internals (paths, ONNX Runtime's text)."""
    code, http = next((_STATUS[cls] for cls in type(err).__mro__ if cls in _STATUS), (_S.INTERNAL, 500))
    if isinstance(err, NoSuchEndpoint):
        http = err.http
    if code is not grpc.StatusCode.INTERNAL:
        return Status(code, bounded_details(str(err)), http)  # whatever quoted the client, the trailer stays small
    if isinstance(err, BatchFailed):
        if not err.logged:
            CLIENT_ERRORS.log(logger, logging.ERROR, "internal error: %s", err, exc_info=err)
        return Status(code, err.public, http)
    # A client that finds a way to cause one must not flood the log with tracebacks.
    CLIENT_ERRORS.log(logger, logging.ERROR, "internal error: %s", err, exc_info=err)
    return Status(code, f"internal error ({type(err).__name__}); the server log has the details", http)


async def abort(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End the call with the status for `err`. Never returns: context.abort raises."""
    status = status_for(err)
    await context.abort(status.code, status.details)
