"""Hostile gRPC clients (issue 27): oversized `parameters`, calls cancelled while their message is
being received. A real server on loopback; the receive slots' wait is held by the test (a
message that never completes), never by a guess of how long something takes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.proto import wire
from attnserve.server import parsing

from tests.oip import infer_request, random_inputs

INFER = "/inference.GRPCInferenceService/ModelInfer"
MIB = 1 << 20


def _with_parameters(request: pb.ModelInferRequest, count: int) -> pb.ModelInferRequest:
    for i in range(count):
        request.parameters[f"p{i}"].bool_param = True
    return request


def _parameters_on_the_wire(count: int) -> bytes:
    """`count` entries of ModelInferRequest.parameters (field 4), as protobuf writes them, built
    without a million Python map operations: key "parameter0000001", value bool_param true."""
    entries = []
    for i in range(count):
        key = b"parameter%07d" % i
        entry = b"\x0a" + wire.encode_varint(len(key)) + key + b"\x12\x02\x08\x01"
        entries.append(b"\x22" + wire.encode_varint(len(entry)) + entry)
    return b"".join(entries)


# -- parameters (defect 8) ---------------------------------------------------------------------


def test_a_million_parameters_are_refused_before_they_are_scanned():
    """The wire scan stops at the first bound crossed: it reads MAX_PARAMETERS + 1 entries of
    the 1,000,000, not the whole message (counted by a wrapper over the varint reader)."""
    data = pb.ModelInferRequest(model_name="self_attention").SerializeToString() + _parameters_on_the_wire(1_000_000)
    assert dict(pb.ModelInferRequest.FromString(_parameters_on_the_wire(2)).parameters)["parameter0000001"].bool_param
    steps = 0
    real = wire._varint

    def counted(view, at):
        nonlocal steps
        steps += 1
        return real(view, at)

    wire._varint = counted
    try:
        with pytest.raises(wire.FieldsOverLimit, match=f"more than {parsing.MAX_PARAMETERS} `parameters`"):
            parsing.bounded_infer_request(pb.ModelInferRequest.FromString)(data)
    finally:
        wire._varint = real
    assert steps <= 3 * (parsing.MAX_PARAMETERS + 2), steps


def test_too_many_parameters_are_invalid_argument_naming_the_bound_large_or_small(server):
    """A 17 MB ModelInfer of 1,000,000 `parameters` and a small one of MAX_PARAMETERS + 1 (or
    an input's own) are INVALID_ARGUMENT naming the limit; the same request within it is served."""
    rng = np.random.default_rng(0)
    x = random_inputs(rng, 1, 4, 4, 512, 512)
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(server.address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        infer_bytes = channel.unary_unary(INFER, response_deserializer=pb.ModelInferResponse.FromString)
        huge = infer_request("self_attention", **x).SerializeToString() + _parameters_on_the_wire(1_000_000)
        assert len(huge) > 16 * MIB
        small = _with_parameters(infer_request("self_attention", **x), parsing.MAX_PARAMETERS + 1)
        nested = infer_request("self_attention", **x)
        for i in range(parsing.MAX_PARAMETERS + 1):
            nested.inputs[0].parameters[f"p{i}"].int64_param = i
        for request, where in ((huge, "the inference request"), (small, "the inference request"),
                               (nested, "input 'query'")):
            with pytest.raises(grpc.RpcError) as exc:
                (infer_bytes if isinstance(request, bytes) else stub.ModelInfer)(request, timeout=60)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
            assert where in exc.value.details() and f"{parsing.MAX_PARAMETERS:,}" in exc.value.details(), \
                exc.value.details()
            assert "`parameters`" in exc.value.details()
        fine = _with_parameters(infer_request("self_attention", **x), parsing.MAX_PARAMETERS)
        assert stub.ModelInfer(fine, timeout=60).outputs[0].name == "output"


# -- cancelled calls and the receive slots (defect 1) --------------------------------------------


def test_cancelled_calls_give_their_receive_slots_back_at_once(model_repository, monkeypatch):
    """--memory-limit-bytes 512 MiB: 2 receive slots. Two ModelInfer calls send all of a 393 KB
    message but its last 16 bytes (their slots held) and are cancelled (RST_STREAM). A third call
    is answered, and nothing is left arriving, so a stop does not wait on them. The slots' and
    arrivals' staleness timers are set to an hour: only the cancellation can free them."""
    from attnserve.server.app import Server
    from attnserve.server.config import ServerConfig
    from attnserve.server.gate import ReceiveSlots
    from attnserve.server.lifecycle import Arrivals

    from tests.h2_client import RawGrpcClient, grpc_frame

    monkeypatch.setattr(ReceiveSlots, "STALE_S", 3600.0)
    monkeypatch.setattr(Arrivals, "TIMEOUT_S", 3600.0)
    # The Python port's receive slots (the native port's bound is gRPC's memory quota: test_native_limits.py).
    config = ServerConfig(model_repository=model_repository, host="127.0.0.1", port=0, http_port=-1,
                          metrics_port=-1, memory_limit_bytes=512 * MIB, drain_delay_s=0, grace_period_s=5,
                          data_plane="python")
    rng = np.random.default_rng(1)
    big = grpc_frame(infer_request("self_attention", **random_inputs(rng, 1, 96, 96, 512, 512)).SerializeToString())
    assert len(big) > 390_000
    small = infer_request("self_attention", **random_inputs(rng, 1, 4, 4, 512, 512))

    async def until(condition, what: str, bound_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + bound_s
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)

    async def main() -> tuple[int, int]:
        server = Server(config)
        port = await server.start()
        gate, admission = server._gate, server._admission
        assert gate.receive.slots == 2
        client = await asyncio.to_thread(RawGrpcClient, port)
        try:
            sids = []
            for _ in range(2):
                sids.append(client.start_call(INFER, None))
                client.send_bytes(sids[-1], big[:-16])
            await until(lambda: client.pump(0.01) >= 0 and gate.receive.receiving == 2,
                        "the two calls did not take the receive slots")
            for sid in sids:
                client.cancel(sid)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                answer = await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(small, timeout=60)
            assert answer.outputs[0].name == "output"
            await until(lambda: admission.in_flight == 0 and gate.receive.receiving == 0,
                        "the cancelled calls are still counted")
            return gate.receive.receiving, admission.in_flight
        finally:
            client.close()
            await server.stop(5)

    assert asyncio.run(main()) == (0, 0)
