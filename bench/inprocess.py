"""In-process ONNX Runtime on the served graph: the ceiling the server is measured against."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from attnserve.server.repository import ModelSpec


@dataclass(frozen=True)
class Shape:
    """One request of the benchmark: batch, query length, key length."""

    batch: int
    q_len: int
    k_len: int


# The workloads: one (1, 10, 512) sequence per self-attention request; four 256-query
# sequences over 77 keys per cross-attention request.
SHAPES = {"self_attention": Shape(1, 10, 10), "cross_attention": Shape(4, 256, 77)}


def feeds(spec: ModelSpec, shape: Shape, requests: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b = shape.batch * requests
    return {
        "query": rng.standard_normal((b, shape.q_len, spec.query_dim), dtype=np.float32),
        "key": rng.standard_normal((b, shape.k_len, spec.kv_dim), dtype=np.float32),
        "value": rng.standard_normal((b, shape.k_len, spec.kv_dim), dtype=np.float32),
        "mask": np.ones((b, shape.q_len, shape.k_len), dtype=np.bool_),
    }


def measure(spec: ModelSpec, shape: Shape, batches: tuple[int, ...], seconds: float,
            want_probs: bool = True, providers: tuple[str, ...] = ("CPUExecutionProvider",)
            ) -> dict[int, dict[str, float]]:
    """For each k in `batches`: k requests merged into one run, as the server's batcher does.
    Returns {k: {"requests_per_s", "ms_per_call"}}. ONNX Runtime's own defaults (one intra-op
    thread per core, spinning on): the best a caller in-process gets, not the server's choices."""
    graph = spec.graph_all_outputs if want_probs else spec.graph_output_only
    session = ort.InferenceSession(str(graph), providers=list(providers))
    if session.get_providers()[0] != providers[0]:  # ONNX Runtime falls back to the CPU with a warning alone
        raise RuntimeError(f"in-process session asked for {providers[0]} runs on {session.get_providers()}")
    rng = np.random.default_rng(0)
    results = {}
    for k in batches:
        x = feeds(spec, shape, k, rng)
        for _ in range(5):
            session.run(None, x)
        calls = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds or calls < 5:
            session.run(None, x)
            calls += 1
        results[k] = {"requests_per_s": calls * k / elapsed, "ms_per_call": elapsed / calls * 1000}
    return results
