"""The attnserve client: numpy in, numpy out, over the Open Inference Protocol (KServe V2) gRPC.

    from attnserve.client import InferenceClient
    with InferenceClient("127.0.0.1:8001") as c:
        out = c.infer("self_attention", q, k, v, mask=m, outputs=("output", "attn_probs"))

`AsyncInferenceClient` is the same API for asyncio; `attnserve` is the CLI (health,
models, infer, batch). Every failure the server reports is an `InferenceError(code, details)`.
`client.stream()` sends many requests over one ModelStreamInfer call, `client.infer_async()`
returns a cancellable `InferCall`, `channels=N` spreads calls over N connections.
"""

from attnserve.client.aio import AsyncInferenceClient
from attnserve.client.calls import InferCall
from attnserve.client.client import InferenceClient
from attnserve.client.codec import (
    InferResult,
    ModelIndexEntry,
    ModelMetadata,
    ModelStatistics,
    ServerMetadata,
    TensorMetadata,
)
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions, RetryPolicy, TlsConfig
from attnserve.client.stream import AsyncInferStream, InferStream

__all__ = [
    "AsyncInferStream",
    "AsyncInferenceClient",
    "ClientOptions",
    "InferCall",
    "InferResult",
    "InferStream",
    "InferenceClient",
    "InferenceError",
    "ModelIndexEntry",
    "ModelMetadata",
    "ModelStatistics",
    "RetryPolicy",
    "ServerMetadata",
    "TensorMetadata",
    "TlsConfig",
]
