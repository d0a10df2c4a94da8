"""The resumable batch job behind `attnserve batch`.

    run_batch(BatchJob(model="self_attention", input_path=Path("in.npz"), output_path=Path("out.npz")),
              ClientOptions(url="127.0.0.1:8001,127.0.0.1:8002"))

Input: an .npz with `query` (N, lq, query_dim), `key` and `value` (N, lk, kv_dim) and optionally
`mask` (N, lq, lk), or a directory of such .npz shards taken in sorted name order, items numbered
globally across them. Output: an .npz with `output` (N, lq, out_dim) (and `attn_probs`
(N, heads, lq, lk) when asked), rows in input order.

Why asyncio: one event loop keeps `concurrency` requests in flight over one grpc.aio channel
(round robin across the servers) without a thread per request; the loop only packs and unpacks
bytes, and the blocking parts (reading a chunk from a memory-mapped input, writing and fsyncing a
part file) run in worker threads via `asyncio.to_thread`. Requests start in input order from a
sliding window: a new chunk is read only when one of the `concurrency` slots frees, so memory
holds at most `concurrency` chunks plus the input shards they come from (memory-mapped when the
.npz is uncompressed; a compressed shard is loaded whole).

Resuming: the work directory `<output>.parts/` holds `manifest.json` (model, outputs and a
fingerprint of the inputs) and one `<start>-<stop>.npz` per finished chunk (global item
indices), each written to a temporary file, fsynced and renamed into place, so a part exists
whole or not at all whenever the job is killed (kill -9 included). A rerun with the same
arguments skips the items its parts cover (the batch size and concurrency may change; the
model, outputs and inputs may not: the manifest refuses a mix), computes the gaps, then
assembles the output chunk by chunk (`npzio.write_npz`: atomic, bounded memory) and removes the
work directory. The output's zip comment carries the job's key, so a rerun after the end (or
after a kill during clean-up) sees that the job is complete and computes nothing; an existing
output of another job is replaced, atomically, when this one is assembled.

The model version is pinned: the first response's `model_version` is recorded in the manifest
and sent with every later request, so a server that loads a new version mid-job cannot mix two
models' outputs in one file.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np

from attnserve.client import npzio
from attnserve.client.aio import AsyncInferenceClient
from attnserve.client.client import InferenceClient
from attnserve.client.codec import ModelMetadata
from attnserve.contract import OUTPUT_NAMES
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions

logger = logging.getLogger(__name__)

FORMAT = "attnserve.batch/1"
DEFAULT_BATCH_SIZE = 32  # the server's default max_batch_size: one request fills one run
DEFAULT_CONCURRENCY = 4
MANIFEST = "manifest.json"
LOCK = ".lock"
_PART = re.compile(r"^(\d{12})-(\d{12})\.npz$")
_TMP_PREFIX = ".tmp-"
_FLOAT32 = np.dtype("<f4")
# Fingerprint: files up to this size are hashed whole; larger ones by head, tail and samples.
_HASH_WHOLE_BYTES = 8 << 20
_HASH_EDGE_BYTES = 1 << 20
_HASH_SAMPLES = 64
_HASH_SAMPLE_BYTES = 64 << 10


class BatchError(Exception):
    """The job cannot go on; the message says why and what to do. Finished parts stay."""

    summary: "BatchSummary | None" = None  # set by run_batch: how far the job got


@dataclass(frozen=True)
class BatchJob:
    model: str
    input_path: Path
    output_path: Path
    outputs: tuple[str, ...] = ("output",)
    batch_size: int = DEFAULT_BATCH_SIZE  # items per request
    concurrency: int = DEFAULT_CONCURRENCY  # requests in flight
    model_version: str = ""  # empty: the server's default, pinned after the first response
    timeout_s: float | None = None  # per request, retries included; None: the client's default

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_path", Path(self.input_path))
        object.__setattr__(self, "output_path", Path(self.output_path))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.model:
            raise ValueError("model must not be empty")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        unknown = [name for name in self.outputs if name not in OUTPUT_NAMES]
        if not self.outputs or unknown or len(set(self.outputs)) != len(self.outputs):
            raise ValueError(f"outputs must be distinct names from {list(OUTPUT_NAMES)}, got {list(self.outputs)}")

    @property
    def parts_dir(self) -> Path:
        return self.output_path.with_name(self.output_path.name + ".parts")


@dataclass
class BatchSummary:
    items: int = 0  # in the input
    computed: int = 0  # sent to the server by this run
    resumed: int = 0  # found finished (parts or a complete output) and not recomputed
    seconds: float = 0.0
    requests: int = 0
    retries: int = 0
    errors: int = 0

    @property
    def items_per_s(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"batch: {self.items} items ({self.computed} computed, {self.resumed} resumed) "
                f"in {self.seconds:.2f} s, {self.items_per_s:.1f} items/s, {self.requests} requests, "
                f"{self.retries} retries, {self.errors} errors")


# ---------------------------------------------------------------------------
# Input shards
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # global index of its first item
    count: int
    has_mask: bool


@dataclass(frozen=True)
class ItemShape:
    """Per-item sizes, the same in every shard: query (lq, query_dim), key/value (lk, kv_dim)."""

    lq: int
    lk: int
    query_dim: int
    kv_dim: int


def _shard_paths(input_path: Path) -> list[Path]:
    if input_path.is_dir():
        paths = sorted(p for p in input_path.iterdir()
                       if p.suffix == ".npz" and p.is_file() and not p.name.startswith("."))
        if not paths:
            raise BatchError(f"input directory {input_path} holds no .npz shards")
        return paths
    if not input_path.is_file():
        raise BatchError(f"input {input_path} does not exist")
    return [input_path]


def _describe(path: Path) -> tuple[int, ItemShape, bool]:
    """A shard's item count and item shape, checked from its headers alone."""
    headers = npzio.read_headers(path)
    missing = [name for name in ("query", "key", "value") if name not in headers]
    if missing:
        raise BatchError(f"{path}: missing arrays {missing}; expected query, key, value and optionally mask, "
                         f"got {sorted(headers)}")
    q, k, v = headers["query"], headers["key"], headers["value"]
    for name, info in (("query", q), ("key", k), ("value", v)):
        if len(info.shape) != 3:
            raise BatchError(f"{path}: {name} must be (items, length, width), got shape {info.shape}")
        if info.dtype.kind not in "fiu":
            raise BatchError(f"{path}: {name} must be real-valued (converted to float32), got dtype {info.dtype}")
    n = q.shape[0]
    if k.shape != v.shape or k.shape[0] != n:
        raise BatchError(f"{path}: expected key and value of shape ({n}, lk, kv_dim), got key {k.shape} "
                         f"and value {v.shape}")
    shape = ItemShape(lq=q.shape[1], lk=k.shape[1], query_dim=q.shape[2], kv_dim=k.shape[2])
    mask = headers.get("mask")
    if mask is not None:
        if mask.shape != (n, shape.lq, shape.lk):
            raise BatchError(f"{path}: mask must be (items, lq, lk)={(n, shape.lq, shape.lk)}, got {mask.shape}")
        if mask.dtype.kind not in "biu":
            raise BatchError(f"{path}: mask must be bool (True = attend) or integer 0/1, got dtype {mask.dtype}")
    return n, shape, mask is not None


