"""The attnserve client: numpy in, numpy out, over the Open Inference Protocol (KServe V2) gRPC.

    from client import InferenceClient
    with InferenceClient("127.0.0.1:8001") as c:
        out = c.infer("self_attention", q, k, v, mask=m, outputs=("output", "attn_probs"))

`AsyncInferenceClient` is the same API for asyncio; `python -m client` is the CLI (health,
models, infer, batch). Every failure the server reports is an `InferenceError(code, details)`.
"""

from client.aio import AsyncInferenceClient
from client.client import InferenceClient
from client.codec import InferResult, ModelMetadata, ModelStatistics, ServerMetadata, TensorMetadata
from client.errors import InferenceError
from client.options import ClientOptions, RetryPolicy, TlsConfig

__all__ = [
    "AsyncInferenceClient",
    "ClientOptions",
    "InferResult",
    "InferenceClient",
    "InferenceError",
    "ModelMetadata",
    "ModelStatistics",
    "RetryPolicy",
    "ServerMetadata",
    "TensorMetadata",
    "TlsConfig",
]
