"""Sending the chunks: one event loop keeps `concurrency` requests in flight over one grpc.aio
channel (round robin across the servers) without a thread per request.

Requests start in input order from a sliding window: a chunk is read only when one of the
`concurrency` slots frees. The loop only packs and unpacks bytes; reading rows and writing and
fsyncing a part run in worker threads. The first chunk runs alone: its response names the model
version that the manifest pins and every later request asks for, so a server that loads a new
version mid-job cannot mix two models' outputs in one file. The first failure stops new chunks
from starting; the ones in flight finish (and keep their parts).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from attnserve.client import codec
from attnserve.client.aio import AsyncInferenceClient
from attnserve.client.batch.manifest import Manifest
from attnserve.client.batch.plan import Chunk
from attnserve.client.batch.progress import Progress
from attnserve.client.batch.reader import ShardReader
from attnserve.client.batch.shards import Shard
from attnserve.client.batch.spec import BatchError, BatchJob, BatchSummary, InputRefused
from attnserve.client.batch.workdir import WorkDir
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions
from attnserve.client.shm import (
    SharedMemorySlot,
    job_prefix,
    release_leftovers,
    same_host,
    slot_dims,
    stored_job_prefix,
    uses_shared_memory,
)
from attnserve.client.tracecontext import JobTrace

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChunkFailure:
    chunk: Chunk
    error: Exception

    def to_error(self, workdir: Path) -> BatchError:
        where = f"items {self.chunk.start}..{self.chunk.stop - 1}"
        if isinstance(self.error, InputRefused):  # read, refused, never sent
            return InputRefused(f"{self.error}; no request was sent for {where}")
        return BatchError(f"request for {where} failed: {self.error}{_hint(self.error)}; finished parts are "
                          f"kept in {workdir}: rerun the same command to resume")


def _hint(err: Exception) -> str:
    if isinstance(err, InferenceError):
        if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "shared memory region" in err.details:
            return " (the server's shared memory bounds are spent: lower --concurrency, or --shared-memory off)"
        if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return " (server queue full or message too large: lower --concurrency or --batch-size)"
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return " (raise --timeout, or lower --batch-size / --concurrency)"
        if err.code == grpc.StatusCode.UNAVAILABLE:
            return " (no server answered; retries exhausted)"
    return ""


class Runner:
    def __init__(self, job: BatchJob, options: ClientOptions, shards: list[Shard], workdir: WorkDir,
                 manifest: Manifest, progress: Progress, summary: BatchSummary, trace: JobTrace | None = None) -> None:
        self._job = job
        self._trace = trace or JobTrace.start()  # the job's calls are one trace (docs/tracing.md)
        self._options = options
        self._shards = shards
        self._workdir = workdir
        self.manifest = manifest  # replaced by a pinned one (and rewritten) after the first response
        self._progress = progress
        self._summary = summary
        self._failure: ChunkFailure | None = None
        self._slots: asyncio.Queue[SharedMemorySlot] | None = None  # shared memory, when used

    @property
    def version(self) -> str:
        """The version to ask for: the pinned one, else the one given (empty: the server's default)."""
        return self.manifest.served_version or self._job.model_version

    async def compute(self, chunks: list[Chunk]) -> ChunkFailure | None:
        """Run every chunk, or stop launching at the first failure and return it."""
        reader = ShardReader(self._shards, chunks)
        try:
            async with AsyncInferenceClient(self._options) as client:
                try:
                    await self._release_leftovers(client)
                    await self._open_slots(client)
                    return await self._compute(client, reader, chunks)
                finally:
                    await self._close_slots(client)
        finally:
            self._summary.rounded = reader.rounded

    async def _release_leftovers(self, client: AsyncInferenceClient) -> None:
        """A run of this job killed before it closed its slots left their regions registered and
        their shm objects in /dev/shm: release them (their names carry the work directory's id)."""
        prefix = stored_job_prefix(self._workdir.path)
        if prefix is None:
            return
        try:
            await release_leftovers(client, prefix, timeout_s=self._job.timeout_s)
        except InferenceError as err:  # the server's idle expiry reclaims them in the end
            logger.warning("could not unregister the regions an earlier run of this job left (%s*): %s", prefix, err)

    async def _open_slots(self, client: AsyncInferenceClient) -> None:
        """--shared-memory auto: one pair of regions per request in flight, when the server is on
        this host and lists the extension."""
        if self._job.shared_memory != "auto" or not same_host(self._options.url):
            return
        extensions = (await client.server_metadata(timeout_s=self._job.timeout_s)).extensions
        metadata = await client.model_metadata(self._job.model, self._job.model_version, timeout_s=self._job.timeout_s)
        if not uses_shared_memory(self._job.shared_memory, self._options.url, extensions, metadata):
            return
        out_dim, heads = slot_dims(metadata)
        prefix = await asyncio.to_thread(job_prefix, self._workdir.path)
        self._slots = asyncio.Queue()
        for index in range(self._job.concurrency):
            self._slots.put_nowait(SharedMemorySlot(f"{prefix}{index}", out_dim, heads))
        self._summary.shared_memory = True

    async def _close_slots(self, client: AsyncInferenceClient) -> None:
        slots, self._slots = self._slots, None
        while slots is not None and not slots.empty():
            try:
                await slots.get_nowait().close(client)
            except Exception:  # the server is gone: its regions went with it; ours are unlinked
                pass

    async def _infer(self, client: AsyncInferenceClient, inputs: dict) -> codec.InferResult:
        if self._slots is None:
            return await client.infer_result(
                self._job.model, inputs["query"], inputs["key"], inputs["value"], inputs.get("mask"),
                self._job.outputs, model_version=self.version, timeout_s=self._job.timeout_s,
                metadata=self._trace.call_metadata(), priority=self._job.priority, timeout_us=self._job.timeout_us)
        slot = await self._slots.get()
        try:
            checked = codec.validate_inputs(inputs["query"], inputs["key"], inputs["value"], inputs.get("mask"))
            result = await slot.infer(client, self._job.model, checked, self._job.outputs, model_version=self.version,
                                      timeout_s=self._job.timeout_s, metadata=self._trace.call_metadata(),
                                      priority=self._job.priority, timeout_us=self._job.timeout_us)
            codec.check_output_shapes(result.outputs, checked)
            return result
        finally:
            self._slots.put_nowait(slot)

    async def _compute(self, client: AsyncInferenceClient, reader: ShardReader, chunks: list[Chunk]
                       ) -> ChunkFailure | None:
        rest = iter(chunks)
        if not self.manifest.pinned:
            first = next(rest, None)
            if first is not None:
                await self._guarded(client, reader, first)
        slots = asyncio.Semaphore(self._job.concurrency)
        in_flight: set[asyncio.Task] = set()
        for chunk in rest:
            await slots.acquire()  # the sliding window: start a chunk only when a slot frees
            if self._failure is not None:
                slots.release()
                break
            task = asyncio.create_task(self._guarded(client, reader, chunk))
            in_flight.add(task)
            task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
        if in_flight:
            await asyncio.gather(*in_flight)
        self._summary.retries = client.retry_count
        return self._failure

    async def _guarded(self, client: AsyncInferenceClient, reader: ShardReader, chunk: Chunk) -> None:
        try:
            await self._run_chunk(client, reader, chunk)
        except Exception as err:  # recorded; the job stops launching chunks and reports the first
            self._summary.errors += 1
            if self._failure is None:
                self._failure = ChunkFailure(chunk, err)

    async def _run_chunk(self, client: AsyncInferenceClient, reader: ShardReader, chunk: Chunk) -> None:
        inputs = await reader.read(chunk)
        self._summary.requests += 1
        result = await self._infer(client, inputs)
        if not self.manifest.pinned:  # the first chunk, run alone: pin before its part exists
            self.manifest = self.manifest.pin(result.model_version)
            await asyncio.to_thread(self._workdir.write_manifest, self.manifest)
        elif result.model_version and self.version and result.model_version != self.version:
            raise BatchError(f"the server answered with model version {result.model_version!r}, but this job "
                             f"pinned version {self.version!r}")
        await asyncio.to_thread(self._workdir.write_part, chunk.start, chunk.stop, result.outputs)
        self._summary.computed += chunk.count
        self._progress.advance(chunk.count)
        self._progress.retries = client.retry_count