def discover_shards(input_path: Path) -> tuple[list[Shard], ItemShape]:
    shards: list[Shard] = []
    item_shape: ItemShape | None = None
    offset = 0
    for path in _shard_paths(input_path):
        try:
            count, shape, has_mask = _describe(path)
        except BatchError:
            raise
        except Exception as err:  # zipfile.BadZipFile, a truncated .npy header, ...: name the file
            raise BatchError(f"{path}: not a readable .npz ({type(err).__name__}: {err})") from None
        if item_shape is None:
            item_shape = shape
        elif shape != item_shape:
            raise BatchError(f"{path}: items of shape {shape} differ from the first shard's {item_shape}; "
                             "all shards need one lq, lk and width so the outputs stack")
        if count:
            shards.append(Shard(path, offset, count, has_mask))
        offset += count
    if not shards or item_shape is None:
        raise BatchError(f"input {input_path} holds no items")
    return shards, item_shape


def _sampled_sha256(path: Path) -> str:
    """sha256 of the whole file when small; else of its size, head, tail and evenly spaced samples.

    A fingerprint against mixing different inputs (regenerated data differs everywhere), read
    in a fraction of a second even for inputs larger than RAM; not a proof against a single
    byte edited in the middle of a huge file.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _HASH_WHOLE_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            spots = [0, size - _HASH_EDGE_BYTES]
            step = (size - _HASH_SAMPLE_BYTES) // (_HASH_SAMPLES + 1)
            for i, start in enumerate(spots + [step * (j + 1) for j in range(_HASH_SAMPLES)]):
                f.seek(start)
                digest.update(f.read(_HASH_EDGE_BYTES if i < 2 else _HASH_SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint(job: BatchJob, shards: list[Shard]) -> dict[str, Any]:
    """What makes two runs the same job: model, version asked, outputs, and the inputs' content."""
    base = job.input_path if job.input_path.is_dir() else job.input_path.parent
    return {
        "format": FORMAT,
        "model": job.model,
        "model_version": job.model_version,
        "outputs": list(job.outputs),
        "inputs": [
            {"file": str(s.path.relative_to(base)), "items": s.count, "bytes": s.path.stat().st_size,
             "sha256_sampled": _sampled_sha256(s.path)}
            for s in shards
        ],
    }


