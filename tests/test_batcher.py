"""The batcher alone, driven by a real attention computation (house style 13a).

`NumpyAttention` is a small multi-head attention in numpy (fixed random weights, masked scores
filled with -1e10 as in the seeds); `Model` wraps it as the batcher's blocking `run_batch`,
records every call's feeds, and can hold its runs on a gate so tests decide when the model is
busy instead of guessing with sleeps. One test runs the batcher over a real ONNX Runtime Engine.

No test here depends on the machine's speed: work in flight is held by the gate, a test waits for
the state it needs (a run begun, a request queued) rather than sleeping, and a time bound appears
only where waiting is the feature, as a lower bound or one far from the configured delay.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from attnserve.server.batcher import REGULAR as REGULAR_SESSION
from attnserve.server.batcher import SOLO as SOLO_SESSION
from attnserve.server.batcher import (
    Batcher,
    BatcherClosed,
    BatchFailed,
    BatchPolicy,
    BatchStats,
    DeadlineExpired,
    QueueFull,
)
from attnserve.server.graphs import GENERAL, KEY_PADDING, NO_MASK
from attnserve.server.lifecycle import Arrivals
from attnserve.server.tensors import Work, dense_mask, merge, split

QUERY_DIM = KV_DIM = OUT_DIM = 16
NUM_HEADS, HEAD_DIM = 2, 8
MASK_FILL = -1e10  # the seeds' fill for masked scores
TOL = 1e-5
# How long a test waits for a state it needs (a run begun, a request queued) before it fails, and
# how long a held run waits for the test to let it go: only a broken test or batcher takes this.
WAIT_S = 30.0
# A max_queue_delay_s no run may wait out: a request that ran well before it (FAR_BELOW_S) did
# not wait for it. 10 s against 30 s leaves any machine, however slow or shared, the margin.
LONG_DELAY_S = 30.0
FAR_BELOW_S = 10.0


class NumpyAttention:
    """Multi-head attention: (B, Lq, 16) over (B, Lk, 16) -> output (B, Lq, 16), attn_probs (B, 2, Lq, Lk)."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d_model = NUM_HEADS * HEAD_DIM
        scale = 1.0 / np.sqrt(QUERY_DIM)
        self.to_q = (rng.standard_normal((QUERY_DIM, d_model)) * scale).astype(np.float32)
        self.to_k = (rng.standard_normal((KV_DIM, d_model)) * scale).astype(np.float32)
        self.to_v = (rng.standard_normal((KV_DIM, d_model)) * scale).astype(np.float32)
        self.to_out = (rng.standard_normal((d_model, OUT_DIM)) * scale).astype(np.float32)
        self.out_bias = (rng.standard_normal(OUT_DIM) * 0.1).astype(np.float32)

    @staticmethod
    def _split_heads(x: np.ndarray) -> np.ndarray:
        b, s, _ = x.shape  # batch, seq, d_model
        return x.reshape(b, s, NUM_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)  # (b, h, s, dh)

    def __call__(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        query, key, value, mask = feeds["query"], feeds["key"], feeds["value"], dense_mask(feeds)
        b, lq, _ = query.shape  # batch, query length, query_dim
        q = self._split_heads(query @ self.to_q)  # (b, h, lq, dh)
        k = self._split_heads(key @ self.to_k)  # (b, h, lk, dh)
        v = self._split_heads(value @ self.to_v)  # (b, h, lk, dh)
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(HEAD_DIM))  # (b, h, lq, lk)
        scores = np.where(mask[:, None], scores, np.float32(MASK_FILL))
        scores = scores - scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        probs = (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)  # (b, h, lq, lk)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(b, lq, NUM_HEADS * HEAD_DIM)  # (b, lq, d_model)
        return (context @ self.to_out + self.out_bias).astype(np.float32), probs


ATTENTION = NumpyAttention()


@dataclass
class Call:
    feeds: dict[str, np.ndarray]
    want_probs: bool

    @property
    def rows(self) -> int:
        return self.feeds["query"].shape[0]

    def holds(self, work: Work) -> bool:
        """Whether this run computed `work`: some row starts with its (random, so unique) first query."""
        q = self.feeds["query"]
        if q.shape[1] < work.q_len:
            return False
        return bool((q[:, : work.q_len] == work.query[0]).all(axis=(1, 2)).any())


class Model:
    """The batcher's run_batch: the numpy attention, recording each call; optionally failing,
    returning the wrong number of rows, or held on a gate the test controls.

    hold(): every run from now on waits at the gate, after it is recorded; release(n) lets n
    held (or future) runs through; open() lets everything through again. `await
    run_started(n)` returns once the n-th run has begun (it is recorded, and held if the
    model is), so a test waits for the state it needs instead of sleeping."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.fail_next: Exception | None = None
        self.drop_a_row = False
        self._cond = threading.Condition()
        self._held = False
        self._passes = 0  # runs let through while held
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = []

    def hold(self) -> None:
        with self._cond:
            self._held, self._passes = True, 0

    def release(self, runs: int = 1) -> None:
        with self._cond:
            self._passes += runs
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    async def run_started(self, n: int) -> None:
        """Until the model has begun its n-th run (counting from 1)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if len(self.calls) >= n:
                return
            self._waiters.append((n, loop, future))
        await asyncio.wait_for(future, WAIT_S)

    def __call__(self, feeds: dict[str, np.ndarray], want_probs: bool):
        with self._cond:
            self.calls.append(Call({k: v.copy() for k, v in feeds.items()}, want_probs))
            begun = len(self.calls)
            due = [(loop, f) for n, loop, f in self._waiters if n <= begun]
            self._waiters = [w for w in self._waiters if w[0] > begun]
            for loop, future in due:  # this is a worker thread: tell the waiting loop safely
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            if not self._cond.wait_for(lambda: not self._held or self._passes > 0, WAIT_S):
                raise AssertionError("test never released the model")
            if self._held:
                self._passes -= 1
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        output, probs = ATTENTION(feeds)
        if self.drop_a_row:
            output, probs = output[1:], probs[1:]
        return output, (probs if want_probs else None)

    def runs_with(self, work: Work) -> list[Call]:
        return [c for c in self.calls if c.holds(work)]


@dataclass
class Observer:
    batches: list[BatchStats] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats)

    def on_queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def on_runs(self, running: int) -> None:
        pass


_rng = np.random.default_rng(1234)


