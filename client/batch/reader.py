"""A chunk's input rows, copied out of its shard in a worker thread.

Every chunk's values are checked as they are read (`codec.check_values`): NaN, inf, numbers past
float32's range and masks outside {0, 1} stop the job before a request carries them, naming the
file and the item; `rounded` counts the values float32 rounds, for the job's one warning.

Each shard is opened (memory-mapped when stored uncompressed; a compressed shard is loaded
whole) when its first chunk is read and dropped after its last, so memory holds the chunks in
flight plus the shards they come from.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
from attnserve.client import codec, npzio
from attnserve.client.batch import tables
from attnserve.client.batch.plan import Chunk
from attnserve.client.batch.shards import Shard
from attnserve.client.batch.spec import InputRefused


class ShardReader:
    """Create it inside the event loop that reads (its locks belong to that loop)."""

    def __init__(self, shards: list[Shard], chunks: list[Chunk]) -> None:
        self._shards = shards
        self._open: dict[int, dict[str, np.ndarray]] = {}
        self._opening: dict[int, asyncio.Lock] = {}
        self._chunks_left = Counter(chunk.shard_index for chunk in chunks)
        self.rounded = 0  # values that float32 rounds, over the chunks read so far

    async def read(self, chunk: Chunk) -> dict[str, np.ndarray]:
        """query (n, lq, query_dim), key and value (n, lk, kv_dim), and mask (n, lq, lk) when the
        shard has one, n = chunk.count; every chunk given at construction is read exactly once."""
        shard = self._shards[chunk.shard_index]
        try:
            arrays = await self._arrays(chunk.shard_index)
            lo = chunk.start - shard.offset + shard.first_row
            hi = lo + chunk.count
            names = ("query", "key", "value", "mask") if shard.has_mask else ("query", "key", "value")

            def rows() -> tuple[dict[str, np.ndarray], int]:
                chunk_rows = {name: np.ascontiguousarray(arrays[name][lo:hi]) for name in names}
                try:
                    return chunk_rows, codec.check_values(chunk_rows, first_item=lo)
                except ValueError as err:
                    raise InputRefused(f"{shard.path}: {err}") from None

            # Copy the rows out of the memory map in a worker thread: this is where the disk is read.
            chunk_rows, rounded = await asyncio.to_thread(rows)
            self.rounded += rounded
            return chunk_rows
        finally:
            self._release(chunk.shard_index)

    async def _arrays(self, index: int) -> dict[str, np.ndarray]:
        async with self._opening.setdefault(index, asyncio.Lock()):
            if index not in self._open:
                shard = self._shards[index]
                # A Parquet shard is read whole (its columns decoded), as a compressed .npz is.
                read = tables.read_parquet if shard.is_table else npzio.open_npz
                try:
                    self._open[index] = await asyncio.to_thread(read, shard.path)
                except ValueError as err:  # a null row in a table, a damaged member
                    raise InputRefused(f"{shard.path}: {err}") from None
        return self._open[index]

    def _release(self, index: int) -> None:
        self._chunks_left[index] -= 1
        if self._chunks_left[index] == 0:  # its last chunk is read: unmap it
            self._open.pop(index, None)
