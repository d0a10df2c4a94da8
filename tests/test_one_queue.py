"""REST and gRPC calls to one model version wait in one queue, the native core's, and join the same
runs (docs/native-data-plane.md, "REST in the core"). A run held at the test's gate keeps the
others queued while both kinds arrive; the next batch at the gate then holds them all."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native

from tests.gated_server import GatedServer
from tests.oip import infer_request, outputs_of, rest_infer
from tests.test_native_control import _in_flight

pytestmark = pytest.mark.skipif(native.why_unavailable() is not None, reason=str(native.why_unavailable()))

MODEL = "cross_attention"  # small: 32 wide
WAIT_S = 60.0  # only catches a hang
EACH = 8  # calls of each kind queued behind the held run


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"query": rng.standard_normal((1, 6, 32), dtype=np.float32),
            "key": rng.standard_normal((1, 5, 32), dtype=np.float32),
            "value": rng.standard_normal((1, 5, 32), dtype=np.float32)}


def test_rest_and_grpc_calls_to_one_model_join_the_same_runs(model_repository):
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "32") as proc, \
            grpc.insecure_channel(f"127.0.0.1:{proc.port}") as channel, \
            futures.ThreadPoolExecutor(max_workers=2 * EACH + 1) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        rest = httpclient.InferenceServerClient(url=proc.http_address, concurrency=EACH)
        try:
            held = pool.submit(stub.ModelInfer, infer_request(MODEL, **_inputs(0)), timeout=WAIT_S)
            assert proc.gate.wait_started() == 1  # the first run holds the runner
            grpc_calls = {seed: pool.submit(stub.ModelInfer, infer_request(MODEL, **_inputs(seed)), timeout=WAIT_S)
                          for seed in range(1, EACH + 1)}
            rest_calls = {seed: pool.submit(rest_infer, rest, MODEL, _inputs(seed), True)
                          for seed in range(EACH + 1, 2 * EACH + 1)}
            _in_flight(proc, 1 + 2 * EACH)  # every call of both kinds is in the core's queue
            proc.gate.release()
            assert proc.gate.wait_started() == 2 * EACH  # one run takes them all, whichever port they came by
            proc.gate.release()
            assert not proc.gate.has_started()
            outputs_of(held.result(timeout=WAIT_S))
            # Each answer is its own request's: equal to the same request computed alone.
            for seed, call in grpc_calls.items():
                got = outputs_of(call.result(timeout=WAIT_S))
                alone = pool.submit(stub.ModelInfer, infer_request(MODEL, **_inputs(seed)), timeout=WAIT_S)
                proc.gate.wait_started()
                proc.gate.release()
                want = outputs_of(alone.result(timeout=WAIT_S))
                np.testing.assert_allclose(got["output"], want["output"], atol=1e-6)
            for seed, call in rest_calls.items():
                got = call.result(timeout=WAIT_S)
                alone = pool.submit(stub.ModelInfer, infer_request(MODEL, **_inputs(seed)), timeout=WAIT_S)
                proc.gate.wait_started()
                proc.gate.release()
                want = outputs_of(alone.result(timeout=WAIT_S))
                np.testing.assert_allclose(got["output"], want["output"], atol=1e-6)
                np.testing.assert_allclose(got["attn_probs"], want["attn_probs"], atol=1e-6)
        finally:
            rest.close()


def test_a_rest_call_refused_by_the_core_has_the_grpc_calls_words(model_repository):
    """One parse and one set of checks: a bad request gets the same message on both ports."""
    with GatedServer(model_repository, "--data-plane", "native") as proc, \
            grpc.insecure_channel(f"127.0.0.1:{proc.port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        bad = _inputs(1)
        bad["key"] = bad["key"][:, :, :16]  # the wrong width
        request = infer_request(MODEL, **bad)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        rest = httpclient.InferenceServerClient(url=proc.http_address)
        try:
            with pytest.raises(Exception) as refused:
                rest_infer(rest, MODEL, bad, True)
        finally:
            rest.close()
        assert exc.value.details() in str(refused.value)
        assert refused.value.status() == "400"
