"""The mask shapes beyond (B, Lq, Lk): (Lq, Lk), (B, 1, Lq, Lk), (B, H, Lq, Lk), as the seeds take them.

Seed 000's `masked_fill(mask == 0, -1e10)` broadcasts each of them against its (B, H, Lq, Lk)
scores; the server must give the same numbers, on both transports, alone and merged into
batches with other forms and lengths (padding), with fully masked rows and masks that differ by
head. Bad shapes are INVALID_ARGUMENT / HTTP 400 naming the shapes taken. Real server, real ONNX
Runtime; the reference is tests.seed_reference's seed 000 class with the served weights (for
cross_attention too, at its width and heads: seed 002 takes no mask).
"""

from __future__ import annotations

import json
import zlib

import grpc
import numpy as np
import pytest
import torch
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import codec
from attnserve.server.engine import Engine, choose_device
from attnserve.server.graphs import GENERAL, HEADS, UNFUSED, GraphSet
from attnserve.server.memory.costs import AttentionDims, run_working_set
from attnserve.server.repository import read_model_spec
from attnserve.server.tensors import Work, merge

from attnserve import contract
from tests.export_helpers import old_layout
from tests.oip import eager, infer_request, outputs_of
from tests.seed_reference import Seed000MultiHeadAttention

TOLERANCE = 1e-5
DIMS = {"self_attention": (512, 8), "cross_attention": (32, 2)}  # width, heads
FORMS = ("q_k", "b_q_k", "b_1_q_k", "b_h_q_k")


def _as_seed000(ours: torch.nn.Module, width: int, heads: int) -> Seed000MultiHeadAttention:
    """Seed 000's own class (tests.seed_reference, not export/attention.py) holding the served
    (demo) weights of `ours`: to_q/to_k/to_v/to_out are Wq/Wk/Wv/Wo."""
    ref = Seed000MultiHeadAttention(d_model=width, n_heads=heads, dropout=0.1)
    names = {"to_q": "Wq", "to_k": "Wk", "to_v": "Wv", "to_out": "Wo"}
    ref.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in ours.state_dict().items()})
    return ref.eval()


@pytest.fixture(scope="module")
def seed000(eager_modules):
    return _as_seed000(eager_modules["self_attention"], *DIMS["self_attention"])


def reference(model, seed000, eager_modules):
    """Seed 000 itself for self_attention; for cross_attention (seed 002 has the same math but
    takes no mask) seed 000's class at cross_attention's width and heads, with its weights."""
    return seed000 if model == "self_attention" else _as_seed000(eager_modules[model], *DIMS[model])


def want(module, x: dict) -> dict:
    """The eager answer to x. Seed 000 broadcasts a 3-D mask against its (b, h, lq, lk) scores as
    (1, b, lq, lk); the contract's (batch, q_len, k_len) is the same for every head, so seed 000
    is handed it as (b, 1, lq, lk). Every other form goes to it as sent."""
    mask = x["mask"]
    if isinstance(module, Seed000MultiHeadAttention) and mask is not None and mask.ndim == 3:
        mask = mask[:, None]
    return eager(module, x["query"], x["key"], x["value"], mask)


def mask_of(form: str, rng: np.random.Generator, b: int, h: int, lq: int, lk: int, dead_row: bool = True
            ) -> np.ndarray:
    """A mask in `form`, about a third masked, query row 0 fully masked when `dead_row` (in head
    0 only, for per-head masks, whose heads otherwise differ at random)."""
    shape = {"q_k": (lq, lk), "b_q_k": (b, lq, lk), "b_1_q_k": (b, 1, lq, lk), "b_h_q_k": (b, h, lq, lk)}[form]
    mask = rng.random(shape) > 0.33
    mask[..., 0] = True  # every row attends a key ...
    if dead_row:
        mask[(0,) * (len(shape) - 2) + (0,)] = False  # ... but this one
        if form == "b_h_q_k":
            mask[0, 1:, 0, 0] = True  # the other heads attend in that row
    return mask


