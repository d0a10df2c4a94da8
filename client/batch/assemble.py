"""The output from the parts: checked complete and in order, then streamed member by member
into one .npz (`npzio.write_npz`: atomic, one part in memory at a time) whose zip comment is the
job's key, so a rerun sees that the job is complete. A .parquet output is written whole (every
part in memory) with an `id` column, the job's key in its schema metadata (client.batch.tables).

`merge_outputs` joins the outputs of `--shard 0/n .. n-1/n`, in the order given."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from attnserve.client import npzio
from attnserve.client.batch import tables
from attnserve.client.batch.shards import Shard
from attnserve.client.batch.spec import BatchError, BatchJob
from attnserve.client.batch.workdir import WorkDir
from attnserve.client.paths import check_input_file, check_output_file

_FLOAT32 = np.dtype("<f4")


def _check_complete(parts: list[tuple[int, int]], total: int) -> None:
    cursor = 0
    for start, stop in parts:  # sorted: complete, in order, no overlap
        if start != cursor:
            raise BatchError(f"items {cursor}..{start - 1} have no part; rerun to compute them")
        cursor = stop
    if cursor != total:
        raise BatchError(f"items {cursor}..{total - 1} have no part; rerun to compute them")


def _output_item_shapes(outputs: tuple[str, ...], first_part: Path) -> dict[str, tuple[int, ...]]:
    """Each output's per-item shape, from the first part (every part is checked against it)."""
    with np.load(first_part) as part:
        return {name: tuple(part[name].shape[1:]) for name in outputs}


def _part_rows(workdir: WorkDir, parts: list[tuple[int, int]], name: str,
               item_shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    for start, stop in parts:
        path = workdir.part_path(start, stop)
        with np.load(path) as part:
            rows = part[name]  # (stop - start, *item_shape)
        if rows.shape != (stop - start, *item_shape) or rows.dtype != _FLOAT32:
            raise BatchError(f"{path}: {name} has shape {rows.shape} {rows.dtype}, expected "
                             f"{(stop - start, *item_shape)} float32; delete it and rerun to recompute it")
        yield rows


def finished_key(path: Path) -> bytes | None:
    """The job key a finished output carries (.npz: its zip comment; .parquet: its metadata)."""
    return tables.read_job_key(path) if tables.is_table(path) else npzio.read_comment(path)


def assemble(job: BatchJob, workdir: WorkDir, total: int, key: str, shards: list[Shard] | None = None,
             first_item: int = 0) -> None:
    """shards (this job's, a share's when sharded) and first_item: where a table's ids come from."""
    parts = workdir.parts()
    _check_complete(parts, total)
    shapes = _output_item_shapes(job.outputs, workdir.part_path(*parts[0]))
    if tables.is_table(job.output_path):
        columns = {tables.ITEM_ID: _ids(shards or [], first_item)}
        for name in job.outputs:
            columns[name] = np.concatenate(list(_part_rows(workdir, parts, name, shapes[name])))
        tables.write_parquet(job.output_path, columns, job_key=key)
        return
    members = [npzio.StreamedMember(name, _FLOAT32, (total, *shapes[name]),
                                    _part_rows(workdir, parts, name, shapes[name]))
               for name in job.outputs]
    npzio.write_npz(job.output_path, members, comment=key.encode())


def _ids(shards: list[Shard], first_item: int) -> np.ndarray:
    """Each item's id: its table's id column where the input has one, else its global number."""
    ids = []
    for shard in shards:
        column = tables.read_ids(shard.path) if shard.is_table else None
        if column is None:
            ids.append(np.arange(first_item + shard.offset, first_item + shard.offset + shard.count, dtype=np.int64))
        else:
            ids.append(column[shard.first_row:shard.first_row + shard.count])
    return np.concatenate(ids)


def merge_outputs(parts: list[Path], output: Path) -> int:
    """The outputs of `--shard 0/n .. n-1/n` (in that order) as one output of the same format;
    returns its items. Every part must hold the same arrays of the same item shape."""
    if not parts:
        raise BatchError("nothing to merge: name the shards' outputs, in shard order")
    if any(tables.is_table(p) != tables.is_table(output) for p in parts):
        raise BatchError(f"merge parts and output must all be .npz or all .parquet, got {[str(p) for p in parts]} "
                         f"and {output}")
    try:  # every path before anything is read: a FIFO part would block, a bad output fail at the end
        for part in parts:
            check_input_file(part, "merge part")
        check_output_file(output, "output")
    except ValueError as err:
        raise BatchError(str(err)) from None
    if tables.is_table(output):
        pieces = [tables.read_parquet(p) for p in parts]
        names = list(pieces[0])
        for path, piece in zip(parts, pieces, strict=True):
            if list(piece) != names:
                raise BatchError(f"{path}: columns {list(piece)}, expected {names} as in {parts[0]}")
        columns = {name: np.concatenate([piece[name] for piece in pieces]) for name in names}
        tables.write_parquet(output, columns)
        return len(columns[names[0]])
    headers = [npzio.read_headers(p) for p in parts]
    names = list(headers[0])
    for path, header in zip(parts, headers, strict=True):
        if list(header) != names or any(header[n].shape[1:] != headers[0][n].shape[1:] for n in names):
            raise BatchError(f"{path}: arrays {({n: h.shape for n, h in header.items()})} differ from "
                             f"{parts[0]}'s; merge the outputs of one sharded job")
    total = sum(header[names[0]].shape[0] for header in headers)

    def rows(name: str) -> Iterator[np.ndarray]:
        for path in parts:
            with np.load(path) as part:
                yield np.ascontiguousarray(part[name], dtype=_FLOAT32)

    npzio.write_npz(output, [npzio.StreamedMember(name, _FLOAT32, (total, *headers[0][name].shape[1:]), rows(name))
                             for name in names])
    return total
