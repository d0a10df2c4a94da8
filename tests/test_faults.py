"""A model whose ONNX Runtime run fails: only its batch's requests fail, with INTERNAL and a logged
traceback; the server goes on serving the other models, and this one for inputs that work.

The failing model is a real ONNX graph, built here with the `onnx` package: it loads (ONNX Runtime
accepts it at session creation) and computes output = query by reshaping (B, Lq, 4) to
(B, Lq/2, 8) and back, which ONNX Runtime refuses at run time when Lq is odd. attn_probs is the
mask as floats, with one head. No mocks: the failure comes from inside ONNX Runtime.
"""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import urllib.request

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2

from attnserve.contract import tensor_contract
from attnserve.files import write_json_atomic
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess

WIDTH = 4
MODEL = "odd_lengths_fail"


def _write_failing_model(repository) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["query", "pairs"], ["paired"]),  # fails unless Lq * 4 % 8 == 0
         helper.make_node("Reshape", ["paired", "back"], ["output"]),
         helper.make_node("Cast", ["mask"], ["mask_float"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["mask_float", "head_axis"], ["attn_probs"])],
        MODEL,
        [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "Lq", WIDTH]),
         helper.make_tensor_value_info("key", TensorProto.FLOAT, ["B", "Lk", WIDTH]),
         helper.make_tensor_value_info("value", TensorProto.FLOAT, ["B", "Lk", WIDTH]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", "Lq", "Lk"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", "Lq", WIDTH]),
         helper.make_tensor_value_info("attn_probs", TensorProto.FLOAT, ["B", 1, "Lq", "Lk"])],
        initializer=[helper.make_tensor("pairs", TensorProto.INT64, [3], [0, -1, 2 * WIDTH]),
                     helper.make_tensor("back", TensorProto.INT64, [3], [0, -1, WIDTH]),
                     helper.make_tensor("head_axis", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    directory = repository / MODEL
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))  # no output-only graph: the full one serves
    write_json_atomic(directory / "config.json", {
        "name": MODEL, "platform": "onnxruntime_onnx",
        "attention": {"query_dim": WIDTH, "kv_dim": WIDTH, "out_dim": WIDTH, "num_heads": 1},
        **tensor_contract(WIDTH, WIDTH, WIDTH, 1),
        "batching": {"max_batch_size": 8, "max_queue_delay_ms": 1.0},
        "limits": {"max_q_len": 64, "max_kv_len": 64},
    })


@pytest.fixture(scope="module")
def faulty_server(model_repository, tmp_path_factory):
    repository = tmp_path_factory.mktemp("faulty") / "models"
    repository.mkdir()
    shutil.copytree(model_repository / "cross_attention", repository / "cross_attention")
    _write_failing_model(repository)
    proc = ServerProcess(repository)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def _request(rng, b: int, lq: int, lk: int = 3):
    x = random_inputs(rng, b, lq, lk, WIDTH, WIDTH, masked=True)
    return x, infer_request(MODEL, **x)


def _internal_count(proc) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pattern = rf'^attnserve_requests_total{{(?=[^}}]*model="{MODEL}")(?=[^}}]*code="INTERNAL")[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_failing_batches_get_internal_and_the_server_goes_on(faulty_server, eager_modules):
    rng = np.random.default_rng(0)
    with faulty_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=10).ready  # it loads

        x, request = _request(rng, 2, 4)  # even Lq: runs
        got = outputs_of(stub.ModelInfer(request, timeout=10))
        np.testing.assert_array_equal(got["output"], x["query"])
        np.testing.assert_array_equal(got["attn_probs"], x["mask"][:, None].astype(np.float32))

        _, request = _request(rng, 1, 3)  # odd Lq: ONNX Runtime raises inside the run
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=10)
        assert exc.value.code() == grpc.StatusCode.INTERNAL
        assert "the batch this request was in failed" in exc.value.details()
        assert "reshape" not in exc.value.details().lower()  # ONNX Runtime's text stays in the log
        assert "the server log has the traceback" in exc.value.details()

        # Failing batches while another model serves, concurrently: each failing request gets
        # INTERNAL, each good one its right answer.
        failing = [_request(rng, 1, 5)[1] for _ in range(12)]
        good = [random_inputs(rng, 2, 7, 5, 32, 32, masked=True) for _ in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            bad_futures = [pool.submit(stub.ModelInfer, r, timeout=30) for r in failing]
            good_futures = [pool.submit(stub.ModelInfer, infer_request("cross_attention", **y), timeout=30)
                            for y in good]
            for f in bad_futures:
                assert f.exception() is not None and f.exception().code() == grpc.StatusCode.INTERNAL
            for y, f in zip(good, good_futures, strict=True):
                want = eager(eager_modules["cross_attention"], **y)
                got = outputs_of(f.result())
                for name in ("output", "attn_probs"):
                    assert float(np.max(np.abs(got[name] - want[name]))) <= 1e-5

        # The same model still serves the inputs that work.
        for lq in (2, 6):
            x, request = _request(rng, 3, lq)
            np.testing.assert_array_equal(outputs_of(stub.ModelInfer(request, timeout=10))["output"], x["query"])
        assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=10).ready
    assert faulty_server.health() == health_pb2.HealthCheckResponse.SERVING
    assert faulty_server.health(MODEL) == health_pb2.HealthCheckResponse.SERVING
    assert _internal_count(faulty_server) == 13
    log = faulty_server.log()
    assert f"model {MODEL}: batch of" in log and "failed" in log
    assert "Traceback (most recent call last)" in log and "onnxruntime" in log
