"""attnserve.proto.wire: raw tensor bytes read and written beside protobuf, byte for byte what
protobuf itself would read and write, without its copies."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from attnserve.proto import inference_pb2 as pb
from attnserve.proto import wire
from attnserve.server import codec


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
    assert pb.ModelInferResponse.FromString(data) == response.as_message()
    assert response.as_message().raw_output_contents[0] == array.tobytes()
    assert codec.serialize_infer_response(pb.ModelInferResponse(id="x")) == pb.ModelInferResponse(id="x").SerializeToString()


def test_a_large_request_hands_freed_heap_back_and_a_small_one_does_not():
    import platform

    from attnserve.server import heap

    assert heap.release_after(heap.TRIM_MIN_BYTES - 1) is False
    assert heap.release_after(heap.TRIM_MIN_BYTES) is (platform.libc_ver()[0] == "glibc")
