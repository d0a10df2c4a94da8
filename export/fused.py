"""The fused-attention graphs: the module's projections around ONNX Runtime's MultiHeadAttention.

Two output-only graphs per version, built with the `onnx` helper API from the module's own
weights (to_q/to_k/to_v/to_out, with their biases):

    model_fused.onnx              query, key, value -> output
    model_fused_key_padding.onnx  query, key, value, key_padding_mask int32 (b, lk) -> output

    query (b, lq, query_dim) --MatMul to_q.weight^T--> (b, lq, d_model) --+
    key   (b, lk, kv_dim)    --MatMul to_k.weight^T--> (b, lk, d_model) --+- MultiHeadAttention
    value (b, lk, kv_dim)    --MatMul to_v.weight^T--> (b, lk, d_model) --+  (bias = [bq, bk, bv],
                                                                            num_heads, -1e10 fill)
    --> (b, lq, d_model) --MatMul to_out.weight^T, Add to_out.bias--> output (b, lq, out_dim)

Why com.microsoft.MultiHeadAttention and not opset-23 `Attention` (docs/export.md has the
figures): without a mask ORT runs MultiHeadAttention as flash attention
(memory grows with L, not L^2), while its CPU `Attention` materializes the scores even
without a mask and wants a mask already expanded over the query rows. With a key padding mask,
MultiHeadAttention adds `mask_filter_value` (-1e10, the seeds' fill) to the scaled scores of
masked keys: in fp32 a score s + -1e10 rounds to -1e10 itself for |s| < 512, so a masked key
gets probability 0 and a fully masked row is uniform, the seeds' semantics (parity proves it).

A general (b, lq, lk) mask has no fused graph: such requests, and those that want attn_probs,
run the unfused graphs of onnx_export.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.config import AttentionConfig
from torch import Tensor

from attnserve import contract

MS_DOMAIN = "com.microsoft"
# (b, lq, lk) of the fused graphs' parity cases beyond the unfused graphs' shapes: one long
# sequence (ORT's flash path tiles it; the key padding path holds every score), batch 2 so the
# key padding graph sees one item padded and one fully masked.
LONG_PARITY_SHAPES = {contract.FUSED: ((1, 2048, 2048),), contract.FUSED_KEY_PADDING: ((2, 2048, 2048),)}
# sqrt(lq * lk) at which the crossover is measured (lq = lk), and the margin within which a
# fused graph counts as no slower than the unfused one (the noise of a short measurement).
CROSSOVER_LENGTHS = (16, 32, 64, 128, 256, 512)
CROSSOVER_MARGIN = 0.05
CROSSOVER_RULE = (f"a fused graph runs when sqrt(Lq*Lk) >= its length: the shortest measured length from "
                  f"which it was no slower than the unfused graph (within {CROSSOVER_MARGIN:.0%}) at every "
                  f"longer measured length")


def weight_t(linear: torch.nn.Linear) -> np.ndarray:
    """A projection's weight as (in, out) fp32: x @ W^T as one MatMul."""
    return linear.weight.detach().to(torch.float32).numpy().T.copy()


def bias(linear: torch.nn.Linear) -> np.ndarray:
    return linear.bias.detach().to(torch.float32).numpy().copy()


