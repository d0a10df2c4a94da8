"""Warm-up: every graph of a version runs before the version reports ready (docs/server.md, "Warm-up").

    runs = warm_up_plan(engine.graphs, spec)   # [WarmRun(graph, masking, want_probs, length)]
    done = warm_up(engine, spec, runs)         # {(graph, session): runs}; blocking, off the loop
    sent = await warm_request_path(spec, limits, batcher)  # {session: requests}; on the loop

Why: ONNX Runtime's first run of a graph at a shape (and on CUDA, its kernels' set-up) is slower
than the next; without this, those first runs land on the first callers after readiness. Each
graph runs at a short length and at the crossover length (where server.graphs switches between
the unfused and the fused graphs), on the regular sessions and, where it has them, on the solo
ones (server.engine, "Solo sessions"). Inputs are zeros with every mask open: the cost of a run
does not depend on the values. Then a short request goes down the request path itself (codec,
batcher, its run thread, its solo and batched runs, the answer's serialization), whose first use
the sessions' runs do not touch and which would otherwise land on the first caller; no caller's,
it is counted in no statistics. Knows nothing of gRPC.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from attnserve.proto import inference_pb2 as pb
from attnserve.server import codec
from attnserve.server.batcher import REGULAR, SOLO, Batcher  # the session kinds the warm-up metrics label
from attnserve.server.graphs import GENERAL, HEADS, KEY_PADDING, NO_MASK, GraphSet
from attnserve.server.repository import ModelSpec

if TYPE_CHECKING:
    from attnserve.server.engine import Engine

from attnserve.contract import (
    ALL_OUTPUTS,
    FUSED,
    FUSED_KEY_PADDING,
    HEAD_MASK,
    HEAD_MASK_ALL_OUTPUTS,
    HEAD_MASK_OUTPUT_ONLY,
    KEY_PADDING_MASK,
    OUTPUT_NAMES,
    OUTPUT_ONLY,
)

SHORT_LEN = 16  # a short request's length: the first length export's crossover measures
# The long length of a version whose crossover is no longer than SHORT_LEN, or which has no fused
# graphs: the longest length export's crossover measures.
LONG_LEN_FALLBACK = 512
_DTYPES = {"FP32": np.float32, "FP16": np.float16}


@dataclass(frozen=True)
class WarmRun:
    graph: str  # the graph kind this run takes (server.graphs chooses it from the three below)
    masking: str
    want_probs: bool
    length: int  # Lq = Lk


# masking and want_probs that make server.graphs choose each graph (at a length it runs at).
_HOW = {ALL_OUTPUTS: (NO_MASK, True), OUTPUT_ONLY: (GENERAL, False), FUSED: (NO_MASK, False),
        FUSED_KEY_PADDING: (KEY_PADDING, False), HEAD_MASK_ALL_OUTPUTS: (HEADS, True),
        HEAD_MASK_OUTPUT_ONLY: (HEADS, False)}


def warm_up_plan(graphs: GraphSet, spec: ModelSpec) -> list[WarmRun]:
    """Each graph of `graphs` at the short length and at the crossover (the longest length at
    which server.graphs switches to a fused graph; LONG_LEN_FALLBACK where that is no longer than
    the short one); a fused graph from its own crossover (the shortest length it takes) instead
    of the short length. Lengths within the model's limits."""
    longest = min(spec.max_q_len, spec.max_kv_len)
    crossovers = [graphs.crossover.get(kind, 0) for kind in (FUSED, FUSED_KEY_PADDING) if kind in graphs.kinds]
    crossover = max(crossovers, default=0)
    crossover = crossover if crossover > SHORT_LEN else LONG_LEN_FALLBACK
    runs = []
    for kind in sorted(graphs.kinds):
        masking, want_probs = _HOW[kind]
        first = max(graphs.crossover.get(kind, 0), SHORT_LEN) if kind in (FUSED, FUSED_KEY_PADDING) else SHORT_LEN
        for length in dict.fromkeys(min(n, longest) for n in (first, crossover)):  # distinct, in order
            if graphs.graph_for(masking, want_probs, length, length) == kind:
                runs.append(WarmRun(kind, masking, want_probs, length))
    return runs


