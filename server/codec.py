"""Protobuf <-> numpy for ModelInfer: the only place tensor bytes are decoded and encoded.

decode() validates a request against its model before anything large is allocated (names,
datatypes, ranks, widths, batch and length agreement, byte counts, limits) and raises ValueError
with the tensor's name and the expectation; a bad request therefore fails alone, before it can
join a batch. Raw contents are wrapped with np.frombuffer, without a copy. The attention-matrix
bound is checked last, against the graph that will run the request (server.graphs), once its
mask is read.

Typed contents (`fp32_contents`, `bool_contents`) never become Python objects: they are read
from, and written as, their packed wire bytes (attnserve.proto.wire; a typed answer built with
`tolist()` held the event loop, and every other client behind it, for a large one). Large raw
contents (a message of WIRE_MIN_BYTES or more) skip protobuf's copies: InferRequest,
InferResponse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import wire
from attnserve.server import shm
from attnserve.server.graphs import HEADS, UNFUSED, GraphSet, attention_bytes
from attnserve.server.memory import heap
from attnserve.server.memory.budget import Reservation
from attnserve.server.quoting import quoted
from attnserve.server.repository import ModelSpec
from attnserve.server.tensors import Result, Work

from attnserve.contract import (
    ALL_OUTPUTS,
    DATATYPES,
    FUSED,
    FUSED_KEY_PADDING,
    GRAPH_HEAD_MASK,
    HEAD_MASK_ALL_OUTPUTS,
    HEAD_MASK_OUTPUT_ONLY,
    INPUT_NAMES,
    OUTPUT_NAMES,
    OUTPUT_ONLY,
    REQUIRED_INPUTS,
)

# Little-endian on the wire, whatever this machine is.
_DTYPES = {"FP32": np.dtype("<f4"), "BOOL": np.dtype("?")}
_EXPECTED_DATATYPE = {name: DATATYPES[name] for name in INPUT_NAMES}
_TYPED_FIELD = {"FP32": "fp32_contents", "BOOL": "bool_contents"}
_REQUIRED = REQUIRED_INPUTS
_RANKS = {"mask": (2, 3, 4)}  # contract.MASK_SHAPES; every other input is rank 3


@dataclass(frozen=True)
class Limits:
    max_q_len: int
    max_kv_len: int
    # B * H * Lq * Lk * 4 for one request, in the graph that will run it: the fused graph without
    # a mask (flash attention) holds no attention matrix, so this bound never refuses its runs.
    max_attention_bytes: int
    max_response_bytes: int | None = None  # the gRPC send limit: the answer must fit in it
    # Tensor bytes typed contents may hold, a request's and its answer's (--max-typed-bytes):
    # they are parsed and built on the event loop; larger ones must be raw.
    max_typed_bytes: int | None = None
    # The graphs the model can run (its Engine's); UNFUSED: every run holds the whole matrix.
    graphs: GraphSet = UNFUSED


@dataclass(frozen=True, slots=True)
class ShmOutput:
    """An output the caller placed in shared memory (server.shm): where, its shape, and the writer
    the batch's thread writes it with (Work.write_to)."""

    placement: shm.Placement
    shape: tuple[int, ...]
    writer: shm.RegionWriter


@dataclass(slots=True)
class Decoded:
    work: Work
    outputs: tuple[str, ...]  # requested outputs, in response order
    raw: bool  # answer in raw_output_contents
    # Outputs the caller placed in shared memory, by name.
    shm_outputs: dict[str, ShmOutput] = field(default_factory=dict)

    def shm_refusal(self) -> shm.SharedMemoryError | None:
        """Why an output could not be written into its region (the object shrunk), if one could not."""
        return next((o.writer.error for o in self.shm_outputs.values() if o.writer.error is not None), None)