def job_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------
# The work directory
# ---------------------------------------------------------------------------


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{path.name}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WorkDir:
    """`<output>.parts/`: the manifest, one file per finished chunk, and a lock against two runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file: IO[bytes] | None = None

    def lock(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.path / LOCK, "wb")
        try:
            # Released by the kernel when the process dies, kill -9 included.
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise BatchError(f"another batch job is writing {self.path}; wait for it or stop it") from None
        for stale in self.path.glob(f"{_TMP_PREFIX}*"):  # a killed run's half-written files
            stale.unlink(missing_ok=True)

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def read_manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise BatchError(f"{self.path / MANIFEST} is unreadable ({err}); delete {self.path} to start over") from None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        _write_json_atomic(self.path / MANIFEST, manifest)

    def part_path(self, start: int, stop: int) -> Path:
        return self.path / f"{start:012d}-{stop:012d}.npz"

    def parts(self) -> list[tuple[int, int]]:
        """Finished chunks as (start, stop) item ranges, sorted."""
        ranges = []
        for entry in os.scandir(self.path):
            match = _PART.match(entry.name)
            if match:
                ranges.append((int(match.group(1)), int(match.group(2))))
        return sorted(ranges)

    def write_part(self, start: int, stop: int, arrays: dict[str, np.ndarray]) -> None:
        tmp = self.path / f"{_TMP_PREFIX}{os.getpid()}-{start:012d}.npz"
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.part_path(start, stop))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        # Parts first and the manifest last: a kill midway leaves a directory a rerun recognises
        # (and the output's zip comment already says the job is complete).
        for start, stop in self.parts():
            self.part_path(start, stop).unlink(missing_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)
        self.unlock()
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    shard_index: int
    start: int  # global item indices [start, stop)
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def plan_chunks(shards: list[Shard], done: list[tuple[int, int]], batch_size: int) -> list[Chunk]:
    """The chunks still to compute: each shard's ranges not covered by `done`, cut into batch_size pieces."""
    chunks = []
    done = sorted(done)
    j = 0  # the first finished range that may still lie ahead of the cursor
    for index, shard in enumerate(shards):
        cursor, end = shard.offset, shard.offset + shard.count
        while cursor < end:
            while j < len(done) and done[j][1] <= cursor:
                j += 1
            if j < len(done) and done[j][0] <= cursor:  # the cursor is inside a finished range
                cursor = done[j][1]
                continue
            gap_end = min(end, done[j][0]) if j < len(done) else end
            for start in range(cursor, gap_end, batch_size):
                chunks.append(Chunk(index, start, min(start + batch_size, gap_end)))
            cursor = gap_end
    return chunks


def check_parts(shards: list[Shard], done: list[tuple[int, int]]) -> int:
    """Finished ranges must lie inside one shard each and not overlap; returns the items they cover."""
    bounds = [(s.offset, s.offset + s.count) for s in shards]
    previous_stop = -1
    for start, stop in done:
        if start >= stop or start < previous_stop:
            raise BatchError(f"part {start}-{stop} overlaps another or is empty; the work directory is "
                             "damaged: delete it to start over")
        if not any(lo <= start and stop <= hi for lo, hi in bounds):
            raise BatchError(f"part {start}-{stop} does not fit the input's shards; the work directory is "
                             "from other inputs: delete it to start over")
        previous_stop = stop
    return sum(stop - start for start, stop in done)


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