def make_work(b: int = 1, lq: int = 4, lk: int = 6, *, mask: np.ndarray | None | str = "random",
              want_probs: bool = True) -> Work:
    """A request with fresh random data. mask="random" masks some keys but never a whole row."""
    if isinstance(mask, str):
        mask = _rng.random((b, lq, lk)) < 0.7
        mask[..., 0] = True
    return Work(
        query=_rng.standard_normal((b, lq, QUERY_DIM)).astype(np.float32),
        key=_rng.standard_normal((b, lk, KV_DIM)).astype(np.float32),
        value=_rng.standard_normal((b, lk, KV_DIM)).astype(np.float32),
        mask=mask,
        want_probs=want_probs,
    )


def alone(work: Work, attention=ATTENTION) -> tuple[np.ndarray, np.ndarray]:
    """The unbatched computation of one request."""
    mask = work.mask if work.mask is not None else np.ones((work.rows, work.q_len, work.k_len), np.bool_)
    return attention({"query": work.query, "key": work.key, "value": work.value, "mask": mask})


def assert_matches_alone(work: Work, result, attention=ATTENTION) -> None:
    output, probs = alone(work, attention)
    assert result.output.shape == (work.rows, work.q_len, OUT_DIM)
    np.testing.assert_allclose(result.output, output, atol=TOL, rtol=0)
    if work.want_probs:
        assert result.attn_probs is not None
        assert result.attn_probs.shape == (work.rows, NUM_HEADS, work.q_len, work.k_len)
        np.testing.assert_allclose(result.attn_probs, probs, atol=TOL, rtol=0)
    else:
        assert result.attn_probs is None


async def wait_until(predicate, timeout_s: float = WAIT_S) -> None:
    """Poll a state (not a guess of how long work takes); the timeout only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def wait_for_clock(t: float) -> None:
    """Until time.monotonic() has passed `t`: waiting for a time, not for work."""
    while time.monotonic() <= t:
        await asyncio.sleep(max(t - time.monotonic(), 0) + 0.001)


async def started(model: Model, policy: BatchPolicy, observer: Observer | None = None,
                  arrivals: Arrivals | None = None, **options) -> Batcher:
    batcher = Batcher("test", model, policy, observer, arrivals, **options)
    batcher.start()
    return batcher


async def stop(batcher: Batcher, model: Model) -> None:
    model.open()  # a failed assertion must not leave the worker held on the gate
    await batcher.close()


async def queue_behind_held_run(batcher: Batcher, model: Model, works: list[Work], deadline: float | None = None):
    """Hold the model on a blocker request and queue `works` behind it. Returns (the blocker's
    task, the tasks of `works`) with the blocker's run begun and held, and every one of `works` queued."""
    model.hold()
    runs_before = len(model.calls)
    blocker = asyncio.create_task(batcher.submit(make_work()))
    await model.run_started(runs_before + 1)
    tasks = [asyncio.create_task(batcher.submit(w, deadline)) for w in works]
    await wait_until(lambda: batcher.queue_depth == len(works))
    return blocker, tasks


async def queue_while_busy(batcher: Batcher, model: Model, works: list[Work], deadline: float | None = None):
    """queue_behind_held_run, then let everything run: the model is released on return."""
    blocker, tasks = await queue_behind_held_run(batcher, model, works, deadline)
    model.open()
    return blocker, tasks


async def answered_behind_blocker(batcher: Batcher, model: Model, works: list[Work]) -> list:
    """queue_while_busy, then the answers of `works` once the blocker's run is done; the batcher
    is stopped after, whatever happened."""
    try:
        blocker, tasks = await queue_while_busy(batcher, model, works)
        await blocker
        return await asyncio.gather(*tasks)
    finally:
        await stop(batcher, model)


# -- each caller gets its own rows ----------------------------------------------------------


def test_each_caller_gets_its_own_rows_and_busy_model_batches():
    """Requests arrive in waves, each while the previous wave's run is held: the first finds the
    model idle and runs alone; each later wave queues behind the busy model and runs as one batch."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=64, max_queue_delay_s=0.0))
        works = [make_work(b=1 + i % 3, lq=5, lk=7) for i in range(20)]
        waves = [works[:1], works[1:7], works[7:14], works[14:]]
        tasks = []
        try:
            model.hold()
            for run, wave in enumerate(waves, start=1):
                tasks += [asyncio.create_task(batcher.submit(w)) for w in wave]
                if run > 1:  # queued behind the held run, then that run is let go
                    await wait_until(lambda wave=wave: batcher.queue_depth == len(wave))
                    model.release(1)
                await model.run_started(run)  # this wave's run has begun (and is held)
            model.open()
            results = await asyncio.gather(*tasks)
        finally:
            await stop(batcher, model)
        return model, works, waves, results

    model, works, waves, results = asyncio.run(main())
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
    assert len(model.calls) < len(works)
    assert model.calls[0].rows == works[0].rows  # the first request found the model idle: ran alone
    assert max(r.batch_requests for r in results) > 1
    assert [c.rows for c in model.calls] == [sum(w.rows for w in wave) for wave in waves]  # a run per wave
    assert [r.batch_requests for r in results] == [len(wave) for wave in waves for _ in wave]
    assert sum(c.rows for c in model.calls) == sum(w.rows for w in works)  # each computed once
    for w in works:
        assert len(model.runs_with(w)) == 1


def test_lone_request_on_idle_model_is_dispatched_at_once():
    """With a max_queue_delay_s of 30 s, a lone request on an idle model runs alone and long
    before that delay: it did not wait for company (none was coming)."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=LONG_DELAY_S))
        try:
            w = make_work()
            t0 = time.monotonic()
            result = await batcher.submit(w)
            return w, result, time.monotonic() - t0
        finally:
            await stop(batcher, model)

    w, result, elapsed = asyncio.run(main())
    assert_matches_alone(w, result)
    assert result.batch_requests == 1
    assert elapsed < FAR_BELOW_S, f"a lone request on an idle model waited {elapsed:.3f}s (max_queue_delay_s 30)"


