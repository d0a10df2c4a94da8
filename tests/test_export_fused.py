"""The fused-attention graphs export writes (export.fused), against the eager module.

Real ONNX Runtime sessions on the graphs `attnserve export` wrote (conftest's session-scoped
`model_repository`, demo weights seed 0), at shapes unlike the trace's and the export's own,
with padded and fully masked items, and at L = 2,048.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from attnserve.export import fused
from attnserve.export.checkpoint import demo_module
from attnserve.export.config import PRESETS
from onnx import numpy_helper

from attnserve import contract
from tests.export_helpers import eager_output, key_mask, max_abs, ort_session, random_qkv

pytestmark = pytest.mark.e2e  # exports and times fused graphs

PRESET_NAMES = ("self_attention", "cross_attention")
TOLERANCE = 1e-5
# Unlike the trace's example and the export's own parity shapes; the long one is L = 2,048.
SHAPES = [(3, 17, 5), (1, 1, 1), (2, 4, 129), (5, 2, 1), (2, 33, 64)]
LONG = (1, 2048, 2048)
LONG_PADDED = (2, 2048, 2048)


@pytest.fixture(scope="module")
def fused_sessions(model_repository):
    return {(name, kind): ort_session(model_repository / name / "1" / contract.GRAPH_FILES[kind])
            for name in PRESET_NAMES for kind in contract.FUSED_KINDS}



@pytest.mark.parametrize("shape", [*SHAPES, LONG], ids=lambda s: "b{}-lq{}-lk{}".format(*s))
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fused_graph_matches_eager_without_a_mask(fused_sessions, eager_modules, name, shape):
    module = eager_modules[name]
    b, lq, lk = shape
    query, key, value = random_qkv(b, lq, lk, module.config.query_dim, module.config.kv_dim, seed=lq * 7 + lk)
    (got,) = fused_sessions[name, contract.FUSED].run(None, {"query": query.numpy(), "key": key.numpy(),
                                                             "value": value.numpy()})
    assert max_abs(got, eager_output(module, query, key, value)) <= TOLERANCE


@pytest.mark.parametrize("shape", [*SHAPES, LONG_PADDED], ids=lambda s: "b{}-lq{}-lk{}".format(*s))
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_key_padding_graph_matches_eager_with_padded_and_fully_masked_items(fused_sessions, eager_modules,
                                                                            name, shape):
    module = eager_modules[name]
    b, lq, lk = shape
    query, key, value = random_qkv(b, lq, lk, module.config.query_dim, module.config.kv_dim, seed=lq + 3 * lk)
    session = fused_sessions[name, contract.FUSED_KEY_PADDING]
    for keep in (torch.ones(b, lk, dtype=torch.bool), key_mask(b, lk, seed=b + lk)):
        feeds = {"query": query.numpy(), "key": key.numpy(), "value": value.numpy(),
                 contract.KEY_PADDING_MASK: keep.to(torch.int32).numpy()}
        (got,) = session.run(None, feeds)
        want = eager_output(module, query, key, value, keep)
        assert max_abs(got, want) <= TOLERANCE
        if b > 1 and not keep[-1].any():
            # The fully masked item: every query row is the uniform average of the projected values.
            with torch.no_grad():
                uniform = module.to_out(module.to_v(value[-1]).mean(dim=0))
            assert float(np.max(np.abs(got[-1] - uniform.numpy()))) <= TOLERANCE


@pytest.mark.parametrize("kind", contract.FUSED_KINDS)
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fused_graphs_hold_the_modules_own_weights(model_repository, eager_modules, name, kind):
    module = eager_modules[name]
    model = onnx.load(str(model_repository / name / "1" / contract.GRAPH_FILES[kind]))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for proj in ("to_q", "to_k", "to_v", "to_out"):
        np.testing.assert_array_equal(weights[f"{proj}.weight_t"], getattr(module, proj).weight.detach().numpy().T)
    np.testing.assert_array_equal(weights["qkv_bias"], torch.cat([module.to_q.bias, module.to_k.bias,
                                                                  module.to_v.bias]).detach().numpy())
    np.testing.assert_array_equal(weights["to_out.bias"], module.to_out.bias.detach().numpy())
    (attention,) = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    assert attention.domain == "com.microsoft"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["num_heads"] == module.config.num_heads
    assert attrs["mask_filter_value"] == pytest.approx(-1e10)  # the seeds' fill, not ORT's -10000
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    expected = {"query": ["batch", "q_len", module.config.query_dim], "key": ["batch", "k_len", module.config.kv_dim],
                "value": ["batch", "k_len", module.config.kv_dim]}
    if kind == contract.FUSED_KEY_PADDING:
        expected[contract.KEY_PADDING_MASK] = ["batch", "k_len"]
    assert inputs == expected


def test_fused_graph_without_bias_matches_eager(tmp_path):
    module = demo_module(PRESETS["cross_attention"].replace(bias=False, kv_dim=24, out_dim=8), seed=3).eval()
    for kind in contract.FUSED_KINDS:
        path = tmp_path / contract.GRAPH_FILES[kind]
        fused.build(module, path, kind, opset=18)
        query, key, value = random_qkv(2, 9, 13, 32, 24, seed=1)
        keep = key_mask(2, 13, seed=5)
        feeds = {"query": query.numpy(), "key": key.numpy(), "value": value.numpy()}
        if kind == contract.FUSED_KEY_PADDING:
            feeds[contract.KEY_PADDING_MASK] = keep.to(torch.int32).numpy()
        (got,) = ort_session(path).run(None, feeds)
        assert max_abs(got,
                       eager_output(module, query, key, value, keep if kind != contract.FUSED else None)) <= TOLERANCE




@pytest.mark.parametrize("kind", contract.FUSED_KINDS)
def test_the_parity_gate_refuses_a_fused_graph_that_differs(tmp_path, monkeypatch, kind):
    """The export's own gate covers the fused graphs: one of them built with the scores' scale 1 %
    off (a real graph, run by ONNX Runtime) and the export is refused, naming it, with nothing
    written."""
    from attnserve.export import onnx_export

    build = fused.build

    def off_by_a_percent(module, path, which, opset):
        build(module, path, which, opset)
        if which == kind:
            model = onnx.load(str(path))
            (attention,) = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
            for attr in attention.attribute:
                if attr.name == "scale":
                    attr.f *= 1.01
            onnx.save(model, str(path))

    monkeypatch.setattr(fused, "build", off_by_a_percent)
    module = demo_module(PRESETS["cross_attention"].replace(query_dim=16, kv_dim=8, out_dim=8), seed=4).eval()
    with pytest.raises(onnx_export.ParityError, match=f"{kind}.output"):
        onnx_export.export_model(module, tmp_path, "m", weights={"source": "demo", "seed": 4})
    assert not (tmp_path / "m").exists() or not any(p.name.isdigit() for p in (tmp_path / "m").iterdir())
