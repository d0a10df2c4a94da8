"""Dynamic batching for one model: queue -> batch -> pad + mask -> run -> split.

Knows nothing of gRPC, protobuf or ONNX Runtime: it is given a blocking `run_batch(feeds,
want_probs)` and runs it on its own worker threads, so the event loop keeps accepting requests.

- Policy: a lone request on an idle model runs at once; while a batch runs, what waits merges
  into the next run (up to `max_batch_size` rows), waiting up to `max_queue_delay_s` only while
  company is coming (another batch runs, or the `arrivals` signal says requests are on the way).
- Solo runs: a batch of one request while the server holds no other call runs on `run_solo`,
  whose threads spin so the next lone request finds the cores awake; a solo run whose shape last
  ran within INLINE_SOLO_MAX_S (or a shape holding it: no fewer rows, no shorter lengths, the same
  masking and outputs) computes on the event loop itself (nothing else waits there).
- Warm-up: `submit(..., warm_up=SOLO or REGULAR)` sends a request down this path on the session
  kind asked for, before the model serves (server.warmup); its batch is told to no observer.
- Padding: requests are padded to the batch's longest query and key, padded keys masked; a
  request joins only within `max_padding_ratio` and `max_batch_scores`, and a flash-attention
  batch takes only requests that keep it on that graph.
- Masks and exactness: server.tensors (Work, merge, split), which attnserve.runtime uses too.
- Memory: each request reserves its cost in a memory.budget.MemoryBudget before it queues; a merged
  run's extra is reserved until the run ends; the reservation travels in its Result.
- Cancellation: a request whose caller is cancelled leaves the queue at once; in a running batch
  it is computed on for the others, and the last one to go stops the run (`stoppable_runs`: a
  RunStop), whose memory goes back when the run returns (it holds that memory until then).
More, and the figures behind each choice: docs/design.md ("The batcher") and docs/record/performance.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from attnserve.server import priority, scheduling
from attnserve.server.memory.budget import MemoryBudget, Reservation
from attnserve.server.memory.costs import Cost
from attnserve.server.quoting import escaped, logged
from attnserve.server.tensors import Result, RunBatch, RunStop, RunStopped, Work, batch_masking, compute_batch

logger = logging.getLogger(__name__)

# (rows, q_len, k_len, masking, want_probs) of a merged batch -> the attention scores per head its
# run holds at once (server.graphs.GraphSet.scores_held); the default: all rows x Lq x Lk of them.
ScoresOf = Callable[[int, int, int, str, bool], int]


def _all_scores(rows: int, q_len: int, k_len: int, masking: str, want_probs: bool) -> int:
    return rows * q_len * k_len


# The session kinds a warm-up request asks for (submit's warm_up; server.warmup's names).
REGULAR, SOLO = "regular", "solo"


class QueueFull(Exception):
    """The model's queue is at max_queue_size: the request is shed at once."""


class DeadlineExpired(Exception):
    """The request's deadline passed while it was queued; it was never computed."""


class BatcherClosed(Exception):
    """The batcher is shutting down and takes no new requests."""


# Where a request was when its caller went away (Stage.name; request_path counts cancellations by it).
QUEUED = "queued"  # waiting for memory or in the queue: it leaves at once, never computed
RUNNING = "running"  # its batch computes: on for the other requests, or until the last one goes
TERMINATED = "terminated"  # the last request of its running batch to go: the run was stopped


@dataclass(slots=True)
class Stage:
    """Where one request is in its batcher, kept up to date for its caller (QUEUED, RUNNING,
    TERMINATED), so that a cancellation can be counted by where it stopped the request."""

    name: str = QUEUED


