"""`run_batch`: the job from start to end, each step in its own module.

    discover shards -> fingerprint -> this share (--shard) -> complete already? -> lock the work
    directory -> manifest and finished parts -> plan what is left -> preflight -> compute ->
    assemble -> remove the directory
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import IO

from attnserve.client.batch.assemble import assemble, finished_key
from attnserve.client.batch.fingerprint import Fingerprint, fingerprint
from attnserve.client.batch.manifest import Manifest
from attnserve.client.batch.plan import Chunk, check_parts, plan_chunks
from attnserve.client.batch.preflight import preflight
from attnserve.client.batch.progress import DEFAULT_EVERY_S, Progress
from attnserve.client.batch.runner import Runner
from attnserve.client.batch.shards import ItemShape, Shard, discover_shards, is_shard_name, take_share, total_items
from attnserve.client.batch.spec import BatchError, BatchJob, BatchSummary, InputRefused
from attnserve.client.batch.workdir import WorkDir
from attnserve.client.options import ClientOptions
from attnserve.client.paths import check_output_file
from attnserve.client.tracecontext import JobTrace

logger = logging.getLogger(__name__)


def run_batch(job: BatchJob, options: ClientOptions, progress_stream: IO[str] | None = None,
              progress_every_s: float = DEFAULT_EVERY_S) -> BatchSummary:
    """Run (or resume) the job to the end; raises BatchError (with `.summary`) when it cannot finish.

    `progress_stream`: where progress goes (the CLI passes stderr): a bar on a TTY, else a line
    every `progress_every_s` seconds.
    """
    started = time.monotonic()
    summary = BatchSummary()
    try:
        _run(job, options, (progress_stream, progress_every_s), summary)
    except BatchError as err:
        err.summary = summary
        raise
    finally:
        summary.seconds = time.monotonic() - started
    return summary


def _run(job: BatchJob, options: ClientOptions, progress_to: tuple[IO[str] | None, float],
         summary: BatchSummary) -> None:
    shards, item = discover_shards(job.input_path)
    output = job.output_path.resolve()
    if any(s.path.resolve() == output for s in shards):
        raise BatchError(f"output {job.output_path} is one of the input shards; write it elsewhere")
    _check_output_paths(job)
    identity = fingerprint(job, shards)
    first_item = 0  # the global number of this job's first item
    if job.shard is not None:
        shards, first_item = take_share(shards, *job.shard)
    summary.items = total = total_items(shards)
    workdir = WorkDir(job.parts_dir)

    if finished_key(job.output_path) == identity.key.encode():
        logger.info("%s already holds this job's complete output", job.output_path)
        summary.resumed = total
        if workdir.exists():  # killed while cleaning up
            workdir.lock()
            workdir.remove()
        return

    new_workdir = not workdir.exists()
    workdir.lock()
    try:
        manifest, done = _resume_point(workdir, identity)
        summary.resumed = check_parts(shards, done)
        chunks = plan_chunks(shards, done, job.batch_size)
        if chunks:
            _preflight(job, options, item, workdir, new_workdir, summary)
        if manifest is None:
            manifest = Manifest.start(identity, total, job.batch_size)
            workdir.write_manifest(manifest)
        logger.info("batch job: %d items, %d already done, %d chunks to compute", total, summary.resumed, len(chunks))
        try:
            _compute(job, options, shards, workdir, manifest, chunks, progress_to, summary)
        except InputRefused as err:
            raise _refused(err, workdir, new_workdir) from None
        assemble_started = time.monotonic()
        assemble(job, workdir, total, identity.key, shards, first_item)
        workdir.remove()
        logger.info("assembled %s in %.2f s", job.output_path, time.monotonic() - assemble_started)
    finally:
        workdir.unlock()


def _check_output_paths(job: BatchJob) -> None:
    """Before anything is read or sent: the output and its work directory can be written, and the
    output will not become a shard of this job's input directory when the job is rerun."""
    try:
        check_output_file(job.output_path, "output")
    except ValueError as err:
        raise BatchError(str(err)) from None
    parts = job.parts_dir
    if parts.exists() and not parts.is_dir():
        raise BatchError(f"{parts} (the job's work directory beside the output) is not a directory; "
                         "move it or choose another --output")
    if (job.input_path.is_dir() and is_shard_name(job.output_path)
            and job.output_path.parent.resolve() == job.input_path.resolve()):
        raise BatchError(f"output {job.output_path} is inside the input directory {job.input_path}, where "
                         "a rerun would read it as a shard; write it elsewhere")


def _resume_point(workdir: WorkDir, identity: Fingerprint) -> tuple[Manifest | None, list[tuple[int, int]]]:
    """The locked work directory's manifest (None: a new job) and finished parts, refusing another job's."""
    manifest = workdir.read_manifest()
    done = workdir.parts()
    if manifest is None and done:
        raise BatchError(f"{workdir.path} holds parts but no manifest; delete it to start over")
    if manifest is not None and manifest.key != identity.key:
        theirs = manifest.fingerprint
        raise BatchError(
            f"{workdir.path} holds a job for other inputs, model or outputs "
            f"(model {theirs.model!r}, outputs {list(theirs.outputs)}); rerun with those "
            f"arguments, or delete {workdir.path} (or choose another --output) to start this one"
        )
    return manifest, done


def _refused(err: InputRefused, workdir: WorkDir, new_workdir: bool) -> InputRefused:
    """The refusal, once the work directory of a new job that finished nothing is gone: a bad
    input leaves no trace, or the refusal says where this input's finished parts are."""
    if new_workdir and not workdir.parts():
        workdir.remove()
        return err
    return InputRefused(f"{err}; this input's finished parts are kept in {workdir.path}: once the input "
                        "is fixed it is another job, so delete that directory and rerun")


def _preflight(job: BatchJob, options: ClientOptions, item: ItemShape, workdir: WorkDir, new_workdir: bool,
               summary: BatchSummary) -> None:
    try:
        preflight(job, options, item)
    except BatchError:
        summary.errors += 1
        if new_workdir:
            workdir.remove()  # nothing was written: leave no trace
        raise


def _compute(job: BatchJob, options: ClientOptions, shards: list[Shard], workdir: WorkDir, manifest: Manifest,
             chunks: list[Chunk], progress_to: tuple[IO[str] | None, float], summary: BatchSummary) -> None:
    progress = Progress(summary.items, summary.resumed, *progress_to)
    trace = JobTrace.start()  # this run's calls are one trace (docs/tracing.md)
    summary.trace_id = trace.trace_id
    logger.info("batch job: calls sent in trace %s", trace.trace_id)
    runner = Runner(job, options, shards, workdir, manifest, progress, summary, trace)
    started = time.monotonic()
    try:
        failure = asyncio.run(runner.compute(chunks)) if chunks else None
    finally:
        progress.close()
        summary.compute_seconds = progress.seconds
    logger.info("computed %d items in %.2f s", summary.computed, time.monotonic() - started)
    if summary.rounded:  # documented (docs/client.md), but numbers changed: say so once
        logger.warning("%d input values were rounded to float32 (float64's extra digits, or integers past "
                       "2**24); store the input as float32 to send it unchanged", summary.rounded)
    if failure is not None:
        raise failure.to_error(workdir.path) from None