def test_an_answered_batch_leaves_nothing_of_its_requests_in_the_batcher():
    """Once its callers have their answers, the batcher holds no reference to a batch: its
    inputs (in the server, views into the received messages) go with the callers' last
    references, without waiting for a collection or for the next batch. Before, the collector
    kept its last batch until it took the next one, so a long request's received bytes and its
    output stayed resident beside the next request's (self_attention (1, 4096, 512): +32 MB)."""
    import gc
    import weakref

    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy())
        gc.disable()  # reference counts alone must free them: no cycle may hold the batch
        try:
            work = make_work()
            inputs = [weakref.ref(getattr(work, name)) for name in ("query", "key", "value")]
            result = await batcher.submit(work)
            assert_matches_alone(work, result)
            output = weakref.ref(result.output)
            del work, result
            await wait_until(lambda: all(ref() is None for ref in (*inputs, output)), timeout_s=10)
            assert batcher.queue_depth == 0  # still serving: nothing was freed by closing it
        finally:
            gc.enable()
            await stop(batcher, model)

    asyncio.run(main())


def test_max_batch_size_is_respected_and_a_larger_request_runs_alone():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0))
        works = [make_work(b=b, lq=3, lk=5) for b in (3, 2, 6, 1, 2, 1, 3)]
        results = await answered_behind_blocker(batcher, model, works)
        return model, works, results

    model, works, results = asyncio.run(main())
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
    big = works[2]
    (big_run,) = model.runs_with(big)
    assert big_run.rows == 6  # alone, though larger than max_batch_size
    for call in model.calls:
        if call is not big_run:
            assert call.rows <= 4
    assert any(c.rows == 4 for c in model.calls)  # batches did fill up to the limit
    assert len(model.calls) < 1 + len(works)


# -- padding ----------------------------------------------------------------------------------


def test_mixed_lengths_are_padded_and_match_unbatched_runs():
    async def main():
        model = Model()
        observer = Observer()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_padding_ratio=0.9), observer)
        works = [
            make_work(b=2, lq=3, lk=5),
            make_work(b=1, lq=7, lk=2),
            make_work(b=1, lq=1, lk=9, mask=None),
            make_work(b=3, lq=6, lk=6),
        ]
        results = await answered_behind_blocker(batcher, model, works)
        return model, observer, works, results

    model, observer, works, results = asyncio.run(main())
    assert len(model.calls) == 2  # the blocker, then all four together
    shared = model.calls[1]
    assert shared.feeds["query"].shape == (7, 7, QUERY_DIM)  # 7 rows padded to lq 7
    assert shared.feeds["key"].shape == (7, 9, KV_DIM)  # and to lk 9
    for w, r in zip(works, results, strict=True):
        assert r.batch_requests == 4
        assert_matches_alone(w, r)  # shapes are the request's own: padded rows and keys dropped
    assert observer.batches[-1].padding_ratio > 0.3


def test_padding_ratio_bound_keeps_short_and_long_requests_apart():
    async def main():
        model = Model()
        observer = Observer()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_padding_ratio=0.2), observer)
        short = make_work(b=1, lq=2, lk=2)
        long = make_work(b=1, lq=64, lk=64)
        near = make_work(b=1, lq=64, lk=60)  # 3% padding beside `long`: may share its run
        works = [short, long, near]
        results = await answered_behind_blocker(batcher, model, works)
        return model, observer, works, results

    model, observer, (short, long, near), results = asyncio.run(main())
    for w, r in zip((short, long, near), results, strict=True):
        assert_matches_alone(w, r)
    (short_run,) = model.runs_with(short)
    (long_run,) = model.runs_with(long)
    assert short_run is not long_run
    assert model.runs_with(near) == [long_run]
    ratios = [s.padding_ratio for s in observer.batches]
    assert max(ratios) > 0  # the (64, 60) request was padded ...
    assert all(r <= 0.2 for r in ratios)  # ... but no batch exceeded the bound


def test_fully_masked_row_only_joins_batches_of_equal_key_length():
    async def main():
        model = Model()
        # 0.5 lets `exact` join the longer-key run on padding grounds (42% padded): only
        # exactness keeps it out. It keeps `same_k` out of that run (65%).
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_padding_ratio=0.5))
        exact_mask = np.ones((1, 2, 3), np.bool_)
        exact_mask[0, 0] = False  # query row 0 sees no key: uniform over its own 3 keys
        works = {
            "longer": make_work(b=1, lq=2, lk=8),
            "plain": make_work(b=1, lq=2, lk=3),  # same shape as `exact`, no fully masked row
            "exact": make_work(b=1, lq=2, lk=3, mask=exact_mask),
            "same_k": make_work(b=1, lq=4, lk=3),  # equal key length: may share with `exact`
        }
        results = await answered_behind_blocker(batcher, model, list(works.values()))
        return model, works, dict(zip(works, results, strict=True))

    model, works, results = asyncio.run(main())
    assert works["exact"].exact_k_len and not works["plain"].exact_k_len
    for name, w in works.items():
        assert_matches_alone(w, results[name])
    np.testing.assert_array_equal(results["exact"].attn_probs[0, :, 0],
                                  np.full((NUM_HEADS, 3), 1 / 3, np.float32))
    (exact_run,) = model.runs_with(works["exact"])
    (longer_run,) = model.runs_with(works["longer"])
    assert exact_run is not longer_run
    assert exact_run.feeds["key"].shape[1] == 3  # never padded on keys
    assert model.runs_with(works["same_k"]) == [exact_run]  # batched where the key length is equal
    assert model.runs_with(works["plain"]) == [longer_run]  # a plain request of that shape is padded
    assert len(model.calls) == 3


# -- outputs asked for ------------------------------------------------------------------------


def test_want_probs_each_request_gets_what_it_asked_for():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0))
        try:
            lone = make_work(want_probs=False)
            lone_result = await batcher.submit(lone)
            works = [make_work(want_probs=False), make_work(want_probs=True), make_work(b=2, want_probs=False)]
            blocker, tasks = await queue_while_busy(batcher, model, works)
            await blocker
            results = await asyncio.gather(*tasks)
        finally:
            await stop(batcher, model)
        return model, lone, lone_result, works, results

    model, lone, lone_result, works, results = asyncio.run(main())
    assert lone_result.attn_probs is None
    assert_matches_alone(lone, lone_result)
    assert model.runs_with(lone)[0].want_probs is False  # the model was not asked for probs
    (mixed_run,) = model.runs_with(works[1])
    assert mixed_run.want_probs is True
    for w, r in zip(works, results, strict=True):
        assert r.batch_requests == 3
        assert_matches_alone(w, r)  # None where not asked, the request's own probs where asked
    assert [r.attn_probs is None for r in results] == [True, False, True]


# -- shedding, deadlines, cancellation -------------------------------------------------------


