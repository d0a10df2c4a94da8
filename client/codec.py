"""numpy ⇄ protobuf for the client: the only place tensor bytes are packed or unpacked.

Shared by the sync and asyncio clients, and free of I/O:
    validate_inputs(query, key, value, mask)  -> dict of float32/bool C-contiguous arrays
    build_infer_request(model, inputs, outputs) -> ModelInferRequest (raw_input_contents only)
    parse_infer_response(response, requested)  -> InferResult (raw or typed contents)
    metadata messages -> frozen dataclasses

Arrays in a parsed result are read-only views over the response's bytes (no copy); call
`.copy()` to modify one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np
from attnserve.client.errors import InferenceError
from attnserve.proto import inference_pb2 as pb

from attnserve.contract import DATATYPES as DATATYPES_BY_TENSOR
from attnserve.contract import OUTPUT_NAMES

# The tensor contract's output datatypes; any other output must still carry a known datatype.
OUTPUT_DATATYPES = {name: DATATYPES_BY_TENSOR[name] for name in OUTPUT_NAMES}

# V2 datatype -> (little-endian numpy dtype, InferTensorContents field or None when raw-only).
DATATYPES: dict[str, tuple[np.dtype, str | None]] = {
    "BOOL": (np.dtype("?"), "bool_contents"),
    "UINT8": (np.dtype("u1"), "uint_contents"),
    "UINT16": (np.dtype("<u2"), "uint_contents"),
    "UINT32": (np.dtype("<u4"), "uint_contents"),
    "UINT64": (np.dtype("<u8"), "uint64_contents"),
    "INT8": (np.dtype("i1"), "int_contents"),
    "INT16": (np.dtype("<i2"), "int_contents"),
    "INT32": (np.dtype("<i4"), "int_contents"),
    "INT64": (np.dtype("<i8"), "int64_contents"),
    "FP16": (np.dtype("<f2"), None),
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "FP64": (np.dtype("<f8"), "fp64_contents"),
}
_FLOAT32 = np.dtype("<f4")


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


def _as_float32(name: str, array: Any) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{name}: expected a real-valued array (converted to float32), got dtype {array.dtype}")
    if array.ndim != 3:
        raise ValueError(f"{name}: expected 3 dims (batch, length, width), got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=_FLOAT32)


def _as_mask(array: Any, expected: tuple[int, int, int]) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind == "b":
        keep = array
    elif array.dtype.kind in "iu":
        keep = array != 0  # nonzero = attend, as the eager module reads an integer mask
    else:
        raise ValueError(
            f"mask: expected bool (True = attend, False = masked) or integer 0/1, got dtype {array.dtype}; "
            "additive float masks are not supported"
        )
    b, lq, lk = expected
    if array.shape == expected[1:]:  # one (lq, lk) mask for every item
        keep = np.broadcast_to(keep, expected)
    elif array.ndim == 4 and array.shape[0] == b and array.shape[2:] == (lq, lk):
        # (b, 1, lq, lk) is (b, lq, lk) (what every server takes); (b, heads, lq, lk) goes as it is:
        # the server checks heads against the model (and refuses it where heads differ and its
        # version has no head-mask graphs).
        keep = keep[:, 0] if array.shape[1] == 1 else keep
    elif array.shape != expected:
        raise ValueError(f"mask: expected shape (batch, lq, lk)={expected}, (lq, lk)={expected[1:]} or "
                         f"(batch, 1|heads, lq, lk)=({b}, 1|heads, {lq}, {lk}), got {array.shape}")
    return np.ascontiguousarray(keep, dtype=np.bool_)


# float32's largest finite value: a larger one would become inf and every output NaN.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_values(arrays: Mapping[str, Any], first_item: int = 0) -> int:
    """Refuse what the conversion to float32 / bool would change silently; returns how many values it rounds.

    query, key and value must be real-valued and finite within float32's range (NaN, inf and
    1e39 are refused); a mask must be bool or integers 0/1 (7 and -3 are refused). A refusal is a
    ValueError naming the array, the item (the index along the first axis plus `first_item`) and
    the value. The count is of values float32 rounds (float64's extra digits, integers past 2**24):
    the caller says it once, as a warning.
    """
    rounded = 0
    for name, array in arrays.items():
        if array is None:
            continue
        array = np.asarray(array)
        if name == "mask":
            _check_mask_values(array, first_item)
        else:
            rounded += _check_float32_values(name, array, first_item)
    return rounded


def _where(name: str, array: np.ndarray, bad: np.ndarray, first_item: int) -> tuple[str, Any]:
    """'query of item 7, at [7, 0, 3],' and the value there, for the first True of `bad`."""
    index = np.unravel_index(int(np.argmax(bad)), bad.shape)
    value = array[index].item()
    at = [int(i) for i in index]
    if array.ndim < 3:  # one (lq, lk) mask for every item
        return f"{name}, at {at},", value
    at[0] += first_item
    return f"{name} of item {at[0]}, at {at},", value


def _check_float32_values(name: str, array: np.ndarray, first_item: int) -> int:
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{name}: expected a real-valued array (converted to float32), got dtype {array.dtype}")
    if array.dtype == _FLOAT32 or array.dtype.itemsize <= 2:  # float16 and small integers are exact in float32
        if array.dtype.kind == "f":
            bad = ~np.isfinite(array)
            if bad.any():
                where, value = _where(name, array, bad, first_item)
                raise ValueError(f"{where} is {value}; expected finite numbers")
        return 0
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(_FLOAT32)
    if array.dtype.kind == "f":
        bad = ~np.isfinite(converted)
        if bad.any():
            where, value = _where(name, array, bad, first_item)
            if not np.isfinite(value):
                raise ValueError(f"{where} is {value}; expected finite numbers")
            raise ValueError(f"{where} is {value!r}, beyond float32's range (±{_FLOAT32_MAX:.4g}); "
                             "scale the input into it")
        return int(np.count_nonzero(converted != array))  # compared in the wider type: exact
    return _rounded_integers(array, converted)


def _rounded_integers(array: np.ndarray, converted: np.ndarray) -> int:
    """How many integers float32 changes: those with a set bit below their top 24 (float32's mantissa)."""
    magnitude = np.abs(array).astype(np.uint64)  # abs(int64 min) wraps to itself: 2**63 as uint64
    _, exponent = np.frexp(converted.astype(np.float64))  # the bit length, off by one only where rounded up
    shift = np.maximum(exponent - 24, 0).astype(np.uint64)
    low = magnitude & ((np.uint64(1) << shift) - np.uint64(1))
    return int(np.count_nonzero(low))


def _check_mask_values(array: np.ndarray, first_item: int) -> None:
    if array.dtype.kind == "b":
        return
    if array.dtype.kind not in "iu":
        raise ValueError(
            f"mask: expected bool (True = attend, False = masked) or integer 0/1, got dtype {array.dtype}; "
            "additive float masks are not supported")
    bad = (array != 0) & (array != 1)
    if bad.any():
        where, value = _where("mask", array, bad, first_item)
        raise ValueError(f"{where} is {value}; expected bool (True = attend) or integer 0/1")


def validate_inputs(query: Any, key: Any, value: Any, mask: Any = None) -> dict[str, np.ndarray]:
    """The request's inputs as float32 / bool C-contiguous arrays, or a ValueError naming the problem.

    query (b, lq, query_dim); key and value (b, lk, kv_dim); mask (b, lq, lk), (lq, lk) or
    (b, 1|heads, lq, lk), optional.
    The widths are the model's to check (the server answers INVALID_ARGUMENT naming them).
    """
    inputs = {"query": _as_float32("query", query), "key": _as_float32("key", key),
              "value": _as_float32("value", value)}
    q, k, v = inputs["query"].shape, inputs["key"].shape, inputs["value"].shape
    if not q[0] == k[0] == v[0]:
        raise ValueError(f"batch sizes disagree: query {q[0]}, key {k[0]}, value {v[0]}")
    if k != v:
        raise ValueError(f"key and value must have one shape (batch, lk, kv_dim), got key {k} and value {v}")
    for name, array in inputs.items():
        if 0 in array.shape:
            raise ValueError(f"{name}: every dim must be >= 1, got shape {array.shape}")
    if mask is not None:
        inputs["mask"] = _as_mask(mask, (q[0], q[1], k[1]))
    return inputs


def build_infer_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] = (),
    *,
    model_version: str = "",
    request_id: str = "",
    priority: int = 0,
    timeout_us: int = 0,
) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying every input as raw little-endian bytes (no typed contents).

    `inputs` come from `validate_inputs`; an empty `outputs` asks for every output.
    priority, timeout_us: Triton's schedule policy parameters (1 the highest priority; a timeout
    in the server's queue, in microseconds); 0 sends none (the model's defaults).
    """
    if not model:
        raise ValueError("model name must not be empty")
    for name, number in (("priority", priority), ("timeout_us", timeout_us)):
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**63:
            raise ValueError(f"{name} must be an integer >= 0 (0: the model's default), got {number!r}")
    if len(set(outputs)) != len(outputs):
        raise ValueError(f"outputs listed twice: {list(outputs)}")
    tensors = []
    raw = []
    for name, array in inputs.items():
        datatype = _datatype_of(array.dtype)
        tensors.append(pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=array.shape))
        raw.append(array.tobytes())  # C order; the dtypes above are little-endian
    request = pb.ModelInferRequest(
        model_name=model,
        model_version=model_version,
        id=request_id,
        inputs=tensors,
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in outputs],
        raw_input_contents=raw,
    )
    if priority:  # the parameters' types tritonclient sends
        request.parameters["priority"].uint64_param = priority
    if timeout_us:
        request.parameters["timeout"].int64_param = timeout_us
    return request


def _datatype_of(dtype: np.dtype) -> str:
    for name, (known, _) in DATATYPES.items():
        if dtype == known:
            return name
    raise ValueError(f"no Open Inference Protocol datatype for numpy dtype {dtype}")


def request_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    """Bytes of tensor data a request carries (its size on the wire, give or take a few hundred)."""
    return sum(array.nbytes for array in inputs.values())


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InferResult:
    """A parsed ModelInferResponse: the outputs by name, and which model version computed them."""

    outputs: dict[str, np.ndarray]
    model_name: str = ""
    model_version: str = ""
    id: str = ""


def _malformed(message: str) -> InferenceError:
    return InferenceError(grpc.StatusCode.INTERNAL, f"malformed ModelInferResponse: {message}")


def parse_infer_response(response: pb.ModelInferResponse, requested: Sequence[str] = ()) -> InferResult:
    """The outputs of a response as numpy arrays, checking datatypes, shapes and byte counts.

    Returns the `requested` outputs (all of them when empty); a missing one, an unknown
    datatype or a byte count that does not match the shape raises InferenceError(INTERNAL).
    """
    tensors = list(response.outputs)
    raw = list(response.raw_output_contents)
    if raw and len(raw) != len(tensors):
        raise _malformed(f"{len(tensors)} outputs but {len(raw)} raw_output_contents entries")
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        name = tensor.name
        if name in arrays:
            raise _malformed(f"output {name!r} appears twice")
        if tensor.datatype not in DATATYPES:
            raise _malformed(f"output {name!r} has datatype {tensor.datatype!r}, which this client cannot read")
        expected_datatype = OUTPUT_DATATYPES.get(name)
        if expected_datatype is not None and tensor.datatype != expected_datatype:
            raise _malformed(f"output {name!r}: expected datatype {expected_datatype}, got {tensor.datatype}")
        shape = tuple(tensor.shape)
        if any(dim < 0 for dim in shape):
            raise _malformed(f"output {name!r} has a negative dim in shape {shape}")
        dtype, field_name = DATATYPES[tensor.datatype]
        count = math.prod(shape)
        if raw:
            if tensor.HasField("contents"):
                raise _malformed(f"output {name!r} has typed contents beside raw_output_contents")
            data = raw[index]
            if len(data) != count * dtype.itemsize:
                raise _malformed(
                    f"output {name!r} {tensor.datatype}{list(shape)}: expected {count * dtype.itemsize} bytes, "
                    f"got {len(data)}"
                )
            array = np.frombuffer(data, dtype=dtype).reshape(shape)
        else:
            if field_name is None:
                raise _malformed(f"output {name!r} is {tensor.datatype}, which travels as raw contents only")
            values = getattr(tensor.contents, field_name)
            if len(values) != count:
                raise _malformed(
                    f"output {name!r} {tensor.datatype}{list(shape)}: expected {count} values in "
                    f"contents.{field_name}, got {len(values)}"
                )
            array = np.array(values, dtype=dtype).reshape(shape)
            array.flags.writeable = False  # same as the raw path: results are read-only
        arrays[name] = array
    if requested:
        missing = [name for name in requested if name not in arrays]
        if missing:
            raise _malformed(f"requested outputs {missing} missing; got {sorted(arrays)}")
        arrays = {name: arrays[name] for name in requested}
    return InferResult(arrays, response.model_name, response.model_version, response.id)


def check_output_shapes(outputs: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]) -> None:
    """Outputs must line up with the inputs: `output` (b, lq, *), `attn_probs` (b, *, lq, lk)."""
    b, lq, _ = inputs["query"].shape
    lk = inputs["key"].shape[1]
    output = outputs.get("output")
    if output is not None and (output.ndim != 3 or output.shape[:2] != (b, lq)):
        raise _malformed(f"output: expected shape ({b}, {lq}, out_dim) for this request, got {output.shape}")
    probs = outputs.get("attn_probs")
    if probs is not None and (probs.ndim != 4 or probs.shape[0] != b or probs.shape[2:] != (lq, lk)):
        raise _malformed(f"attn_probs: expected shape ({b}, heads, {lq}, {lk}) for this request, got {probs.shape}")


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"extensions": list(self.extensions)}


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 = variable

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...] = field(default_factory=tuple)
    outputs: tuple[TensorMetadata, ...] = field(default_factory=tuple)

    def input(self, name: str) -> TensorMetadata | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorMetadata | None:
        return next((t for t in self.outputs if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": self.platform,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }


@dataclass(frozen=True)
class ModelStatistics:
    """The counters of Triton's ModelStatistics that tell how much a model computed."""

    name: str
    version: str
    inference_count: int  # items (batch rows) inferred
    execution_count: int  # model executions (batches)
    success_count: int  # successful requests
    fail_count: int  # failed requests
    last_inference_ms: int  # milliseconds since the epoch, 0 = never

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelIndexEntry:
    """One model of the server's repository (Triton's RepositoryIndex)."""

    name: str
    version: str  # the version served; "" when none is loaded
    state: str  # READY or UNAVAILABLE
    reason: str = ""  # why it is not ready

    @property
    def ready(self) -> bool:
        return self.state == "READY"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_repository_index(response: pb.RepositoryIndexResponse) -> list[ModelIndexEntry]:
    return [ModelIndexEntry(m.name, m.version, m.state, m.reason) for m in response.models]


def parse_server_metadata(response: pb.ServerMetadataResponse) -> ServerMetadata:
    return ServerMetadata(response.name, response.version, tuple(response.extensions))


def _tensor_metadata(tensor: pb.ModelMetadataResponse.TensorMetadata) -> TensorMetadata:
    return TensorMetadata(tensor.name, tensor.datatype, tuple(tensor.shape))


def parse_model_metadata(response: pb.ModelMetadataResponse) -> ModelMetadata:
    return ModelMetadata(
        name=response.name,
        versions=tuple(response.versions),
        platform=response.platform,
        inputs=tuple(_tensor_metadata(t) for t in response.inputs),
        outputs=tuple(_tensor_metadata(t) for t in response.outputs),
    )


def parse_model_statistics(response: pb.ModelStatisticsResponse) -> list[ModelStatistics]:
    return [
        ModelStatistics(
            name=stats.name,
            version=stats.version,
            inference_count=stats.inference_count,
            execution_count=stats.execution_count,
            success_count=stats.inference_stats.success.count,
            fail_count=stats.inference_stats.fail.count,
            last_inference_ms=stats.last_inference,
        )
        for stats in response.model_stats
    ]
