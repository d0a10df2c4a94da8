"""Metadata calls before anything is computed or written: an unknown model, wrong widths,
missing outputs or messages over the size limit fail here, with what to change. Tensors that
travel through shared memory (--shared-memory auto) leave the messages small: no size check."""

from __future__ import annotations

from attnserve.client.batch.shards import ItemShape
from attnserve.client.batch.spec import BatchError, BatchJob
from attnserve.client.client import InferenceClient
from attnserve.client.codec import ModelMetadata
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions
from attnserve.client.shm import same_host, uses_shared_memory

_MESSAGE_HEADROOM_BYTES = 64 << 10  # for the message's own fields


def preflight(job: BatchJob, options: ClientOptions, item: ItemShape) -> ModelMetadata:
    with InferenceClient(options) as client:
        try:
            metadata = client.model_metadata(job.model, job.model_version, timeout_s=job.timeout_s)
            # The runner's own test (Runner._open_slots), asked only where it can hold.
            through_regions = (job.shared_memory == "auto" and same_host(options.url) and uses_shared_memory(
                job.shared_memory, options.url, client.server_metadata(timeout_s=job.timeout_s).extensions, metadata))
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
    if not through_regions:
        _check_message_sizes(job, options, item, metadata)
    return metadata


def _check_message_sizes(job: BatchJob, options: ClientOptions, item: ItemShape, metadata: ModelMetadata) -> None:
    # float32 query, key and value, one byte of mask per (lq, lk) pair
    request_item = 4 * (item.lq * item.query_dim + 2 * item.lk * item.kv_dim) + item.lq * item.lk
    response_item = 0
    output = metadata.output("output")  # (batch, lq, out_dim)
    if "output" in job.outputs and output is not None and output.shape and output.shape[-1] > 0:
        response_item += 4 * item.lq * output.shape[-1]
    probs = metadata.output("attn_probs")  # (batch, heads, lq, lk)
    if "attn_probs" in job.outputs and probs is not None and len(probs.shape) == 4 and probs.shape[1] > 0:
        response_item += 4 * probs.shape[1] * item.lq * item.lk
    per_item = max(request_item, response_item)
    limit = options.max_message_bytes - _MESSAGE_HEADROOM_BYTES
    if per_item * job.batch_size > limit:
        fits = max(limit // per_item, 0)
        raise BatchError(
            f"--batch-size {job.batch_size} makes messages of {per_item * job.batch_size / 2**20:.1f} MiB, "
            f"over the {options.max_message_bytes / 2**20:.0f} MiB limit; use --batch-size {fits} or less"
            + ("" if fits else " (one item does not fit: raise --max-message-mb)")
        )
