"""`InferCall`: the sync client's non-blocking call, a future you can cancel.

    call = client.infer_async("self_attention", q, k, v)
    call.done()            # answered (or failed, or cancelled)?
    call.cancel()          # cancels the gRPC call in flight: the server stops waiting for it
    call.result(timeout)   # the outputs, or InferenceError (CANCELLED after cancel()); TimeoutError if not done

Each attempt is a gRPC future (`stub.ModelInfer.future`); a retryable failure starts the next one
after the retry policy's backoff, on a timer thread, within the call's one deadline, as the
blocking funnel does. cancel() stops the attempt in flight and any retry to come.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from attnserve.client.errors import InferenceError, remaining_or_expired
from attnserve.client.options import RetryPolicy

CANCELLED_BY_CALLER = "cancelled by the caller (InferCall.cancel)"


class InferCall:
    """A call in flight. Its result is the blocking call's answer; its error an `InferenceError`."""

    def __init__(self, start: Callable[[float], grpc.Future], finish: Callable[[Any], Any], retry: RetryPolicy,
                 budget_s: float, *, on_retry: Callable[[], None] = lambda: None,
                 closed: Callable[[], bool] = lambda: False) -> None:
        """start(remaining_s): one attempt; finish(response): its answer (may raise InferenceError);
        on_retry: counts a retry; closed: whether the client closed (its calls are not sent again)."""
        self._start, self._finish, self._retry = start, finish, retry
        self._budget_s = budget_s
        self._deadline = time.monotonic() + budget_s
        self._on_retry, self._closed = on_retry, closed
        self._outcome: concurrent.futures.Future = concurrent.futures.Future()
        self._outcome.set_running_or_notify_cancel()  # settled only here, never cancelled as a Future
        self._lock = threading.RLock()  # a done callback may ask cancelled() on the settling thread
        self._attempt: grpc.Future | None = None
        self._retries_done = 0
        self._cancelled = False
        self._begin()

    # -- the caller's side -------------------------------------------------------------------

    def result(self, timeout: float | None = None) -> Any:
        """The answer, waiting at most `timeout` seconds (None: until the call's deadline settles it)."""
        return self._outcome.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._outcome.exception(timeout)

    def done(self) -> bool:
        return self._outcome.done()

    def cancelled(self) -> bool:
        """True when cancel() ended the call (result() raises InferenceError CANCELLED)."""
        with self._lock:
            return self._cancelled and self._outcome.done()

    def cancel(self) -> bool:
        """Cancel the call: the gRPC call in flight is cancelled (RST_STREAM: the server sees the
        client go) and no retry follows. False when the call had already settled."""
        with self._lock:
            if self._outcome.done():
                return False
            self._cancelled = True
            attempt = self._attempt
        if attempt is not None:
            attempt.cancel()  # its done callback settles the call, unless it finished first
        # Between attempts (a retry's backoff) or before the first, nothing is in flight to cancel.
        self._settle(error=InferenceError(grpc.StatusCode.CANCELLED, CANCELLED_BY_CALLER))
        return self.cancelled()

    def add_done_callback(self, fn: Callable[[InferCall], None]) -> None:
        self._outcome.add_done_callback(lambda _outcome: fn(self))

    # -- attempts ----------------------------------------------------------------------------

    def _begin(self) -> None:
        try:
            remaining = remaining_or_expired(self._deadline, self._budget_s)
        except InferenceError as err:
            self._settle(error=err)
            return
        with self._lock:
            if self._cancelled:
                return
            try:
                attempt = self._attempt = self._start(remaining)
            except ValueError as err:  # grpc: the channel is closed (a retry's timer fired after close())
                self._settle(error=InferenceError(grpc.StatusCode.CANCELLED, f"the client was closed: {err}"))
                return
        attempt.add_done_callback(self._attempt_done)  # outside the lock: it may run at once, here

    def _attempt_done(self, attempt: grpc.Future) -> None:
        if attempt.cancelled():
            self._settle(error=InferenceError(grpc.StatusCode.CANCELLED, CANCELLED_BY_CALLER))
            return
        failure = attempt.exception()
        if failure is None:
            try:
                self._settle(value=self._finish(attempt.result()))
            except InferenceError as err:
                self._settle(error=err)
            return
        error = (InferenceError.from_rpc_error(failure) if isinstance(failure, grpc.RpcError)
                 else InferenceError(grpc.StatusCode.UNKNOWN, str(failure)))
        with self._lock:
            stop = self._cancelled or self._closed()
        delay = None if stop else self._retry.delay_before_retry(error, self._retries_done,
                                                                 self._deadline - time.monotonic())
        if delay is None:
            self._settle(error=error)
            return
        self._retries_done += 1
        self._on_retry()
        timer = threading.Timer(delay, self._begin)
        timer.daemon = True  # a pending retry does not keep the interpreter alive
        timer.start()

    def _settle(self, *, value: Any = None, error: InferenceError | None = None) -> None:
        with self._lock:
            if self._outcome.done():
                return
            if error is None:
                self._outcome.set_result(value)
            else:
                self._outcome.set_exception(error)