def test_queue_full_sheds_the_third_concurrent_request_at_once():
    """Two requests queued behind a held run fill a queue of 2: a third is refused while that run
    is still held, so it was shed at once, not after waiting for any run."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_size=2, max_queue_delay_s=0.0))
        works = [make_work() for _ in range(3)]
        try:
            blocker, queued = await queue_behind_held_run(batcher, model, works[:2])
            third = asyncio.create_task(batcher.submit(works[2]))
            # bounded only against a hang: a batcher that queued it would answer after the held run
            await asyncio.wait({third}, timeout=WAIT_S)
            assert third.done(), "the third request was not shed while the model was held"
            still_held = not blocker.done() and len(model.calls) == 1
            with pytest.raises(QueueFull) as exc:
                await third
            model.open()
            await blocker
            results = await asyncio.gather(*queued)
        finally:
            await stop(batcher, model)
        return model, works, results, exc.value, still_held

    model, works, results, err, still_held = asyncio.run(main())
    for w, r in zip(works[:2], results, strict=True):
        assert_matches_alone(w, r)
    assert isinstance(err, QueueFull)
    assert "max_queue_size 2" in str(err)
    assert still_held  # shed while the model was busy: no run had finished or started since
    assert model.runs_with(works[2]) == []


def test_deadline_passing_in_queue_raises_and_is_never_computed():
    """The test holds the running batch until the queued request's deadline has certainly passed,
    then lets the model go: that request fails without being computed, the other one is served."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0))
        try:
            model.hold()
            first = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(1)
            late = make_work()
            on_time = make_work()
            late_deadline = time.monotonic() + 0.05
            late_task = asyncio.create_task(batcher.submit(late, deadline=late_deadline))
            on_time_task = asyncio.create_task(batcher.submit(on_time, deadline=time.monotonic() + 10 * WAIT_S))
            await wait_until(lambda: batcher.queue_depth == 2)
            await wait_for_clock(late_deadline)  # it expires while queued behind the held run
            model.open()
            await first
            with pytest.raises(DeadlineExpired, match="not computed"):
                await late_task
            on_time_result = await on_time_task
        finally:
            await stop(batcher, model)
        return model, late, on_time, on_time_result

    model, late, on_time, on_time_result = asyncio.run(main())
    assert model.runs_with(late) == []
    assert_matches_alone(on_time, on_time_result)
    assert on_time_result.batch_requests == 1
    assert len(model.calls) == 2


def test_cancelled_queued_request_is_not_computed():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0))
        kept, dropped = make_work(), make_work()
        try:
            blocker, (kept_task, dropped_task) = await queue_behind_held_run(batcher, model, [kept, dropped])
            dropped_task.cancel()  # while queued behind the held run
            model.open()
            await blocker
            kept_result = await kept_task  # the run `dropped` would have joined has finished
            with pytest.raises(asyncio.CancelledError):
                await dropped_task
        finally:
            await stop(batcher, model)
        return model, kept, dropped, kept_result

    model, kept, dropped, kept_result = asyncio.run(main())
    assert_matches_alone(kept, kept_result)
    assert kept_result.batch_requests == 1
    assert model.runs_with(dropped) == []
    assert len(model.calls) == 2


# -- failures ---------------------------------------------------------------------------------


def test_failing_run_fails_each_request_of_that_batch_once_and_batcher_keeps_serving():
    async def main():
        model = Model()
        observer = Observer()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0), observer)
        boom = ValueError("device lost")
        try:
            works = [make_work() for _ in range(3)]
            model.hold()
            model.fail_next = boom
            tasks = [asyncio.create_task(batcher.submit(w)) for w in works]
            await model.run_started(1)
            model.open()
            # bounded: a request the batcher forgot to settle must fail the test, not hang it
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
            after = make_work()
            after_result = await batcher.submit(after)
        finally:
            await stop(batcher, model)
        return model, observer, boom, works, outcomes, after, after_result

    model, observer, boom, works, outcomes, after, after_result = asyncio.run(main())
    assert model.calls[0].rows == 3  # the three formed one batch, and it failed
    for err in outcomes:
        assert isinstance(err, BatchFailed)
        assert err.__cause__ is boom
        assert "device lost" in str(err)
        assert err.logged and "device lost" not in err.public  # logged once; the client gets no internals
    assert len({id(err) for err in outcomes}) == 3  # one exception per request
    assert [s.failed for s in observer.batches] == [True, False]
    assert_matches_alone(after, after_result)


def test_run_returning_wrong_number_of_rows_fails_that_batch():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0))
        try:
            model.drop_a_row = True
            with pytest.raises(BatchFailed, match="returned 1 rows for a batch of 2") as exc:
                await batcher.submit(make_work(b=2))
            model.drop_a_row = False
            w = make_work(b=2)
            result = await batcher.submit(w)
        finally:
            await stop(batcher, model)
        return exc.value, w, result

    err, w, result = asyncio.run(main())
    assert isinstance(err.__cause__, RuntimeError)
    assert_matches_alone(w, result)


# -- shutdown ---------------------------------------------------------------------------------


def test_close_finishes_every_queued_request_then_refuses_new_ones():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=2, max_queue_delay_s=0.0))
        works = [make_work() for _ in range(7)]
        model.hold()
        tasks = [asyncio.create_task(batcher.submit(w)) for w in works]
        await model.run_started(1)
        closing = asyncio.create_task(batcher.close())
        await asyncio.sleep(0)  # close() runs up to its first wait
        with pytest.raises(BatcherClosed):
            await batcher.submit(make_work())  # refused while draining: close has begun
        # The one run is held, so nothing but this loop can move: give close() turns of the loop
        # (counted, not timed); returning now would mean it did not wait for the queued requests.
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done()
        model.open()
        await asyncio.wait_for(closing, WAIT_S)
        done_when_closed = [t.done() for t in tasks]
        results = await asyncio.gather(*tasks)
        with pytest.raises(BatcherClosed, match="shutting down"):
            await batcher.submit(make_work())
        return model, works, done_when_closed, results

    model, works, done_when_closed, results = asyncio.run(main())
    assert all(done_when_closed)
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
    assert len(model.calls) == 4  # 7 requests, max_batch_size 2


# -- several batches in flight ---------------------------------------------------------------


