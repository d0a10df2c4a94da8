"""The client's ModelStreamInfer (client.stream) against real servers: many requests over one
stream answered exactly (against the eager PyTorch modules), a bad request failing only itself,
the in-flight window held with the gate, cancel, and the asyncio twin."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from attnserve.client import AsyncInferenceClient, InferenceClient, InferenceError

from tests.gated_server import GatedServer
from tests.oip import WIDTHS, eager, random_inputs

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
OUTPUTS = ("output", "attn_probs")


def _cases(count: int, seed: int) -> list[tuple[str, dict]]:
    """`count` requests of both models, shapes and masks varying."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        model = ("self_attention", "cross_attention")[i % 2]
        b, lq, lk = int(rng.integers(1, 4)), int(rng.integers(1, 20)), int(rng.integers(1, 20))
        cases.append((model, random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=i % 3 == 0)))
    return cases


def _assert_exact(got: dict, model: str, x: dict, eager_modules) -> None:
    want = eager(eager_modules[model], **x)
    assert list(got) == list(OUTPUTS)
    for name in OUTPUTS:
        assert got[name].shape == want[name].shape, name
        assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE, name


def _bad(x: dict) -> dict:
    """The same request with a query one column too wide: the server refuses it (INVALID_ARGUMENT)."""
    return {**x, "query": np.concatenate([x["query"], x["query"][..., :1]], axis=-1)}


def test_a_stream_of_many_requests_is_answered_exactly(server, eager_modules):
    cases = _cases(120, seed=1)
    with InferenceClient(server.address, timeout_s=60) as client:
        with client.stream(max_in_flight=8) as stream:
            futures = [stream.submit(model, outputs=OUTPUTS, **x) for model, x in cases]
            assert stream.in_flight <= 8
        for (model, x), future in zip(cases, futures, strict=True):
            _assert_exact(future.result(timeout=60), model, x, eager_modules)
        # The same client (and server) still serves unary calls after the stream's clean close.
        model, x = cases[0]
        _assert_exact(client.infer(model, outputs=OUTPUTS, **x), model, x, eager_modules)


def test_a_bad_request_in_a_stream_fails_only_itself(server, eager_modules):
    cases = _cases(6, seed=2)
    bad_model, bad_x = cases[2]
    with InferenceClient(server.address, timeout_s=60) as client, client.stream() as stream:
        futures = [stream.submit(model, outputs=OUTPUTS, **x) for model, x in cases[:2]]
        refused = stream.submit(bad_model, outputs=OUTPUTS, **_bad(bad_x))
        unknown = stream.submit("no_such_model", outputs=OUTPUTS, **bad_x)
        futures += [stream.submit(model, outputs=OUTPUTS, **x) for model, x in cases[3:]]
        with pytest.raises(InferenceError) as exc:
            refused.result(timeout=60)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
        assert str(WIDTHS[bad_model]) in exc.value.details, exc.value.details  # names the width expected
        with pytest.raises(InferenceError) as exc:
            unknown.result(timeout=60)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND, exc.value
        # A request after the refused ones is answered on the same stream.
        model, x = cases[0]
        futures.append(stream.submit(model, outputs=OUTPUTS, **x))
    for (model, x), future in zip(cases[:2] + cases[3:] + cases[:1], futures, strict=True):
        _assert_exact(future.result(timeout=60), model, x, eager_modules)


@pytest.fixture
def gated(model_repository):
    """One batch of one request at a time, held at the gate until the test releases it."""
    with GatedServer(model_repository, "--max-batch-size", "1", "--batches-in-flight", "1") as proc:
        yield proc


def test_the_window_bounds_requests_in_flight(gated, eager_modules):
    """max_in_flight=2: with the first request held at the gate, a third submit finds no room
    (TimeoutError, nothing sent); one answer makes room; a submit waiting for room goes on."""
    cases = _cases(4, seed=4)
    with InferenceClient(gated.address, timeout_s=60) as client, client.stream(max_in_flight=2) as stream:
        futures = [stream.submit(model, outputs=OUTPUTS, **x) for model, x in cases[:2]]
        gated.gate.wait_started()  # the first is computing (held), the second queued behind it
        with pytest.raises(TimeoutError, match="2 requests in flight"):
            stream.submit(cases[2][0], outputs=OUTPUTS, wait_s=0, **cases[2][1])
        assert stream.in_flight == 2
        waiting: list = []
        submitter = threading.Thread(
            target=lambda: waiting.append(stream.submit(cases[2][0], outputs=OUTPUTS, **cases[2][1])))
        submitter.start()
        gated.gate.release()  # the first is answered: room for one
        submitter.join(60)
        assert not submitter.is_alive() and len(waiting) == 1, "the waiting submit did not go on"
        futures += waiting
        gated.gate.release(2)
    for (model, x), future in zip(cases[:3], futures, strict=True):
        _assert_exact(future.result(timeout=60), model, x, eager_modules)