class BatchFailed(Exception):
    """The run of the batch this request was in raised; the cause is chained.

    public: what a client may be told (no ONNX Runtime internals); logged: whether the failure
    and its traceback are in the log already (once per batch, not once per request)."""

    def __init__(self, message: str, *, public: str, logged: bool) -> None:
        super().__init__(message)
        self.public = public
        self.logged = logged


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 32  # rows (sequences) per run; a larger single request runs alone
    max_queue_delay_s: float = 0.001
    max_queue_size: int = 512
    max_padding_ratio: float = 0.5
    batches_in_flight: int = 1
    # Input bytes waiting in the queue; a request that would pass it is shed (one request is
    # always admitted to an empty queue, so the bound is max(this, one request)).
    max_queued_bytes: int = 1 << 30
    # rows x Lq x Lk of a merged, padded batch (its attention matrix per head); a request only
    # joins a batch that stays within it (the oldest request always goes). None: no bound.
    max_batch_scores: int | None = None
    # A waiting request gains a priority level per this many batches formed without it
    # (server.scheduling: no level starves).
    priority_aging_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue_size", "batches_in_flight", "max_queued_bytes",
                     "priority_aging_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be >= 0, got {self.max_queue_delay_s}")
        if not 0.0 <= self.max_padding_ratio < 1.0:
            raise ValueError(f"max_padding_ratio must be in [0, 1), got {self.max_padding_ratio}")
        if self.max_batch_scores is not None and self.max_batch_scores < 1:
            raise ValueError(f"max_batch_scores must be >= 1, got {self.max_batch_scores}")


@dataclass(frozen=True)
class BatchStats:
    requests: int
    rows: int
    padding_ratio: float  # padded share of the batch's (rows, Lq, Lk) attention matrix
    compute_s: float  # merge + run + split, as the batch's requests saw it
    queue_s: tuple[float, ...]  # each request's wait
    failed: bool
    merge_s: float = 0.0  # padding and concatenating the inputs
    run_s: float = 0.0  # the ONNX Runtime run
    split_s: float = 0.0  # slicing each request's outputs back
    solo: bool = False  # ran on run_solo ("Solo runs")
    terminated: bool = False  # stopped midway: every request of it was cancelled (not a failure)


class BatchObserver(Protocol):
    def on_batch(self, stats: BatchStats) -> None: ...
    def on_queue_depth(self, depth: int) -> None: ...
    def on_runs(self, running: int) -> None: ...


class ArrivalSignal(Protocol):
    """Requests on their way to a batcher: received by the server, not submitted yet (the
    server's lifecycle.Arrivals). A hint that company is coming even while no batch runs."""

    @property
    def arriving(self) -> int: ...


class LoneCallSignal(Protocol):
    """Whether the call being dispatched is the only one the server holds, after a quiet spell
    (the server's lifecycle.Admission): its batch then runs on `run_solo` ("Solo runs")."""

    @property
    def lone_call(self) -> bool: ...


class BatchTracer(Protocol):
    """Told of each batch run with the spans its requests' calls handed in (server.tracing)."""

    def batch_done(self, stats: BatchStats, served: list[tuple[Work, object]]) -> None: ...


class Costing(Protocol):
    """What requests and merged batches of one model version cost in memory (server.memory, on
    the graph each run takes: models.GraphCosting)."""

    def cost(self, work: Work) -> Cost: ...
    def batch_run(self, rows: int, q_len: int, k_len: int, masking: str, want_probs: bool) -> int: ...


@dataclass(slots=True, eq=False)  # identity: a cancelled one is removed from the queue by it
class _Pending:
    work: Work
    deadline: float | None  # time.monotonic()
    future: asyncio.Future
    enqueued_at: float
    reservation: Reservation | None = None
    run_share: int = 0  # the run of this request alone, reserved in `reservation`
    trace: object = None  # its call's span, for the batch's (BatchTracer); None: untraced
    priority: int = 1  # its level, 1 the highest (server.scheduling)
    since: int = 0  # the queue's batch count when it arrived: its aging (set by the queue)
    expiry: asyncio.TimerHandle | None = None  # refuses it when its deadline passes in the queue
    stage: Stage | None = None  # its caller's view of where it is
    run: _Run | None = None  # the batch computing it, once taken from the queue
    warm_up: str | None = None  # a warm-up request's session kind (REGULAR, SOLO); None: a caller's

    def drop(self) -> None:
        """It will not be answered with a Result: its memory goes back."""
        if self.reservation is not None:
            self.reservation.release()


