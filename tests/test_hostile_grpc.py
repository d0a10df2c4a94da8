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
