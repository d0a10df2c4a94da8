"""The state of the server's calls that several layers share; created once by app.Server.

    draining = Draining()            # the gate refuses new inference calls, the servicer says not ready
    arrivals = Arrivals()            # each Batcher reads arrivals.arriving
    admission = Admission(arrivals)  # the gate counts inference calls; Server.stop waits on it
    budget = MemoryBudget(limit)     # every batcher reserves what a request costs; transports release

Knows nothing of gRPC: the gate (server.gate) reports what gRPC tells it, when each call's
headers arrive and when its handler starts and returns.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Callable


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
    the next call from gRPC's core (whose queue it cannot see; docs/performance.md, "Solo runs",
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


class MemoryTooLarge(ValueError):
    """A request that alone could never fit the memory budget (INVALID_ARGUMENT: do not retry as is)."""


class MemoryExhausted(Exception):
    """The memory budget is spent now and the request has no deadline to wait within: shed at
    once (RESOURCE_EXHAUSTED: retry later)."""


class Reservation:
    """Bytes taken from a MemoryBudget; `release()` gives them back (once; later calls do nothing)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: "MemoryBudget | None", nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)


class _Waiter:
    __slots__ = ("total", "first", "future")

    def __init__(self, total: int, first: int, future: asyncio.Future) -> None:
        self.total = total  # what it needs once admitted
        self.first = first  # its inputs, counted while it waits (they are in memory already)
        self.future = future


