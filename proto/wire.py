"""Raw tensor bytes on the protobuf wire, without protobuf's copies.

protobuf (upb) copies a bytes field when it parses a message, again each time Python reads it,
and again when a message holding it is built and serialized: three to four copies of every raw
tensor of an inference request or answer, more memory than a long sequence's model run, and
(serializing 25 MB, here) tens of milliseconds. These two helpers handle one repeated bytes
field of a message themselves (the wire format: a length-delimited record per entry, records
in any order) and leave every other field to protobuf:

    message, views = parse_with_raw(pb.ModelInferRequest, data, "raw_input_contents")
    data = serialize_with_raw(response_without_raw, "raw_output_contents", arrays)

and a third bounds a message's fields before anyone parses them (check_fields).

A leaf: protobuf's public API only. Used by the server's codec (its ModelInfer and
ModelStreamInfer messages) and the benchmark's client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

_LENGTH_DELIMITED = 2


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


class FieldsOverLimit(WireError):
    """A message with more records, or more bytes in a field, than check_fields allows: refused
    before protobuf (or parse_with_raw's own scan) spends time on them."""

    refused_before_parsing = True  # its message says why itself (server.errors.MalformedMessage)


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _skip(data: memoryview, at: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, at)[1]
    if wire_type == _LENGTH_DELIMITED:
        length, at = _varint(data, at)
        return at + length
    if wire_type in (1, 5):  # fixed64, fixed32
        return at + (8 if wire_type == 1 else 4)
    raise WireError(f"wire type {wire_type} (groups or invalid)")


def parse_with_raw(message_type, data: bytes, field_name: str, check_rest: Callable[[int], None] | None = None):
    """(message, views): `data` parsed as `message_type` except the repeated bytes field
    `field_name`, whose entries are read-only memoryviews into `data`, in order. Raises
    WireError (or protobuf's DecodeError) for malformed bytes. check_rest: given the bytes
    protobuf would parse (all but those entries) before it does; it may raise."""
    number = message_type.DESCRIPTOR.fields_by_name[field_name].number
    view = memoryview(data)
    raw: list[memoryview] = []
    rest: list[memoryview] = []
    at = 0
    while at < len(view):
        start = at
        tag, at = _varint(view, at)
        field, wire_type = tag >> 3, tag & 7
        if field == number and wire_type == _LENGTH_DELIMITED:
            length, begin = _varint(view, at)
            at = begin + length
            if at > len(view):
                raise WireError(f"field {field} runs past the end of the message")
            raw.append(view[begin:at])
            continue
        at = _skip(view, at, wire_type)
        if at > len(view):
            raise WireError(f"field {field} runs past the end of the message")
        rest.append(view[start:at])
    if check_rest is not None:
        check_rest(sum(part.nbytes for part in rest))
    message = message_type.FromString(data if not raw else b"".join(rest))
    return message, raw


def check_fields(message_type, data: bytes, bounds: Mapping[str, tuple[int, int]], max_records: int,
                 what: str = "the message") -> None:
    """Raise FieldsOverLimit, before anything is parsed, if `data` (a `message_type` on the wire)
    has more than max_records top-level records, or a field named in `bounds` with more than
    (entries, bytes) of them; WireError for malformed bytes. Stops at the first bound crossed:
    its cost is bounded by the bounds, not by the message (a map field's entries are each a
    record, so a million `parameters` would otherwise be a million steps of this loop)."""
    by_number = {message_type.DESCRIPTOR.fields_by_name[name].number: (name, *bound) for name, bound in bounds.items()}
    counts: dict[int, list[int]] = {number: [0, 0] for number in by_number}
    view = memoryview(data)
    at = records = 0
    while at < len(view):
        records += 1
        if records > max_records:
            raise FieldsOverLimit(f"{what} has more than {max_records:,} top-level fields (the limit); "
                                  "an inference request has a few")
        start = at
        tag, at = _varint(view, at)
        at = _skip(view, at, tag & 7)
        if at > len(view):
            raise WireError(f"field {tag >> 3} runs past the end of the message")
        count = counts.get(tag >> 3)
        if count is None:
            continue
        name, max_entries, max_bytes = by_number[tag >> 3]
        count[0] += 1
        count[1] += at - start
        if count[0] > max_entries:
            raise FieldsOverLimit(f"{what}: more than {max_entries:,} `{name}` entries (the limit is {max_entries:,})")
        if count[1] > max_bytes:
            raise FieldsOverLimit(f"{what}: `{name}` holds more than {max_bytes:,} bytes (the limit is {max_bytes:,})")


def serialize_with_raw(message, field_name: str, buffers: Sequence) -> bytes:
    """`message` serialized, then each of `buffers` (bytes-like, C-contiguous) as an entry of the
    repeated bytes field `field_name`: one copy of each buffer, into the returned bytes."""
    number = type(message).DESCRIPTOR.fields_by_name[field_name].number
    tag = encode_varint(number << 3 | _LENGTH_DELIMITED)
    parts: list = [message.SerializeToString()]
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        parts += [tag, encode_varint(view.nbytes), view]
    return b"".join(parts)
