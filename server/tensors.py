"""A batch's tensors: Work (one validated request), its masks, merge (pad, mask, concatenate
into one run's feeds), split (the run's outputs back per request) and compute_batch (the three
around a run). Knows nothing of queues, gRPC or ONNX Runtime: the batcher (server.batcher) and
attnserve.runtime's offline predictor both compute through it.

- Masks: Work keeps any of contract.MASK_SHAPES as the least it needs; `merge` feeds the least a
  run needs (none, a key padding mask, the full mask, or a per-head mask).
- Exactness: a request whose row masks all its keys joins only batches of its own key length
  (padding would widen its uniform distribution).
- Copies keep the GIL (server.stacking). More: docs/design.md ("The batcher").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from attnserve.server.graphs import GENERAL, HEADS, KEY_PADDING, NO_MASK
from attnserve.server.stacking import concat_rows, place

from attnserve.contract import HEAD_MASK, KEY_PADDING_MASK

if TYPE_CHECKING:
    from attnserve.server.memory.budget import Reservation

# feeds {"query", "key", "value"} and at most one of "mask" (B, Lq, Lk) bool, "key_padding_mask"
# (B, Lk) int32 (1 = attend), "head_mask" (B, H, Lq, Lk) bool, none = every key attended
# -> (output, attn_probs or None); blocking. One that writes into given arrays (compute_batch's
# writes_into: the Engine's) also takes `into={"output": array, "attn_probs": array}` (either
# name) and returns those arrays, filled by the run.
# A stoppable run (the engine's) also takes `stop=`, a RunStop (server.batcher's stoppable_runs).
RunBatch = Callable[[dict[str, np.ndarray], bool], tuple[np.ndarray, "np.ndarray | None"]]
# Where an answer's outputs go without a copy, when the run can write straight there (64: ONNX
# Runtime's own buffers' alignment, which its kernels may count on).
INTO_ALIGNMENT = 64


class OutputWriter(Protocol):
    """Where one output of a request goes instead of its Result (server.shm.RegionWriter: the
    caller's shared memory region): `write` gets the output's bytes on the batch's thread and
    never raises for the request's own fault (it keeps it, for the request alone)."""

    def write(self, data: memoryview) -> None: ...


class RunStopped(Exception):
    """The run was stopped (RunStop.stop) before or while it computed: nobody waits for it."""


class RunStop:
    """One run's off switch, thrown on the event loop, seen by the run on its worker thread.

    The batcher stops a run once every request of its batch is cancelled; a stoppable run
    registers how to stop itself (the engine: its ONNX Runtime RunOptions' terminate flag) with
    `on_stop` and unregisters it with `off` once it returns. Thread-safe."""

    __slots__ = ("_lock", "_hook", "stopped")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hook: Callable[[], None] | None = None
        self.stopped = False

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            hook, self._hook = self._hook, None
        if hook is not None:
            hook()

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Call `hook` on stop(), or now if stopped already (a stop between the check and the run)."""
        with self._lock:
            if not self.stopped:
                self._hook = hook
                return
        hook()

    def off(self) -> None:
        with self._lock:
            self._hook = None

@dataclass(slots=True)
class Work:
    """One validated request. Shapes were checked before it got here."""

    query: np.ndarray  # (b, lq, query_dim) float32
    key: np.ndarray  # (b, lk, kv_dim) float32
    value: np.ndarray  # (b, lk, kv_dim) float32
    # bool, False = masked; None = attend to every key. Given as any of contract.MASK_SHAPES: (lq, lk),
    # (b, lq, lk), (b, 1, lq, lk) or (b, h, lq, lk); kept as (b, lq, lk), or (b, h, lq, lk) when
    # its heads differ (module docstring, "Masks").
    mask: np.ndarray | None
    want_probs: bool
    # Where its outputs go (server.shm: its staging buffers; attnserve.runtime: its callers'
    # arrays), shaped as the outputs, float32, writable; None: returned as the run made them.
    output_into: np.ndarray | None = None  # (b, lq, out_dim)
    probs_into: np.ndarray | None = None  # (b, h, lq, lk)
    # Then written out (server.shm: into the caller's regions), by name ("output", "attn_probs"):
    # each writer gets its output_into/probs_into's bytes on the batch's thread. See compute_batch.
    write_to: dict[str, OutputWriter] | None = None
    # How compute_batch filled output_into/probs_into: "run" (the run wrote there, no copy),
    # "copied" (from the run's result), "" (not yet, or nothing to fill).
    written: str = field(init=False, default="")
    # True if some query row masks all of its keys: see "Exactness" above.
    exact_k_len: bool = field(init=False)
    # server.graphs' NO_MASK (no mask, or one that masks nothing), KEY_PADDING (every query row
    # masks the same keys and attends at least one: then key_mask is that (b, lk) row) or
    # GENERAL (anything else, fully masked rows included: see server.graphs), HEADS (a
    # (b, h, lq, lk) mask whose heads differ).
    masking: str = field(init=False)
    key_mask: np.ndarray | None = field(init=False)
    # The mask's bytes: as it came (a view of it holds them all) or as a run copies it
    # ((lq, lk) broadcast over the batch), whichever is more.
    mask_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.masking, self.key_mask = NO_MASK, None
        sent = self.mask
        self.mask = mask = canonical_mask(sent, self.query.shape[0])
        self.mask_nbytes = 0 if sent is None else max(sent.nbytes, mask.nbytes)
        if mask is None or mask.size == 0:
            self.exact_k_len = False
            return
        self.exact_k_len = not mask.any(axis=-1).all()
        if mask.ndim == 4:
            self.masking = HEADS
            return
        first = mask[:, :1, :]  # (b, 1, lk)
        if self.exact_k_len or not np.array_equal(mask, np.broadcast_to(first, mask.shape)):
            self.masking = GENERAL
        elif not first.all():
            self.masking, self.key_mask = KEY_PADDING, first[:, 0, :]  # (b, lk)

    @property
    def rows(self) -> int:
        return self.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.query.shape[1]

    @property
    def k_len(self) -> int:
        return self.key.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of its input arrays: what it holds while it waits in the queue."""
        return self.query.nbytes + self.key.nbytes + self.value.nbytes + self.mask_nbytes


def canonical_mask(mask: np.ndarray | None, rows: int) -> np.ndarray | None:
    """A mask of any of contract.MASK_SHAPES (shapes checked by the codec) as Work keeps it: a
    (rows, lq, lk) view, or (rows, h, lq, lk) when its heads differ. Nothing is copied."""
    if mask is None or mask.ndim == 3:
        return mask
    if mask.ndim == 2:  # (lq, lk): the same for every item, as the seeds broadcast it
        return np.broadcast_to(mask, (rows, *mask.shape))
    if mask.ndim != 4:
        raise ValueError(f"mask: rank {mask.ndim}; expected 2, 3 or 4")
    first = mask[:, 0]  # (rows, lq, lk)
    if all(np.array_equal(mask[:, h], first) for h in range(1, mask.shape[1])):
        return first  # (rows, 1, lq, lk), or heads that are all alike
    return mask


@dataclass(slots=True)
class Result:
    output: np.ndarray | None  # (b, lq, out_dim); None: in the request's output_into
    attn_probs: np.ndarray | None  # (b, h, lq, lk); None: not asked for, or in its probs_into
    queue_s: float
    compute_s: float
    batch_requests: int
    # Its share of the memory budget (None without one): the transport releases it once the
    # answer is sent, or at the latest when the call ends.
    reservation: Reservation | None = None

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()


def compute_batch(run_batch: RunBatch, works: list[Work], writes_into: bool = False, stop: RunStop | None = None
                  ) -> tuple[list[tuple[np.ndarray | None, np.ndarray | None]], float, tuple[float, float, float]]:
    """On a worker thread: pad and merge, run, check, split (attnserve.runtime runs it too).
    Returns per-request outputs, the batch's padding ratio, and the seconds spent merging, running
    and splitting. A request's output_into/probs_into are filled: by the run itself when it is the
    whole batch and `writes_into` (run_batch takes `into`), else by the split copying its rows
    there; its outputs returned are then None (they are in those arrays, which the caller holds:
    nothing that views the caller's memory outlives the call on the run's thread). A request's
    write_to writers get their outputs' bytes here, on this thread, in place of returning them.
    stop: handed to a stoppable run_batch; RunStopped if it was stopped before the run."""
    t0 = time.perf_counter()
    feeds, padding_ratio = merge(works)
    want_probs = any(w.want_probs for w in works)
    into = _run_into(works, feeds) if writes_into else None
    t1 = time.perf_counter()
    options = {}
    if into:
        options["into"] = into
    if stop is not None:
        if stop.stopped:  # every request left while the batch waited for its thread
            raise RunStopped("stopped before it ran")
        options["stop"] = stop
    output, attn_probs = run_batch(feeds, want_probs, **options)
    t2 = time.perf_counter()
    rows = feeds["query"].shape[0]
    if output.shape[0] != rows or (want_probs and (attn_probs is None or attn_probs.shape[0] != rows)):
        raise RuntimeError(f"run returned {output.shape[0]} rows for a batch of {rows}")
    if into:
        works[0].written = "run"
        if output is not into.get("output", output) or attn_probs is not into.get("attn_probs", attn_probs):
            raise RuntimeError("the run did not return the arrays it was given to write into")
    results = [_copy_into(w, out, probs) for w, (out, probs) in zip(works, split(works, output, attn_probs),
                                                                     strict=True)]
    return results, padding_ratio, (t1 - t0, t2 - t1, time.perf_counter() - t2)


def _run_into(works: list[Work], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The arrays the run may write its outputs into: a lone request's destinations, when they
    are exactly the run's outputs (no padding to drop: it is the whole batch), aligned, and
    overlap neither the inputs nor each other (the run reads the inputs while it writes)."""
    if len(works) != 1:
        return None
    w = works[0]
    into = {name: array for name, array in (("output", w.output_into), ("attn_probs", w.probs_into))
            if array is not None}
    if not into or any(a.dtype != np.float32 or a.ctypes.data % INTO_ALIGNMENT for a in into.values()):
        return None
    others = list(feeds.values()) + list(into.values())
    if any(np.may_share_memory(a, b) for a in into.values() for b in others if b is not a):
        return None
    return into


def _copy_into(w: Work, output: np.ndarray | None, attn_probs: np.ndarray | None
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A request's rows copied into its destinations (the split writing there) unless the run
    wrote them there, then handed to its writers (write_to); None in place of each output that
    is in a destination."""
    results = _fill(w, output, attn_probs)
    for name, writer in (w.write_to or {}).items():
        into = w.output_into if name == "output" else w.probs_into
        if into is not None and w.written:
            writer.write(memoryview(into).cast("B"))  # keeps a refusal to itself: the batch goes on
    return results


def _fill(w: Work, output: np.ndarray | None, attn_probs: np.ndarray | None
          ) -> tuple[np.ndarray | None, np.ndarray | None]:
    if w.output_into is None and w.probs_into is None:
        return output, attn_probs
    written = "run" if w.written == "run" else "copied"
    if w.output_into is not None:
        if written == "copied":
            np.copyto(w.output_into, output)
        output = None
    if w.probs_into is not None:
        if written == "copied" and attn_probs is not None:
            np.copyto(w.probs_into, attn_probs)
        attn_probs = None
    w.written = written
    return output, attn_probs


def batch_masking(maskings: set[str] | frozenset[str], same_k_len: bool) -> str:
    """The masking a batch's run needs: that of its requests, KEY_PADDING once keys are padded."""
    if HEADS in maskings:
        return HEADS
    if GENERAL in maskings:
        return GENERAL
    if KEY_PADDING in maskings or not same_k_len:
        return KEY_PADDING
    return NO_MASK


def merge(works: list[Work]) -> tuple[dict[str, np.ndarray], float]:
    """Pad to the longest query and key, mask padded keys; returns feeds and padding ratio.
    The feeds carry the least mask the batch needs (module docstring, "Masks")."""
    rows = sum(w.rows for w in works)
    q_len = max(w.q_len for w in works)
    k_len = max(w.k_len for w in works)
    masking = batch_masking({w.masking for w in works}, all(w.k_len == k_len for w in works))
    same_lengths = all(w.q_len == q_len and w.k_len == k_len for w in works)
    if len(works) == 1:
        w = works[0]
        feeds = {"query": w.query, "key": w.key, "value": w.value}
    elif same_lengths:  # copies that keep the GIL (server.stacking): this runs beside the event loop
        feeds = {name: concat_rows([getattr(w, name) for w in works]) for name in ("query", "key", "value")}
    else:
        first = works[0]
        feeds = {"query": np.zeros((rows, q_len, first.query.shape[2]), dtype=np.float32),  # (B, Lq, q_dim)
                 "key": np.zeros((rows, k_len, first.key.shape[2]), dtype=np.float32)}  # (B, Lk, kv_dim)
        feeds["value"] = np.zeros_like(feeds["key"])
        start = 0
        for w in works:
            for name in ("query", "key", "value"):
                place(feeds[name], start, getattr(w, name))
            start += w.rows
    if masking == KEY_PADDING:
        key_padding = np.zeros((rows, k_len), dtype=np.int32)  # (B, Lk): 1 = a real key to attend
        start = 0
        for w in works:
            end = start + w.rows
            key_padding[start:end, : w.k_len] = 1 if w.key_mask is None else w.key_mask
            start = end
        feeds[KEY_PADDING_MASK] = key_padding
    elif masking == HEADS:
        feeds[HEAD_MASK] = _head_mask(works, rows, q_len, k_len, same_lengths)
    elif masking == GENERAL:
        if len(works) == 1 or (same_lengths and all(w.mask is not None for w in works)):
            # A view ((lq, lk) broadcast, a head sliced) becomes the contiguous array a run takes.
            mask = np.ascontiguousarray(works[0].mask) if len(works) == 1 else concat_rows([w.mask for w in works])
        else:
            mask = np.zeros((rows, q_len, k_len), dtype=np.bool_)  # (B, Lq, Lk): padding is masked
            start = 0
            for w in works:
                end = start + w.rows
                mask[start:end, : w.q_len, : w.k_len] = True if w.mask is None else w.mask
                start = end
        feeds["mask"] = mask
    useful = sum(w.rows * w.q_len * w.k_len for w in works)
    return feeds, 1.0 - useful / (rows * q_len * k_len)


def _head_mask(works: list[Work], rows: int, q_len: int, k_len: int, same_lengths: bool) -> np.ndarray:
    """(B, H, Lq, Lk) bool of a batch with a mask whose heads differ: each request's own mask,
    repeated over the heads where it has none; padded keys and query rows masked."""
    heads = next(w.mask.shape[1] for w in works if w.masking == HEADS)
    if len(works) == 1:
        return works[0].mask
    if same_lengths and all(w.masking == HEADS for w in works):
        return concat_rows([w.mask for w in works])
    mask = np.zeros((rows, heads, q_len, k_len), dtype=np.bool_)  # padding is masked
    start = 0
    for w in works:
        end = start + w.rows
        if w.mask is None:
            mask[start:end, :, : w.q_len, : w.k_len] = True
        else:  # (b, h, lq, lk), or (b, lq, lk) broadcast over the heads
            mask[start:end, :, : w.q_len, : w.k_len] = w.mask if w.mask.ndim == 4 else w.mask[:, None]
        start = end
    return mask


def dense_mask(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The (B, Lq, Lk) bool mask of merged feeds, whichever form they carry it in (True = attend)."""
    if "mask" in feeds:
        return feeds["mask"]
    b, lq, _ = feeds["query"].shape  # batch, query length, query_dim
    lk = feeds["key"].shape[1]
    if KEY_PADDING_MASK in feeds:
        return np.ascontiguousarray(np.broadcast_to(feeds[KEY_PADDING_MASK].astype(np.bool_)[:, None, :], (b, lq, lk)))
    return np.ones((b, lq, lk), dtype=np.bool_)


def split(works: list[Work], output: np.ndarray, attn_probs: np.ndarray | None
          ) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each request's own rows, padding dropped: output (b, lq, out_dim), attn_probs (b, h, lq, lk)."""
    results = []
    start = 0
    for w in works:
        end = start + w.rows
        out = output[start:end, : w.q_len]
        probs = attn_probs[start:end, :, : w.q_len, : w.k_len] if (w.want_probs and attn_probs is not None) else None
        results.append((out, probs))
        start = end
    return results