def decode(request: pb.ModelInferRequest, spec: ModelSpec, limits: Limits,
           regions: shm.Lease | None = None) -> Decoded:
    """regions: the request's lease on the registered shared memory regions (None: the
    extension is off), for tensors whose parameters name one (server.shm)."""
    inputs = request.inputs
    names = [t.name for t in inputs]
    unknown = [n for n in names if n not in INPUT_NAMES]
    if unknown:
        raise ValueError(f"unknown input {quoted(unknown[0])}; model {spec.name} takes {list(INPUT_NAMES)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"input {duplicates[0]!r} given more than once")
    missing = [n for n in _REQUIRED if n not in names]
    if missing:
        raise ValueError(f"missing input {missing[0]!r}; required: {list(_REQUIRED)}, optional: ['mask']")

    placements = {t.name: shm.placement(t.parameters, f"input {t.name!r}") for t in inputs}
    out_placements = {o.name: shm.placement(o.parameters, f"output {o.name!r}") for o in request.outputs}
    in_shm = [n for n, p in placements.items() if p is not None]
    out_shm = {n for n, p in out_placements.items() if p is not None}
    if (in_shm or out_shm) and regions is None:
        raise shm.SharedMemoryError(f"{'input' if in_shm else 'output'} {(in_shm or sorted(out_shm))[0]!r} names a "
                                    f"{shm.REGION}, but {shm.WHY_OFF}")
    # Raw entries belong to the inputs not in shared memory, in order (Triton's rule); a request
    # with inputs in shared memory is answered raw, as Triton answers (tritonclient reads only that).
    plain = len(inputs) - len(in_shm)
    raw = len(request.raw_input_contents) > 0 or (bool(in_shm) and not any(t.HasField("contents") for t in inputs))
    if request.raw_input_contents and len(request.raw_input_contents) != plain:
        raise ValueError(f"raw_input_contents has {len(request.raw_input_contents)} entries for {plain} inputs"
                         + (f" (not counting {len(in_shm)} in shared memory)" if in_shm else ""))

    # Shapes first: every check below is arithmetic on them, nothing is allocated yet.
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in inputs:
        want = _EXPECTED_DATATYPE[tensor.name]
        if tensor.datatype != want:
            raise ValueError(f"input {tensor.name!r}: expected datatype {want}, got {quoted(tensor.datatype)}")
        shape = tuple(tensor.shape)
        if len(shape) not in _RANKS.get(tensor.name, (3,)):
            ranks = " or ".join(map(str, _RANKS.get(tensor.name, (3,))))
            hint = f" ({_mask_shapes(spec)})" if tensor.name == "mask" else ""
            raise ValueError(f"input {tensor.name!r}: expected rank {ranks}{hint}, got shape {quoted(list(shape))}")
        if any(d < 0 for d in shape):
            raise ValueError(f"input {tensor.name!r}: negative dimension in shape {list(shape)}")
        shapes[tensor.name] = shape
    _check_shapes(shapes, spec, limits)
    outputs = _requested_outputs(request, spec)
    sent = tuple(name for name in outputs if name not in out_shm)  # in the answer itself
    _check_response_size(request, shapes, sent, spec, limits)
    if not raw:
        _check_typed_size({n: s for n, s in shapes.items() if placements[n] is None}, sent, spec, limits)

    arrays: dict[str, np.ndarray] = {}
    index = 0  # into raw_input_contents
    for tensor in inputs:
        shape = shapes[tensor.name]
        dtype = _DTYPES[tensor.datatype]
        count = math.prod(shape)
        placement = placements[tensor.name]
        if tensor.HasField("contents"):
            _check_contents_fields(tensor)
        if placement is not None:
            if tensor.HasField("contents"):
                raise ValueError(f"input {tensor.name!r}: has typed contents and a {shm.REGION}; use one")
            data = regions.input(placement, count * dtype.itemsize, f"input {tensor.name!r}")  # read: one copy
            if tensor.datatype == "BOOL":
                _check_bool_bytes(tensor.name, data)
            array = np.frombuffer(data, dtype=dtype).reshape(shape)
        elif raw:
            if tensor.HasField("contents"):
                raise ValueError(f"input {tensor.name!r}: has typed contents and raw_input_contents; use one")
            data = request.raw_input_contents[index]
            index += 1
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
    if work.masking == HEADS and not limits.graphs.takes_head_masks:
        raise ValueError(heads_differ_refusal(spec))
    _check_attention_bytes(work, spec, limits)
    # The batch's thread writes these there (server.tensors.compute_batch): the answer has no copy to make.
    out_shapes = output_shapes(shapes, spec)
    shm_outputs = {}
    for name in outputs:
        if name in out_shm:
            nbytes = 4 * math.prod(out_shapes[name])
            writer = regions.output(out_placements[name], nbytes, f"output {name!r}")
            shm_outputs[name] = ShmOutput(out_placements[name], out_shapes[name], writer)
    if shm_outputs:  # the run (or the split) fills each writer's buffer, which its writer writes out
        buffers = {name: np.frombuffer(placed.writer.buffer, dtype=_DTYPES["FP32"]).reshape(placed.shape)
                   for name, placed in shm_outputs.items()}
        work.output_into, work.probs_into = buffers.get("output"), buffers.get("attn_probs")
        work.write_to = {name: placed.writer for name, placed in shm_outputs.items()}
    return Decoded(work=work, outputs=outputs, raw=raw, shm_outputs=shm_outputs)


# Why a graph holds the attention matrix, for the message that refuses a request over the bound.
_WHY_HELD = {
    HEAD_MASK_ALL_OUTPUTS: "its mask differs by head, and it asks for attn_probs",
    HEAD_MASK_OUTPUT_ONLY: "its mask differs by head: the unfused head-mask graph runs it",
    ALL_OUTPUTS: "it asks for attn_probs",
    OUTPUT_ONLY: "the unfused graph runs it",
    FUSED_KEY_PADDING: "its key mask runs on the fused key padding graph, which holds every score",
}


def _check_attention_bytes(work: Work, spec: ModelSpec, limits: Limits) -> None:
    """The attention matrix of the graph this request would run alone (server.graphs): the
    unfused graphs and the key padding one hold B*H*Lq*Lk*4 bytes, flash attention none. (Its
    mask is read first: whether it is the same for every query row decides the graph.)"""
    b, lq, lk = work.rows, work.q_len, work.k_len
    kind = limits.graphs.graph_for(work.masking, work.want_probs, lq, lk)
    needed = attention_bytes(kind, b, spec.num_heads, lq, lk)
    if needed > limits.max_attention_bytes:
        hint = _flash_hint(limits.graphs)
        raise ValueError(f"request needs a {needed:,}-byte attention matrix (batch {b} x {spec.num_heads} "
                         f"heads x {lq} x {lk} x 4: {_WHY_HELD.get(kind, kind)}); the limit is "
                         f"{limits.max_attention_bytes:,} bytes{hint}")


def _flash_hint(graphs: GraphSet) -> str:
    return (" (without a mask and asking for `output` alone it would run on flash attention, which holds none)"
            if FUSED in graphs.kinds else "")


# The graphs that hold an attention matrix, in the order the native plane takes their words (its `Held`).
NATIVE_HELD_ORDER = (HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_OUTPUT_ONLY, ALL_OUTPUTS, OUTPUT_ONLY, FUSED_KEY_PADDING)


def native_graph_terms(graphs: GraphSet) -> dict:
    """What the native plane needs to bound a request's attention matrix as _check_attention_bytes
    does (plane.set_graphs): each fused graph's crossover (-1: not loaded), whether the unfused
    output-only graph is loaded, and this module's words for each graph that holds the matrix."""
    def crossover(kind: str) -> int:
        return graphs.crossover.get(kind, 0) if kind in graphs.kinds else -1

    return {"fused_from": crossover(FUSED), "fused_key_padding_from": crossover(FUSED_KEY_PADDING),
            "output_only": OUTPUT_ONLY in graphs.kinds,
            "why_held": [_WHY_HELD[kind] for kind in NATIVE_HELD_ORDER], "flash_hint": _flash_hint(graphs)}


def _check_contents_fields(tensor: pb.ModelInferRequest.InferInputTensor) -> None:
    """An input's typed contents hold its datatype's field alone: another (bytes_contents, int64_contents,
    ...) would otherwise be ignored, or read as what it is not. The first such, in field order, is
    named (the native data plane answers the same words)."""
    own = _TYPED_FIELD[tensor.datatype]
    for carried, _ in tensor.contents.ListFields():
        if carried.name != own:
            raise ValueError(f"input {tensor.name!r}: contents.{carried.name} is not for datatype {tensor.datatype}: "
                             f"its values go in contents.{own} or raw_input_contents")


_BOOL_TRANSLATE_MAX_BYTES = 4096  # where bytes.translate and numpy's max cost the same


def _check_bool_bytes(name: str, data: bytes) -> None:
    """The protocol's BOOL is one byte, 1 = true, 0 = false: any other byte is not a BOOL (and
    numpy would read it as some truth value of its own, silently). A small mask is checked by
    bytes.translate (numpy's max has a reduction's fixed cost, on the event loop for every
    request); a large one by numpy (its max is the faster there)."""
    if len(data) < _BOOL_TRANSLATE_MAX_BYTES and isinstance(data, bytes) and not data.translate(None, b"\x00\x01"):
        return
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
    if "mask" in shapes and shapes["mask"] not in ((lq, lk), (b, lq, lk), (b, 1, lq, lk), (b, spec.num_heads, lq, lk)):
        raise ValueError(f"input 'mask': expected shape {_mask_shapes(spec, b, lq, lk)}, got {list(shapes['mask'])}")
    if b < 1 or lq < 1 or lk < 1:
        raise ValueError(f"batch, q_len and k_len must be >= 1, got {b}, {lq}, {lk}")
    if lq > limits.max_q_len:
        raise ValueError(f"input 'query': length {lq} exceeds this model's max_q_len {limits.max_q_len}")
    if lk > limits.max_kv_len:
        raise ValueError(f"input 'key': length {lk} exceeds this model's max_kv_len {limits.max_kv_len}")


def _mask_shapes(spec: ModelSpec, b: int | None = None, lq: int | None = None, lk: int | None = None) -> str:
    """The mask shapes this model takes (contract.MASK_SHAPES), with this request's sizes if known."""
    h = spec.num_heads
    forms = ["[batch, q_len, k_len]", "[q_len, k_len]", "[batch, 1, q_len, k_len]", f"[batch, {h}, q_len, k_len]"]
    if b is not None:
        sizes = ([b, lq, lk], [lq, lk], [b, 1, lq, lk], [b, h, lq, lk])
        forms = [f"{form} = {size}" for form, size in zip(forms, sizes, strict=True)]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


# Room for what a response holds besides tensor bytes: names, shapes, datatypes, field tags.
_RESPONSE_OVERHEAD_BYTES = 4096


def _check_response_size(request: pb.ModelInferRequest, shapes: dict[str, tuple[int, ...]],
                         outputs: tuple[str, ...], spec: ModelSpec, limits: Limits) -> None:
    """Refuse up front a request whose answer could not be sent (over the message limit)."""
    if limits.max_response_bytes is None:
        return
    sizes = output_bytes(shapes, spec)
    needed = sum(sizes[name] for name in outputs)
    total = needed + len(request.id) + len(request.model_name) + _RESPONSE_OVERHEAD_BYTES
    if total > limits.max_response_bytes:
        parts = " + ".join(f"{name} {sizes[name]:,}" for name in outputs)
        raise ValueError(f"the response would need {total:,} bytes ({parts} bytes of tensors), over the "
                         f"{limits.max_response_bytes:,}-byte message limit (--max-message-bytes); ask for fewer "
                         f"rows, shorter sequences, or only the outputs you need")


def output_shapes(shapes: dict[str, tuple[int, ...]], spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Each output's shape for inputs of these (checked) shapes."""
    b, lq, _ = shapes["query"]  # batch, query length, query_dim
    lk = shapes["key"][1]
    return {"output": (b, lq, spec.out_dim), "attn_probs": (b, spec.num_heads, lq, lk)}


def output_bytes(shapes: dict[str, tuple[int, ...]], spec: ModelSpec) -> dict[str, int]:
    """Tensor bytes of each output for inputs of these (checked) shapes."""
    return {name: 4 * math.prod(shape) for name, shape in output_shapes(shapes, spec).items()}


def _check_typed_size(shapes: dict[str, tuple[int, ...]], outputs: tuple[str, ...], spec: ModelSpec,
                      limits: Limits) -> None:
    """Typed contents are parsed and built on the event loop (protobuf's C code and gRPC's
    serialization, while every other call waits): a request whose typed inputs, or
    whose typed answer, would be over --max-typed-bytes is refused before anything is read or
    computed, pointing to raw contents. (A raw request is answered raw.)"""
    if limits.max_typed_bytes is None:
        return
    inputs = sum(math.prod(shape) * _DTYPES[_EXPECTED_DATATYPE[name]].itemsize for name, shape in shapes.items())
    sizes = output_bytes(shapes, spec)
    answer = sum(sizes[name] for name in outputs)
    for what, nbytes in (("its inputs", inputs), ("its answer", answer)):
        if nbytes > limits.max_typed_bytes:
            raise ValueError(f"typed contents: {what} would hold {nbytes:,} bytes of tensors as typed contents, over "
                             f"the {limits.max_typed_bytes:,}-byte limit for typed contents (--max-typed-bytes); send "
                             "the inputs as raw_input_contents and the answer comes as raw_output_contents")


def _requested_outputs(request: pb.ModelInferRequest, spec: ModelSpec) -> tuple[str, ...]:
    if not request.outputs:
        return OUTPUT_NAMES  # the protocol: no outputs named means all of them
    names = [o.name for o in request.outputs]
    for name in names:
        if name not in OUTPUT_NAMES:
            raise ValueError(f"unknown output {quoted(name)}; model {spec.name} has {list(OUTPUT_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"output requested more than once: {quoted(names)}")
    return tuple(names)


def encode(request: InferRequest | pb.ModelInferRequest, decoded: Decoded, result: Result, version: int
           ) -> InferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    raw_outputs: list[np.ndarray] = []
    for name in decoded.outputs:
        placed = decoded.shm_outputs.get(name)
        if placed is not None:  # written there already (server.tensors.compute_batch)
            placement = placed.placement
            tensor = response.outputs.add(name=name, datatype="FP32", shape=placed.shape)
            tensor.parameters[shm.REGION].string_param = placement.region
            tensor.parameters[shm.BYTE_SIZE].int64_param = placed.writer.nbytes
            if placement.offset:
                tensor.parameters[shm.OFFSET].int64_param = placement.offset
            if decoded.raw:
                raw_outputs.append(_NO_BYTES)  # raw entries stay one per output (Triton's, tritonclient's indexing)
            continue
        array = result.output if name == "output" else result.attn_probs
        tensor = response.outputs.add(name=name, datatype="FP32", shape=array.shape)
        if decoded.raw:
            raw_outputs.append(np.ascontiguousarray(array, dtype="<f4"))
        else:
            tensor.contents.MergeFromString(_packed("fp32_contents", np.ascontiguousarray(array, dtype="<f4")))
    # Raw outputs written by serialize_infer_response; the reservation released by the transport.
    answer = InferResponse(response, raw_outputs, result.reservation)
    if sum(a.nbytes for a in raw_outputs) < WIRE_MIN_BYTES:
        answer.as_message()  # small: protobuf's own serialization is the cheaper one
    return answer


_NO_BYTES = np.empty(0, dtype="<f4")


# -- the wire: raw tensor bytes without protobuf's copies (attnserve.proto.wire) -------------------


class InferRequest:
    """A ModelInferRequest as received: every field from protobuf, except raw_input_contents,
    which are views into the received message's bytes (read-only, never copied)."""

    __slots__ = ("message", "raw_input_contents")

    def __init__(self, message: pb.ModelInferRequest, raw_input_contents: list[memoryview]) -> None:
        self.message = message
        self.raw_input_contents = raw_input_contents

    def __getattr__(self, name: str):  # model_name, inputs, outputs, id, ...: the message's own
        return getattr(self.message, name)

    def drop_contents(self) -> None:
        """Let go of the tensors (and with the last view, the received message's bytes)."""
        self.raw_input_contents = []
        self.message.Clear()


class InferResponse:
    """A ModelInferResponse to send: the message, and the raw outputs it will carry, as arrays
    (little-endian fp32, contiguous) written straight into the serialized answer; and its share
    of the memory budget (memory.budget.Reservation), which the transport gives back with
    `release()` once the answer is sent (or its call is over)."""

    __slots__ = ("message", "raw_output_contents", "reservation")

    def __init__(self, message: pb.ModelInferResponse, raw_output_contents: list[np.ndarray],
                 reservation: Reservation | None = None) -> None:
        self.message = message
        self.raw_output_contents = raw_output_contents
        self.reservation = reservation

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()

    def as_message(self) -> pb.ModelInferResponse:
        """The whole answer as one protobuf message (copies the raw outputs: streams nest it)."""
        for array in self.raw_output_contents:
            self.message.raw_output_contents.append(array.tobytes())
        self.raw_output_contents = []
        return self.message


# Below this, protobuf's copies cost less than reading the wire in Python (small requests come
# by the thousand per second, where the event loop's time is the server's throughput).
WIRE_MIN_BYTES = 1 << 20


class TypedContentsTooLarge(ValueError):
    """A message whose typed contents are over --max-typed-bytes, refused before protobuf parses
    them (server.parsing answers INVALID_ARGUMENT with this message as it is)."""

    refused_before_parsing = True


# Room for what a request holds besides its tensors' bytes: names, shapes, datatypes, tags.
_REQUEST_OVERHEAD_BYTES = 64 << 10


def parse_infer_request(data: bytes, max_typed_bytes: int | None = None) -> InferRequest | pb.ModelInferRequest:
    """The request deserializer of ModelInfer and ModelStreamInfer: for a message of
    WIRE_MIN_BYTES or more, raw_input_contents as views into `data`, the rest parsed by protobuf;
    a smaller one protobuf parses whole. Malformed bytes raise (server.parsing answers
    INVALID_ARGUMENT). max_typed_bytes (--max-typed-bytes): a message whose bytes besides
    raw_input_contents are over it (and the room for names and shapes) is refused before
    protobuf parses them (on the event loop): TypedContentsTooLarge."""
    if len(data) < WIRE_MIN_BYTES:
        return pb.ModelInferRequest.FromString(data)

    def check(rest_bytes: int) -> None:
        if max_typed_bytes is not None and rest_bytes > max_typed_bytes + _REQUEST_OVERHEAD_BYTES:
            raise TypedContentsTooLarge(
                f"typed contents: the request holds {rest_bytes:,} bytes besides raw_input_contents, over the "
                f"{max_typed_bytes:,}-byte limit for typed contents (--max-typed-bytes); send the inputs as "
                "raw_input_contents and the answer comes as raw_output_contents")

    request = InferRequest(*wire.parse_with_raw(pb.ModelInferRequest, data, "raw_input_contents", check))
    heap.release_after(len(data))  # gRPC's own copy of a large message is freed by now
    return request


def serialize_infer_response(response: InferResponse | pb.ModelInferResponse) -> bytes:
    """The response serializer of ModelInfer: the message, then each raw output as its field,
    copied once (into the answer's bytes)."""
    if isinstance(response, pb.ModelInferResponse):
        return response.SerializeToString()
    if not response.raw_output_contents:
        return response.message.SerializeToString()
    data = wire.serialize_with_raw(response.message, "raw_output_contents", response.raw_output_contents)
    # The arrays are in `data` now. gRPC keeps the call's done callbacks (which hold this answer,
    # for its reservation) until it lets go of the call, after the next call began here.
    response.raw_output_contents = []
    return data


# -- typed contents as packed wire bytes -------------------------------------------------------


def _packed(field: str, array: np.ndarray) -> bytes:
    """A packed repeated field of InferTensorContents on the wire: its values' little-endian bytes."""
    return wire.serialize_with_raw(pb.InferTensorContents(), field, [array])


def _typed_values(contents: pb.InferTensorContents, datatype: str, count: int) -> np.ndarray:
    """The values of contents' typed field for `datatype`, from their packed wire bytes (protobuf
    writes repeated scalars packed): no Python object per value. BOOL values are varints of 0 or
    1, one byte each."""
    _, chunks = wire.parse_with_raw(pb.InferTensorContents, contents.SerializeToString(), _TYPED_FIELD[datatype])
    raw = b"".join(chunks)
    if datatype == "BOOL":
        octets = np.frombuffer(raw, dtype=np.uint8)
        if octets.size != count:  # a value other than 0 or 1 took more than one byte
            raise ValueError(f"contents.bool_contents: expected {count} one-byte values, got {octets.size} bytes")
        return octets.astype(np.bool_)
    return np.frombuffer(raw, dtype=_DTYPES[datatype])


def heads_differ_refusal(spec: ModelSpec) -> str:
    """Why a mask whose heads differ is refused by a version without head-mask graphs (the native
    data plane answers the same words)."""
    return (f"input 'mask': its heads differ, and version {spec.version} of model {spec.name} has no "
            f"head-mask graphs ({GRAPH_HEAD_MASK}: exported before them, or fp16); it takes "
            f"masks alike for every head: [q_len, k_len], [batch, q_len, k_len], "
            f"[batch, 1, q_len, k_len], or [batch, {spec.num_heads}, q_len, k_len] with equal heads")
