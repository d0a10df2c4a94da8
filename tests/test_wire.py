"""attnserve.proto.wire: raw tensor bytes read and written beside protobuf, byte for byte what
protobuf itself would read and write, without its copies."""

from __future__ import annotations

import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import wire
from attnserve.server import codec
from google.protobuf.message import DecodeError


def _request(raw: list[bytes], typed: bool = False) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="r")
    tensor = request.inputs.add(name="query", datatype="FP32", shape=[1, 2, 2])
    if typed:
        tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    request.outputs.add(name="output")
    request.parameters["k"].string_param = "v"
    request.raw_input_contents.extend(raw)
    return request


@pytest.mark.parametrize("raw", [[], [b"abc", b"", b"\x00" * 300], [np.arange(40000, dtype="<f4").tobytes()]],
                         ids=["none", "short", "long"])
def test_parse_with_raw_reads_what_protobuf_reads(raw):
    request = _request(raw, typed=not raw)
    data = request.SerializeToString()
    message, views = wire.parse_with_raw(pb.ModelInferRequest, data, "raw_input_contents")
    assert [bytes(v) for v in views] == raw
    assert all(v.readonly and v.obj is data for v in views)  # views into the received bytes: no copy
    del request.raw_input_contents[:]
    assert message == request  # every other field, parameters and typed contents included


def test_records_in_any_order_and_malformed_bytes():
    request = _request([b"one", b"two"])
    data = request.SerializeToString()
    # protobuf writes raw_input_contents (field 7) last; a writer may put them first.
    head = wire.serialize_with_raw(pb.ModelInferRequest(), "raw_input_contents", [b"one", b"two"])
    del request.raw_input_contents[:]
    message, views = wire.parse_with_raw(pb.ModelInferRequest, head + request.SerializeToString(),
                                         "raw_input_contents")
    assert message == request and [bytes(v) for v in views] == [b"one", b"two"]
    for bad in (data[:-1], b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"):
        with pytest.raises((wire.WireError, DecodeError)):
            wire.parse_with_raw(pb.ModelInferRequest, bad, "raw_input_contents")


def test_serialize_with_raw_writes_what_protobuf_writes():
    outputs = [np.arange(6, dtype="<f4").reshape(2, 3), np.ones((1, 2, 2, 2), "<f4")]
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="r")
    response.outputs.add(name="output", datatype="FP32", shape=[2, 3])
    data = wire.serialize_with_raw(response, "raw_output_contents", outputs)
    expected = pb.ModelInferResponse()
    expected.CopyFrom(response)
    expected.raw_output_contents.extend(a.tobytes() for a in outputs)
    assert data == expected.SerializeToString()
    assert pb.ModelInferResponse.FromString(data) == expected


