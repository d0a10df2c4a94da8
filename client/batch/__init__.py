"""The resumable batch job behind `attnserve batch`.

    run_batch(BatchJob(model="self_attention", input_path=Path("in.npz"), output_path=Path("out.npz")),
              ClientOptions(url="127.0.0.1:8001,127.0.0.1:8002"))

Input: an .npz with `query` (N, lq, query_dim), `key` and `value` (N, lk, kv_dim) and optionally
`mask` (N, lq, lk), or a directory of such .npz shards taken in sorted name order, items numbered
globally across them. Output: an .npz with `output` (N, lq, out_dim) (and `attn_probs`
(N, heads, lq, lk) when asked), rows in input order.

Resuming: the work directory `<output>.parts/` holds the manifest (the job's fingerprint and the
pinned model version) and one part per finished chunk, each written atomically. A rerun with the
same arguments skips the items its parts cover (the batch size and concurrency may change; the
model, outputs and inputs may not: the manifest refuses a mix), computes the gaps, assembles the
output chunk by chunk and removes the work directory. The output's zip comment carries the
job's key, so a rerun after the end (or after a kill during clean-up) computes nothing; an
existing output of another job is replaced, atomically, when this one is assembled.

One concern per module, in the order a run meets them:

    spec.py         BatchJob, BatchSummary, BatchError, the defaults
    shards.py       the input's shards, checked from their headers
    fingerprint.py  what makes two runs the same job; its key
    manifest.py     the work directory's typed manifest
    workdir.py      the work directory: lock, manifest file, parts
    plan.py         the chunks left to compute
    preflight.py    one metadata call that refuses a job that cannot work
    reader.py       a chunk's rows from its (memory-mapped) shard
    runner.py       the sliding window of requests; the version pin
    progress.py     the progress bar
    assemble.py     the output from the parts
    job.py          run_batch: the steps in order
"""

from attnserve.client.batch.fingerprint import FORMAT, Fingerprint, InputFile, fingerprint
from attnserve.client.batch.job import run_batch
from attnserve.client.batch.manifest import Manifest
from attnserve.client.batch.plan import Chunk, check_parts, plan_chunks
from attnserve.client.batch.preflight import preflight
from attnserve.client.batch.progress import Progress
from attnserve.client.batch.shards import ItemShape, Shard, discover_shards
from attnserve.client.batch.spec import DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, BatchError, BatchJob, BatchSummary
from attnserve.client.batch.workdir import LOCK, MANIFEST, WorkDir

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CONCURRENCY",
    "FORMAT",
    "LOCK",
    "MANIFEST",
    "BatchError",
    "BatchJob",
    "BatchSummary",
    "Chunk",
    "Fingerprint",
    "InputFile",
    "ItemShape",
    "Manifest",
    "Progress",
    "Shard",
    "WorkDir",
    "check_parts",
    "discover_shards",
    "fingerprint",
    "plan_chunks",
    "preflight",
    "run_batch",
]