def test_two_batches_in_flight_partial_batch_waits_only_while_another_runs():
    """With two execution slots and max_queue_delay_s 30 s: a lone request on the idle model runs
    at once; a request arriving while another batch runs waits for company though a slot is
    free (the next arrival joins it), and the pair leaves as soon as the model goes idle."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(batches_in_flight=2, max_queue_delay_s=LONG_DELAY_S))
        try:
            # Idle: a lone request goes at once despite the 30 s delay.
            t0 = time.monotonic()
            lone = make_work()
            lone_result = await batcher.submit(lone)
            lone_s = time.monotonic() - t0

            # Busy: a request arriving while another batch runs waits for company ...
            model.hold()
            first = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(2)  # `first` runs, held at the gate; the second slot is free
            a, b = make_work(), make_work()
            task_a = asyncio.create_task(batcher.submit(a))
            await asyncio.sleep(0)  # a's submit runs up to its wait: a is queued
            # Give a batcher that does not wait the chance to send `a` off alone through the free
            # slot. Too short a chance can only let such a batcher pass, never fail a correct one.
            a_queued_by = time.monotonic()
            await wait_for_clock(a_queued_by + 0.1)
            task_b = asyncio.create_task(batcher.submit(b))
            await asyncio.sleep(0)  # b's submit runs up to its wait: b is queued
            # ... and leaves as soon as the model goes idle, not when the 30 s run out.
            t1 = time.monotonic()
            model.open()
            await first
            result_a, result_b = await asyncio.gather(task_a, task_b)
            idle_s = time.monotonic() - t1
        finally:
            await stop(batcher, model)
        return model, lone, lone_result, lone_s, (a, b), (result_a, result_b), idle_s

    model, lone, lone_result, lone_s, works, results, idle_s = asyncio.run(main())
    assert lone_s < FAR_BELOW_S and lone_result.batch_requests == 1
    assert_matches_alone(lone, lone_result)
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
        assert r.batch_requests == 2  # a and b waited for each other
    assert model.runs_with(works[0]) == model.runs_with(works[1])
    assert results[0].queue_s >= 0.1  # `a` stayed queued with a slot free until `b` came (a lower bound)
    assert len(model.calls) == 3
    assert idle_s < FAR_BELOW_S, f"the partial batch waited {idle_s:.3f}s after the model went idle"


# -- requests on their way (the server's Arrivals) -------------------------------------------


class WatchedArrivals:
    """The server's Arrivals, noting each time the batcher asks whether company is coming: the
    event that proves it has looked at its queue and decided."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.asked = asyncio.Event()

    @property
    def arriving(self) -> int:
        self.asked.set()
        return self.arrivals.arriving


def test_idle_model_waits_for_requests_on_their_way_and_only_for_them():
    """With the model idle, a request waits for company only while the server's Arrivals says a
    request is on its way; once that one is submitted, the two run as one batch, long before
    max_queue_delay_s."""
    async def main():
        model = Model()
        arrivals = Arrivals()
        watched = WatchedArrivals(arrivals)
        batcher = await started(model, BatchPolicy(max_batch_size=2, max_queue_delay_s=LONG_DELAY_S),
                                arrivals=watched)
        try:
            ticket = arrivals.arrived(unary=True)  # headers in, message on its way
            a, b = make_work(), make_work()
            t0 = time.monotonic()
            task_a = asyncio.create_task(batcher.submit(a))
            # The batcher asks only once `a` is queued, and goes on to its next wait (or its
            # dispatch) before this task resumes: `a` must still be queued.
            await asyncio.wait_for(watched.asked.wait(), WAIT_S)
            assert batcher.queue_depth == 1 and model.calls == [], "ran alone while a request was on its way"
            arrivals.started(ticket)  # its handler runs and submits, as the servicer does
            result_b = await batcher.submit(b)
            result_a = await task_a
            together_s = time.monotonic() - t0

            arrivals.arrived(unary=False)  # a stream: not a request on its way
            assert arrivals.arriving == 0
            t1 = time.monotonic()
            lone = make_work()
            lone_result = await batcher.submit(lone)
            lone_s = time.monotonic() - t1
        finally:
            await stop(batcher, model)
        return model, (a, b), (result_a, result_b), together_s, lone, lone_result, lone_s

    model, works, results, together_s, lone, lone_result, lone_s = asyncio.run(main())
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
        assert r.batch_requests == 2
    assert together_s < FAR_BELOW_S, f"waited {together_s:.3f}s: the whole max_queue_delay_s, not for its company"
    assert_matches_alone(lone, lone_result)
    assert lone_result.batch_requests == 1 and lone_s < FAR_BELOW_S
    assert [c.rows for c in model.calls] == [2, 1]


# -- merge / split / Work ---------------------------------------------------------------------


def test_merge_and_split_layout_by_hand():
    q1 = np.arange(1 * 2 * 16, dtype=np.float32).reshape(1, 2, 16)
    k1 = np.full((1, 3, 16), 1.0, np.float32)
    m1 = np.array([[[True, False, True], [True, True, True]]])
    w1 = Work(query=q1, key=k1, value=k1 + 1, mask=m1, want_probs=True)
    q2 = -np.ones((2, 1, 16), np.float32)
    k2 = np.full((2, 4, 16), 2.0, np.float32)
    w2 = Work(query=q2, key=k2, value=k2 + 1, mask=None, want_probs=False)

    feeds, ratio = merge([w1, w2])
    assert feeds["query"].shape == (3, 2, 16) and feeds["key"].shape == (3, 4, 16)
    assert feeds["value"].shape == (3, 4, 16) and feeds["mask"].shape == (3, 2, 4)
    np.testing.assert_array_equal(feeds["query"][0], q1[0])
    np.testing.assert_array_equal(feeds["query"][1:, :1], q2)
    np.testing.assert_array_equal(feeds["query"][1:, 1:], 0)  # padded query rows are zeros
    np.testing.assert_array_equal(feeds["key"][0, :3], k1[0])
    np.testing.assert_array_equal(feeds["key"][0, 3:], 0)  # padded key
    np.testing.assert_array_equal(feeds["value"][0, :3], k1[0] + 1)
    np.testing.assert_array_equal(feeds["key"][1:], k2)
    expected_mask = np.array([
        [[True, False, True, False], [True, True, True, False]],  # w1: own mask, padded key masked
        [[True, True, True, True], [False, False, False, False]],  # w2 row 0: all keys, padded query row masked
        [[True, True, True, True], [False, False, False, False]],
    ])
    np.testing.assert_array_equal(feeds["mask"], expected_mask)
    assert ratio == pytest.approx(1 - (1 * 2 * 3 + 2 * 1 * 4) / (3 * 2 * 4))

    output = np.arange(3 * 2 * 5, dtype=np.float32).reshape(3, 2, 5)
    probs = np.arange(3 * 2 * 2 * 4, dtype=np.float32).reshape(3, 2, 2, 4)
    (out1, p1), (out2, p2) = split([w1, w2], output, probs)
    np.testing.assert_array_equal(out1, output[:1])
    np.testing.assert_array_equal(p1, probs[:1, :, :2, :3])
    np.testing.assert_array_equal(out2, output[1:, :1])
    assert p2 is None  # w2 did not ask for probs

    same = [make_work(b=1, lq=2, lk=3, mask=None), make_work(b=2, lq=2, lk=3)]
    feeds, ratio = merge(same)
    assert ratio == 0.0
    np.testing.assert_array_equal(feeds["mask"][0], True)
    np.testing.assert_array_equal(feeds["mask"][1:], same[1].mask)
    np.testing.assert_array_equal(feeds["query"], np.concatenate([w.query for w in same]))


