"""Protobuf <-> numpy for ModelInfer: the only place tensor bytes are decoded and encoded.

decode() validates a request against its model before anything large is allocated (names,
datatypes, ranks, widths, batch and length agreement, byte counts, limits) and raises ValueError
with the tensor's name and the expectation; a bad request therefore fails alone, before it can
join a batch. Raw contents are wrapped with np.frombuffer, without a copy.

Typed contents (`fp32_contents`, `bool_contents`) never become Python objects: they are read
from, and written as, their packed wire bytes by protobuf's C code (a 63 MB typed answer built
with `tolist()` held the event loop for 0.6 s, every other client stalled behind it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnserve.proto import inference_pb2 as pb
from attnserve.server.batcher import Result, Work
from attnserve.contract import DATATYPES, INPUT_NAMES, OUTPUT_NAMES, REQUIRED_INPUTS
from attnserve.server.echo import echo
from attnserve.server.repository import ModelSpec

# Little-endian on the wire, whatever this machine is.
_DTYPES = {"FP32": np.dtype("<f4"), "BOOL": np.dtype("?")}
_EXPECTED_DATATYPE = {name: DATATYPES[name] for name in INPUT_NAMES}
_TYPED_FIELD = {"FP32": "fp32_contents", "BOOL": "bool_contents"}
_REQUIRED = REQUIRED_INPUTS


@dataclass(frozen=True)
class Limits:
    max_q_len: int
    max_kv_len: int
    max_attention_bytes: int  # B * H * Lq * Lk * 4 for one request
    max_response_bytes: int | None = None  # the gRPC send limit: the answer must fit in it


@dataclass(slots=True)
class Decoded:
    work: Work
    outputs: tuple[str, ...]  # requested outputs, in response order
    raw: bool  # answer in raw_output_contents


def decode(request: pb.ModelInferRequest, spec: ModelSpec, limits: Limits) -> Decoded:
    inputs = request.inputs
    names = [t.name for t in inputs]
    unknown = [n for n in names if n not in INPUT_NAMES]
    if unknown:
        raise ValueError(f"unknown input {echo(unknown[0])}; model {spec.name} takes {list(INPUT_NAMES)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"input {duplicates[0]!r} given more than once")
    missing = [n for n in _REQUIRED if n not in names]
    if missing:
        raise ValueError(f"missing input {missing[0]!r}; required: {list(_REQUIRED)}, optional: ['mask']")

    raw = len(request.raw_input_contents) > 0
    if raw and len(request.raw_input_contents) != len(inputs):
        raise ValueError(f"raw_input_contents has {len(request.raw_input_contents)} entries for {len(inputs)} inputs")

    # Shapes first: every check below is arithmetic on them, nothing is allocated yet.
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in inputs:
        want = _EXPECTED_DATATYPE[tensor.name]
        if tensor.datatype != want:
            raise ValueError(f"input {tensor.name!r}: expected datatype {want}, got {echo(tensor.datatype)}")
        shape = tuple(tensor.shape)
        if len(shape) != 3:
            raise ValueError(f"input {tensor.name!r}: expected rank 3, got shape {echo(list(shape))}")
        if any(d < 0 for d in shape):
            raise ValueError(f"input {tensor.name!r}: negative dimension in shape {list(shape)}")
        shapes[tensor.name] = shape
    _check_shapes(shapes, spec, limits)
    outputs = _requested_outputs(request, spec)
    _check_response_size(request, shapes, outputs, spec, limits)

    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(inputs):
        shape = shapes[tensor.name]
        dtype = _DTYPES[tensor.datatype]
        count = math.prod(shape)
        if raw:
            if tensor.HasField("contents"):
                raise ValueError(f"input {tensor.name!r}: has typed contents and raw_input_contents; use one")
            data = request.raw_input_contents[index]
            if len(data) != count * dtype.itemsize:
                raise ValueError(f"input {tensor.name!r}: shape {list(shape)} {tensor.datatype} needs "
                                 f"{count * dtype.itemsize} bytes, raw_input_contents has {len(data)}")
            if tensor.datatype == "BOOL":
                _check_bool_bytes(tensor.name, data)
            array = np.frombuffer(data, dtype=dtype).reshape(shape)
        else:
            values = getattr(tensor.contents, _TYPED_FIELD[tensor.datatype])
            if len(values) != count:
                raise ValueError(f"input {tensor.name!r}: shape {list(shape)} needs {count} values in "
                                 f"contents.{_TYPED_FIELD[tensor.datatype]}, got {len(values)}")
            array = _typed_values(tensor.contents, tensor.datatype, count).reshape(shape)
        arrays[tensor.name] = array.astype(np.float32, copy=False) if tensor.datatype == "FP32" else array

    work = Work(arrays["query"], arrays["key"], arrays["value"], arrays.get("mask"),
                want_probs="attn_probs" in outputs)
    return Decoded(work=work, outputs=outputs, raw=raw)


def _check_bool_bytes(name: str, data: bytes) -> None:
    """The protocol's BOOL is one byte, 1 = true, 0 = false: any other byte is not a BOOL (and
    numpy would read it as some truth value of its own, silently)."""
    octets = np.frombuffer(data, dtype=np.uint8)
    if octets.size and octets.max() > 1:
        first = int(np.argmax(octets > 1))
        raise ValueError(f"input {name!r}: BOOL bytes must be 0 or 1; byte {first} is 0x{int(octets[first]):02X}")


def _check_shapes(shapes: dict[str, tuple[int, ...]], spec: ModelSpec, limits: Limits) -> None:
    b, lq, q_width = shapes["query"]
    widths = {"query": spec.query_dim, "key": spec.kv_dim, "value": spec.kv_dim}
    for name, want in widths.items():
        if shapes[name][2] != want:
            raise ValueError(f"input {name!r}: expected shape [batch, length, {want}], got {list(shapes[name])}")
    for name in ("key", "value"):
        if shapes[name][0] != b:
            raise ValueError(f"input {name!r}: batch size {shapes[name][0]} disagrees with query's {b}")
    lk = shapes["key"][1]
    if shapes["value"][1] != lk:
        raise ValueError(f"input 'value': length {shapes['value'][1]} disagrees with key's {lk}")
    if "mask" in shapes and shapes["mask"] != (b, lq, lk):
        raise ValueError(f"input 'mask': expected shape [batch, q_len, k_len] = {[b, lq, lk]}, got {list(shapes['mask'])}")
    if b < 1 or lq < 1 or lk < 1:
        raise ValueError(f"batch, q_len and k_len must be >= 1, got {b}, {lq}, {lk}")
    if lq > limits.max_q_len:
        raise ValueError(f"input 'query': length {lq} exceeds this model's max_q_len {limits.max_q_len}")
    if lk > limits.max_kv_len:
        raise ValueError(f"input 'key': length {lk} exceeds this model's max_kv_len {limits.max_kv_len}")
    attention_bytes = b * spec.num_heads * lq * lk * 4
    if attention_bytes > limits.max_attention_bytes:
        raise ValueError(f"request needs a {attention_bytes:,}-byte attention matrix (batch {b} x {spec.num_heads} "
                         f"heads x {lq} x {lk} x 4); the limit is {limits.max_attention_bytes:,} bytes")


# Room for what a response holds besides tensor bytes: names, shapes, datatypes, field tags.
_RESPONSE_OVERHEAD_BYTES = 4096


def _check_response_size(request: pb.ModelInferRequest, shapes: dict[str, tuple[int, ...]],
                         outputs: tuple[str, ...], spec: ModelSpec, limits: Limits) -> None:
    """Refuse up front a request whose answer could not be sent (over the message limit)."""
    if limits.max_response_bytes is None:
        return
    b, lq, _ = shapes["query"]
    lk = shapes["key"][1]
    sizes = {"output": b * lq * spec.out_dim * 4, "attn_probs": b * spec.num_heads * lq * lk * 4}
    needed = sum(sizes[name] for name in outputs)
    total = needed + len(request.id) + len(request.model_name) + _RESPONSE_OVERHEAD_BYTES
    if total > limits.max_response_bytes:
        parts = " + ".join(f"{name} {sizes[name]:,}" for name in outputs)
        raise ValueError(f"the response would need {total:,} bytes ({parts} bytes of tensors), over the "
                         f"{limits.max_response_bytes:,}-byte message limit (--max-message-bytes); ask for fewer "
                         f"rows, shorter sequences, or only the outputs you need")


def _requested_outputs(request: pb.ModelInferRequest, spec: ModelSpec) -> tuple[str, ...]:
    if not request.outputs:
        return OUTPUT_NAMES  # the protocol: no outputs named means all of them
    names = [o.name for o in request.outputs]
    for name in names:
        if name not in OUTPUT_NAMES:
            raise ValueError(f"unknown output {echo(name)}; model {spec.name} has {list(OUTPUT_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"output requested more than once: {echo(names)}")
    return tuple(names)


def encode(request: pb.ModelInferRequest, decoded: Decoded, result: Result, version: int
           ) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    for name in decoded.outputs:
        array = result.output if name == "output" else result.attn_probs
        tensor = response.outputs.add(name=name, datatype="FP32", shape=array.shape)
        if decoded.raw:
            response.raw_output_contents.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
        else:
            tensor.contents.MergeFromString(_packed_field(_FP32_FIELD, np.ascontiguousarray(array, dtype="<f4")))
    return response


_FIELD_NUMBER = {name: pb.InferTensorContents.DESCRIPTOR.fields_by_name[field].number
                 for name, field in _TYPED_FIELD.items()}
_FP32_FIELD = _FIELD_NUMBER["FP32"]
_LENGTH_DELIMITED = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _packed_field(number: int, array: np.ndarray) -> bytes:
    """A packed repeated field on the wire: tag, length, the values' little-endian bytes."""
    data = array.tobytes()
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(len(data)) + data


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _typed_values(contents: pb.InferTensorContents, datatype: str, count: int) -> np.ndarray:
    """The values of contents' typed field for `datatype`, from their packed wire bytes (protobuf
    writes repeated scalars packed): no Python object per value. BOOL values are varints of 0 or
    1, one byte each."""
    wanted = _FIELD_NUMBER[datatype]
    data = contents.SerializeToString()
    chunks = []
    at = 0
    while at < len(data):
        tag, at = _read_varint(data, at)
        wire_type = tag & 7
        if wire_type == _LENGTH_DELIMITED:
            length, at = _read_varint(data, at)
            if tag >> 3 == wanted:
                chunks.append(data[at:at + length])
            at += length
        elif wire_type == 0:
            _, at = _read_varint(data, at)
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"contents: unexpected wire type {wire_type}")
    raw = b"".join(chunks)
    if datatype == "BOOL":
        octets = np.frombuffer(raw, dtype=np.uint8)
        if octets.size != count:  # a value other than 0 or 1 took more than one byte
            raise ValueError(f"contents.bool_contents: expected {count} one-byte values, got {octets.size} bytes")
        return octets.astype(np.bool_)
    return np.frombuffer(raw, dtype=_DTYPES[datatype])