def save_graph(path: Path, kind: str, nodes: list, inputs: list, outputs: list, initializers: list, opset: int,
               doc: str) -> None:
    """Check and write graph `kind` (the ONNX opset and com.microsoft's, for MultiHeadAttention):
    the one way the fused and row-chunk graphs (export.chunked) are written."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, f"attnserve_{kind}", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="attnserve.export",
                              ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True),
                              doc_string=f"attnserve {kind}: {doc}")
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build(module: MultiHeadAttention, path: Path, kind: str, opset: int) -> None:
    """Write the fused graph `kind` (contract.FUSED or FUSED_KEY_PADDING) of `module` to `path`."""
    from onnx import TensorProto, helper, numpy_helper

    if kind not in contract.FUSED_KINDS:
        raise ValueError(f"kind must be one of {contract.FUSED_KINDS}, got {kind!r}")
    cfg = module.config
    b, lq, lk = contract.BATCH, contract.Q_LEN, contract.K_LEN

    initializers = [numpy_helper.from_array(weight_t(lin), f"{name}.weight_t")
                    for name, lin in (("to_q", module.to_q), ("to_k", module.to_k), ("to_v", module.to_v),
                                      ("to_out", module.to_out))]
    inputs = [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, [b, lq, cfg.query_dim]),
        helper.make_tensor_value_info("key", TensorProto.FLOAT, [b, lk, cfg.kv_dim]),
        helper.make_tensor_value_info("value", TensorProto.FLOAT, [b, lk, cfg.kv_dim]),
    ]
    nodes = [helper.make_node("MatMul", [x, f"{p}.weight_t"], [f"{x}_proj"], name=f"{p}")
             for x, p in (("query", "to_q"), ("key", "to_k"), ("value", "to_v"))]  # (b, l, d_model)
    attention_inputs = ["query_proj", "key_proj", "value_proj"]
    if cfg.bias:
        # MultiHeadAttention adds the three projection biases itself: one (3 * d_model) tensor.
        qkv_bias = np.concatenate([bias(module.to_q), bias(module.to_k), bias(module.to_v)])
        initializers.append(numpy_helper.from_array(qkv_bias, "qkv_bias"))
        attention_inputs.append("qkv_bias")
    else:
        attention_inputs.append("")
    if kind == contract.FUSED_KEY_PADDING:
        inputs.append(helper.make_tensor_value_info(contract.KEY_PADDING_MASK, TensorProto.INT32, [b, lk]))
        attention_inputs.append(contract.KEY_PADDING_MASK)
    while attention_inputs[-1] == "":
        attention_inputs.pop()
    nodes.append(helper.make_node(
        "MultiHeadAttention", attention_inputs, ["attended"], name="attention", domain=MS_DOMAIN,
        num_heads=cfg.num_heads, mask_filter_value=float(cfg.mask_fill),
        scale=1.0 / math.sqrt(cfg.head_dim)))  # (b, lq, d_model)
    nodes.append(helper.make_node("MatMul", ["attended", "to_out.weight_t"],
                                  ["output" if not cfg.bias else "output_nobias"], name="to_out"))
    if cfg.bias:
        initializers.append(numpy_helper.from_array(bias(module.to_out), "to_out.bias"))
        nodes.append(helper.make_node("Add", ["output_nobias", "to_out.bias"], ["output"], name="to_out_bias"))
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, [b, lq, cfg.out_dim])]
    save_graph(path, kind, nodes, inputs, outputs, initializers, opset,
               "ONNX Runtime's fused MultiHeadAttention, output only")


# -- parity --------------------------------------------------------------------------------------


def _key_mask(b: int, lk: int, generator: torch.Generator) -> Tensor:
    """(b, lk) bool, True = attend: about a third of the keys masked; item 0 fully masked (every
    query row of it is uniform), the last item padded (its second half masked) when b > 1."""
    keep = torch.rand(b, lk, generator=generator) > 0.33
    keep[0] = False
    if b > 1:
        keep[-1, : max(lk // 2, 1)] = True
        keep[-1, max(lk // 2, 1):] = False
    return keep


def parity_error(module: MultiHeadAttention, query: Tensor, key: Tensor, value: Tensor, keep: Tensor | None,
                 run) -> float:
    """Max abs error of run(feeds)'s output against eager PyTorch on (query, key, value). A key
    mask `keep` (b, lk) goes to eager as its (b, lq, lk) mask and to `run` as KEY_PADDING_MASK."""
    b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
    full = None if keep is None else keep[:, None, :].expand(b, lq, lk)  # (b, lq, lk)
    with torch.no_grad():
        want, _ = module(query, key, value, mask=full)
    feeds = {"query": query.numpy(), "key": key.numpy(), "value": value.numpy()}
    if keep is not None:
        feeds[contract.KEY_PADDING_MASK] = keep.to(torch.int32).numpy()
    return float(np.max(np.abs(run(feeds) - want.numpy())))


def worse(worst: float, err: float) -> float:
    """The worst error so far with `err`: NaN once any case gave NaN (max would drop it)."""
    return max(worst, err) if err == err else float("nan")


def parity(module: MultiHeadAttention, graphs: dict[str, Path], shapes: tuple[tuple[int, int, int], ...],
           random_inputs, generator: torch.Generator) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Max abs error of each fused graph against eager PyTorch (fp32, the seeds' -1e10 fill), over
    `shapes` and LONG_PARITY_SHAPES: FUSED without a mask, FUSED_KEY_PADDING with every key kept
    and with a key mask (padded item, fully masked item) given to eager as its (b, lq, lk) mask."""
    import onnxruntime as ort

    config = module.config
    worst: dict[str, dict[str, float]] = {}
    cases: list[dict[str, Any]] = []
    for kind, path in graphs.items():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        worst[kind] = {"output": 0.0}
        long_shapes = LONG_PARITY_SHAPES[kind]
        for b, lq, lk in (*shapes, *long_shapes):
            query, key, value = random_inputs(config, b, lq, lk, generator)
            masks: list[Tensor | None] = [None]
            if kind == contract.FUSED_KEY_PADDING:  # every key kept (short shapes), and a key mask
                masks = ([] if (b, lq, lk) in long_shapes else [torch.ones(b, lk, dtype=torch.bool)])
                masks.append(_key_mask(b, lk, generator))
            for keep in masks:
                err = parity_error(module, query, key, value, keep,
                                   lambda feeds, session=session: session.run(None, feeds)[0])
                worst[kind]["output"] = worse(worst[kind]["output"], err)
                cases.append({"graph": kind, "batch": b, "q_len": lq, "k_len": lk,
                              "key_mask": keep is not None and not bool(keep.all()), f"{kind}.output": err})
    return worst, cases


