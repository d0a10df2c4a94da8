"""REST bodies <-> the protocol's messages: JSON tensors, Triton's binary tensor data extension.

    request, binary = parse_infer(body, header_length, model, version)   # -> pb.ModelInferRequest
    body, header_length = encode_infer(response, binary)                  # pb.ModelInferResponse ->
    as_json(message)                                                      # any other message -> dict

The REST port is a thin adapter: it turns a request body into the same pb.ModelInferRequest a
gRPC client sends, with every input's bytes in raw_input_contents (JSON `data` is converted
here, binary data is sliced out of the body), so codec.decode validates it exactly as it does
a gRPC request. Only what is REST's own is checked here: the JSON's structure, the binary
section's sizes, and that JSON `data` holds numbers (FP32) or true/false (BOOL), as many as the
shape needs. Every error is a ValueError (400, server.errors).

Wire facts: ../shared/reference/open-inference-protocol-rest.md. Elements are little-endian and
row-major; BOOL is one byte, 1 = true.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from attnserve.proto import inference_pb2 as pb
from attnserve.server import scheduling, shm
from attnserve.server.codec import InferResponse, output_bytes
from attnserve.server.quoting import quoted
from attnserve.server.repository import ModelSpec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from attnserve.contract import OUTPUT_NAMES

HEADER_LENGTH = "Inference-Header-Content-Length"
_DTYPES = {"FP32": np.dtype("<f4"), "BOOL": np.dtype("?")}
_KINDS = {"FP32": "fiu", "BOOL": "b"}  # numpy kinds JSON `data` may have: numbers; true/false
_WHAT = {"FP32": "numbers", "BOOL": "true/false"}
_FP32_MAX = float(np.finfo(np.float32).max)
# What a non-finite output value is written as in JSON `data`: the strings of protobuf's JSON
# mapping (bare NaN tokens are not JSON); numpy and tritonclient's as_numpy read them back.
NON_FINITE_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a JSON array, got {type(value).__name__}")
    return value


def _flag(parameters: dict, key: str, what: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{what}: parameter {key!r} must be true or false, got {quoted(value)}")
    return value


def parse_json(text: bytes | memoryview) -> Any:
    try:
        return json.loads(bytes(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the request's JSON does not parse: {err}") from None
    except RecursionError:  # json's scanner recurses once per level
        raise ValueError("the request's JSON is nested too deeply to parse") from None


def json_parse_bytes(text: bytes) -> int:
    """An upper bound of the memory that parsing `text` (a request's JSON) and converting its
    `data` takes at its peak, from its length and the containers and strings it holds:
    json's Python objects cost up to ~11 bytes a byte of numbers, ~100 a list or object, ~70 a
    string (measured, docs/rest-hardening.md)."""
    containers = text.count(b"[") + text.count(b"{")
    return 12 * len(text) + 100 * containers + 36 * text.count(b'"')


def _offending(array: np.ndarray, datatype: str) -> Any:
    """The first value of `array` (JSON `data` that is not all of one allowed kind) that `datatype` does not take."""
    for value in array.ravel():
        value = value.item() if isinstance(value, np.generic) else value
        if datatype == "BOOL" and isinstance(value, bool):
            continue
        if datatype == "FP32" and isinstance(value, float):
            continue
        if datatype == "FP32" and isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**64:
            continue
        return value
    return array.ravel()[0]


def _json_bytes(data: Any, name: str, datatype: str, count: int) -> bytes:
    """JSON `data` (flat or nested, row-major) as the tensor's little-endian bytes. FP32 data must
    be finite numbers within float32's range: JSON has no NaN or Infinity (json reads them, and
    1e999 as inf), and a larger number would silently become inf."""
    if not isinstance(data, list):
        raise ValueError(f"input {name!r}: data must be a JSON array of {_WHAT[datatype]}, got {quoted(data)}")
    try:
        array = np.asarray(data)
    except (ValueError, RecursionError):  # ragged nesting
        raise ValueError(f"input {name!r}: data is not a regular array (ragged nested lists)") from None
    if array.size and array.dtype.kind not in _KINDS[datatype]:
        value = _offending(array, datatype)
        # beyond 64 bits: numpy keeps it an object
        if datatype == "FP32" and isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"input {name!r}: FP32 data must be numbers within float32's range, got the integer "
                             f"{quoted(value, 40)}")
        raise ValueError(f"input {name!r}: {datatype} data must be {_WHAT[datatype]}, got {quoted(value)}")
    if array.size != count:
        raise ValueError(f"input {name!r}: its shape needs {count} values in data, got {array.size}")
    with np.errstate(over="ignore"):  # too large for float32: inf, refused just below
        tensor = np.ascontiguousarray(array, dtype=_DTYPES[datatype])
    if datatype == "FP32" and not np.isfinite(tensor).all():
        index = int(np.flatnonzero(~np.isfinite(tensor.ravel()))[0])
        raise ValueError(f"input {name!r}: FP32 data must be finite numbers within float32's range "
                         f"(|x| <= {_FP32_MAX:.7g}), got {array.ravel()[index].item()!r} at index {index} "
                         "(NaN and Infinity are not JSON: send non-finite values as binary data)")
    return tensor.tobytes()


def _shape(value: Any, name: str) -> list[int]:
    shape = _list(value, f"input {name!r}: shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
        raise ValueError(f"input {name!r}: shape must be non-negative integers, got {quoted(shape)}")
    return shape


def parse_infer(body: bytes, header_length: int | None, model_name: str, model_version: str,
                max_json_bytes: int | None = None) -> tuple[pb.ModelInferRequest, dict[str, bool]]:
    """A REST inference body -> (the request, output name -> answer it binary). header_length:
    the Inference-Header-Content-Length header (None: the whole body is JSON). An output not in
    the map follows the request's `binary_data_output` (the map's key ""). max_json_bytes: the
    most JSON text it may have (--max-json-bytes; json parses it on the event loop), refused
    before it is parsed."""
    view = memoryview(body)
    if header_length is None:
        header_length = len(body)
    if not 0 <= header_length <= len(body):
        raise ValueError(f"{HEADER_LENGTH} is {header_length}, but the body has {len(body)} bytes")
    if max_json_bytes is not None and header_length > max_json_bytes:
        raise ValueError(f"the request has {header_length:,} bytes of JSON, over the {max_json_bytes:,}-byte limit "
                         "(--max-json-bytes); send large tensors as binary data (parameters.binary_data_size, "
                         "the bytes after the JSON)")
    document = _object(parse_json(view[:header_length]), "the request")
    binary = view[header_length:]

    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version)
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise ValueError(f"id must be a string, got {quoted(request_id)}")
    request.id = request_id
    parameters = _object(document.get("parameters", {}), "parameters")
    binary_all = _flag(parameters, "binary_data_output", "the request")
    for key in scheduling.SCHEDULE_PARAMETERS:  # checked where gRPC's are (server.scheduling)
        if key in parameters:
            _schedule_parameter(parameters[key], request.parameters[key], key)

    offset = 0
    for entry in _list(document.get("inputs", []), "inputs"):
        entry = _object(entry, "each input")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"each input needs a string name, got {quoted(name)}")
        datatype = entry.get("datatype")
        if not isinstance(datatype, str):
            raise ValueError(f"input {name!r}: datatype must be a string, got {quoted(datatype)}")
        shape = _shape(entry.get("shape"), name)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        input_parameters = _object(entry.get("parameters", {}), f"input {name!r}: parameters")
        size = input_parameters.get("binary_data_size")
        if _shm_parameters(input_parameters, tensor.parameters, f"input {name!r}"):
            if "data" in entry or size is not None:
                raise ValueError(f"input {name!r}: has {shm.REGION} and data or binary_data_size; use one")
        elif size is not None:
            if "data" in entry:
                raise ValueError(f"input {name!r}: has data and binary_data_size; use one")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"input {name!r}: binary_data_size must be a non-negative integer, got {quoted(size)}")
            if offset + size > len(binary):
                raise ValueError(f"input {name!r}: binary_data_size {size} runs past the body's binary section "
                                 f"({len(binary)} bytes, {offset} taken by the inputs before it)")
            request.raw_input_contents.append(binary[offset:offset + size].tobytes())
            offset += size
        elif "data" in entry:
            if datatype not in _DTYPES:  # codec.decode names the datatype the input needs
                request.raw_input_contents.append(b"")
                continue
            request.raw_input_contents.append(_json_bytes(entry["data"], name, datatype, math.prod(shape)))
        else:
            raise ValueError(f"input {name!r}: no data (give data, or binary_data_size and the bytes)")
    if offset != len(binary):
        raise ValueError(f"the body has {len(binary)} bytes of binary data after its JSON, the inputs' "
                         f"binary_data_size take {offset}")

    binary_outputs = {"": binary_all}
    for entry in _list(document.get("outputs", []), "outputs"):
        entry = _object(entry, "each output")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"each output needs a string name, got {quoted(name)}")
        output = request.outputs.add(name=name)
        output_parameters = _object(entry.get("parameters", {}), f"output {name!r}: parameters")
        _shm_parameters(output_parameters, output.parameters, f"output {name!r}")
        binary_outputs[name] = _flag(output_parameters, "binary_data", f"output {name!r}") or binary_all
    return request, binary_outputs


def _schedule_parameter(value: Any, into: pb.InferParameter, key: str) -> None:
    """A JSON `priority` or `timeout` as the InferParameter a gRPC client would send; a value of
    another type keeps its type, for server.scheduling to refuse with the gRPC wording."""
    if isinstance(value, bool):
        into.bool_param = value
    elif isinstance(value, int) and -2**63 <= value < 2**63:
        into.int64_param = value
    elif isinstance(value, int) and 0 <= value < 2**64:
        into.uint64_param = value
    elif isinstance(value, str):
        into.string_param = value
    elif isinstance(value, float):
        into.double_param = value
    else:
        if isinstance(value, int):  # beyond 64 bits: refused as gRPC's would be where it can say why
            scheduling.check_parameter_int(key, value)
        raise ValueError(f"parameter {key!r} must be an integer, got {quoted(value)}")


def _shm_parameters(parameters: dict, into, what: str) -> bool:
    """Copy a tensor's shared memory parameters (server.shm) from JSON into the request's
    InferParameter map; whether it names a region. server.shm.placement checks them further."""
    named = False
    for key in (shm.REGION, shm.OFFSET, shm.BYTE_SIZE):
        if key not in parameters:
            continue
        value = parameters[key]
        if key == shm.REGION:
            if not isinstance(value, str):
                raise ValueError(f"{what}: {key} must be a string, got {quoted(value)}")
            into[key].string_param = value
            named = True
        else:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ValueError(f"{what}: {key} must be a non-negative integer, got {quoted(value)}")
            into[key].int64_param = value
    return named


def parse_shm_register(parsed: object, region: str) -> dict[str, Any]:
    """A system shared memory register body, parsed: {"key": str, "offset": int, "byte_size": int}."""
    document = _object(parsed, "the register request")
    key = document.get("key")
    if not isinstance(key, str):
        raise ValueError(f"shared memory region {region!r}: key must be a string, got {quoted(key)}")
    numbers = {}
    for field, default in (("offset", 0), ("byte_size", None)):
        value = document.get(field, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
            raise ValueError(f"shared memory region {region!r}: {field} must be an unsigned 64-bit integer, "
                             f"got {quoted(value)}")
        numbers[field] = value
    return {"key": key, **numbers}


# The most text json writes for one float32 value (as a double: "-1.0000000149011612e-05,").
JSON_VALUE_BYTES = 24


def check_json_answer(request: pb.ModelInferRequest, spec: ModelSpec, binary_outputs: dict[str, bool],
                      max_json_bytes: int) -> None:
    """Refuse, before it is computed, a request whose answer's JSON `data` could be over
    max_json_bytes (--max-json-bytes; json writes it on the event loop),
    counted at JSON_VALUE_BYTES a value. Shapes that are not the contract's are left to
    codec.decode, which names what is wrong."""
    if all(binary_outputs.values()):  # every output answered binary: no JSON data to bound
        return
    shapes = {t.name: tuple(t.shape) for t in request.inputs}
    if any(len(shapes.get(name, ())) != 3 for name in ("query", "key")):
        return
    sizes = output_bytes(shapes, spec)
    names = [o.name for o in request.outputs if shm.REGION not in o.parameters] if request.outputs else list(
        OUTPUT_NAMES)
    text = [name for name in names if name in sizes and not binary_outputs.get(name, binary_outputs[""])]
    values = sum(sizes[name] // 4 for name in text)
    if values * JSON_VALUE_BYTES > max_json_bytes:
        raise ValueError(f"the answer would write {values:,} values ({', '.join(text)}) as JSON data, up to "
                         f"{values * JSON_VALUE_BYTES:,} bytes of text, over the {max_json_bytes:,}-byte limit "
                         "(--max-json-bytes); ask for binary outputs (parameters.binary_data or "
                         "binary_data_output), or for `output` alone")


def encode_infer(answer: InferResponse, binary_outputs: dict[str, bool]) -> tuple[bytes, int | None]:
    """The answer's body, and its Inference-Header-Content-Length (None: all JSON). The answer
    has raw outputs (parse_infer's requests are raw), one per output: as arrays still (a large
    answer: server.codec.encode leaves them out of the message) or in the message."""
    response = answer.message
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    outputs, tail = [], []
    for tensor, raw in zip(response.outputs, answer.raw_output_contents or response.raw_output_contents, strict=True):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if shm.REGION in tensor.parameters:  # its bytes are in the caller's region (server.shm)
            entry["parameters"] = {key: getattr(p, p.WhichOneof("parameter_choice"))
                                   for key, p in tensor.parameters.items()}
        elif binary_outputs.get(tensor.name, binary_outputs[""]):
            entry["parameters"] = {"binary_data_size": memoryview(raw).nbytes}
            tail.append(raw)
        else:
            entry["data"] = _json_data(np.frombuffer(raw, dtype=_DTYPES[tensor.datatype]))
        outputs.append(entry)
    document["outputs"] = outputs
    head = json.dumps(document, separators=(",", ":")).encode()
    if not tail:
        return head, None
    return b"".join([head, *tail]), len(head)


def _json_data(array: np.ndarray) -> list:
    """An output's values for JSON `data`; non-finite ones as NON_FINITE_JSON's strings."""
    values = array.tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        for index in np.flatnonzero(~np.isfinite(array)).tolist():
            values[index] = NON_FINITE_JSON[repr(values[index])]
    return values


def as_json(message: Message) -> dict[str, Any]:
    """A message as Triton's REST port writes it: field names as in the .proto, every field (the
    defaults too), enums by name, and 64-bit integers as JSON numbers (protobuf's own JSON
    mapping writes them as strings, which perf_analyzer does not read)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.label == FieldDescriptor.LABEL_REPEATED:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return as_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    return value
