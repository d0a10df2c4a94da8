"""What is left to compute: the input's items not covered by finished parts, cut into chunks
of at most batch_size that never straddle two shards (one request reads one shard)."""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.client.batch.shards import Shard
from attnserve.client.batch.spec import BatchError


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
