"""The CUDA path, on a machine that has it: these tests run only where onnxruntime-gpu sees a
GPU (`.venv/bin/pip install onnxruntime-gpu` in place of onnxruntime) and are skipped, saying
so, elsewhere. CI has no GPU: there, test_server_lifecycle.py shows the refusal instead.

    .venv/bin/python -m pytest tests/test_cuda.py -v      # on a GPU machine
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
from attnserve.export import checkpoint
from attnserve.export.config import PRESETS
from attnserve.export.onnx_export import PARITY_TOLERANCE_FP16, export_model
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.engine import CUDA, Engine, choose_device
from attnserve.server.repository import read_model_spec

from tests.export_helpers import max_abs, random_mask, random_qkv
from tests.oip import infer_request, outputs_of
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.e2e,  # starts servers on CUDA
              pytest.mark.skipif(CUDA not in onnxruntime.get_available_providers(),
                                reason="no CUDAExecutionProvider here (onnxruntime-gpu and a GPU needed)")]

# fp32 on the GPU may round differently (TF32 matmuls where ONNX Runtime allows them).
CUDA_FP32_TOLERANCE = 2e-3


def test_cuda_probe_runs_on_cuda():
    from attnserve.server.cuda_probe import why_cuda_cannot_run

    assert why_cuda_cannot_run() is None


@pytest.mark.parametrize("io_binding", [False, True], ids=["plain", "io_binding"])
@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_cuda_engine_matches_the_cpu(model_repository, model, io_binding):
    """The served path (plain runs, numpy in and out) and I/O binding, each against the CPU."""
    spec = read_model_spec(model_repository / model)
    gpu = Engine(spec, choose_device("cuda"), io_binding=io_binding)
    cpu = Engine(spec, choose_device("cpu"))
    assert gpu.providers[0] == CUDA and gpu._io_binding == io_binding
    rng = np.random.default_rng(21)
    b, lq, lk = 5, 40, 17
    mask = rng.random((b, lq, lk)) < 0.7
    mask[0, 0] = False
    feeds = {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
             "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
             "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32), "mask": mask}
    for want_probs in (True, False):
        got_out, got_probs = gpu.run(feeds, want_probs)
        want_out, want_probs_arr = cpu.run(feeds, want_probs)
        np.testing.assert_allclose(got_out, want_out, atol=CUDA_FP32_TOLERANCE, rtol=0)
        if want_probs:
            np.testing.assert_allclose(got_probs, want_probs_arr, atol=CUDA_FP32_TOLERANCE, rtol=0)


@pytest.mark.parametrize("model", ["self_attention", "cross_attention"])
def test_cuda_takes_the_fused_graphs_and_matches_the_cpu(model_repository, model):
    """The same choice on the CUDA provider (server.graphs), past both crossovers: no mask on
    model_fused.onnx, a key padding mask on model_fused_key_padding.onnx, each equal to the CPU's."""
    from attnserve import contract

    spec = read_model_spec(model_repository / model)
    gpu = Engine(spec, choose_device("cuda"))
    cpu = Engine(spec, choose_device("cpu"))
    assert gpu.graphs == cpu.graphs and not gpu.why_not_fused
    long = 2 * max(dict(spec.crossover).values())
    rng = np.random.default_rng(23)
    base = {"query": rng.standard_normal((2, long, spec.query_dim), dtype=np.float32),
            "key": rng.standard_normal((2, long, spec.kv_dim), dtype=np.float32),
            "value": rng.standard_normal((2, long, spec.kv_dim), dtype=np.float32)}
    key_padding = np.ones((2, long), np.int32)
    key_padding[0, long // 2:] = 0
    for feeds, kind in ((base, contract.FUSED), (base | {contract.KEY_PADDING_MASK: key_padding},
                                                 contract.FUSED_KEY_PADDING)):
        assert gpu.graph_for(feeds, False) == cpu.graph_for(feeds, False) == kind
        np.testing.assert_allclose(gpu.run(feeds, False)[0], cpu.run(feeds, False)[0],
                                   atol=CUDA_FP32_TOLERANCE, rtol=0)
        assert gpu.runs[kind] == 1


def test_fp16_export_served_on_cuda_matches_the_fp32_module(tmp_path):
    module = checkpoint.demo_module(PRESETS["self_attention"], seed=0).eval()
    export_model(module, tmp_path, "self_attention", weights={"source": "demo", "seed": 0}, precision="fp16")
    query, key, value = random_qkv(4, 33, 21, 512, 512, seed=22)
    mask = random_mask(4, 33, 21, seed=22)
    server = ServerProcess(tmp_path, "--device", "cuda")  # starts only if every session runs on CUDA
    try:
        with server.channel() as channel:
            got = outputs_of(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request(
                "self_attention", query=query.numpy(), key=key.numpy(), value=value.numpy(), mask=mask.numpy()),
                timeout=60))
    finally:
        server.stop()
    with torch.no_grad():
        want_out, want_probs = module(query, key, value, mask=mask)
    assert np.isfinite(got["attn_probs"]).all()
    assert max_abs(got["output"], want_out) <= PARITY_TOLERANCE_FP16
    assert max_abs(got["attn_probs"], want_probs) <= PARITY_TOLERANCE_FP16
