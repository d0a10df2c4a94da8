"""The resumable batch job behind `attnserve batch`.

    run_batch(BatchJob(model="self_attention", input_path=Path("in.npz"), output_path=Path("out.npz")),
              ClientOptions(url="127.0.0.1:8001,127.0.0.1:8002"))

Input: an .npz with `query`, `key`, `value` and optionally `mask`, or a directory of such shards
(sorted by name, items numbered across them). Output: an .npz of `output` (and `attn_probs`),
rows in input order.

Resuming: `<output>.parts/` holds the manifest (the job's fingerprint, the pinned model version)
and one part per finished chunk, each written atomically; a rerun computes only the gaps, then
assembles the output and removes the directory. The output's zip comment carries the job's key,
so a rerun after the end computes nothing.

One concern per module, in the order a run meets them: spec (BatchJob, the defaults), shards
(the input's shards), fingerprint (what makes two runs the same job), manifest, workdir (lock,
manifest file, parts), plan (the chunks left), preflight (one metadata call that refuses a job
that cannot work), reader (a chunk's rows, memory-mapped), runner (the window of requests; the
version pin), progress, assemble (the output from the parts), job (run_batch: the steps).
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
