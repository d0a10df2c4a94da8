"""The fp16 export: graphs that compute in half precision (for GPUs) behind the same fp32
contract, a mask fill that stays finite in fp16, parity within ~1e-3 of the fp32 seeds, and a
server that serves them unchanged. Run here on ONNX Runtime's CPU kernels, which have fp16
MatMul, Softmax and Where; on a GPU the same graph runs on the CUDA provider."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from attnserve.export import checkpoint
from attnserve.export.config import PRESETS
from attnserve.export.onnx_export import (
    FP16_MASK_FILL,
    PARITY_TOLERANCE_FP16,
    ExportError,
    export_model,
    half_precision,
)
from attnserve.proto import inference_pb2_grpc as pb_grpc

from tests.export_helpers import max_abs, ort_run, ort_session, random_mask, random_qkv, run_export
from tests.oip import infer_request, outputs_of
from tests.server_process import ServerProcess

pytestmark = pytest.mark.e2e  # exports, then serves the export in a server process


@pytest.fixture(scope="module")
def fp16_repository(tmp_path_factory):
    """`attnserve export --precision fp16` of the cross-attention preset (demo weights, seed 0)."""
    root = tmp_path_factory.mktemp("fp16")
    done = run_export("--preset", "cross_attention", "--repository", str(root), "--precision", "fp16")
    assert done.returncode == 0, done.stderr
    assert "tolerance 0.002" in done.stdout
    module = checkpoint.demo_module(PRESETS["cross_attention"], seed=0).eval()
    return root, module, root / "cross_attention" / "1"


def test_the_seeds_fill_overflows_in_fp16_and_the_export_keeps_it_finite():
    module = checkpoint.demo_module(PRESETS["cross_attention"], seed=0).eval()
    query, key, value = random_qkv(2, 5, 7, 32, 32, seed=3)
    mask = torch.ones(2, 5, 7, dtype=torch.bool)
    mask[1, 2, :] = False  # one fully masked row
    # The seeds' -1e10 is -inf in fp16 (a graph constant would be too): a fully masked row's
    # softmax is then 0/0. Eager PyTorch refuses the fill outright.
    with np.errstate(over="ignore"):
        assert np.isneginf(np.float16(module.config.mask_fill))
    with torch.no_grad(), pytest.raises(RuntimeError, match="overflow"):
        module.half()(query.half(), key.half(), value.half(), mask=mask)

    module = checkpoint.demo_module(PRESETS["cross_attention"], seed=0).eval()
    half = half_precision(module)
    assert half.config.mask_fill == FP16_MASK_FILL and np.isfinite(np.float16(FP16_MASK_FILL))
    assert module.config.mask_fill == -1e10  # the fp32 module is left as it was
    with torch.no_grad():
        out, probs = half(query.half(), key.half(), value.half(), mask=mask)
        want_out, want_probs = module(query, key, value, mask=mask)
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    assert torch.allclose(probs[1, :, 2].float(), torch.full((2, 7), 1 / 7), atol=1e-3)  # uniform, as in fp32
    assert float((out.float() - want_out).abs().max()) <= PARITY_TOLERANCE_FP16


def test_fp16_export_keeps_the_fp32_contract_and_records_its_parity(fp16_repository):
    root, module, version_dir = fp16_repository
    record = json.loads((version_dir / "export.json").read_text())
    assert record["precision"] == "fp16" and record["graph_mask_fill"] == FP16_MASK_FILL
    assert record["parity"]["tolerance"] == PARITY_TOLERANCE_FP16
    for graph, errors in record["parity"]["max_abs_error"].items():
        assert all(0 < err <= PARITY_TOLERANCE_FP16 for err in errors.values()), (graph, errors)
    graph = onnx.load(str(version_dir / "model.onnx"))
    elem = onnx.TensorProto
    assert [i.type.tensor_type.elem_type for i in graph.graph.input] == [elem.FLOAT] * 3 + [elem.BOOL]
    assert [o.type.tensor_type.elem_type for o in graph.graph.output] == [elem.FLOAT] * 2
    weights = [t for t in graph.graph.initializer if len(t.dims) == 2]
    assert weights and all(t.data_type == elem.FLOAT16 for t in weights)  # it computes in fp16

    session = ort_session(version_dir / "model.onnx")
    query, key, value = random_qkv(3, 256, 77, 32, 32, seed=8)
    mask = random_mask(3, 256, 77, seed=8)
    got_out, got_probs = ort_run(session, query, key, value, mask)
    with torch.no_grad():
        want_out, want_probs = module(query, key, value, mask=mask)
    assert np.isfinite(got_out).all() and np.isfinite(got_probs).all()
    assert max_abs(got_out, want_out) <= PARITY_TOLERANCE_FP16
    assert max_abs(got_probs, want_probs) <= PARITY_TOLERANCE_FP16


def test_the_server_serves_an_fp16_export_unchanged(fp16_repository):
    root, module, _ = fp16_repository
    query, key, value = random_qkv(2, 256, 77, 32, 32, seed=9)
    mask = random_mask(2, 256, 77, seed=9)
    server = ServerProcess(root)
    try:
        with server.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            got = outputs_of(stub.ModelInfer(infer_request(
                "cross_attention", query=query.numpy(), key=key.numpy(), value=value.numpy(), mask=mask.numpy()),
                timeout=30))
    finally:
        server.stop()
    with torch.no_grad():
        want_out, want_probs = module(query, key, value, mask=mask)
    assert max_abs(got["output"], want_out) <= PARITY_TOLERANCE_FP16
    assert max_abs(got["attn_probs"], want_probs) <= PARITY_TOLERANCE_FP16


def test_unknown_precision_is_refused_before_anything_is_written(tmp_path):
    module = checkpoint.demo_module(PRESETS["cross_attention"], seed=0)
    with pytest.raises(ExportError, match="precision"):
        export_model(module, tmp_path, "m", weights={}, precision="bf16")
    assert not any(tmp_path.iterdir())
