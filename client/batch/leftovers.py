"""`attnserve batch --output OUT --cleanup-shared-memory`: release what a killed run of the job
writing OUT left in shared memory, without running it: the regions registered on the server
(--url) and the shm objects in /dev/shm, both named from the id in the job's work directory
(attnserve.client.shm.job_prefix). A rerun of the job does the same before it starts; the parts
already computed are kept either way (docs/shared-memory.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from attnserve.client.aio import AsyncInferenceClient
from attnserve.client.batch.spec import BatchError, parts_dir_of
from attnserve.client.batch.workdir import WorkDir
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions
from attnserve.client.shm import release_leftovers, stored_job_prefix


def release_job_shared_memory(output_path: Path, options: ClientOptions,
                              timeout_s: float | None = None) -> tuple[list[str], list[str]]:
    """(regions unregistered, shm objects unlinked) of the job writing `output_path`; BatchError
    when a run of it holds its work directory (it uses them) or the server refuses."""
    workdir = WorkDir(parts_dir_of(output_path))
    if not workdir.exists():
        return [], []
    workdir.lock()  # a running job's regions are in use: its lock refuses us
    try:
        prefix = stored_job_prefix(workdir.path)
        if prefix is None:
            return [], []  # no run of this job used shared memory

        async def release() -> tuple[list[str], list[str]]:
            async with AsyncInferenceClient(options) as client:
                return await release_leftovers(client, prefix, timeout_s=timeout_s)

        try:
            return asyncio.run(release())
        except InferenceError as err:
            raise BatchError(f"cannot unregister the regions of the job writing {output_path} on "
                             f"{options.url}: {err}") from None
    finally:
        workdir.unlock()
