"""PyTriton serving the same ONNX graphs, the peer issue 26 measures attnserve against.

    build/pytriton-venv/bin/python bench/pytriton_peer.py --ready-file F \
        --model self_attention=models/self_attention/1/model.onnx:512:512:512:8:32:1.0 ...

Runs in its own virtualenv (`make bench-peers`: nvidia-pytriton and onnxruntime, no attnserve), so
it imports nothing of ours. Each model is a PyTriton Python model with Triton's dynamic batcher
(the model's own `max_batch_size` rows and `max_queue_delay_ms`, as the server batches), whose function runs an ONNX
Runtime session opened with the server's own session options (`session_options`, kept equal to
attnserve.server.engine's by tests/test_bench_goals.py). Writes {"grpc_port": ...} to
--ready-file once Triton serves, then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sysconfig
import threading
from pathlib import Path


def session_options(intra_op_threads: int):
    """attnserve.server.engine.session_options(intra_op_threads), spinning off: the same threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_cpu_mem_arena = False
    return options


def parse_model(text: str) -> dict:
    """NAME=GRAPH:QUERY_DIM:KV_DIM:OUT_DIM:HEADS:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_MS, as bench.goals
    writes it."""
    name, _, rest = text.partition("=")
    fields = rest.rsplit(":", 6)
    if not name or len(fields) != 7 or not fields[0]:
        raise ValueError(f"expected NAME=GRAPH:QUERY_DIM:KV_DIM:OUT_DIM:HEADS:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_MS, "
                         f"got {text!r}")
    graph, q_dim, kv_dim, out_dim, heads, max_batch, delay_ms = fields
    return {"name": name, "graph": graph, "query_dim": int(q_dim), "kv_dim": int(kv_dim), "out_dim": int(out_dim),
            "num_heads": int(heads), "max_batch_size": int(max_batch), "max_queue_delay_ms": float(delay_ms)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, type=parse_model)
    p.add_argument("--intra-op-threads", type=int, default=0)
    p.add_argument("--ready-file", type=Path, required=True)
    args = p.parse_args(argv)

    # Triton's Python-backend stub links libpython3.x from the loader's path: make it this
    # interpreter's, or a system libpython of another patch release meets this stdlib and fails.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))
    import numpy as np
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    ports = {"grpc_port": _free_port(), "http_port": _free_port(), "metrics_port": _free_port()}
    loopback = {f"{kind}_address": "127.0.0.1" for kind in ("grpc", "http", "metrics")}
    # No endpoint behind PyTriton's access token: perf_analyzer reads the statistics endpoint.
    triton = Triton(config=TritonConfig(**ports, **loopback),
                    security_config=TritonSecurityConfig(restricted_endpoints=[]))
    for m in args.model:
        session = ort.InferenceSession(m["graph"], session_options(args.intra_op_threads),
                                       providers=["CPUExecutionProvider"])

        def infer(query, key, value, mask, session=session):
            output, attn_probs = session.run(None, {"query": query, "key": key, "value": value, "mask": mask})
            return {"output": output, "attn_probs": attn_probs}

        # Shapes without the batch dim: Triton's batcher owns it (max_batch_size > 0).
        triton.bind(
            model_name=m["name"], infer_func=batch(infer),
            inputs=[Tensor(name="query", dtype=np.float32, shape=(-1, m["query_dim"])),
                    Tensor(name="key", dtype=np.float32, shape=(-1, m["kv_dim"])),
                    Tensor(name="value", dtype=np.float32, shape=(-1, m["kv_dim"])),
                    Tensor(name="mask", dtype=np.bool_, shape=(-1, -1))],
            outputs=[Tensor(name="output", dtype=np.float32, shape=(-1, m["out_dim"])),
                     Tensor(name="attn_probs", dtype=np.float32, shape=(m["num_heads"], -1, -1))],
            config=ModelConfig(max_batch_size=m["max_batch_size"], batcher=DynamicBatcher(
                max_queue_delay_microseconds=int(m["max_queue_delay_ms"] * 1000))),
            strict=False)
    triton.run()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tmp = args.ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({**ports, "onnxruntime": ort.__version__, "pid": os.getpid()}))
    tmp.replace(args.ready_file)
    stop.wait()
    triton.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
