"""Resource limits that hold: the queue bounded in bytes, a merged batch's attention matrix bounded
like one request's, answers that could not be sent refused up front, gRPC message limits.

Batcher tests drive the real batcher with the numpy attention of test_batcher (house style);
the end-to-end ones use a server of their own whose messages are limited to 1 MiB.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.client import InferenceClient, InferenceError
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import codec
from attnserve.server.batcher import BatchPolicy, QueueFull
from attnserve.server.repository import ModelSpec

from attnserve.contract import TensorSpec
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess
from tests.test_batcher import (
    Model,
    answered_behind_blocker,
    assert_matches_alone,
    make_work,
    queue_behind_held_run,
    started,
    stop,
)

pytestmark = pytest.mark.e2e  # starts servers

# -- the queue, in bytes --------------------------------------------------------------------


def test_queue_is_bounded_in_bytes_and_frees_them_as_it_drains():
    async def main():
        model = Model()
        works = [make_work(1, 4, 6) for _ in range(4)]
        size = works[0].nbytes  # (4 + 6 + 6) x 16 floats + a 4 x 6 mask = 1,048 bytes
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_queued_bytes=int(2.5 * size)))
        try:
            blocker, queued = await queue_behind_held_run(batcher, model, works[:2])
            with pytest.raises(QueueFull) as exc:  # a third would hold 3 x 1,048 > 2,620 bytes
                await batcher.submit(works[2])
            model.open()
            results = await asyncio.gather(blocker, *queued)
            # Drained: the bytes are free again, the same request is taken.
            later = await batcher.submit(works[2])
        finally:
            await stop(batcher, model)
        return model, works, results, later, exc.value, size

    model, works, results, later, err, size = asyncio.run(main())
    assert f"{2 * size:,} input bytes queued" in str(err) and "max_queued_bytes 2,620" in str(err)
    for w, r in zip(works[:2], results[1:], strict=True):
        assert_matches_alone(w, r)
    assert_matches_alone(works[2], later)
    assert len(model.runs_with(works[2])) == 1  # computed once: when it was taken, not when shed


def test_request_larger_than_the_byte_bound_is_taken_by_an_empty_queue_alone():
    async def main():
        model = Model()
        big = [make_work(2, 8, 8) for _ in range(2)]
        batcher = await started(model, BatchPolicy(max_queue_delay_s=0.0, max_queued_bytes=100))
        try:
            blocker, (first,) = await queue_behind_held_run(batcher, model, big[:1])  # an empty queue takes it
            with pytest.raises(QueueFull, match="max_queued_bytes 100"):
                await batcher.submit(big[1])
            model.open()
            await blocker
            return await first
        finally:
            await stop(batcher, model)

    result = asyncio.run(main())
    assert result.output.shape == (2, 8, 16)


# -- a merged batch's attention matrix ------------------------------------------------------


def test_merged_batch_stays_within_the_attention_bound():
    """Four queued requests of 1 x 4 x 6 scores each: without a bound they run as one batch;
    with max_batch_scores 48 no run holds more than two of them."""

    async def run(policy):
        model = Model()
        batcher = await started(model, policy)
        works = [make_work(1, 4, 6) for _ in range(4)]
        results = await answered_behind_blocker(batcher, model, works)
        return model, works, results

    model, works, results = asyncio.run(run(BatchPolicy(max_queue_delay_s=0.0, max_batch_scores=48)))
    for w, r in zip(works, results, strict=True):
        assert_matches_alone(w, r)
    runs = model.calls[1:]  # after the blocker
    assert [c.rows for c in runs] == [2, 2]
    assert all(c.feeds["mask"].size <= 48 for c in runs)  # rows x Lq x Lk

    unbounded, _, _ = asyncio.run(run(BatchPolicy(max_queue_delay_s=0.0)))
    assert [c.rows for c in unbounded.calls[1:]] == [4]


def test_server_limits_reach_each_model(model_repository):
    from attnserve.server.config import ServerConfig
    from attnserve.server.engine import choose_device
    from attnserve.server.metrics import Metrics
    from attnserve.server.models import ModelRegistry

    config = ServerConfig(model_repository=model_repository, max_queued_bytes=12345, max_message_bytes=2 << 20,
                          max_attention_bytes=1 << 20, metrics_port=-1)
    registry = ModelRegistry.from_repository(config, choose_device("cpu"), Metrics())
    model = registry.loaded["self_attention"]  # 8 heads
    assert model.batcher.policy.max_queued_bytes == 12345
    assert model.batcher.policy.max_batch_scores == (1 << 20) // (4 * 8)
    assert model.limits.max_response_bytes == 2 << 20
    assert model.limits.max_attention_bytes == 1 << 20


# -- answers that could not be sent ---------------------------------------------------------


def _spec(num_heads=8, dim=512) -> ModelSpec:
    return ModelSpec(name="m", version=1, version_dir=Path("."), platform="onnxruntime_onnx", query_dim=dim,
                     kv_dim=dim, out_dim=dim, num_heads=num_heads, inputs=(),
                     outputs=(TensorSpec("output", "FP32", ()),),
                     max_batch_size=32, max_queue_delay_ms=1.0, max_q_len=4096, max_kv_len=4096)


def test_decode_refuses_a_response_over_the_message_limit_before_allocating():
    spec = _spec()
    limits = codec.Limits(4096, 4096, 1 << 40, max_response_bytes=1 << 20)
    request = infer_request("m", raw=True, query=np.zeros((1, 200, 512), np.float32),
                            key=np.zeros((1, 200, 512), np.float32), value=np.zeros((1, 200, 512), np.float32))
    # output 1 x 200 x 512 x 4 = 409,600 bytes; attn_probs 1 x 8 x 200 x 200 x 4 = 1,280,000 bytes
    with pytest.raises(ValueError) as exc:
        codec.decode(request, spec, limits)
    message = str(exc.value)
    assert "output 409,600 + attn_probs 1,280,000" in message and "1,048,576-byte message limit" in message
    request.outputs.add(name="output")
    assert codec.decode(request, spec, limits).outputs == ("output",)
    del request.outputs[:]
    request.outputs.add(name="attn_probs")
    with pytest.raises(ValueError, match="attn_probs 1,280,000"):
        codec.decode(request, spec, limits)


# -- the attention bound follows the graph that will run --------------------------------------


def test_attention_bound_applies_to_the_graph_that_will_run():
    """(1, 256, 256) over 8 heads is a 2 MiB attention matrix, over a 1 MiB bound: refused where
    the graph that would run holds it, served where that graph is flash attention (no mask,
    `output` alone, a version with the fused graph)."""
    from attnserve.server.graphs import GraphSet

    from attnserve import contract

    spec = _spec(num_heads=8, dim=16)
    fused = GraphSet(frozenset(contract.GRAPH_FILES), {contract.FUSED: 16, contract.FUSED_KEY_PADDING: 16})
    unfused_only = GraphSet(frozenset({contract.ALL_OUTPUTS, contract.OUTPUT_ONLY}))
    x = np.zeros((1, 256, 16), np.float32)
    keys = np.ones((1, 256, 256), np.bool_)
    keys[..., 200:] = False  # the same keys masked for every query row
    general = keys.copy()
    general[0, 0, 0] = False

    def decode(graphs, outputs=("output",), mask=None):
        limits = codec.Limits(4096, 4096, 1 << 20, graphs=graphs)
        return codec.decode(infer_request("m", outputs=outputs, query=x, key=x, value=x, mask=mask), spec, limits)

    assert decode(fused).work.masking == "none"
    assert decode(fused, mask=np.ones((1, 256, 256), np.bool_)).outputs == ("output",)  # masks nothing
    cases = {
        "attn_probs": (fused, ("output", "attn_probs"), None, "it asks for attn_probs"),
        "general mask": (fused, ("output",), general, "the unfused graph runs it"),
        "key mask": (fused, ("output",), keys, "fused key padding graph, which holds every score"),
        "old layout": (unfused_only, ("output",), None, "the unfused graph runs it"),
        "no graphs known": (GraphSet(), ("output",), None, "the unfused graph runs it"),
    }
    for case, (graphs, outputs, mask, why) in cases.items():
        with pytest.raises(ValueError) as exc:
            decode(graphs, outputs, mask)
        message = str(exc.value)
        assert "2,097,152-byte attention matrix (batch 1 x 8 heads x 256 x 256 x 4" in message, case
        assert why in message and "the limit is 1,048,576 bytes" in message, case


@pytest.fixture(scope="module")
def small_server(model_repository):
    """Messages of 1 MiB at most, both ways. (A call gRPC refuses for its size never reaches a
    handler, so draining waits for it until the short grace period ends.)"""
    proc = ServerProcess(model_repository, "--max-message-bytes", str(1 << 20), "--grace-period-s", "2")
    yield proc
    assert proc.stop() == 0


def test_response_too_large_to_send_is_invalid_argument_and_output_alone_is_served(small_server, eager_modules):
    """attn_probs of 1 x 2 x 400 x 400 floats is 1.28 MB: over the 1 MiB message limit."""
    x = random_inputs(np.random.default_rng(0), 1, 400, 400, 32, 32)
    with small_server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(infer_request("cross_attention", **x), timeout=60)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "attn_probs 1,280,000" in exc.value.details() and "1,048,576-byte message limit" in exc.value.details()
        got = outputs_of(stub.ModelInfer(infer_request("cross_attention", outputs=("output",), **x), timeout=60))
    want = eager(eager_modules["cross_attention"], **x)
    assert float(np.max(np.abs(got["output"] - want["output"]))) <= 1e-5


def test_message_size_limits_hold_on_both_sides(small_server):
    data = np.zeros((1, 200, 512), np.float32)  # three of these: 1.23 MB > 1 MiB
    request = infer_request("self_attention", query=data, key=data, value=data)
    assert request.ByteSize() > 1 << 20
    # The server's receive limit holds against a client that raised its own.
    with grpc.insecure_channel(small_server.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=60)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The project's client enforces its own limit before sending anything.
    with InferenceClient(small_server.address, max_message_bytes=1 << 20, timeout_s=10) as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("self_attention", data, data, data)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.health_check() == "SERVING"
