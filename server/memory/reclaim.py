"""When the process gives memory back: the memory budget's two signals turned into heap passes.

    reclaimer = Reclaimer(loop, budget=lambda: server.budget)
    MemoryBudget(limit, on_idle=reclaimer.on_idle, on_crowded=reclaimer.on_crowded)

- on_crowded (a second large use held at once): the heap turns lean at once and trims.
- on_idle (the budget emptied after a large use): reclaim passes (collect, trim) a moment later
  and again after 5 and 15 s, each only while less than a large use is held (a new one ends in a
  new idle, and its own passes); a pass that finds at most one large use turns the heap roomy.
Passes run off the event loop (malloc_trim walks every heap). docs/design.md ("Reclaim").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from attnserve.server.memory import heap
from attnserve.server.memory.budget import MemoryBudget

# After the memory budget empties, the call that released it is still finishing (its request
# and response objects go when its handler's frames do): reclaim a moment later, lean; roomy, a
# second later, so that a client's next long request within it finds its heap resident
# (server.memory.heap, "Reclaim"). gRPC's core frees its own buffers of those calls later still (an
# answer leaves as the client's window allows, a connection's buffers go when it closes), and
# the last refused calls' exceptions, which hold their requests' tensors through their frames,
# become garbage as those calls end: reclaim again (collect, trim: cheap once heap.freeze_gc() ran)
# after 5 and 15 s.
LEAN_RECLAIM_DELAYS_S = (0.05, 1.0, 5.0, 15.0)
ROOMY_RECLAIM_DELAYS_S = (1.0, 5.0, 15.0)


class Reclaimer:
    def __init__(self, loop: asyncio.AbstractEventLoop, budget: Callable[[], MemoryBudget | None]) -> None:
        """budget: the budget whose use each pass looks at (created after the reclaimer)."""
        self._loop = loop
        self._budget = budget
        self._pending: list[asyncio.TimerHandle] = []

    def on_idle(self) -> None:
        for handle in self._pending:
            handle.cancel()
        delays = LEAN_RECLAIM_DELAYS_S if heap.is_lean() else ROOMY_RECLAIM_DELAYS_S
        self._pending[:] = [self._loop.call_later(delay_s, self._reclaim_if_quiet) for delay_s in delays]

    def on_crowded(self) -> None:
        if not heap.is_lean():
            heap.go_lean()
            self._loop.run_in_executor(None, heap.trim)

    def _reclaim_if_quiet(self) -> None:
        budget = self._budget()
        if budget is not None and budget.used_bytes < MemoryBudget.IDLE_AFTER_BYTES:
            if budget.large_uses < 2:
                heap.go_roomy()
            self._loop.run_in_executor(None, heap.reclaim)
