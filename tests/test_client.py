"""The client against a real server process on loopback: sync and asyncio round trips, parity with
eager PyTorch, errors as InferenceError(code, details), deadlines, retries, round robin."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest
import torch
from attnserve.client import AsyncInferenceClient, InferenceClient, InferenceError, RetryPolicy

from tests.gated_server import GatedServer
from tests.server_process import ServerProcess

TOLERANCE = 1e-5
DIMS = {"self_attention": (512, 8), "cross_attention": (32, 2)}  # width, heads


def _random_inputs(model: str, b: int, lq: int, lk: int, seed: int, masked: bool):
    width, _ = DIMS[model]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, lq, width), dtype=np.float32)
    k = rng.standard_normal((b, lk, width), dtype=np.float32)
    v = rng.standard_normal((b, lk, width), dtype=np.float32)
    mask = None
    if masked:
        mask = rng.random((b, lq, lk)) > 0.3
        mask[:, :, 0] = True
        mask[0, 0, :] = False  # a fully masked row: uniform attention, as in the seeds
    return q, k, v, mask


def eager(module, q, k, v, mask=None):
    with torch.no_grad():
        out, probs = module(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                            mask=None if mask is None else torch.from_numpy(mask))
    return {"output": out.numpy(), "attn_probs": probs.numpy()}


def assert_close(got, want, names=("output", "attn_probs")):
    assert list(got) == list(names)
    for name in names:
        assert got[name].shape == want[name].shape, name
        err = float(np.max(np.abs(got[name] - want[name])))
        assert err <= TOLERANCE, f"{name}: max abs error {err}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(server):
    with InferenceClient(server.address, timeout_s=30) as c:
        yield c


# -- round trips and parity --------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_sync_infer_matches_eager_pytorch(client, eager_modules, model, masked):
    for seed, (b, lq, lk) in enumerate([(1, 1, 1), (3, 7, 5), (2, 16, 33)]):
        q, k, v, mask = _random_inputs(model, b, lq, lk, seed, masked)
        got = client.infer(model, q, k, v, mask=mask, outputs=("output", "attn_probs"))
        assert_close(got, eager(eager_modules[model], q, k, v, mask))


def test_async_infer_matches_eager_pytorch(server, eager_modules):
    cases = [(model, b, lq, lk, masked) for model in sorted(DIMS) for (b, lq, lk) in [(2, 3, 4), (4, 9, 6)]
             for masked in (False, True)]

    async def main():
        async with AsyncInferenceClient(server.address) as c:
            inputs = [_random_inputs(m, b, lq, lk, i, masked) for i, (m, b, lq, lk, masked) in enumerate(cases)]
            # Concurrent requests on one channel: the server may batch them; each gets its own rows.
            results = await asyncio.gather(*(
                c.infer(m, q, k, v, mask, outputs=("output", "attn_probs"))
                for (m, *_), (q, k, v, mask) in zip(cases, inputs, strict=True)))
            assert await c.server_ready() and await c.model_ready("cross_attention")
            return inputs, results

    inputs, results = asyncio.run(main())
    for (model, *_), (q, k, v, mask), got in zip(cases, inputs, results, strict=True):
        assert_close(got, eager(eager_modules[model], q, k, v, mask))


def test_outputs_select_what_comes_back(client, eager_modules):
    q, k, v, _ = _random_inputs("cross_attention", 2, 4, 6, 7, masked=False)
    want = eager(eager_modules["cross_attention"], q, k, v)
    assert_close(client.infer("cross_attention", q, k, v), want, names=("output",))  # the default
    assert_close(client.infer("cross_attention", q, k, v, outputs=("attn_probs",)), want, names=("attn_probs",))
    both = client.infer("cross_attention", q, k, v, outputs=())  # empty: every output
    assert sorted(both) == ["attn_probs", "output"]
    result = client.infer_result("cross_attention", q.astype(np.float64), k, v)  # converted to float32
    assert result.model_name == "cross_attention" and result.model_version == "1"


def test_a_response_over_grpc_default_4_mib_arrives(client):
    # attn_probs of 1 x 8 heads x 400 x 400 floats is 5.1 MB: gRPC's default receive limit is 4 MiB.
    q, k, v, _ = _random_inputs("self_attention", 1, 400, 400, 3, masked=False)
    probs = client.infer("self_attention", q, k, v, outputs=("attn_probs",))["attn_probs"]
    assert probs.nbytes > 4 << 20
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-4)


# -- health and metadata ---------------------------------------------------------------------


def test_health_and_metadata_calls(client):
    assert client.server_live() and client.server_ready()
    assert client.health_check() == "SERVING"
    assert client.model_ready("self_attention") and client.model_ready("cross_attention", "1")
    meta = client.server_metadata()
    assert meta.name == "attnserve" and "statistics" in meta.extensions
    model = client.model_metadata("cross_attention")
    assert model.to_dict() == {
        "name": "cross_attention", "versions": ["1"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "query", "datatype": "FP32", "shape": [-1, -1, 32]},
                   {"name": "key", "datatype": "FP32", "shape": [-1, -1, 32]},
                   {"name": "value", "datatype": "FP32", "shape": [-1, -1, 32]},
                   {"name": "mask", "datatype": "BOOL", "shape": [-1, -1, -1]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, -1, 32]},
                    {"name": "attn_probs", "datatype": "FP32", "shape": [-1, 2, -1, -1]}],
    }
    before = client.model_statistics("cross_attention")[0].inference_count
    q, k, v, _ = _random_inputs("cross_attention", 3, 2, 2, 0, masked=False)
    client.infer("cross_attention", q, k, v)
    stats = client.model_statistics("cross_attention")
    assert [s.name for s in stats] == ["cross_attention"] and stats[0].inference_count == before + 3


# -- errors ------------------------------------------------------------------------------------


def test_bad_requests_raise_inference_error_with_code_and_details(client):
    q, k, v, _ = _random_inputs("cross_attention", 2, 3, 4, 0, masked=False)
    with pytest.raises(InferenceError) as exc:
        client.infer("no_such_model", q, k, v)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    assert "no_such_model" in exc.value.details

    with pytest.raises(InferenceError) as exc:
        client.infer("self_attention", q, k, v)  # width 32 sent to a width-512 model
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "512" in exc.value.details and "32" in exc.value.details

    with pytest.raises(InferenceError) as exc:
        client.model_metadata("no_such_model")
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    assert client.retry_count == 0  # none of these is retryable


def test_async_errors_are_the_same_type(server):
    q, k, v, _ = _random_inputs("cross_attention", 1, 2, 2, 0, masked=False)

    async def main():
        async with AsyncInferenceClient(server.address) as c:
            with pytest.raises(InferenceError) as exc:
                await c.infer("self_attention", q, k, v)
            return exc.value

    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "expected shape" in err.details


def test_invalid_inputs_fail_before_sending(client):
    q, k, v, _ = _random_inputs("cross_attention", 2, 3, 4, 0, masked=False)
    with pytest.raises(ValueError, match="batch sizes disagree"):
        client.infer("cross_attention", q, k[:1], v[:1])


def test_deadline_exceeded(model_repository):
    """The server holds the batch at a gate until the client's 0.5 s deadline has passed: the
    call ends DEADLINE_EXCEEDED, is not retried, and the client stays usable."""
    q, k, v, _ = _random_inputs("self_attention", 2, 8, 8, 0, masked=False)
    with GatedServer(model_repository) as proc, InferenceClient(proc.address, timeout_s=30) as c:
        with pytest.raises(InferenceError) as exc:
            c.infer("self_attention", q, k, v, timeout_s=0.5)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and c.retry_count == 0
        proc.gate.release(10)
        assert c.infer("self_attention", q, k, v)["output"].shape == (2, 8, 512)


def test_unreachable_server_is_retried_then_unavailable():
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.02, max_backoff_s=0.05)
    q, k, v, _ = _random_inputs("cross_attention", 1, 1, 1, 0, masked=False)
    with InferenceClient(f"127.0.0.1:{_free_port()}", timeout_s=5, retry=policy) as c:
        started = time.monotonic()
        with pytest.raises(InferenceError) as exc:
            c.infer("cross_attention", q, k, v)
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert c.retry_count == 2  # three attempts in all
        assert time.monotonic() - started < 4.0
        with pytest.raises(InferenceError):
            c.server_live()  # probes report the state now: not retried
        assert c.retry_count == 2


# -- several servers -----------------------------------------------------------------------------


def test_round_robin_spreads_requests_over_two_servers(server, model_repository):
    second = ServerProcess(model_repository)
    try:
        servers = [server, second]

        def counts():
            out = []
            for s in servers:
                with InferenceClient(s.address) as c:
                    out.append(c.model_statistics("cross_attention")[0].inference_count)
            return out

        before = counts()
        q, k, v, _ = _random_inputs("cross_attention", 1, 2, 3, 0, masked=False)
        url = ",".join(s.address for s in servers)
        with InferenceClient(url) as c:
            for _ in range(20):
                c.infer("cross_attention", q, k, v)
        gained = [after - b for after, b in zip(counts(), before, strict=True)]
        assert sum(gained) == 20
        assert all(g >= 5 for g in gained), f"requests per server: {gained}"
    finally:
        second.stop()
