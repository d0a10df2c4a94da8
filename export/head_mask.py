"""Parity of the mask forms beyond (b, lq, lk): what the server feeds for each, against eager.

A request's mask may be any of contract.MASK_SHAPES, as the seeds' `masked_fill(mask == 0, ...)`
broadcasts it. The server feeds the unfused graphs (b, lq, lk) for the first three (a broadcast of
(lq, lk), a reshape of (b, 1, lq, lk): no new arithmetic), and the head-mask graphs
(model_head_mask*.onnx, traced by onnx_export with a (b, h, lq, lk) bool `head_mask`) a mask whose
heads differ. Here eager PyTorch takes the mask in the form the client sent; ONNX Runtime takes
what the server would feed. Cases: each form at the unfused gate's shapes, per-head masks whose
heads differ (one head's query row fully masked while the others attend; an item padded: keys
and query rows past its length masked in every head, as the batcher pads), and one long sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from attnserve.export.attention import MultiHeadAttention
from torch import Tensor

from attnserve import contract

# (b, lq, lk) of the head-mask graphs' long case: one item, padded rows and a fully masked row.
LONG_PARITY_SHAPES = ((1, 2048, 2048),)
FORMS = ("q_k", "b_1_q_k", "b_h_q_k")  # (lq, lk), (b, 1, lq, lk), (b, h, lq, lk) with heads that differ


def head_mask(b: int, h: int, lq: int, lk: int, generator: torch.Generator) -> Tensor:
    """(b, h, lq, lk) bool, True = attend, heads that differ: about a third masked at random per
    head; in item 0 query row 0 fully masked in head 0 only (and in every head when h == 1); in
    the last item (b > 1, or b == 1 with lq, lk >= 4) keys and query rows past 3/4 of the lengths
    masked in every head (what the batcher's padding writes)."""
    mask = torch.rand(b, h, lq, lk, generator=generator) > 0.33
    mask[0, 0, 0, :] = False
    if h > 1 and lk > 1:
        mask[0, 1:, 0, 0] = True  # the other heads attend in that row
    if lq >= 4 and lk >= 4:
        kq, kk = 3 * lq // 4, 3 * lk // 4
        mask[-1, :, :, kk:] = False
        mask[-1, :, kq:, :] = False
    return mask


def _served(form: str, mask: Tensor, b: int) -> tuple[str, Tensor]:
    """The graph input the server feeds for a mask sent in `form`, and that tensor."""
    if form == "q_k":
        return "mask", mask.expand(b, *mask.shape).contiguous()  # (b, lq, lk)
    if form == "b_1_q_k":
        return "mask", mask[:, 0]  # (b, lq, lk)
    return contract.HEAD_MASK, mask  # (b, h, lq, lk)


def parity(module: MultiHeadAttention, graphs: dict[str, Path], shapes: tuple[tuple[int, int, int], ...],
           random_inputs, generator: torch.Generator) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Max abs error per graph (keys "<kind>.forms") of each mask form against eager PyTorch.
    `graphs` holds the unfused graphs and the head-mask ones (contract.HEAD_MASK_KINDS)."""
    import onnxruntime as ort

    config = module.config
    h = config.num_heads
    sessions = {kind: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for kind, p in graphs.items()}
    worst: dict[str, dict[str, float]] = {}
    cases: list[dict[str, Any]] = []

    def run(kind: str, feeds: dict[str, np.ndarray], want_out: Tensor, want_probs: Tensor, case: dict) -> None:
        got = sessions[kind].run(None, feeds)
        errs = worst.setdefault(f"{kind}.forms", {})
        for name, value, want in zip(contract.GRAPH_OUTPUTS[kind], got, (want_out, want_probs)[:len(got)], strict=True):
            err = float(np.max(np.abs(value - want.numpy())))
            errs[name] = max(errs.get(name, 0.0), err) if err == err else float("nan")
            case[f"{kind}.{name}"] = err

    long = set(LONG_PARITY_SHAPES)
    for b, lq, lk in (*shapes, *LONG_PARITY_SHAPES):
        query, key, value = random_inputs(config, b, lq, lk, generator)
        for form in (("b_h_q_k",) if (b, lq, lk) in long else FORMS):
            if form == "q_k":
                sent = head_mask(1, 1, lq, lk, generator)[0, 0]  # (lq, lk)
            elif form == "b_1_q_k":
                sent = head_mask(b, 1, lq, lk, generator)  # (b, 1, lq, lk)
            else:
                sent = head_mask(b, h, lq, lk, generator)  # (b, h, lq, lk)
            with torch.no_grad():
                want_out, want_probs = module(query, key, value, mask=sent)
            name, served = _served(form, sent, b)
            feeds = {"query": query.numpy(), "key": key.numpy(), "value": value.numpy(), name: served.numpy()}
            kinds = (contract.HEAD_MASK_KINDS if name == contract.HEAD_MASK
                     else (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY))
            if (b, lq, lk) in long:
                kinds = (contract.HEAD_MASK_OUTPUT_ONLY,)  # the one an output-only long request takes
            case: dict[str, Any] = {"batch": b, "q_len": lq, "k_len": lk, "mask_form": form}
            for kind in kinds:
                if kind in sessions:
                    run(kind, feeds, want_out, want_probs, case)
            cases.append(case)
    return worst, cases