def inputs(model: str, rng: np.random.Generator, b: int, lq: int, lk: int, form: str | None,
           dead_row: bool = True) -> dict:
    width, h = DIMS[model]
    return {"query": rng.standard_normal((b, lq, width), dtype=np.float32),
            "key": rng.standard_normal((b, lk, width), dtype=np.float32),
            "value": rng.standard_normal((b, lk, width), dtype=np.float32),
            "mask": None if form is None else mask_of(form, rng, b, h, lq, lk, dead_row)}


def assert_close(got: dict, want: dict, names=("output", "attn_probs")) -> None:
    for name in names:
        assert got[name].shape == want[name].shape, name
        err = float(np.max(np.abs(got[name] - want[name])))
        assert err <= TOLERANCE, f"{name}: max abs error {err}"


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


# -- through the server --------------------------------------------------------------------------

@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("form", FORMS)
def test_grpc_each_mask_form_matches_the_seed(stub, seed000, eager_modules, model, raw, form):
    rng = np.random.default_rng(zlib.crc32(f"grpc {model} {raw} {form}".encode()))
    x = inputs(model, rng, 3, 10, 7, form)  # unlike the trace's sizes; lq != lk
    expected = want(reference(model, seed000, eager_modules), x)
    both = stub.ModelInfer(infer_request(model, raw=raw, **x))
    assert_close(outputs_of(both), expected)
    only = stub.ModelInfer(infer_request(model, raw=raw, outputs=("output",), **x))
    assert_close(outputs_of(only), expected, names=("output",))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("form", FORMS)
def test_rest_each_mask_form_matches_the_seed(server, seed000, eager_modules, binary, form):
    import tritonclient.http as httpclient

    from tests.oip import rest_infer

    rng = np.random.default_rng(zlib.crc32(f"rest {binary} {form}".encode()))
    x = inputs("self_attention", rng, 2, 9, 5, form)
    with httpclient.InferenceServerClient(url=server.http_address) as client:
        got = rest_infer(client, "self_attention", x, binary=binary)
    assert_close(got, want(seed000, x))


def test_concurrent_mixed_forms_and_lengths_each_equal_the_seed(stub, seed000):
    """Requests of every form, lengths and fully masked rows at once: however the batcher merges
    them (head masks beside (B, Lq, Lk) masks, padding), each answer is its own seed-000 run."""
    import concurrent.futures

    rng = np.random.default_rng(17)
    cases = []
    for i in range(24):
        lq, lk = int(rng.integers(1, 20)), int(rng.integers(1, 20))
        cases.append(inputs("self_attention", rng, int(rng.integers(1, 3)), lq, lk, (None, *FORMS)[i % 5]))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: stub.ModelInfer.future(infer_request("self_attention", **x)).result(), cases))
    for x, answer in zip(cases, answers, strict=True):
        assert_close(outputs_of(answer), want(seed000, x))


def _bad_masks(h: int):
    b, lq, lk = 2, 3, 4
    return {
        "wrong heads": (b, h + 1, lq, lk), "wrong q_len": (b, lq + 1, lk), "wrong k_len (2-D)": (lq, lk + 1),
        "wrong batch (4-D)": (b + 1, 1, lq, lk), "rank 1": (lk,), "rank 5": (b, 1, 1, lq, lk),
    }


