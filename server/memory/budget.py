"""The process's one memory budget (--memory-limit-bytes), shared by every model and transport.

    budget = MemoryBudget(limit, on_idle=reclaimer.on_idle, on_crowded=reclaimer.on_crowded)
    reservation = await budget.reserve(nbytes, deadline)  # every batcher, before a request queues
    reservation.release()                                  # the transport, once the answer is sent

Knows nothing of gRPC or ONNX Runtime; what a request costs is server.memory.costs' estimate.
With the native data plane the reserved bytes live in its counter (shared_counter: native calls
take from the same budget, server.native.share_budget).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable


class MemoryTooLarge(ValueError):
    """A request that alone could never fit the memory budget (INVALID_ARGUMENT: do not retry as is)."""


class MemoryExhausted(Exception):
    """The memory budget is spent now and the request has no deadline to wait within: shed at
    once (RESOURCE_EXHAUSTED: retry later)."""


class Reservation:
    """Bytes taken from a MemoryBudget; `release()` gives them back (once; later calls do nothing)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: MemoryBudget | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)


class _LocalCounter:
    """The reserved bytes and the queue of waiters of a budget that no native data plane shares
    (the native one is attnserve.server._native.Budget, with the same calls and rule: both planes'
    waiters then queue there, in one arrival order: MemoryBudget.shared_counter)."""

    __slots__ = ("_limit", "_room", "_reserved", "_waiting", "_queue", "_granted", "_tickets")

    def __init__(self, limit_bytes: int, room_bytes: int) -> None:
        self._limit, self._room, self._reserved, self._waiting = limit_bytes, room_bytes, 0, 0
        self._queue: collections.deque[tuple[int, int, int]] = collections.deque()  # (ticket, total, first)
        self._granted: list[int] = []
        self._tickets = itertools.count(1)

    def _fits(self, nbytes: int, waiting: int) -> bool:
        # Under the limit less the waiting room, or alone (nothing reserved) under the limit.
        return self._reserved + nbytes <= self._limit - self._room or (
            self._reserved == 0 and nbytes + waiting <= self._limit)

    def _can_wait(self, nbytes: int, first: int) -> bool:
        """Whether its inputs fit the waiting room and, with it added, every waiter could be
        admitted in turn once nothing else is reserved."""
        if self._waiting + first > self._room:
            return False
        behind = 0  # inputs of the waiters after the one looked at, which stay while it is admitted
        for _, total, own in [(0, nbytes, first), *reversed(self._queue)]:
            if total > self._limit - self._room and total + behind > self._limit:
                return False
            behind += own
        return True

    def take(self, nbytes: int, first: int, wait: bool) -> int:
        """0: taken now (nobody waits and it fits); > 0: a ticket, waiting in arrival order; -1: refused."""
        if not self._queue and self._fits(nbytes, self._waiting):
            self._reserved += nbytes
            return 0
        first = min(first, nbytes)
        if not wait or not self._can_wait(nbytes, first):
            return -1
        ticket = next(self._tickets)
        self._queue.append((ticket, nbytes, first))
        self._waiting += first
        return ticket

    def leave(self, ticket: int) -> bool:
        """A waiter gives up: True if it left the queue, False if it was granted first."""
        for entry in self._queue:
            if entry[0] == ticket:
                self._queue.remove(entry)
                self._waiting -= entry[2]
                self._admit()
                return True
        return False

    def give(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self._admit()

    def _admit(self) -> None:
        while self._queue:
            ticket, total, first = self._queue[0]
            if not self._fits(total, self._waiting - first):
                return
            self._queue.popleft()
            self._reserved += total
            self._waiting -= first
            self._granted.append(ticket)

    def granted(self) -> list[int]:
        granted, self._granted = self._granted, []
        return granted

    def went_idle(self) -> bool:
        return False  # only the shared counter wakes the budget (MemoryBudget.wake)

    def reserved(self) -> int:
        return self._reserved

    def waiting_bytes(self) -> int:
        return self._waiting

    def waiters(self) -> int:
        return len(self._queue)

    def native_shed(self) -> int:
        return 0

    def native_too_large(self) -> int:
        return 0

    def native_waits(self) -> int:
        return 0

    def native_wait_timeouts(self) -> int:
        return 0


class _Waiter:
    __slots__ = ("total", "future")

    def __init__(self, total: int, future: asyncio.Future) -> None:
        self.total = total  # what it needs once admitted
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
        server gives freed heap memory back to the system then (server.memory.reclaim).
        on_crowded: called (on the event loop) whenever a second large use comes to be held at
        once (granted or waiting): the heap turns lean (server.memory.reclaim)."""
        if limit_bytes < 1:
            raise ValueError(f"memory limit must be >= 1 byte, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._on_idle = on_idle
        self._on_crowded = on_crowded
        self.large_uses = 0  # large reservations and waiters held now
        self._high_water = 0  # most reserved since the budget was last empty
        self._room = int(limit_bytes * self.WAITING_ROOM)
        # Granted reservations and the queue of waiters: here, or in the counter both data planes
        # share (shared_counter()); this plane's waiters by their ticket there.
        self._counter = _LocalCounter(limit_bytes, self._room)
        self._waiting: dict[int, _Waiter] = {}
        # Counted since start (server.metrics exposes them, with the native plane's): requests
        # that waited for memory, shed at once (MemoryExhausted), whose deadline passed while
        # they waited, and refused as never fitting (MemoryTooLarge).
        self._waits = 0
        self._shed = 0
        self._wait_timeouts = 0
        self._too_large = 0

    def shared_counter(self, make: Callable[[int, int], object]) -> object:
        """Makes the counter (make(limit_bytes, room_bytes): the native data plane's
        _native.Budget) that holds this budget's reservations from now on, so that both planes
        take from one budget; before anything is reserved. Its releases call wake() (the caller
        wires its wake_fd to the event loop)."""
        if self.reserved_bytes or self._counter.waiters():
            raise RuntimeError("the budget's counter is shared before anything is reserved")
        self._counter = make(self.limit_bytes, self._room)
        return self._counter

    def wake(self) -> None:
        """The shared counter granted some of this plane's waiters (a native release made room), or
        a release of either plane emptied it after a large use (on_idle is due)."""
        self._settle_granted()
        if self._counter.went_idle():
            self._high_water = max(self._high_water, self.IDLE_AFTER_BYTES)
        self._maybe_idle()

    @property
    def reserved_bytes(self) -> int:
        """Granted reservations, of both data planes."""
        return self._counter.reserved()

    @property
    def shed(self) -> int:
        return self._shed + self._counter.native_shed()

    @property
    def too_large(self) -> int:
        return self._too_large + self._counter.native_too_large()

    @property
    def waits(self) -> int:
        return self._waits + self._counter.native_waits()

    @property
    def wait_timeouts(self) -> int:
        return self._wait_timeouts + self._counter.native_wait_timeouts()

    def count_shed(self) -> None:
        """One more request shed for memory by a transport's own reservation (server.rest's bodies)."""
        self._shed += 1

    @property
    def waiters(self) -> int:
        """Requests waiting for memory now, both planes'."""
        return self._counter.waiters()

    @property
    def waiting_bytes(self) -> int:
        """Inputs of the requests waiting for memory now, both planes'."""
        return self._counter.waiting_bytes()

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.waiting_bytes

    @property
    def free_bytes(self) -> int:
        """What can be taken now without waiting (nothing while someone waits)."""
        return 0 if self._counter.waiters() else max(self.limit_bytes - self._room - self.reserved_bytes, 0)

    def check_fits(self, nbytes: int, what: str) -> None:
        """MemoryTooLarge if `nbytes` could never fit, whatever else ran."""
        if nbytes > self.limit_bytes:
            self._too_large += 1
            raise MemoryTooLarge(f"{what} needs an estimated {nbytes:,} bytes of memory, over this server's "
                                 f"budget of {self.limit_bytes:,} bytes (--memory-limit-bytes); send fewer rows or "
                                 "shorter sequences, or ask for `output` alone")

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """Take `nbytes` now if they fit and nobody waits; else None."""
        if self._counter.take(nbytes, 0, False) != 0:
            return None
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
        # Taken now, or a ticket in the counter's one queue (both planes' waiters), in one step.
        ticket = self._counter.take(nbytes, first, deadline is not None)
        if ticket == 0:
            self._high_water = max(self._high_water, self.reserved_bytes)
            self._count_large(nbytes, +1)
            return Reservation(self, nbytes)
        if ticket < 0:
            self._shed += 1
            raise MemoryExhausted(f"memory budget: {self.used_bytes:,} of {self.limit_bytes:,} bytes in use "
                                  f"(--memory-limit-bytes), {self.waiters} request(s) waiting; {what} needs "
                                  f"{nbytes:,}; retry later" + ("" if deadline is not None else
                                                               " (a request with a deadline waits within it)"))
        waiter = _Waiter(nbytes, asyncio.get_running_loop().create_future())
        self._waits += 1
        self._waiting[ticket] = waiter
        self._count_large(nbytes, +1)  # waiting or admitted, it stays one large use
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), max(deadline - time.monotonic(), 0.0))
        except (TimeoutError, asyncio.CancelledError) as err:
            self._waiting.pop(ticket, None)
            waiter.future.cancel()
            if self._counter.leave(ticket):
                if isinstance(err, TimeoutError):
                    self._wait_timeouts += 1
                self._count_large(nbytes, -1)
                self._settle_granted()  # the ones behind it may have been granted
            else:
                self._give_back(nbytes)  # admitted just as it gave up
            if isinstance(err, asyncio.CancelledError):
                raise
            return None
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        self._counter.give(nbytes)
        self._count_large(nbytes, -1)
        self._settle_granted()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self.reserved_bytes == 0 and not self._counter.waiters():
            if self._on_idle is not None and self._high_water >= self.IDLE_AFTER_BYTES:
                self._on_idle()
            self._high_water = 0

    def _settle_granted(self) -> None:
        """This plane's waiters that the counter granted (their bytes are reserved there) go on."""
        for ticket in self._counter.granted():
            waiter = self._waiting.pop(ticket, None)
            if waiter is None:  # it gave up and gave the bytes back (reserve)
                continue
            self._high_water = max(self._high_water, self.reserved_bytes)
            waiter.future.set_result(None)