def test_work_exact_k_len_only_when_a_query_row_masks_all_its_keys():
    def work(mask):
        return Work(query=np.zeros((1, 2, 16), np.float32), key=np.zeros((1, 3, 16), np.float32),
                    value=np.zeros((1, 3, 16), np.float32), mask=mask, want_probs=True)

    full = np.ones((1, 2, 3), np.bool_)
    assert work(None).exact_k_len is False
    assert work(full).exact_k_len is False
    some = full.copy()
    some[0, 1, :2] = False  # row 1 still sees key 2
    assert work(some).exact_k_len is False
    one_row = full.copy()
    one_row[0, 1] = False
    assert work(one_row).exact_k_len is True
    assert work(np.zeros((1, 2, 3), np.bool_)).exact_k_len is True


def _plain_work(b, lq, lk, mask=None, want_probs=False):
    return Work(query=_rng.standard_normal((b, lq, 16)).astype(np.float32),
                key=_rng.standard_normal((b, lk, 16)).astype(np.float32),
                value=_rng.standard_normal((b, lk, 16)).astype(np.float32), mask=mask, want_probs=want_probs)


def test_work_masking_is_read_from_its_mask():
    assert _plain_work(1, 3, 4).masking == NO_MASK
    assert _plain_work(2, 3, 4, np.ones((2, 3, 4), np.bool_)).masking == NO_MASK  # masks nothing
    keys = np.ones((2, 3, 4), np.bool_)
    keys[0, :, 2:] = False
    keys[1, :, 0] = False
    w = _plain_work(2, 3, 4, keys)
    assert w.masking == KEY_PADDING and not w.exact_k_len
    np.testing.assert_array_equal(w.key_mask, keys[:, 0, :])
    # A fully masked row is uniform only on the unfused graph's -1e10 fill (the key padding kernel
    # adds -1e10 to its scores, which keeps them apart once |score| >= 512): the general mask.
    fully = np.zeros((1, 3, 4), np.bool_)
    w = _plain_work(1, 3, 4, fully)
    assert w.masking == GENERAL and w.exact_k_len
    one_item_fully = keys.copy()
    one_item_fully[1] = False  # the same keys for every row, but item 1 attends none
    w = _plain_work(2, 3, 4, one_item_fully)
    assert w.masking == GENERAL and w.exact_k_len and w.key_mask is None
    rows_differ = keys.copy()
    rows_differ[0, 1, 0] = False
    assert _plain_work(2, 3, 4, rows_differ).masking == GENERAL


def test_merge_feeds_the_least_mask_the_batch_needs():
    # No mask, same key length (queries padded only: padded query rows are dropped): no mask at all.
    a, b = _plain_work(1, 5, 6), _plain_work(2, 3, 6)
    feeds, ratio = merge([a, b])
    assert sorted(feeds) == ["key", "query", "value"] and ratio > 0
    np.testing.assert_array_equal(feeds["query"][1:, 3:], 0)
    # Keys padded: a key padding mask (B, Lk) int32, 1 = a real key.
    keys = np.ones((1, 2, 4), np.bool_)
    keys[0, :, 1] = False
    c = _plain_work(1, 2, 4, keys)
    feeds, _ = merge([a, c])
    assert sorted(feeds) == ["key", "key_padding_mask", "query", "value"]
    assert feeds["key_padding_mask"].dtype == np.int32
    np.testing.assert_array_equal(feeds["key_padding_mask"], [[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0]])
    dense = dense_mask(feeds)
    assert dense.shape == (2, 5, 6) and dense.flags.c_contiguous
    np.testing.assert_array_equal(dense[1, :2, :4], keys[0])
    # One request whose rows differ: the full (B, Lq, Lk) mask, padding masked, as before.
    general = np.ones((1, 2, 4), np.bool_)
    general[0, 1, 3] = False
    feeds, _ = merge([a, _plain_work(1, 2, 4, general)])
    assert sorted(feeds) == ["key", "mask", "query", "value"]
    np.testing.assert_array_equal(feeds["mask"][1, :2, :4], general[0])
    assert not feeds["mask"][1, :, 4:].any() and not feeds["mask"][1, 2:].any()
    # Alone: no copies, and a key mask as its (b, lk) row.
    feeds, _ = merge([c])
    assert feeds["query"] is c.query and feeds["key_padding_mask"].tolist() == [[1, 0, 1, 1]]
    feeds, _ = merge([a])
    assert sorted(feeds) == ["key", "query", "value"] and dense_mask(feeds).all()


def test_merged_batch_is_bounded_by_what_its_run_holds():
    """scores_of (the engine's graphs, handed in) decides what a merged batch holds: requests of
    one length stay together when their run holds no scores (flash attention); padding them
    would hold every score, over the bound, so unequal ones run apart."""
    from attnserve.server.graphs import GraphSet

    from attnserve import contract

    bound = 100
    scores_of = GraphSet(frozenset(contract.GRAPH_FILES)).scores_held  # every graph, fused at any length

    async def run(works):
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_batch_scores=bound),
                                scores_of=scores_of)
        results = await answered_behind_blocker(batcher, model, works)
        return model, results

    same = [make_work(1, 8, 8, mask=None, want_probs=False) for _ in range(3)]  # 3 x 64 scores > 100
    model, results = asyncio.run(run(same))
    assert [c.rows for c in model.calls[1:]] == [3]
    for w, r in zip(same, results, strict=True):
        assert_matches_alone(w, r)
    unequal = [make_work(1, 8, 8, mask=None, want_probs=False), make_work(1, 8, 7, mask=None, want_probs=False)]
    model, results = asyncio.run(run(unequal))
    assert [c.rows for c in model.calls[1:]] == [1, 1]  # padded: 2 x 8 x 8 = 128 scores > 100
    for w, r in zip(unequal, results, strict=True):
        assert_matches_alone(w, r)