@pytest.mark.parametrize("case", sorted(_bad_masks(8)))
def test_bad_mask_shapes_are_refused_naming_the_shapes_taken(stub, server, case):
    import http.client

    rng = np.random.default_rng(3)
    x = inputs("self_attention", rng, 2, 3, 4, None)
    x["mask"] = np.ones(_bad_masks(8)[case], dtype=np.bool_)
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(infer_request("self_attention", **x))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = exc.value.details()
    assert "'mask'" in message and "[batch, 8, q_len, k_len]" in message and "[q_len, k_len]" in message, message
    body = json.dumps({"inputs": [{"name": n, "datatype": contract.DATATYPES[n], "shape": list(a.shape),
                                   "data": a.ravel().tolist()} for n, a in x.items()]})
    connection = http.client.HTTPConnection(server.http_address, timeout=60)
    try:
        connection.request("POST", "/v2/models/self_attention/infer", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 400 and "[batch, 8, q_len, k_len]" in answer["error"], answer


# -- the engine, in process ----------------------------------------------------------------------

def _work(x: dict, want_probs: bool = False) -> Work:
    return Work(x["query"], x["key"], x["value"], x["mask"], want_probs)


@pytest.mark.parametrize("name", sorted(DIMS))
def test_merged_forms_run_the_head_mask_graph_exactly(model_repository, seed000, eager_modules, name):
    """merge() of a per-head mask beside the other forms, no mask, padded keys and query rows,
    through the real Engine: the head-mask graph runs once, and every request's rows are exact.
    (Fully masked rows only in requests of the batch's key length: the batcher's own rule.)"""
    spec = read_model_spec(model_repository / name)
    engine = Engine(spec, choose_device("cpu"))
    assert engine.graphs.takes_head_masks and engine.why_no_head_masks is None
    rng = np.random.default_rng(23)
    h = DIMS[name][1]
    xs = [inputs(name, rng, 2, 12, 9, "b_h_q_k"), inputs(name, rng, 1, 7, 9, "q_k"),
          inputs(name, rng, 1, 12, 6, "b_1_q_k", dead_row=False), inputs(name, rng, 2, 5, 4, None),
          inputs(name, rng, 1, 12, 9, "b_q_k")]
    module = reference(name, seed000, eager_modules)
    for want_probs, kind in ((False, contract.HEAD_MASK_OUTPUT_ONLY), (True, contract.HEAD_MASK_ALL_OUTPUTS)):
        works = [_work(x, want_probs) for x in xs]
        assert works[0].masking == HEADS and works[0].mask.shape == (2, h, 12, 9)
        assert [None if w.mask is None else w.mask.ndim for w in works[1:]] == [3, 3, None, 3]
        feeds, _ = merge(works)
        assert feeds[contract.HEAD_MASK].shape == (7, h, 12, 9) and "mask" not in feeds
        assert engine.graph_for(feeds, want_probs) == kind
        before = engine.runs[kind]
        output, probs = engine.run(feeds, want_probs)
        assert engine.runs[kind] == before + 1
        start = 0
        for x, w in zip(xs, works, strict=True):
            got = {"output": output[start:start + w.rows, : w.q_len]}
            if want_probs:
                got["attn_probs"] = probs[start:start + w.rows, :, : w.q_len, : w.k_len]
            assert_close(got, want(module, x), names=tuple(got))
            start += w.rows


def test_masks_alike_for_every_head_run_the_graphs_they_ran_before(model_repository):
    """(Lq, Lk), (B, 1, Lq, Lk) and a (B, H, Lq, Lk) whose heads are equal become (B, Lq, Lk)
    views (no copy): the unfused or fused graphs, as a (B, Lq, Lk) mask would."""
    rng = np.random.default_rng(5)
    base = rng.random((2, 6, 5)) > 0.4
    q, k = np.zeros((2, 6, 32), np.float32), np.zeros((2, 5, 32), np.float32)
    for sent in (base[0], base[:, None], np.repeat(base[:, None], 2, axis=1)):
        w = Work(q, k, k, sent, False)
        assert w.mask.shape == (2, 6, 5) and w.masking == GENERAL and np.shares_memory(w.mask, sent)
        assert np.array_equal(w.mask, np.broadcast_to(base[0] if sent.ndim == 2 else base, (2, 6, 5)))
        assert w.nbytes == q.nbytes + 2 * k.nbytes + max(sent.nbytes, 2 * 6 * 5)
    key_rows = np.repeat(np.repeat(base[:, :1], 6, axis=1)[:, None], 2, axis=1)  # (2, 2, 6, 5), heads alike
    key_rows[..., 0] = True
    assert Work(q, k, k, key_rows, False).masking == "key_padding"  # the fused key padding graph's


def test_a_version_without_head_mask_graphs_refuses_heads_that_differ(model_repository, tmp_path):
    """An older export: a mask whose heads differ is INVALID_ARGUMENT naming the masks it takes;
    the same mask with equal heads is served (on the unfused graph)."""
    repo = old_layout(model_repository, "cross_attention", tmp_path)
    spec = read_model_spec(repo / "cross_attention")
    engine = Engine(spec, choose_device("cpu"))
    assert not engine.graphs.takes_head_masks and "model_head_mask" in engine.why_no_head_masks
    limits = codec.Limits(8192, 8192, 1 << 30, graphs=engine.graphs)
    rng = np.random.default_rng(9)
    x = inputs("cross_attention", rng, 1, 4, 3, "b_h_q_k")
    with pytest.raises(ValueError, match=r"heads differ.*\[batch, 2, q_len, k_len\] with equal heads"):
        codec.decode(infer_request("cross_attention", **x), spec, limits)
    x["mask"] = np.repeat(x["mask"][:, :1], 2, axis=1)
    decoded = codec.decode(infer_request("cross_attention", **x), spec, limits)
    assert decoded.work.mask.shape == (1, 4, 3)
    with pytest.raises(ValueError, match="head-mask graphs"):
        UNFUSED.graph_for(HEADS, False, 4, 3)


def test_memory_and_attention_bounds_follow_the_head_mask_graphs():
    dims = AttentionDims(512, 512, 512, 512, 8)
    plain = run_working_set(contract.OUTPUT_ONLY, dims, 2, 1024, 1024)
    heads = run_working_set(contract.HEAD_MASK_OUTPUT_ONLY, dims, 2, 1024, 1024)
    # The mask and its negation inside the graph, over 8 heads instead of 1 (x 1.1, memory.SAFETY).
    assert abs((heads - plain) - 1.1 * 2 * (2 * 7 * 1024 * 1024)) <= 2
    assert run_working_set(contract.HEAD_MASK_ALL_OUTPUTS, dims, 2, 1024, 1024) > heads
    graphs = GraphSet(frozenset(contract.GRAPH_FILES), {contract.FUSED: 1})
    assert graphs.scores_held(2, 1024, 1024, HEADS, False) == 2 * 1024 * 1024  # every score held


def test_the_export_gate_covered_every_form_and_a_long_per_head_mask(model_repository):
    for name in DIMS:
        parity = json.loads((model_repository / name / "1" / "export.json").read_text())["parity"]
        for kind in (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY, *contract.HEAD_MASK_KINDS):
            errors = parity["max_abs_error"][f"{kind}.forms"]
            assert errors and all(err <= TOLERANCE for err in errors.values()), (kind, errors)
        assert parity["long_shapes"][contract.HEAD_MASK_OUTPUT_ONLY] == [[1, 2048, 2048]]


def test_the_export_gate_refuses_a_head_mask_graph_that_differs(model_repository, tmp_path):
    """Head-mask graphs traced from other weights beside the served unfused ones: the parity gate
    (check_parity) raises ParityError naming them, so such an export would write nothing."""
    import shutil

    from attnserve.export import checkpoint
    from attnserve.export.config import PRESETS
    from attnserve.export.onnx_export import ParityError, check_parity, trace

    version = model_repository / "cross_attention" / "1"
    graphs = {}
    for kind in (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY):
        graphs[kind] = tmp_path / contract.GRAPH_FILES[kind]
        shutil.copy(version / contract.GRAPH_FILES[kind], graphs[kind])
    other = checkpoint.demo_module(PRESETS["cross_attention"], seed=1).eval()
    for kind in contract.HEAD_MASK_KINDS:
        graphs[kind] = tmp_path / contract.GRAPH_FILES[kind]
        trace(other, graphs[kind], with_probs=kind == contract.HEAD_MASK_ALL_OUTPUTS, opset=18, heads_in_mask=True)
    served = checkpoint.demo_module(PRESETS["cross_attention"], seed=0).eval()
    with pytest.raises(ParityError, match=r"head_mask_output_only\.forms\.output"):
        check_parity(served, graphs)


def test_the_project_client_sends_a_per_head_mask(server, seed000):
    from attnserve.client import InferenceClient

    rng = np.random.default_rng(31)
    x = inputs("self_attention", rng, 2, 6, 5, "b_h_q_k")
    with InferenceClient(server.address, timeout_s=30) as client:
        got = client.infer("self_attention", x["query"], x["key"], x["value"], mask=x["mask"],
                           outputs=("output", "attn_probs"))
    assert_close(got, want(seed000, x))
