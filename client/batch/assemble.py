"""The output from the parts: checked complete and in order, then streamed member by member
into one .npz (`npzio.write_npz`: atomic, one part in memory at a time) whose zip comment is the
job's key, so a rerun sees that the job is complete."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from attnserve.client import npzio
from attnserve.client.batch.spec import BatchError, BatchJob
from attnserve.client.batch.workdir import WorkDir

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


def assemble(job: BatchJob, workdir: WorkDir, total: int, key: str) -> None:
    parts = workdir.parts()
    _check_complete(parts, total)
    shapes = _output_item_shapes(job.outputs, workdir.part_path(*parts[0]))
    members = [npzio.StreamedMember(name, _FLOAT32, (total, *shapes[name]),
                                    _part_rows(workdir, parts, name, shapes[name]))
               for name in job.outputs]
    npzio.write_npz(job.output_path, members, comment=key.encode())
