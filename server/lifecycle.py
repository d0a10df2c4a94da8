"""The state of the server's calls that several layers share; created once by app.Server.

    draining = Draining()            # the gate refuses new inference calls, the servicer says not ready
    arrivals = Arrivals()            # each Batcher reads arrivals.arriving
    admission = Admission(arrivals)  # the gate counts inference calls; Server.stop waits on it

Knows nothing of gRPC: the gate (server.gate) reports what gRPC tells it, when each call's
headers arrive and when its handler starts and returns.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable


class Draining:
    """Where the server is in its stop. One object for the gate and the servicer.

    serving -> announced (a signal came: readiness false, calls still admitted, so that a load
    balancer that has not yet seen the readiness change loses nothing) -> refusing (the drain
    delay is over: new calls are refused with UNAVAILABLE, gRPC sends GOAWAY, admitted calls
    finish). `hurry()` (a second signal) ends the drain delay at once."""

    def __init__(self) -> None:
        self._announced = False
        self._refusing = False
        self.hurried = asyncio.Event()

    @property
    def active(self) -> bool:
        """Draining has begun: the server and its models report not ready."""
        return self._announced

    @property
    def refusing(self) -> bool:
        """New inference calls are refused (UNAVAILABLE, never computed)."""
        return self._refusing

    def begin(self) -> None:
        self._announced = True

    def refuse(self) -> None:
        self._announced = self._refusing = True

    def hurry(self) -> None:
        self.begin()
        self.hurried.set()


class Arrivals:
    """Inference calls on their way in: their headers have arrived, their handler has not started
    (the message is still arriving, or being parsed).

    `arriving` counts the unary ones among them: requests a batcher will see soon, since a
    ModelInfer handler decodes and submits its request without yielding to the event loop.
    While it is above zero a batcher lets a partial batch wait (up to its max_queue_delay_s) for
    them; under load gRPC, not the model, is often the slower stage, and without the signal each
    request would run alone as it trickles in. Streams are left out of `arriving`: a stream stays
    open for long and its messages come when they come.

    gRPC never runs the handler of a call whose message does not arrive (client gone, deadline
    hit on the way), so a call is forgotten TIMEOUT_S after its headers came; and for the
    batchers' hint a call counts only for HINT_S: one whose message takes longer is not worth
    holding a batch for, and a client that sends headers alone must not slow everyone else."""

    TIMEOUT_S = 10.0
    HINT_S = 0.25

    def __init__(self) -> None:
        # ticket -> (time.monotonic() its headers came, whether it is unary). Insertion order is
        # arrival order, so the stale ones are always at the front.
        self._calls: dict[int, tuple[float, bool]] = {}
        self._unary = 0
        self._tickets = itertools.count()

    @property
    def arriving(self) -> int:
        """Unary inference calls whose headers came (within HINT_S) and whose request is not in
        a batcher yet."""
        if not self._unary:
            return 0
        recent = time.monotonic() - self.HINT_S
        count = 0
        for came_at, unary in reversed(self._calls.values()):  # newest first
            if came_at < recent:
                break
            count += unary
        return count

    @property
    def calls(self) -> int:
        """Every arriving inference call, streams included."""
        self._forget_stale()
        return len(self._calls)

    def arrived(self, *, unary: bool) -> int:
        """A call's headers arrived; returns its ticket."""
        ticket = next(self._tickets)
        self._forget_stale()  # keeps the table bounded whoever reads it
        self._calls[ticket] = (time.monotonic(), unary)
        self._unary += unary
        return ticket

    def started(self, ticket: int) -> None:
        """The call's handler runs: it is no longer arriving (unless already forgotten)."""
        entry = self._calls.pop(ticket, None)
        if entry is not None:
            self._unary -= entry[1]

    def _forget_stale(self) -> None:
        too_old = time.monotonic() - self.TIMEOUT_S
        while self._calls:
            ticket, (came_at, unary) = next(iter(self._calls.items()))
            if came_at >= too_old:
                return
            del self._calls[ticket]
            self._unary -= unary


class Admission:
    """Inference calls in flight, what draining waits for: those still arriving (Arrivals),
    counted from the moment their headers arrive, and those whose handler runs, counted until it
    returns, whatever happens. A call whose headers came before SIGTERM is served even if its
    message comes after.

    `alone` tells the batchers that the call being dispatched is the only one: no other call in
    flight, no stream open, and the server held none for QUIET_S before it arrived. The quiet
    spell tells a lone client apart from a loaded server whose event loop has only just taken
    the next call from gRPC's core (whose queue it cannot see; docs/record/performance.md, "Solo runs",
    has how often each case found it empty)."""

    QUIET_S = 0.0002

    def __init__(self, arrivals: Arrivals, clock: Callable[[], float] = time.monotonic) -> None:
        self._arrivals = arrivals
        self._clock = clock
        self._running = 0
        self._streams = 0  # running stream calls: each carries requests that come when they come
        self._changed = asyncio.Event()
        self._last_change = clock()  # the latest arrival or finish
        self._quiet_before_s = 0.0  # how long the server held no call before the latest arrival

    @property
    def in_flight(self) -> int:
        return self._running + self._arrivals.calls

    @property
    def lone_call(self) -> bool:
        """The one call in flight is a unary call that arrived after a quiet spell (batcher.LoneCallSignal)."""
        return self._streams == 0 and self.in_flight <= 1 and self._quiet_before_s >= self.QUIET_S

    def arrived(self, *, unary: bool) -> int:
        """A call's headers arrived; returns its ticket for `started`."""
        now = self._clock()
        self._quiet_before_s = now - self._last_change if self.in_flight == 0 else 0.0
        self._last_change = now
        return self._arrivals.arrived(unary=unary)

    def started(self, ticket: int, *, stream: bool = False) -> None:
        self._arrivals.started(ticket)
        self._running += 1
        self._streams += stream

    def finished(self, *, stream: bool = False) -> None:
        self._running -= 1
        self._streams -= stream
        self._last_change = self._clock()
        self._changed.set()

    async def wait_idle(self, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """True once no admitted call is running or arriving; False if timeout_s passes first, or
        `interrupt` is set first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.in_flight == 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (interrupt is not None and interrupt.is_set()):
                return False
            self._changed.clear()
            waits = [asyncio.ensure_future(self._changed.wait())]
            if interrupt is not None:
                waits.append(asyncio.ensure_future(interrupt.wait()))
            # Wake on each finished call or the interrupt, and poll for arrivals that never come.
            _done, pending = await asyncio.wait(waits, timeout=min(remaining, 0.05),
                                                return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