def warm_feeds(spec: ModelSpec, run: WarmRun) -> dict[str, np.ndarray]:
    """Zeros of one row at run.length, with the mask its masking takes (every key attended)."""
    dtype = {t.name: _DTYPES.get(t.datatype, np.float32) for t in spec.inputs}
    n = run.length
    feeds = {"query": np.zeros((1, n, spec.query_dim), dtype.get("query", np.float32)),
             "key": np.zeros((1, n, spec.kv_dim), dtype.get("key", np.float32)),
             "value": np.zeros((1, n, spec.kv_dim), dtype.get("value", np.float32))}
    if run.masking == GENERAL:
        feeds["mask"] = np.ones((1, n, n), np.bool_)
    elif run.masking == KEY_PADDING:
        feeds[KEY_PADDING_MASK] = np.ones((1, n), np.int32)
    elif run.masking == HEADS:
        feeds[HEAD_MASK] = np.ones((1, spec.num_heads, n, n), np.bool_)
    return feeds


def warm_up(engine: Engine, spec: ModelSpec, runs: list[WarmRun],
            ran: Callable[[str, str], None] | None = None) -> collections.Counter[tuple[str, str]]:
    """Blocking: each run on the regular session of its graph and, where the engine has one, on
    its solo session. ran(graph, session) after each run. Returns {(graph, session): runs}."""
    done: collections.Counter[tuple[str, str]] = collections.Counter()
    for run in runs:
        feeds = warm_feeds(spec, run)
        sessions = (REGULAR, SOLO) if run.graph in engine.solo_kinds else (REGULAR,)
        for session in sessions:
            engine.run(feeds, run.want_probs, solo=session == SOLO)
            done[run.graph, session] += 1
            if ran is not None:
                ran(run.graph, session)
    return done


def warm_request(spec: ModelSpec, probs: bool = False) -> pb.ModelInferRequest:
    """A short request as a client sends it: zeros at SHORT_LEN, raw contents, the output alone
    (probs: and attn_probs)."""
    feeds = warm_feeds(spec, WarmRun("", NO_MASK, False, min(SHORT_LEN, spec.max_q_len, spec.max_kv_len)))
    request = pb.ModelInferRequest(model_name=spec.name, id="warm-up")
    for name, array in feeds.items():
        datatype = next((t.datatype for t in spec.inputs if t.name == name), "FP32")
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    for name in OUTPUT_NAMES if probs else OUTPUT_NAMES[:1]:
        request.outputs.add(name=name)
    return request


async def warm_request_path(spec: ModelSpec, limits: codec.Limits, batcher: Batcher,
                            sent: Callable[[str], None] | None = None) -> collections.Counter[str]:
    """On the event loop: warm_request(spec) parsed, decoded, submitted to `batcher` as a warm-up
    on its solo sessions twice (the first on its run thread, which it starts; the next where a
    caller's would run: on the loop if short), once more asking for attn_probs too (its own shape
    for the solo rule, its own graph and encoding) and on its regular sessions once, each answer
    encoded and serialized. sent(session) after each. Returns {session: requests}."""
    done: collections.Counter[str] = collections.Counter()
    wires = {probs: warm_request(spec, probs).SerializeToString() for probs in (False, True)}
    sessions = ((SOLO, False), (SOLO, False), (SOLO, True), (REGULAR, False)) if batcher.run_solo is not None \
        else ((REGULAR, False),)
    for session, probs in sessions:
        request = codec.parse_infer_request(wires[probs])
        decoded = codec.decode(request, spec, limits)
        result = await batcher.submit(decoded.work, warm_up=session)
        try:
            response = codec.encode(request, decoded, result, spec.version)
        except BaseException:
            result.release()  # its memory budget share: no answer carries it
            raise
        try:
            codec.serialize_infer_response(response)
        finally:
            response.release()  # its memory budget share: no transport sends it
        done[session] += 1
        if sent is not None:
            sent(session)
    return done