def test_a_batch_on_the_flash_path_takes_only_requests_that_keep_it_there():
    """With the fused graphs at every length, a batch of unmasked requests of one key length
    holds no scores: a request that would pad its keys, bring a key mask or ask for attn_probs
    waits for the next batch (which it then leads) instead of moving the batch onto a graph that
    holds every score. Without the fused graphs (scores_of: every score) they all run together."""
    from attnserve.server.graphs import UNFUSED, GraphSet

    from attnserve import contract

    async def run(works, scores_of):
        model = Model()
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0), scores_of=scores_of)
        results = await answered_behind_blocker(batcher, model, works)
        return model, results

    keys = np.ones((1, 8, 8), np.bool_)
    keys[..., 5:] = False
    works = [make_work(1, 8, 8, mask=None, want_probs=False), make_work(1, 8, 7, mask=None, want_probs=False),
             make_work(1, 6, 8, mask=None, want_probs=False), make_work(1, 8, 8, mask=keys, want_probs=False),
             make_work(1, 8, 8, mask=None, want_probs=True), make_work(2, 8, 8, mask=None, want_probs=False)]
    fused = GraphSet(frozenset(contract.GRAPH_FILES)).scores_held
    model, results = asyncio.run(run(works, fused))
    # The flash batch: requests 0, 2 (queries padded only) and 5; then the 8 x 7 one, on the flash
    # path alone (the rest would pad its keys); then the key mask and attn_probs together.
    assert [c.rows for c in model.calls[1:]] == [4, 1, 2]
    assert [sorted(c.feeds) for c in model.calls[1:3]] == [["key", "query", "value"]] * 2
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
    model, _ = asyncio.run(run(works, UNFUSED.scores_held))
    assert [c.rows for c in model.calls[1:]] == [7]


def test_policy_rejects_out_of_range_values():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        BatchPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="max_padding_ratio"):
        BatchPolicy(max_padding_ratio=1.0)
    with pytest.raises(ValueError, match="max_queue_delay_s"):
        BatchPolicy(max_queue_delay_s=-0.1)


# -- a real ONNX Runtime engine ---------------------------------------------------------------


def test_batcher_over_real_onnx_runtime_engine(model_repository):
    from attnserve.server.engine import Engine, choose_device
    from attnserve.server.repository import read_model_spec

    spec = read_model_spec(model_repository / "cross_attention")
    engine = Engine(spec, choose_device("cpu"))
    rng = np.random.default_rng(7)

    def work(b, lq, lk, want_probs=True, fully_masked_row=False):
        mask = rng.random((b, lq, lk)) < 0.8
        mask[..., 0] = True
        if fully_masked_row:
            mask[0, 0] = False
        return Work(query=rng.standard_normal((b, lq, spec.query_dim)).astype(np.float32),
                    key=rng.standard_normal((b, lk, spec.kv_dim)).astype(np.float32),
                    value=rng.standard_normal((b, lk, spec.kv_dim)).astype(np.float32),
                    mask=mask, want_probs=want_probs)

    calls: list[tuple[int, int, int]] = []
    gate = threading.Event()

    def run_batch(feeds, want_probs):
        calls.append(feeds["mask"].shape)
        assert gate.wait(WAIT_S), "test never released the engine"
        return engine.run(feeds, want_probs)

    works = [work(2, 5, 7), work(1, 9, 4, want_probs=False), work(3, 2, 7), work(1, 4, 4, fully_masked_row=True)]

    async def main():
        batcher = Batcher("cross_attention", run_batch, BatchPolicy(max_queue_delay_s=0.0, max_padding_ratio=0.8))
        batcher.start()
        try:
            blocker = asyncio.create_task(batcher.submit(work(1, 3, 3)))
            await wait_until(lambda: len(calls) == 1)
            tasks = [asyncio.create_task(batcher.submit(w)) for w in works]
            await wait_until(lambda: batcher.queue_depth == len(works))
            gate.set()
            await blocker
            return await asyncio.gather(*tasks)
        finally:
            gate.set()
            await batcher.close()

    results = asyncio.run(main())
    # The first three share a padded run; the fully masked one (lk 4) cannot join lk 7.
    assert calls[1] == (6, 9, 7)
    assert calls[2] == (1, 4, 4)
    for w, r in zip(works, results, strict=True):
        output, probs = engine.run({"query": w.query, "key": w.key, "value": w.value, "mask": w.mask}, True)
        assert r.output.shape == (w.rows, w.q_len, spec.out_dim)
        np.testing.assert_allclose(r.output, output, atol=TOL, rtol=0)
        if w.want_probs:
            assert r.attn_probs.shape == (w.rows, spec.num_heads, w.q_len, w.k_len)
            np.testing.assert_allclose(r.attn_probs, probs, atol=TOL, rtol=0)
        else:
            assert r.attn_probs is None
    np.testing.assert_allclose(results[3].attn_probs[0, :, 0], 0.25, atol=1e-7)


# -- solo runs ---------------------------------------------------------------------------------


class LoneCallSignal:
    """The server's signal (lifecycle.Admission.lone_call), set by the test."""

    def __init__(self, lone_call: bool) -> None:
        self.lone_call = lone_call


def _two_runs() -> tuple[Model, Model]:
    """A Batcher's run_batch and run_solo: the same attention, each recording its calls."""
    return Model(), Model()


def _each_in_turn(regular, run_solo, order: tuple[Work, ...], lone_call: bool | None = True) -> list:
    """The answers of `order`, each submitted once the one before is answered, to a Batcher whose
    lone-call signal says `lone_call` (None: the Batcher has no signal)."""
    signal = None if lone_call is None else LoneCallSignal(lone_call)

    async def main():
        batcher = Batcher("test", regular, BatchPolicy(), run_solo=run_solo, lone_call_signal=signal)
        batcher.start()
        try:
            return [await batcher.submit(work) for work in order]
        finally:
            await batcher.close()

    return asyncio.run(main())


def _slow_at(solo: Model, slow_q_len: int, threads: list[tuple[int, int]]):
    """`solo` as a run_solo that notes each run's (query length, thread) and, for a query of
    `slow_q_len` rows, takes longer than the INLINE_SOLO_MAX_S of 0.5 s the tests set."""
    def run_solo(feeds, want_probs):
        q_len = feeds["query"].shape[1]
        threads.append((q_len, threading.get_ident()))
        if q_len == slow_q_len:
            time.sleep(0.6)  # past INLINE_SOLO_MAX_S, however fast the machine
        return solo(feeds, want_probs)

    return run_solo