@dataclass(slots=True, eq=False)
class _Run:
    """A batch being computed: its requests, and its run's off switch (None: it cannot stop)."""

    batch: list[_Pending]
    stop: RunStop | None


# The longest solo run computed on the event loop ("Solo runs"), judged by the last solo run of
# the same shape: long enough for the reference workloads' short runs, short enough that the loop
# never stalls (docs/record/performance.md, "The event loop first").
INLINE_SOLO_MAX_S = 0.002
SOLO_SHAPES_TIMED = 64  # the shapes whose last solo run's time is kept (the least recent dropped)


class Batcher:
    def __init__(self, name: str, run_batch: RunBatch, policy: BatchPolicy,
                 observer: BatchObserver | None = None, arrivals: ArrivalSignal | None = None,
                 scores_of: ScoresOf | None = None, budget: MemoryBudget | None = None,
                 costing: Costing | None = None, run_solo: RunBatch | None = None,
                 lone_call_signal: LoneCallSignal | None = None, compute_nice: int = 0,
                 tracer: BatchTracer | None = None, writes_into: bool = False, stoppable_runs: bool = False) -> None:
        """writes_into: run_batch and run_solo take `into` (server.tensors.compute_batch): a lone
        request's outputs are written by the run where the request says (shared memory).
        stoppable_runs: run_batch and run_solo take `stop=` (a RunStop) and end early when it is
        stopped (the engine's do): a batch whose requests are all cancelled stops computing."""
        self.name = name
        self._writes_into = writes_into
        self._stoppable_runs = stoppable_runs
        self._tracer = tracer
        self._run_batch = run_batch
        self._run_solo = run_solo if lone_call_signal is not None else None  # see _runs_solo
        self._lone_call_signal = lone_call_signal
        # Seconds the last solo run of each shape computed for (_solo_shape), most recent last.
        self._solo_seconds: collections.OrderedDict[tuple, float] = collections.OrderedDict()
        self.policy = policy
        self._scores_of = scores_of or _all_scores  # what a merged batch's run holds, for max_batch_scores
        self._observer = observer
        self._pending = scheduling.PriorityQueue(policy.priority_aging_batches)
        self._queued_bytes = 0  # sum of work.nbytes over _pending
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(policy.batches_in_flight)
        self._running: set[asyncio.Task] = set()
        self._computing = 0  # batches between dispatch and the release of their slot
        self._arrivals = arrivals  # see _worth_waiting
        if (budget is None) != (costing is None):
            raise ValueError("a memory budget needs a costing, and a costing a budget")
        self._budget = budget
        self._costing = costing
        # Its runs' threads give way to the event loop where both want a core (server.priority).
        self._executor = ThreadPoolExecutor(max_workers=policy.batches_in_flight, thread_name_prefix=f"run-{name}",
                                            initializer=priority.lower_this_thread, initargs=(compute_nice,))
        self._closing = False
        self._loop_task: asyncio.Task | None = None

    @property
    def run_batch(self) -> RunBatch:
        return self._run_batch

    @property
    def stoppable_runs(self) -> bool:
        """Whether run_batch and run_solo take `stop=` (server.native's runner hands its RunStop)."""
        return self._stoppable_runs

    @property
    def run_solo(self) -> RunBatch | None:
        """The solo sessions' run (None without them): for server.native's lone requests."""
        return self._run_solo

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    def _worth_waiting(self) -> bool:
        """Worth waiting for: another batch runs, or requests are on their way in (received,
        not yet submitted). A lone request on an idle server sees neither and goes at once."""
        return self._computing > 0 or (self._arrivals is not None and self._arrivals.arriving > 0)

    def _runs_solo(self, batch: list[_Pending]) -> bool:
        """One request, nothing else queued or running here, none elsewhere ("Solo runs")."""
        return (self._run_solo is not None and len(batch) == 1 and not self._pending and self._computing == 1
                and self._lone_call_signal.lone_call)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._collect_forever(), name=f"batcher-{self.name}")

    async def submit(self, work: Work, deadline: float | None = None, trace: object = None,
                     priority: int = 1, stage: Stage | None = None, warm_up: str | None = None) -> Result:
        """Queue one request and wait for its own result. Raises QueueFull, DeadlineExpired,
        BatcherClosed or BatchFailed; cancelling the caller takes the request out of the queue,
        or out of its running batch (the last one out stops the run: `stoppable_runs`).
        deadline (time.monotonic()): refused unrun once it passes while queued.
        trace: its call's span, handed to the tracer with its batch's (server.tracing).
        priority: its level, 1 the highest (server.scheduling's queue order).
        stage: kept up to date with where the request is (Stage), for its caller.
        warm_up: a warm-up request (server.warmup), run alone on this session kind (REGULAR, or
        SOLO where there are solo sessions) and told to no observer or tracer."""
        if self._closing:
            raise BatcherClosed(f"model {self.name} is shutting down")
        if len(self._pending) >= self.policy.max_queue_size:
            raise QueueFull(f"model {self.name}: {len(self._pending)} requests queued "
                            f"(max_queue_size {self.policy.max_queue_size}); retry later")
        nbytes = work.nbytes
        if self._pending and self._queued_bytes + nbytes > self.policy.max_queued_bytes:
            raise QueueFull(f"model {self.name}: {self._queued_bytes:,} input bytes queued; this request's "
                            f"{nbytes:,} would pass max_queued_bytes {self.policy.max_queued_bytes:,}; retry later")
        reservation, run_share = None, 0
        if self._budget is not None:
            cost = self._costing.cost(work)
            # Returns at once (no await point) when it fits: see lifecycle.Arrivals.
            reservation = await self._budget.reserve(
                cost.total, deadline, first=cost.inputs,
                what=f"model {self.name}: this request (inputs {cost.inputs:,}, run {cost.run:,}, "
                     f"answer {cost.answer:,} bytes)")
            if reservation is None:
                raise DeadlineExpired(f"model {self.name}: deadline passed while waiting for memory "
                                      f"({cost.total:,} bytes); not computed")
            run_share = cost.run
            if self._closing:
                reservation.release()
                raise BatcherClosed(f"model {self.name} is shutting down")
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            if reservation is not None:
                reservation.release()
            raise DeadlineExpired(f"model {self.name}: the request's deadline passed before it was queued; "
                                  "not computed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = _Pending(work, deadline, future, now, reservation, run_share, trace, priority=priority, stage=stage,
                           warm_up=warm_up)
        self._enqueue(pending, loop)
        try:
            return await future  # cancelling the caller cancels the future
        except BaseException:
            if not future.done() or future.cancelled():
                self._cancelled(pending)
            elif future.exception() is None:
                future.result().release()  # answered, but the caller is gone
            else:
                pending.drop()
            raise

    def _enqueue(self, pending: _Pending, loop: asyncio.AbstractEventLoop) -> None:
        self._pending.append(pending)
        self._queued_bytes += pending.work.nbytes
        if pending.deadline is not None:
            # The loop's clock is time.monotonic(): refused when it expires, not when a batch forms.
            pending.expiry = loop.call_at(pending.deadline, self._expire, pending)
        self._wakeup.set()
        self._report_depth()

    def _expire(self, pending: _Pending) -> None:
        """Its deadline passed while it waited: out of the queue and refused, never computed."""
        pending.expiry = None
        if not self._pending.remove(pending):
            return  # taken into a batch meanwhile
        self._queued_bytes -= pending.work.nbytes
        if not pending.future.done():
            pending.future.set_exception(DeadlineExpired(
                f"deadline passed after {time.monotonic() - pending.enqueued_at:.3f}s in the queue of model "
                f"{self.name} ({len(self._pending)} requests still queued); not computed"))
        pending.drop()
        self._report_depth()

    @staticmethod
    def _dequeued(pending: _Pending) -> None:
        """It leaves the queue (into a batch, or dropped): its expiry timer goes."""
        if pending.expiry is not None:
            pending.expiry.cancel()
            pending.expiry = None


    # -- cancellation (docs/scheduling.md, "Cancellation") -----------------------------------

    def _cancelled(self, pending: _Pending) -> None:
        """Its caller is gone: out of the queue now, or out of its running batch, whose run the
        last request to go stops. A running request's memory goes back when its run returns
        (_run): the run holds it until then, and a stopped run returns within one graph node."""
        run = pending.run
        if run is None:
            self._withdraw(pending)
            pending.drop()
            return
        if run.stop is not None and not run.stop.stopped and all(p.future.done() for p in run.batch):
            run.stop.stop()
            if pending.stage is not None:
                pending.stage.name = TERMINATED

    def _withdraw(self, pending: _Pending) -> None:
        """A queued request leaves the queue at once: its depth and bytes no longer count."""
        self._dequeued(pending)
        if not self._pending.remove(pending):
            return  # not queued: still waiting for memory, or closed
        self._queued_bytes -= pending.work.nbytes
        self._report_depth()

    async def close(self, abandon_queued: bool = False) -> None:
        """Take no new requests, finish every running one and, unless `abandon_queued`, every
        queued one; abandoned requests fail with BatcherClosed (never computed: safe to retry)."""
        self._closing = True
        if abandon_queued:
            for p in self._pending.clear():
                self._dequeued(p)
                if not p.future.done():
                    p.future.set_exception(BatcherClosed(
                        f"model {self.name}: shutting down, not started within the grace period; "
                        "retry on another replica"))
                p.drop()
            self._queued_bytes = 0
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- the collector ----------------------------------------------------------------------

    async def _collect_forever(self) -> None:
        while True:
            await self._slots.acquire()  # an execution slot is free: whatever waits goes now
            while not self._pending:
                if self._closing:
                    self._slots.release()
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            if self.policy.max_queue_delay_s > 0 and self._worth_waiting():
                await self._wait_for_company()
            batch, extra = self._take_batch()
            if not batch:
                self._slots.release()
                continue
            self._start(batch, extra)
            # This coroutine waits for its next batch holding no reference to this one: a batch's
            # tensors (its requests' received bytes, its outputs) go as soon as its answers do.
            del batch, extra

    def _start(self, batch: list[_Pending], extra: Reservation | None) -> None:
        self._computing += 1
        run = _Run(batch, RunStop() if self._stoppable_runs else None)
        for p in batch:
            p.run = run
            if p.stage is not None:
                p.stage.name = RUNNING
        self._report_runs()
        task = asyncio.get_running_loop().create_task(self._run(run, extra))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _wait_for_company(self) -> None:
        """Company is coming: let a partial batch fill until the oldest request has waited
        max_queue_delay_s, or until no company is coming any more (an idle model never waits)."""
        deadline = self._pending.oldest().enqueued_at + self.policy.max_queue_delay_s
        while (self._worth_waiting() and sum(p.work.rows for p in self._pending) < self.policy.max_batch_size
               and not self._closing):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> tuple[list[_Pending], Reservation | None]:
        """The first live request in service order (priority, aged, then arrival:
        server.scheduling) plus every compatible one that waits, in that order, and the memory
        the merged run needs beyond its requests' own reservations (padding)."""
        now = time.monotonic()
        extra_free = self._budget.free_bytes if self._budget is not None else 0
        shares = 0  # sum of run_share over chosen requests
        chosen: list[_Pending] = []
        kept: list[_Pending] = []
        rows = q_len = k_len = 0
        useful = 0  # sum of rows * lq * lk over chosen requests
        exact_k_lens: set[int] = set()
        maskings: set[str] = set()
        same_k_len = True  # every chosen request has the batch's key length (no key is padded)
        want_probs = False
        held = 0  # scores per head the chosen batch's run holds (scores_of)
        for p in self._pending.in_service_order():
            if p.future.done():  # cancelled by its caller (client gone, deadline hit in gRPC)
                self._dequeued(p)
                p.drop()
                continue
            if p.deadline is not None and p.deadline <= now:  # expired, its timer not yet run
                self._dequeued(p)
                p.future.set_exception(DeadlineExpired(
                    f"deadline passed after {now - p.enqueued_at:.3f}s in the queue of model {self.name}; "
                    "not computed"))
                p.drop()
                continue
            w = p.work
            if chosen:
                new_rows = rows + w.rows
                new_q, new_k = max(q_len, w.q_len), max(k_len, w.k_len)
                new_useful = useful + w.rows * w.q_len * w.k_len
                exact = exact_k_lens | ({w.k_len} if w.exact_k_len else set())
                new_masking = batch_masking(maskings | {w.masking}, same_k_len and k_len == w.k_len)
                new_held = self._scores_of(new_rows, new_q, new_k, new_masking, want_probs or w.want_probs)
                fits = (
                    new_rows <= self.policy.max_batch_size
                    and 1.0 - new_useful / (new_rows * new_q * new_k) <= self.policy.max_padding_ratio
                    and all(k == new_k for k in exact)
                    and (self.policy.max_batch_scores is None or new_held <= self.policy.max_batch_scores)
                    and (held > 0 or new_held == 0)  # a batch on the flash path stays on it
                    and (self._costing is None  # the merged run's memory beyond its requests' own
                         or self._costing.batch_run(new_rows, new_q, new_k, new_masking, want_probs or w.want_probs)
                         - shares - p.run_share <= extra_free)
                )
                if not fits:
                    kept.append(p)
                    continue
                held = new_held
            else:
                held = self._scores_of(w.rows, w.q_len, w.k_len, w.masking, w.want_probs)
            same_k_len = not chosen or (same_k_len and k_len == w.k_len)
            self._dequeued(p)
            chosen.append(p)
            shares += p.run_share
            rows += w.rows
            q_len, k_len = max(q_len, w.q_len), max(k_len, w.k_len)
            useful += w.rows * w.q_len * w.k_len
            if w.exact_k_len:
                exact_k_lens.add(w.k_len)
            maskings.add(w.masking)
            want_probs = want_probs or w.want_probs
        self._pending.batch_formed(kept, batch_taken=bool(chosen))
        self._queued_bytes = sum(p.work.nbytes for p in kept)
        self._report_depth()
        extra = None
        if len(chosen) > 1 and self._costing is not None:
            masking = batch_masking(maskings, same_k_len)
            needed = self._costing.batch_run(rows, q_len, k_len, masking, want_probs) - shares
            if needed > 0:
                extra = self._budget.try_reserve(needed)  # fits: checked for each request above
        return chosen, extra

    # -- running a batch --------------------------------------------------------------------

    async def _run(self, run: _Run, extra: Reservation | None = None) -> None:
        batch = run.batch
        started = time.monotonic()
        queue_s = tuple(started - p.enqueued_at for p in batch)
        failed = True
        terminated = False
        padding_ratio = 0.0
        timings = (0.0, 0.0, 0.0)
        warm_up = batch[0].warm_up if all(p.warm_up for p in batch) else None  # a warm-up's batch: unobserved
        if warm_up is not None and len(batch) == 1:
            solo = warm_up == SOLO and self._run_solo is not None
        else:
            solo = self._runs_solo(batch)
        try:
            works = [p.work for p in batch]
            loop = asyncio.get_running_loop()
            shape = _solo_shape(works[0]) if solo else None
            if solo and self._solo_estimate(shape) <= INLINE_SOLO_MAX_S:
                results, padding_ratio, timings = compute_batch(self._run_solo, works,  # on the loop ("Solo runs")
                                                                self._writes_into)
            else:
                results, padding_ratio, timings = await loop.run_in_executor(
                    self._executor, _compute_handed, self._run_solo if solo else self._run_batch, [works],
                    self._writes_into, run.stop)
            if solo:
                self._time_solo_run(shape, sum(timings))
            compute_s = time.monotonic() - started
            for p, (output, attn_probs), waited in zip(batch, results, queue_s, strict=True):
                if not p.future.done():
                    p.future.set_result(Result(output, attn_probs, waited, compute_s, len(batch), p.reservation))
                else:
                    p.drop()
            failed = False
        except Exception as err:
            if run.stop is not None and run.stop.stopped:  # every request was cancelled: nobody to tell
                if not isinstance(err, RunStopped):
                    logger.debug("model %s: a stopped run raised %s: %s", logged(self.name), type(err).__name__,
                                 escaped(err))
                failed, terminated = False, True
                for p in batch:
                    p.drop()
                return
            logger.exception("model %s: batch of %d requests failed", logged(self.name), len(batch))
            for p in batch:
                if not p.future.done():
                    failure = BatchFailed(
                        f"model {self.name}: the batch this request was in failed: {type(err).__name__}: {err}",
                        public=f"model {self.name}: the batch this request was in failed "
                               f"({type(err).__name__}; the server log has the traceback)",
                        logged=True)  # just above, once for the batch
                    failure.__cause__ = err
                    p.future.set_exception(failure)
                p.drop()
        finally:
            if extra is not None:
                extra.release()
            for p in batch:
                p.run = None  # no cycle: the batch goes with its callers' last references
            self._computing -= 1
            self._report_runs()
            self._slots.release()
            self._wakeup.set()  # a partial batch waiting for company stops waiting once the model idles
            if warm_up is None and (self._observer is not None or self._tracer is not None):
                stats = BatchStats(
                    requests=len(batch), rows=sum(p.work.rows for p in batch), padding_ratio=padding_ratio,
                    compute_s=time.monotonic() - started, queue_s=queue_s, failed=failed,
                    merge_s=timings[0], run_s=timings[1], split_s=timings[2], solo=solo, terminated=terminated)
                if self._observer is not None:
                    self._observer.on_batch(stats)
                if self._tracer is not None:
                    self._tracer.batch_done(stats, [(p.work, p.trace) for p in batch])

    def _solo_estimate(self, shape: tuple) -> float:
        """Seconds a solo run of `shape` should take: its own last run's, else the least of the
        timed shapes that hold it (no fewer rows, no shorter lengths, the same masking and
        outputs: a run of it costs no less), else infinity. So a first call shorter than one the
        warm-up ran computes where its later calls will."""
        seconds = self._solo_seconds.get(shape)
        if seconds is not None:
            return seconds
        rows, q_len, k_len, masking, want_probs = shape
        return min((t for (r, q, k, m, p), t in self._solo_seconds.items()
                    if m == masking and p == want_probs and r >= rows and q >= q_len and k >= k_len), default=math.inf)

    def _time_solo_run(self, shape: tuple, seconds: float) -> None:
        self._solo_seconds[shape] = seconds
        self._solo_seconds.move_to_end(shape)
        if len(self._solo_seconds) > SOLO_SHAPES_TIMED:
            self._solo_seconds.popitem(last=False)

    def _report_depth(self) -> None:
        if self._observer is not None:
            self._observer.on_queue_depth(len(self._pending))

    def _report_runs(self) -> None:
        if self._observer is not None:
            self._observer.on_runs(self._computing)


def _compute_handed(run_batch: RunBatch, handed: list[list[Work]], writes_into: bool, stop: RunStop | None):
    """compute_batch on the works handed over: the executor's work item, which its (lowered)
    thread drops only once it is scheduled again, then holds no Work, whose arrays (and, for a
    request with outputs in shared memory, the writers that hold its region open) would stay
    until then."""
    return compute_batch(run_batch, handed.pop(), writes_into, stop)


def _solo_shape(work: Work) -> tuple:
    """What a solo run's time depends on: rows, lengths, the graph its masking and attn_probs take."""
    return work.rows, work.q_len, work.k_len, work.masking, work.want_probs
