"""`python -m bench.floor [server flags]`: the server's own stack, answering without a model.

The same process, flags, gRPC server, gate, servicer, codec and batchers as `attnserve serve`,
but each model's batches are "computed" by `zeros`: the right shapes, no ONNX Runtime (through
the server's one seam for it, app.Server's `run_batch`). What a load generator measures against
it is the cost of gRPC, of Python and of batching per call on this machine, the floor under any
model served through this stack. The benchmark runs it beside the real server, in the same run.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from attnserve.server.__main__ import configure_logging, serve, start_on_huge_pages
from attnserve.server.config import load_config
from attnserve.server.repository import ModelSpec
from attnserve.server.tensors import RunBatch


def zeros(spec: ModelSpec) -> RunBatch:
    """A model's run that computes nothing: zeros of the shapes its graph would return."""

    def run(feeds: dict[str, np.ndarray], want_probs: bool) -> tuple[np.ndarray, np.ndarray | None]:
        b, lq, _ = feeds["query"].shape  # batch, query length, query_dim
        lk = feeds["key"].shape[1]  # key length
        output = np.zeros((b, lq, spec.out_dim), np.float32)  # (b, lq, out_dim)
        attn_probs = np.zeros((b, spec.num_heads, lq, lk), np.float32) if want_probs else None  # (b, h, lq, lk)
        return output, attn_probs

    return run


def main(argv: list[str] | None = None) -> int:
    # The Python stack's floor (bench.native_floor is the native plane's), unless the flags say otherwise.
    config = load_config(["--data-plane", "python", *(sys.argv[1:] if argv is None else argv)],
                         prog="python -m bench.floor")
    start_on_huge_pages()  # as the server does (server.memory.heap, "Roomy")
    configure_logging(config)
    return asyncio.run(serve(config, run_batch=zeros))


if __name__ == "__main__":
    sys.exit(main())