class MemoryBudget:
    """The process's one memory budget (--memory-limit-bytes), shared by every model and transport.

    What is counted, by whoever holds it (server.batcher reserves each request's
    memory.request_cost before it queues and the extra of a merged batch before it runs; the
    transport releases a request's reservation once its answer is sent): queued inputs, runs in
    flight (their estimated peak working set), and answers encoded but not yet taken by the client.

    A request that does not fit now waits in arrival order (the oldest keeps its place: while one
    waits, nobody jumps ahead), within its deadline; one without a deadline is shed at once. While
    it waits its inputs (already in memory) are counted, in a share of the budget that
    reservations leave for them (WAITING_ROOM). A request larger than the rest runs alone, when
    nothing else is reserved. A new waiter is taken only if every waiter could still be admitted
    once the running work is done, so waiting never deadlocks. reserved + waiting <= limit, always."""

    WAITING_ROOM = 1 / 8
    # on_idle is called when nothing is reserved any more after at least this much was.
    IDLE_AFTER_BYTES = 64 << 20
    # A reservation or waiter of this much is a large use; on_crowded is called when two are held.
    LARGE_BYTES = 16 << 20

    def __init__(self, limit_bytes: int, on_idle: Callable[[], None] | None = None,
                 on_crowded: Callable[[], None] | None = None) -> None:
        """on_idle: called (on the event loop) when the budget empties after a large use: the
        server gives freed heap memory back to the system then (server.heap.reclaim).
        on_crowded: called (on the event loop) whenever a second large use comes to be held at
        once (granted or waiting): the heap turns lean (server.heap.crowd)."""
        if limit_bytes < 1:
            raise ValueError(f"memory limit must be >= 1 byte, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._on_idle = on_idle
        self._on_crowded = on_crowded
        self.large_uses = 0  # large reservations and waiters held now
        self._high_water = 0  # most reserved since the budget was last empty
        self.reserved_bytes = 0  # granted reservations
        self.waiting_bytes = 0  # inputs of the requests that wait
        self._room = int(limit_bytes * self.WAITING_ROOM)
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # Counted since start (server.metrics exposes them): requests that waited for memory,
        # shed at once (MemoryExhausted), whose deadline passed while they waited, and refused
        # as never fitting (MemoryTooLarge).
        self.waits = 0
        self.shed = 0
        self.wait_timeouts = 0
        self.too_large = 0

    @property
    def waiters(self) -> int:
        """Requests waiting for memory now."""
        return len(self._waiters)

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.waiting_bytes

    @property
    def free_bytes(self) -> int:
        """What can be taken now without waiting (nothing while someone waits)."""
        return 0 if self._waiters else max(self.limit_bytes - self._room - self.reserved_bytes, 0)

    def check_fits(self, nbytes: int, what: str) -> None:
        """MemoryTooLarge if `nbytes` could never fit, whatever else ran."""
        if nbytes > self.limit_bytes:
            self.too_large += 1
            raise MemoryTooLarge(f"{what} needs an estimated {nbytes:,} bytes of memory, over this server's "
                                 f"budget of {self.limit_bytes:,} bytes (--memory-limit-bytes); send fewer rows or "
                                 "shorter sequences, or ask for `output` alone")

    def _admits(self, nbytes: int, waiting_others: int) -> bool:
        """Whether `nbytes` may be granted now, `waiting_others` bytes of waiters' inputs staying."""
        if self.reserved_bytes + nbytes <= self.limit_bytes - self._room:
            return True
        return self.reserved_bytes == 0 and nbytes + waiting_others <= self.limit_bytes  # alone

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """Take `nbytes` now if they fit and nobody waits; else None."""
        if self._waiters or not self._admits(nbytes, self.waiting_bytes):
            return None
        self.reserved_bytes += nbytes
        self._high_water = max(self._high_water, self.reserved_bytes)
        self._count_large(nbytes, +1)
        return Reservation(self, nbytes)

    def _count_large(self, nbytes: int, step: int) -> None:
        if nbytes < self.LARGE_BYTES:
            return
        self.large_uses += step
        if step > 0 and self.large_uses == 2 and self._on_crowded is not None:
            self._on_crowded()

    async def reserve(self, nbytes: int, deadline: float | None, first: int = 0, what: str = "this request"
                      ) -> Reservation | None:
        """Take `nbytes`, waiting in arrival order until `deadline` (time.monotonic()) if they do
        not fit now. first: the part of it already in memory (its inputs), counted while it waits.
        Returns None if the deadline passed first; raises MemoryTooLarge (never fits) or
        MemoryExhausted (does not fit now: no deadline, or no room to wait)."""
        self.check_fits(nbytes, what)
        reservation = self.try_reserve(nbytes)
        if reservation is not None:
            return reservation
        first = min(first, nbytes)
        if deadline is None or not self._can_wait(nbytes, first):
            self.shed += 1
            raise MemoryExhausted(f"memory budget: {self.used_bytes:,} of {self.limit_bytes:,} bytes in use "
                                  f"(--memory-limit-bytes), {len(self._waiters)} request(s) waiting; {what} needs "
                                  f"{nbytes:,}; retry later" + ("" if deadline is not None else
                                                               " (a request with a deadline waits within it)"))
        waiter = _Waiter(nbytes, first, asyncio.get_running_loop().create_future())
        self.waits += 1
        self._waiters.append(waiter)
        self.waiting_bytes += first
        self._count_large(nbytes, +1)  # waiting or admitted, it stays one large use
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), max(deadline - time.monotonic(), 0.0))
        except (TimeoutError, asyncio.CancelledError) as err:
            if waiter.future.done() and not waiter.future.cancelled():
                self._give_back(nbytes)  # admitted just as it gave up
            else:
                if isinstance(err, TimeoutError):
                    self.wait_timeouts += 1
                waiter.future.cancel()
                self._waiters.remove(waiter)
                self.waiting_bytes -= first
                self._count_large(nbytes, -1)
                self._admit_waiters()
            if isinstance(err, asyncio.CancelledError):
                raise
            return None
        return Reservation(self, nbytes)

    def _can_wait(self, nbytes: int, first: int) -> bool:
        """Whether its inputs fit the waiting room and, with it added, every waiter could be
        admitted in turn once nothing else is reserved."""
        if self.waiting_bytes + first > self._room:
            return False
        behind = 0  # inputs of the waiters after the one looked at, which stay while it is admitted
        for total, own in [(nbytes, first), *((w.total, w.first) for w in reversed(self._waiters))]:
            if total > self.limit_bytes - self._room and total + behind > self.limit_bytes:
                return False
            behind += own
        return True

    def _give_back(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes
        self._count_large(nbytes, -1)
        self._admit_waiters()
        if self.reserved_bytes == 0 and not self._waiters:
            if self._on_idle is not None and self._high_water >= self.IDLE_AFTER_BYTES:
                self._on_idle()
            self._high_water = 0

    def _admit_waiters(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.cancelled():
                self._waiters.popleft()
                continue
            if not self._admits(head.total, self.waiting_bytes - head.first):
                return
            self._waiters.popleft()
            self.waiting_bytes -= head.first
            self.reserved_bytes += head.total
            self._high_water = max(self._high_water, self.reserved_bytes)
            head.future.set_result(None)