def test_request_ids_are_checked_and_a_closed_stream_refuses_more(gated):
    model, x = _cases(1, seed=3)[0]
    with InferenceClient(gated.address, timeout_s=60) as client:
        stream = client.stream()
        first = stream.submit(model, request_id="mine", **x)
        gated.gate.wait_started()  # held: "mine" is in flight
        with pytest.raises(ValueError, match="already in flight"):
            stream.submit(model, request_id="mine", **x)
        with pytest.raises(ValueError, match="expected 3 dims"):  # the caller's error, raised before sending
            stream.submit(model, x["query"][0], x["key"], x["value"])
        gated.gate.release(2)
        first.result(timeout=60)
        stream.submit(model, request_id="mine", **x).result(timeout=60)  # free again once answered
        stream.close()
        with pytest.raises(RuntimeError, match="closed"):
            stream.submit(model, **x)


def test_cancel_fails_what_is_unanswered_with_cancelled(gated):
    cases = _cases(2, seed=5)
    with InferenceClient(gated.address, timeout_s=60) as client:
        stream = client.stream()
        futures = [stream.submit(model, **x) for model, x in cases]
        gated.gate.wait_started()
        stream.cancel()
        for future in futures:
            with pytest.raises(InferenceError) as exc:
                future.result(timeout=60)
            assert exc.value.code == grpc.StatusCode.CANCELLED, exc.value
        with pytest.raises(InferenceError):
            stream.submit(*cases[0][:1], **cases[0][1])
        stream.close()
        gated.gate.release(10)  # the held batch, and the next call's
        # The server serves on after the cancelled stream.
        assert client.infer(cases[0][0], **cases[0][1])["output"].shape[0] == cases[0][1]["query"].shape[0]


def test_an_exception_inside_the_context_cancels_the_stream(gated):
    model, x = _cases(1, seed=6)[0]
    with InferenceClient(gated.address, timeout_s=60) as client:
        with pytest.raises(KeyError), client.stream() as stream:
            future = stream.submit(model, **x)
            gated.gate.wait_started()
            raise KeyError("the caller's own failure")
        with pytest.raises(InferenceError) as exc:
            future.result(timeout=60)  # not left waiting for the held batch
        assert exc.value.code == grpc.StatusCode.CANCELLED


def test_the_async_stream_answers_exactly_and_a_bad_request_fails_alone(server, eager_modules):
    cases = _cases(60, seed=7)
    bad_model, bad_x = cases[5]

    async def main():
        async with AsyncInferenceClient(server.address, timeout_s=60) as client:
            async with client.stream(max_in_flight=4) as stream:
                futures = []
                for i, (model, x) in enumerate(cases):
                    futures.append(await stream.submit(model, outputs=OUTPUTS, **(_bad(x) if i == 5 else x)))
                    assert stream.in_flight <= 4
            return await asyncio.gather(*futures, return_exceptions=True)

    results = asyncio.run(main())
    refused = results.pop(5)
    assert isinstance(refused, InferenceError) and refused.code == grpc.StatusCode.INVALID_ARGUMENT, refused
    for (model, x), got in zip(cases[:5] + cases[6:], results, strict=True):
        _assert_exact(got, model, x, eager_modules)


def test_the_async_stream_cancels(gated):
    cases = _cases(2, seed=8)

    async def main():
        async with AsyncInferenceClient(gated.address, timeout_s=60) as client:
            stream = client.stream(max_in_flight=1)
            first = await stream.submit(*cases[0][:1], **cases[0][1])
            await asyncio.to_thread(gated.gate.wait_started)
            with pytest.raises(TimeoutError):  # the window of one is full while the first is held
                await stream.submit(*cases[1][:1], wait_s=0, **cases[1][1])
            await stream.cancel()
            with pytest.raises(InferenceError) as exc:
                await first
            assert exc.value.code == grpc.StatusCode.CANCELLED
            await stream.close()

    asyncio.run(main())
