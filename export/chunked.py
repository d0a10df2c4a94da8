"""The row-chunk graphs: a long fused run computed a chunk of query rows at a time.

Why: ONNX Runtime checks a run's terminate flag only between graph nodes, and a fused graph's
attention is one MultiHeadAttention node holding nearly all of a long run, so a cancel landing
inside it stops nothing. The server (server.engine, "Row chunks") projects key and value once,
then runs the query's rows in chunks over those projections: a cancel stops the run between two
chunks, and each chunk's output rows are written straight into the run's output. Three graphs,
built with the `onnx` helper API from the module's weights as export.fused builds its own:

    model_rows_kv.onnx                     key, value (b, lk, kv_dim)
                                           -> key_proj, value_proj (b, lk, d_model), biases added
    model_fused_rows.onnx                  query (b, rows, query_dim), key_proj, value_proj -> output
    model_fused_rows_key_padding.onnx      + key_padding_mask int32 (b, lk) -> output

    query --MatMul to_q.weight^T, Add to_q.bias--> (b, rows, d_model) --+
    key_proj, value_proj (b, lk, d_model) ------------------------------+- MultiHeadAttention
    --> (b, rows, d_model) --MatMul to_out.weight^T, Add to_out.bias--> output (b, rows, out_dim)

Splitting the query's rows changes no arithmetic of a row (each row's softmax is over all the
keys whatever the chunk), and parity (`parity`) proves the chunked answers against eager PyTorch
before the export writes them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.fused import MS_DOMAIN, _key_mask, bias, parity_error, save_graph, weight_t, worse

from attnserve import contract

# (b, lq, lk, rows per chunk) of the parity cases beyond the unfused graphs' shapes: a long
# sequence in uneven chunks; for the key padding graph a padded and a fully masked item.
LONG_PARITY_SHAPES = {contract.FUSED_ROWS: ((1, 2048, 2048, 700),),
                      contract.FUSED_ROWS_KEY_PADDING: ((2, 1024, 1024, 300),)}
PARITY_CHUNK_ROWS = 128  # the short shapes' chunk: several chunks where lq allows


def build(module: MultiHeadAttention, paths: dict[str, Path], opset: int) -> None:
    """Write the row-chunk graphs (contract.ROW_GRAPH_FILES' kinds) of `module` to `paths`."""
    from onnx import TensorProto, helper, numpy_helper

    cfg = module.config
    b, lk = contract.BATCH, contract.K_LEN  # the row graphs' query axis is "rows": a chunk of q_len

    def projection(x: str, name: str, linear: torch.nn.Linear, out: str) -> tuple[list, list]:
        """x @ W^T (+ bias) -> out: the nodes and their initializers."""
        inits = [numpy_helper.from_array(weight_t(linear), f"{name}.weight_t")]
        if not cfg.bias:
            return [helper.make_node("MatMul", [x, f"{name}.weight_t"], [out], name=name)], inits
        inits.append(numpy_helper.from_array(bias(linear), f"{name}.bias"))
        return [helper.make_node("MatMul", [x, f"{name}.weight_t"], [f"{out}_nobias"], name=name),
                helper.make_node("Add", [f"{out}_nobias", f"{name}.bias"], [out], name=f"{name}_bias")], inits

    def save(kind: str, nodes: list, inputs: list, outputs: list, inits: list) -> None:
        save_graph(paths[kind], kind, nodes, inputs, outputs, inits, opset,
                   "a fused run's query rows in chunks (export.chunked)")

    def tensor(name: str, shape: list, dtype: int = TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, dtype, shape)

    if contract.ROWS_KV in paths:
        k_nodes, k_inits = projection("key", "to_k", module.to_k, contract.KEY_PROJ)  # (b, lk, d_model)
        v_nodes, v_inits = projection("value", "to_v", module.to_v, contract.VALUE_PROJ)  # (b, lk, d_model)
        save(contract.ROWS_KV, k_nodes + v_nodes,
             [tensor("key", [b, lk, cfg.kv_dim]), tensor("value", [b, lk, cfg.kv_dim])],
             [tensor(contract.KEY_PROJ, [b, lk, cfg.d_model]), tensor(contract.VALUE_PROJ, [b, lk, cfg.d_model])],
             k_inits + v_inits)
    for kind in (contract.FUSED_ROWS, contract.FUSED_ROWS_KEY_PADDING):
        if kind not in paths:
            continue
        q_nodes, inits = projection("query", "to_q", module.to_q, "query_proj")  # (b, rows, d_model)
        inputs = [tensor("query", [b, "rows", cfg.query_dim]), tensor(contract.KEY_PROJ, [b, lk, cfg.d_model]),
                  tensor(contract.VALUE_PROJ, [b, lk, cfg.d_model])]
        attention_inputs = ["query_proj", contract.KEY_PROJ, contract.VALUE_PROJ]
        if kind == contract.FUSED_ROWS_KEY_PADDING:
            inputs.append(tensor(contract.KEY_PADDING_MASK, [b, lk], TensorProto.INT32))
            attention_inputs += ["", contract.KEY_PADDING_MASK]  # no bias: added by the projections
        attention = helper.make_node(
            "MultiHeadAttention", attention_inputs, ["attended"], name="attention", domain=MS_DOMAIN,
            num_heads=cfg.num_heads, mask_filter_value=float(cfg.mask_fill),
            scale=1.0 / math.sqrt(cfg.head_dim))  # (b, rows, d_model)
        out_nodes, out_inits = projection("attended", "to_out", module.to_out, "output")  # (b, rows, out_dim)
        save(kind, q_nodes + [attention] + out_nodes, inputs, [tensor("output", [b, "rows", cfg.out_dim])],
             inits + out_inits)


def run_chunked(sessions: dict[str, Any], feeds: dict[str, np.ndarray], chunk_rows: int) -> np.ndarray:
    """The chunked run, on ONNX Runtime sessions of the row graphs (what the server does, without
    its output binding): key/value projected once, then each chunk of rows. For parity only."""
    kv = dict(zip(contract.ROW_GRAPH_OUTPUTS[contract.ROWS_KV],
                  sessions[contract.ROWS_KV].run(None, {"key": feeds["key"], "value": feeds["value"]}), strict=True))
    kind = contract.FUSED_ROWS_KEY_PADDING if contract.KEY_PADDING_MASK in feeds else contract.FUSED_ROWS
    parts = []
    for start, end in contract.row_chunks(feeds["query"].shape[1], chunk_rows):
        chunk = {"query": np.ascontiguousarray(feeds["query"][:, start:end]), **kv}
        if contract.KEY_PADDING_MASK in feeds:
            chunk[contract.KEY_PADDING_MASK] = feeds[contract.KEY_PADDING_MASK]
        parts.append(sessions[kind].run(None, chunk)[0])
    return np.concatenate(parts, axis=1)


def parity(module: MultiHeadAttention, graphs: dict[str, Path], shapes: tuple[tuple[int, int, int], ...],
           random_inputs, generator: torch.Generator) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Max abs error of each chunked run against eager PyTorch, over `shapes` (chunks of
    PARITY_CHUNK_ROWS) and LONG_PARITY_SHAPES: FUSED_ROWS without a mask, FUSED_ROWS_KEY_PADDING
    with a key mask (a padded item, a fully masked item) given to eager as its (b, lq, lk) mask."""
    import onnxruntime as ort

    sessions = {kind: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for kind, p in graphs.items()}
    worst: dict[str, dict[str, float]] = {}
    cases: list[dict[str, Any]] = []
    for kind in (k for k in (contract.FUSED_ROWS, contract.FUSED_ROWS_KEY_PADDING) if k in sessions):
        worst[kind] = {"output": 0.0}
        for b, lq, lk, chunk_rows in (*((*s, PARITY_CHUNK_ROWS) for s in shapes), *LONG_PARITY_SHAPES[kind]):
            query, key, value = random_inputs(module.config, b, lq, lk, generator)
            keep = _key_mask(b, lk, generator) if kind == contract.FUSED_ROWS_KEY_PADDING else None
            err = parity_error(module, query, key, value, keep,
                               lambda feeds, rows=chunk_rows: run_chunked(sessions, feeds, rows))
            worst[kind]["output"] = worse(worst[kind]["output"], err)
            cases.append({"graph": kind, "batch": b, "q_len": lq, "k_len": lk, "chunk_rows": chunk_rows,
                          "chunks": len(contract.row_chunks(lq, chunk_rows)), f"{kind}.output": err})
    return worst, cases