# -- the crossover ---------------------------------------------------------------------------------


def measure_crossover(config: AttentionConfig, unfused: Path, graphs: dict[str, Path],
                      lengths: tuple[int, ...] = CROSSOVER_LENGTHS, budget_s: float = 0.1) -> dict[str, Any]:
    """Time each fused graph against the unfused output-only graph at (1, L, L) for L in `lengths`
    (alternating runs, best of each; ONNX Runtime's default threads, spinning off as the server
    runs it) and choose each fused graph's crossover length (CROSSOVER_RULE)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {kind: ort.InferenceSession(str(p), sess_options=options, providers=["CPUExecutionProvider"])
                for kind, p in {contract.OUTPUT_ONLY: unfused, **graphs}.items()}
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {kind: [] for kind in sessions}
    for length in lengths:
        query = rng.standard_normal((1, length, config.query_dim), dtype=np.float32)
        key = rng.standard_normal((1, length, config.kv_dim), dtype=np.float32)
        base = {"query": query, "key": key, "value": key}
        feeds = {contract.OUTPUT_ONLY: base | {"mask": np.ones((1, length, length), np.bool_)},
                 contract.FUSED: base,
                 contract.FUSED_KEY_PADDING: base | {contract.KEY_PADDING_MASK: np.ones((1, length), np.int32)}}
        best = {kind: float("inf") for kind in sessions}
        for kind, session in sessions.items():
            session.run(None, feeds[kind])  # warm-up: the arena grows once
        started = time.perf_counter()
        rounds = 0
        while rounds < 5 or (time.perf_counter() - started < budget_s * len(sessions) and rounds < 200):
            for kind, session in sessions.items():
                t0 = time.perf_counter()
                session.run(None, feeds[kind])
                best[kind] = min(best[kind], time.perf_counter() - t0)
            rounds += 1
        for kind in sessions:
            times[kind].append(round(best[kind] * 1000, 4))
    crossover: dict[str, Any] = {}
    for kind in graphs:
        choice = 2 * lengths[-1]  # fused never measured no slower: from beyond the measured range
        for i in range(len(lengths) - 1, -1, -1):
            if times[kind][i] > times[contract.OUTPUT_ONLY][i] * (1 + CROSSOVER_MARGIN):
                break
            choice = lengths[i]
        crossover[kind] = choice
    return crossover | {"rule": CROSSOVER_RULE, "measured_ms": {"lengths": list(lengths), **times},
                        "onnxruntime": ort.__version__}