def test_codec_takes_the_wire_path_for_large_messages_only():
    big = b"\x01" * codec.WIRE_MIN_BYTES
    request = codec.parse_infer_request(_request([big]).SerializeToString())
    assert isinstance(request, codec.InferRequest)
    assert request.model_name == "m" and request.id == "r" and request.inputs[0].name == "query"
    assert [bytes(v) for v in request.raw_input_contents] == [big]
    small = codec.parse_infer_request(_request([b"\x00" * 16]).SerializeToString())
    assert isinstance(small, pb.ModelInferRequest) and small.raw_input_contents[0] == b"\x00" * 16

    array = np.arange(codec.WIRE_MIN_BYTES // 4, dtype="<f4")
    response = codec.InferResponse(pb.ModelInferResponse(model_name="m"), [array])
    data = codec.serialize_infer_response(response)
    assert pb.ModelInferResponse.FromString(data) == pb.ModelInferResponse(model_name="m",
                                                                          raw_output_contents=[array.tobytes()])
    bare = pb.ModelInferResponse(id="x")
    assert codec.serialize_infer_response(bare) == bare.SerializeToString()


def test_a_serialized_answer_lets_go_of_its_tensors():
    """gRPC keeps a call's done callbacks, and through them its InferResponse, until it lets go of
    the call, which it did only once the next call had begun: the answer's arrays (8 MB for a
    (1, 4096, 512) output) stayed resident beside the next request's. Once serialized they are
    in the answer's bytes, and the InferResponse holds them no longer (no collection needed)."""
    import weakref

    array = np.arange(codec.WIRE_MIN_BYTES // 4, dtype="<f4")
    alive = weakref.ref(array)
    response = codec.InferResponse(pb.ModelInferResponse(model_name="m"), [array])
    del array
    data = codec.serialize_infer_response(response)
    assert alive() is None
    assert pb.ModelInferResponse.FromString(data).raw_output_contents[0] == np.arange(
        codec.WIRE_MIN_BYTES // 4, dtype="<f4").tobytes()


def test_crowded_a_large_request_hands_freed_heap_back_and_a_small_one_does_not():
    import platform

    from attnserve.server.memory import heap

    assert heap.release_after(heap.TRIM_MIN_BYTES) is False  # roomy: nothing trims
    heap.go_lean()
    try:
        assert heap.release_after(heap.TRIM_MIN_BYTES - 1) is False
        assert heap.release_after(heap.TRIM_MIN_BYTES) is (platform.libc_ver()[0] == "glibc")
    finally:
        heap.go_roomy()


# -- malformed bytes: a clear error, never a crash, a hang or a read past the message ----------------

_VALID = _request([b"abc", b"\x01" * 40]).SerializeToString()
_MALFORMED = {
    "truncated tag varint": b"\x80",
    "overlong varint (11 bytes)": b"\x08" + b"\xff" * 10 + b"\x01",
    "start group (wire type 3)": b"\x0b\x0c",
    "end group (wire type 4)": b"\x0c",
    "wire type 6": b"\x0e\x00",
    "wire type 7": b"\x0f\x00",
    "fixed64 cut short": b"\x09\x00\x00\x00",
    "fixed32 cut short": b"\x0d\x00\x00",
    "a string past the end": b"\x0a\x10abc",
    "raw_input_contents past the end": b"\x3a\x10abc",
    "raw_input_contents of 2**62 bytes": b"\x3a" + wire.encode_varint(1 << 62) + b"abc",
    "length varint cut short": b"\x3a\xff\xff",
    "field number 0": b"\x00\x00" + _VALID,
    "the valid message cut one short": _VALID[:-1],
}


@pytest.mark.parametrize("data", list(_MALFORMED.values()), ids=list(_MALFORMED))
def test_each_malformed_message_raises_a_parse_error(data):
    with pytest.raises((wire.WireError, DecodeError)):
        wire.parse_with_raw(pb.ModelInferRequest, data, "raw_input_contents")


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, len(_VALID)), edits=st.lists(st.tuples(st.integers(0, len(_VALID) - 1),
                                                                 st.integers(0, 255)), max_size=4))
def test_mutated_messages_parse_as_protobuf_parses_them_or_fail_cleanly(cut, edits):
    """Any truncation and byte edits of a real request: the wire path either raises a parse error
    or reads exactly what protobuf reads from the same bytes (views never past the message)."""
    data = bytearray(_VALID[:cut])
    for at, byte in edits:
        if at < len(data):
            data[at] = byte
    data = bytes(data)
    try:
        message, views = wire.parse_with_raw(pb.ModelInferRequest, data, "raw_input_contents")
    except (wire.WireError, DecodeError):
        return
    whole = pb.ModelInferRequest.FromString(data)  # ours parsed: protobuf must, to the same
    assert [bytes(v) for v in views] == list(whole.raw_input_contents)
    assert sum(v.nbytes for v in views) <= len(data)
    del whole.raw_input_contents[:]
    assert message == whole


def test_a_large_malformed_message_is_invalid_argument_through_the_server(server):
    """Messages of WIRE_MIN_BYTES or more take the wire path in the server's deserializer: one cut
    short, one whose raw entry claims more bytes than the message has, one valid in framing whose
    raw entry is a byte short: INVALID_ARGUMENT each, and no traceback in the server's log."""
    import grpc

    x = np.zeros((1, codec.WIRE_MIN_BYTES // (4 * 512) + 1, 512), np.float32)  # over 1 MiB per tensor
    from tests.oip import infer_request

    good = infer_request("self_attention", outputs=("output",), query=x, key=x, value=x)
    data = good.SerializeToString()
    assert len(data) >= codec.WIRE_MIN_BYTES
    short = pb.ModelInferRequest()
    short.CopyFrom(good)
    short.raw_input_contents[2] = short.raw_input_contents[2][:-1]
    cases = {
        "cut short": (data[:-7], "does not parse"),
        "raw entry past the end": (data + b"\x3a" + wire.encode_varint(1 << 40), "does not parse"),
        "a raw entry a byte short": (short.SerializeToString(), "raw_input_contents has"),
    }
    log_before = len(server.log())
    with server.channel() as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        for case, (message, detail) in cases.items():
            with pytest.raises(grpc.RpcError) as exc:
                call(message, timeout=60)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert detail in exc.value.details(), (case, exc.value.details())
        answer = pb.ModelInferResponse.FromString(call(data, timeout=60))  # and the valid one is served
    assert list(answer.outputs[0].shape) == list(x.shape)
    assert "Traceback" not in server.log()[log_before:]