class Progress:
    """A one-line progress bar with items/s, redrawn at most 10 times a second on a TTY.

    On anything else (a pipe, a log file) it stays silent: the summary line says it all.
    """

    def __init__(self, total: int, done: int, stream: IO[str] | None) -> None:
        self.total = total
        self.done = done
        self._first = done
        self._stream = stream if stream is not None and _isatty(stream) else None
        self._start = time.monotonic()
        self._last_draw = 0.0
        self.retries = 0

    def advance(self, items: int) -> None:
        self.done += items
        now = time.monotonic()
        if self._stream is not None and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        rate = (self.done - self._first) / max(now - self._start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:.0f} s" if math.isfinite(eta) else "?"
        self._stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} items "
                           f"{rate:,.0f} items/s eta {eta_text} retries {self.retries}\x1b[K")
        self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


@dataclass
class _Run:
    job: BatchJob
    options: ClientOptions
    shards: list[Shard]
    item_shape: ItemShape
    workdir: WorkDir
    manifest: dict[str, Any]
    progress: Progress
    summary: BatchSummary
    failure: BaseException | None = None
    failed_chunk: Chunk | None = None
    _open: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    _open_locks: dict[int, asyncio.Lock] = field(default_factory=dict)
    _left_in_shard: dict[int, int] = field(default_factory=dict)

    @property
    def version(self) -> str:
        """The version to ask for: the pinned one, else the one given (empty: the server's default)."""
        return self.manifest.get("served_version") or self.job.model_version

    async def compute(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._left_in_shard[chunk.shard_index] = self._left_in_shard.get(chunk.shard_index, 0) + 1
        async with AsyncInferenceClient(self.options) as client:
            rest = iter(chunks)
            if "served_version" not in self.manifest:
                # The first chunk alone: its answer names the version every later request pins.
                first = next(rest, None)
                if first is not None:
                    await self._guarded(client, first)
            slots = asyncio.Semaphore(self.job.concurrency)
            in_flight: set[asyncio.Task] = set()
            for chunk in rest:
                await slots.acquire()  # the sliding window: start a chunk only when a slot frees
                if self.failure is not None:
                    slots.release()
                    break
                task = asyncio.create_task(self._guarded(client, chunk))
                in_flight.add(task)
                task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
            if in_flight:
                await asyncio.gather(*in_flight)
            self.summary.retries = client.retry_count

    async def _guarded(self, client: AsyncInferenceClient, chunk: Chunk) -> None:
        try:
            await self._run_chunk(client, chunk)
        except Exception as err:  # recorded; the job stops launching chunks and reports the first
            self.summary.errors += 1
            if self.failure is None:
                self.failure, self.failed_chunk = err, chunk

    async def _shard_arrays(self, index: int) -> dict[str, np.ndarray]:
        lock = self._open_locks.setdefault(index, asyncio.Lock())
        async with lock:
            if index not in self._open:
                self._open[index] = await asyncio.to_thread(npzio.open_npz, self.shards[index].path)
        return self._open[index]

    def _release_shard(self, index: int) -> None:
        self._left_in_shard[index] -= 1
        if self._left_in_shard[index] == 0:  # its last chunk is done: unmap it
            self._open.pop(index, None)

    async def _run_chunk(self, client: AsyncInferenceClient, chunk: Chunk) -> None:
        shard = self.shards[chunk.shard_index]
        try:
            arrays = await self._shard_arrays(chunk.shard_index)
            lo, hi = chunk.start - shard.offset, chunk.stop - shard.offset
            names = ("query", "key", "value", "mask") if shard.has_mask else ("query", "key", "value")
            # Copy the rows out of the memory map in a worker thread: this is where the disk is read.
            inputs = await asyncio.to_thread(lambda: {name: np.ascontiguousarray(arrays[name][lo:hi]) for name in names})
        finally:
            self._release_shard(chunk.shard_index)
        self.summary.requests += 1
        result = await client.infer_result(
            self.job.model, inputs["query"], inputs["key"], inputs["value"], inputs.get("mask"),
            self.job.outputs, model_version=self.version, timeout_s=self.job.timeout_s,
        )
        if "served_version" not in self.manifest:  # the first chunk, run alone: pin before its part exists
            self.manifest["served_version"] = result.model_version
            await asyncio.to_thread(self.workdir.write_manifest, self.manifest)
        elif result.model_version and self.version and result.model_version != self.version:
            raise BatchError(f"the server answered with model version {result.model_version!r}, but this job "
                             f"pinned version {self.version!r}")
        await asyncio.to_thread(self.workdir.write_part, chunk.start, chunk.stop, result.outputs)
        self.summary.computed += chunk.count
        self.progress.advance(chunk.count)
        self.progress.retries = client.retry_count


def preflight(job: BatchJob, options: ClientOptions, item: ItemShape) -> ModelMetadata:
    """Ask the model's metadata once: an unknown model, wrong widths, missing outputs or messages
    over the size limit fail here, before anything is computed or written."""
    with InferenceClient(options) as client:
        try:
            metadata = client.model_metadata(job.model, job.model_version, timeout_s=job.timeout_s)
        except InferenceError as err:
            raise BatchError(f"model {job.model!r}: {err}") from None
    for name, width in (("query", item.query_dim), ("key", item.kv_dim), ("value", item.kv_dim)):
        tensor = metadata.input(name)
        if tensor is not None and tensor.shape and tensor.shape[-1] not in (-1, width):
            raise BatchError(f"input {name} has width {width} but model {job.model!r} takes "
                             f"{tensor.shape[-1]} (shape {list(tensor.shape)})")
    missing = [name for name in job.outputs if metadata.outputs and metadata.output(name) is None]
    if missing:
        raise BatchError(f"model {job.model!r} has no outputs {missing}; it has {[t.name for t in metadata.outputs]}")
    _check_message_sizes(job, options, item, metadata)
    return metadata


def _check_message_sizes(job: BatchJob, options: ClientOptions, item: ItemShape, metadata: ModelMetadata) -> None:
    request_item = 4 * (item.lq * item.query_dim + 2 * item.lk * item.kv_dim) + item.lq * item.lk
    response_item = 0
    output = metadata.output("output")
    if "output" in job.outputs and output is not None and output.shape and output.shape[-1] > 0:
        response_item += 4 * item.lq * output.shape[-1]
    probs = metadata.output("attn_probs")
    if "attn_probs" in job.outputs and probs is not None and len(probs.shape) == 4 and probs.shape[1] > 0:
        response_item += 4 * probs.shape[1] * item.lq * item.lk
    per_item = max(request_item, response_item)
    limit = options.max_message_bytes - (64 << 10)  # headroom for the message's own fields
    if per_item * job.batch_size > limit:
        fits = max(limit // per_item, 0)
        raise BatchError(
            f"--batch-size {job.batch_size} makes messages of {per_item * job.batch_size / 2**20:.1f} MiB, "
            f"over the {options.max_message_bytes / 2**20:.0f} MiB limit; use --batch-size {fits} or less"
            + ("" if fits else " (one item does not fit: raise --max-message-mb)")
        )


def _output_item_shapes(outputs: tuple[str, ...], first_part: Path) -> dict[str, tuple[int, ...]]:
    """Each output's per-item shape, from the first part (every part is checked against it)."""
    with np.load(first_part) as part:
        return {name: tuple(part[name].shape[1:]) for name in outputs}


def _part_rows(workdir: WorkDir, parts: list[tuple[int, int]], name: str,
               item_shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    for start, stop in parts:
        path = workdir.part_path(start, stop)
        with np.load(path) as part:
            rows = part[name]
        if rows.shape != (stop - start, *item_shape) or rows.dtype != _FLOAT32:
            raise BatchError(f"{path}: {name} has shape {rows.shape} {rows.dtype}, expected "
                             f"{(stop - start, *item_shape)} float32; delete it and rerun to recompute it")
        yield rows


def _assemble(job: BatchJob, workdir: WorkDir, total: int, key: str) -> None:
    parts = workdir.parts()
    cursor = 0
    for start, stop in parts:  # complete, in order, no overlap
        if start != cursor:
            raise BatchError(f"items {cursor}..{start - 1} have no part; rerun to compute them")
        cursor = stop
    if cursor != total:
        raise BatchError(f"items {cursor}..{total - 1} have no part; rerun to compute them")
    shapes = _output_item_shapes(job.outputs, workdir.part_path(*parts[0]))
    members = [npzio.StreamedMember(name, _FLOAT32, (total, *shapes[name]),
                                    _part_rows(workdir, parts, name, shapes[name]))
               for name in job.outputs]
    job.output_path.parent.mkdir(parents=True, exist_ok=True)
    npzio.write_npz(job.output_path, members, comment=key.encode())


def run_batch(job: BatchJob, options: ClientOptions, progress_stream: IO[str] | None = None) -> BatchSummary:
    """Run (or resume) the job to the end; raises BatchError (with `.summary`) when it cannot finish.

    `progress_stream`: where the progress bar goes when it is a TTY (the CLI passes stderr).
    """
    started = time.monotonic()
    summary = BatchSummary()
    try:
        _run(job, options, progress_stream, summary)
    except BatchError as err:
        summary.seconds = time.monotonic() - started
        err.summary = summary
        raise
    summary.seconds = time.monotonic() - started
    return summary


def _run(job: BatchJob, options: ClientOptions, progress_stream: IO[str] | None, summary: BatchSummary) -> None:
    shards, item = discover_shards(job.input_path)
    total = shards[-1].offset + shards[-1].count
    summary.items = total
    output = job.output_path.resolve()
    if any(s.path.resolve() == output for s in shards):
        raise BatchError(f"output {job.output_path} is one of the input shards; write it elsewhere")
    identity = fingerprint(job, shards)
    key = job_key(identity)
    workdir = WorkDir(job.parts_dir)

    if npzio.read_comment(job.output_path) == key.encode():
        logger.info("%s already holds this job's complete output", job.output_path)
        summary.resumed = total
        if workdir.path.exists():  # killed while cleaning up
            workdir.lock()
            workdir.remove()
        return

    new_workdir = not workdir.path.exists()
    workdir.lock()
    try:
        manifest = workdir.read_manifest()
        done = workdir.parts()
        if manifest is None and done:
            raise BatchError(f"{workdir.path} holds parts but no manifest; delete it to start over")
        if manifest is not None and manifest.get("key") != key:
            raise BatchError(
                f"{workdir.path} holds a job for other inputs, model or outputs "
                f"(model {manifest.get('model')!r}, outputs {manifest.get('outputs')}); rerun with those "
                f"arguments, or delete {workdir.path} (or choose another --output) to start this one"
            )
        summary.resumed = check_parts(shards, done)
        chunks = plan_chunks(shards, done, job.batch_size)
        if chunks:
            try:
                preflight(job, options, item)
            except BatchError:
                summary.errors += 1
                if new_workdir:
                    workdir.remove()  # nothing was written: leave no trace
                raise
        if manifest is None:
            manifest = {"key": key, **identity, "items": total, "batch_size": job.batch_size}
            workdir.write_manifest(manifest)
        logger.info("batch job: %d items, %d already done, %d chunks to compute", total, summary.resumed, len(chunks))
        progress = Progress(total, summary.resumed, progress_stream)
        run = _Run(job, options, shards, item, workdir, manifest, progress, summary)
        compute_started = time.monotonic()
        try:
            if chunks:
                asyncio.run(run.compute(chunks))
        finally:
            progress.close()
        logger.info("computed %d items in %.2f s", summary.computed, time.monotonic() - compute_started)
        if run.failure is not None:
            chunk = run.failed_chunk
            where = f"items {chunk.start}..{chunk.stop - 1}" if chunk else "a chunk"
            err = run.failure
            hint = _hint(err)
            raise BatchError(f"request for {where} failed: {err}{hint}; finished parts are kept in "
                             f"{workdir.path}: rerun the same command to resume") from None
        assemble_started = time.monotonic()
        _assemble(job, workdir, total, key)
        workdir.remove()
        logger.info("assembled %s in %.2f s", job.output_path, time.monotonic() - assemble_started)
    finally:
        workdir.unlock()


def _hint(err: BaseException) -> str:
    if isinstance(err, InferenceError):
        if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return " (server queue full or message too large: lower --concurrency or --batch-size)"
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return " (raise --timeout, or lower --batch-size / --concurrency)"
        if err.code == grpc.StatusCode.UNAVAILABLE:
            return " (no server answered; retries exhausted)"
    return ""
