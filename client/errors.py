"""The one exception the client raises for anything the server (or the wire) refused.

Every stub call goes through one funnel (`client.py` / `aio.py`), which turns `grpc.RpcError`
into `InferenceError(code, details)`; the codec raises it too when a response is malformed.
Bad arguments given by the caller are plain `ValueError`s, raised before anything is sent.
"""

from __future__ import annotations

import time

import grpc

# UNAVAILABLE is the one status our server returns only before it computed anything (draining,
# model not ready), and the one gRPC itself returns when no connection could be made. (gRPC also
# returns it when a connection breaks mid-call; an inference has no side effects, so at worst
# that request is computed twice.) CANCELLED from the server is gRPC core's answer to a call that
# reaches it in the instant its stop begins, before the peer has read the GOAWAY (core cancels
# every call that arrives after its shutdown began, before any handler sees it; our drain narrows
# that instant and cannot close it), or to a call still running 10 s after the grace period:
# computed at most once, and safe to send again. The funnels do not retry a CANCELLED they
# caused themselves (their channel closed). Every other status is final.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class InferenceError(Exception):
    """A failed call: the gRPC status code and the server's (or client's) message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> InferenceError:
        # Sync calls raise a grpc.Call; grpc.aio raises AioRpcError. Both have code()/details().
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")

    @classmethod
    def from_stream_message(cls, message: str) -> InferenceError:
        """A ModelStreamInferResponse's error_message: "CODE: details" from attnserve (the code
        a unary call would have ended with), any other text as UNKNOWN (Triton sends the details only)."""
        name, sep, details = message.partition(": ")
        code = grpc.StatusCode.__members__.get(name) if sep else None
        return cls(code, details) if code is not None else cls(grpc.StatusCode.UNKNOWN, message)

    @property
    def retryable(self) -> bool:
        """True when sending the call again is safe: it was not computed, or at most once (an inference
        has no side effects). See RETRYABLE_CODES."""
        return self.code in RETRYABLE_CODES

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


def remaining_or_expired(deadline: float, budget_s: float) -> float:
    """Seconds left until `deadline` (time.monotonic()) for the next attempt of a call, or
    DEADLINE_EXCEEDED without sending it: a call that cannot meet its deadline is not sent
    (gRPC would send it and could even answer it, its timer firing after a fast reply)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise InferenceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"the call's deadline ({budget_s:g} s, retries included) passed before it was sent")
    return remaining