def test_a_lone_request_runs_solo_and_gets_the_same_answer():
    regular, solo = _two_runs()
    work = make_work(1, 4, 6)
    (result,) = _each_in_turn(regular, solo, (work,))
    assert len(solo.calls) == 1 and not regular.calls
    assert_matches_alone(work, result)


def test_a_solo_run_computes_on_the_event_loop_once_its_shape_has_run_short(monkeypatch):
    """A lone request whose shape's last solo run took at most INLINE_SOLO_MAX_S is computed by
    the event loop's own thread (it holds the only call: nothing waits for the loop meanwhile,
    and two thread hand-offs are saved). A shape's first run, and a shape whose last run took
    longer, go to the run thread like any batch; so does a shape forgotten since (only the
    last SOLO_SHAPES_TIMED are kept). The limit is set far from both runs here (a run that
    sleeps past it, one that does not), so the machine's speed does not decide."""
    from attnserve.server import batcher as batching

    monkeypatch.setattr(batching, "INLINE_SOLO_MAX_S", 0.5)
    monkeypatch.setattr(batching, "SOLO_SHAPES_TIMED", 2)
    regular, solo = _two_runs()
    threads: list[tuple[int, int]] = []  # (query length, thread)
    slow_q_len = 7
    # other and another hold no key as long as short's (6): no estimate of short from theirs.
    short, slow = make_work(1, 4, 6), make_work(1, slow_q_len, 6)
    other, another = make_work(1, 5, 5), make_work(1, 8, 5)
    order = (short, short, short, slow, slow, other, another, short)
    results = _each_in_turn(regular, _slow_at(solo, slow_q_len, threads), order)
    on_loop = [thread == threading.get_ident() for _, thread in threads]  # asyncio.run's loop ran here
    assert [q for q, _ in threads] == [w.q_len for w in order]
    # short: first on the run thread, then on the loop; slow: always on the run thread; other and
    # another push short out of the two shapes kept, so its next run is a first run again.
    assert on_loop == [False, True, True, False, False, False, False, False]
    assert len(solo.calls) == len(order) and not regular.calls
    for work, result in zip(order, results, strict=True):
        assert_matches_alone(work, result)


def test_a_first_solo_run_held_by_a_short_timed_shape_computes_on_the_event_loop(monkeypatch):
    """A shape never run alone is judged by the timed shapes that hold it (no fewer rows, no
    shorter lengths, the same masking and outputs): the least of their times. So a first call
    shorter than the warm-up's runs where its later calls will. A shape held only by a slow one,
    or by none with its outputs, goes to the run thread. The limit is far from both runs here."""
    from attnserve.server import batcher as batching

    monkeypatch.setattr(batching, "INLINE_SOLO_MAX_S", 0.5)
    regular, solo = _two_runs()
    threads: list[tuple[int, int]] = []  # (query length, thread)
    big, small, slow, held_by_slow, other_outputs = (
        make_work(1, 8, 8), make_work(1, 4, 6), make_work(1, 12, 12), make_work(1, 10, 10),
        make_work(1, 4, 6, want_probs=False))
    order = (big, small, slow, held_by_slow, other_outputs)
    results = _each_in_turn(regular, _slow_at(solo, slow.q_len, threads), order)
    assert [t == threading.get_ident() for _, t in threads] == [False, True, False, False, False]
    for work, result in zip(order, results, strict=True):
        assert_matches_alone(work, result)


def test_a_warm_up_request_runs_on_the_session_it_asks_for_and_is_told_to_no_observer():
    """submit(warm_up=SOLO or REGULAR) (server.warmup's request path): that session kind, whether
    or not the call is alone, and no batch statistics; a caller's request after it is observed."""
    regular, solo = _two_runs()
    observer = Observer()
    works = [make_work(1, 4, 6) for _ in range(3)]

    async def main():
        batcher = Batcher("test", regular, BatchPolicy(), observer, run_solo=solo,
                          lone_call_signal=LoneCallSignal(False))
        batcher.start()
        try:
            warm_solo = await batcher.submit(works[0], warm_up=SOLO_SESSION)
            assert (len(solo.calls), len(regular.calls)) == (1, 0)
            warm_regular = await batcher.submit(works[1], warm_up=REGULAR_SESSION)
            assert (len(solo.calls), len(regular.calls)) == (1, 1)
            assert observer.batches == []
            caller = await batcher.submit(works[2])
            return warm_solo, warm_regular, caller
        finally:
            await batcher.close()

    results = asyncio.run(main())
    assert len(observer.batches) == 1 and not observer.batches[0].solo  # not alone: the regular run
    for work, result in zip(works, results, strict=True):
        assert_matches_alone(work, result)


@pytest.mark.parametrize("case", ["not alone", "no signal", "no solo run"])
def test_without_solitude_or_a_solo_run_a_request_takes_the_regular_run(case):
    regular, solo = _two_runs()
    _each_in_turn(regular, None if case == "no solo run" else solo, (make_work(1, 4, 6),),
                  lone_call=None if case == "no signal" else case != "not alone")
    assert len(regular.calls) == 1 and not solo.calls


def test_a_batch_dispatched_while_another_runs_is_not_solo():
    """The signal says alone, but this batcher runs another batch: the second request runs
    regular too; once both are done a third, alone at last, runs solo."""
    regular, solo = _two_runs()
    lone_call_signal = LoneCallSignal(False)

    async def main():
        batcher = Batcher("test", regular, BatchPolicy(max_queue_delay_s=0.0, batches_in_flight=2),
                          run_solo=solo, lone_call_signal=lone_call_signal)
        batcher.start()
        regular.hold()
        try:
            first = asyncio.ensure_future(batcher.submit(make_work(1, 4, 6)))
            await regular.run_started(1)
            lone_call_signal.lone_call = True  # from here the server reports one call; this batcher knows better
            second = asyncio.ensure_future(batcher.submit(make_work(1, 4, 6)))
            await regular.run_started(2)
            assert not solo.calls
            regular.open()
            await asyncio.gather(first, second)
            await batcher.submit(make_work(1, 4, 6))
        finally:
            regular.open()
            await batcher.close()

    asyncio.run(main())
    assert len(regular.calls) == 2 and len(solo.calls) == 1
