"""The client's pure parts, no server: codec, connection options, retry policy, .npz streaming, chunk planning."""

from __future__ import annotations

import random
import zipfile

import grpc
import numpy as np
import pytest
from attnserve.client import codec, npzio
from attnserve.client.batch import BatchError, Shard, check_parts, plan_chunks
from attnserve.client.errors import InferenceError
from attnserve.client.options import ClientOptions, RetryPolicy, TlsConfig, grpc_target, parse_addresses
from attnserve.proto import inference_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

RNG = np.random.default_rng(0)


def _inputs(b=2, lq=3, lk=4, dq=8, dk=6):
    return (RNG.standard_normal((b, lq, dq)), RNG.standard_normal((b, lk, dk)), RNG.standard_normal((b, lk, dk)))


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def test_validate_converts_to_float32_c_contiguous_and_bool():
    q, k, v = _inputs()
    q_fortran = np.asfortranarray(q)  # float64, not C-contiguous
    mask = RNG.integers(0, 2, size=(2, 3, 4))  # integers: nonzero = attend
    inputs = codec.validate_inputs(q_fortran, k.tolist(), v.astype(np.int32), mask)
    assert list(inputs) == ["query", "key", "value", "mask"]
    for name in ("query", "key", "value"):
        assert inputs[name].dtype == np.float32 and inputs[name].flags.c_contiguous
    np.testing.assert_array_equal(inputs["query"], q.astype(np.float32))
    assert inputs["mask"].dtype == np.bool_
    np.testing.assert_array_equal(inputs["mask"], mask != 0)


def test_validate_takes_4d_masks_per_head_or_not():
    q, k, v = _inputs()
    per_head = RNG.random((2, 8, 3, 4)) > 0.5
    np.testing.assert_array_equal(codec.validate_inputs(q, k, v, per_head)["mask"], per_head)
    one = codec.validate_inputs(q, k, v, per_head[:, :1])["mask"]  # (b, 1, lq, lk) goes as (b, lq, lk)
    assert one.shape == (2, 3, 4) and one.flags.c_contiguous
    np.testing.assert_array_equal(one, per_head[:, 0])
    with pytest.raises(ValueError, match=r"\(batch, 1\|heads, lq, lk\)=\(2, 1\|heads, 3, 4\)"):
        codec.validate_inputs(q, k, v, per_head[:1])


def test_validate_broadcasts_a_2d_mask_over_the_batch():
    q, k, v = _inputs(b=3)
    mask = np.tril(np.ones((3, 4), dtype=bool))
    got = codec.validate_inputs(q, k, v, mask)["mask"]
    assert got.shape == (3, 3, 4) and got.flags.c_contiguous
    assert all(np.array_equal(row, mask) for row in got)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v, m: (q[0], k, v, m), "query: expected 3 dims"),
        (lambda q, k, v, m: (q.astype(complex), k, v, m), "query: expected a real-valued array"),
        (lambda q, k, v, m: (q > 0, k, v, m), "query: expected a real-valued array"),
        (lambda q, k, v, m: (q, k[:1], v[:1], m), "batch sizes disagree: query 2, key 1, value 1"),
        (lambda q, k, v, m: (q, k, v[:, :2], m), "key and value must have one shape"),
        (lambda q, k, v, m: (q[:, :0], k, v, None), "every dim must be >= 1"),
        (lambda q, k, v, m: (q, k, v, m[:, :, :2]), "mask: expected shape (batch, lq, lk)=(2, 3, 4)"),
        (lambda q, k, v, m: (q, k, v, m.astype(np.float32)), "additive float masks are not supported"),
    ],
)
def test_validate_rejects_bad_inputs_with_a_clear_message(change, message):
    q, k, v = _inputs()
    args = change(q, k, v, np.ones((2, 3, 4), dtype=bool))
    with pytest.raises(ValueError) as exc:
        codec.validate_inputs(*args)
    assert message in str(exc.value)


# ---------------------------------------------------------------------------
# Requests and responses
# ---------------------------------------------------------------------------


def test_request_carries_raw_little_endian_bytes_only():
    q, k, v = _inputs()
    mask = RNG.random((2, 3, 4)) > 0.5
    inputs = codec.validate_inputs(q, k, v, mask)
    request = codec.build_infer_request("m", inputs, ("output", "attn_probs"), model_version="3", request_id="r1")
    assert (request.model_name, request.model_version, request.id) == ("m", "3", "r1")
    assert [o.name for o in request.outputs] == ["output", "attn_probs"]
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("query", "FP32", [2, 3, 8]), ("key", "FP32", [2, 4, 6]), ("value", "FP32", [2, 4, 6]),
        ("mask", "BOOL", [2, 3, 4]),
    ]
    assert not any(t.HasField("contents") for t in request.inputs)  # no per-element protobuf fields
    assert len(request.raw_input_contents) == 4
    assert request.raw_input_contents[0] == q.astype("<f4").tobytes()
    assert request.raw_input_contents[3] == mask.astype(np.uint8).tobytes()  # BOOL: one byte each
    # The message survives the wire.
    again = pb.ModelInferRequest.FromString(request.SerializeToString())
    np.testing.assert_array_equal(np.frombuffer(again.raw_input_contents[1], "<f4").reshape(2, 4, 6),
                                  k.astype(np.float32))


def test_request_without_outputs_asks_for_all():
    inputs = codec.validate_inputs(*_inputs())
    assert len(codec.build_infer_request("m", inputs, ()).outputs) == 0
    with pytest.raises(ValueError, match="listed twice"):
        codec.build_infer_request("m", inputs, ("output", "output"))


def test_request_carries_the_schedule_policy_as_tritonclient_sends_it():
    inputs = codec.validate_inputs(*_inputs())
    assert not codec.build_infer_request("m", inputs).parameters  # 0: the model's defaults, nothing sent
    request = codec.build_infer_request("m", inputs, priority=2, timeout_us=1500)
    assert request.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert request.parameters["timeout"].WhichOneof("parameter_choice") == "int64_param"
    assert (request.parameters["priority"].uint64_param, request.parameters["timeout"].int64_param) == (2, 1500)
    for bad in ({"priority": -1}, {"timeout_us": -5}, {"priority": 1.5}):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            codec.build_infer_request("m", inputs, **bad)


def _response(outputs: dict[str, np.ndarray], *, raw: bool = True) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    for name, array in outputs.items():
        datatype = codec._datatype_of(array.dtype)
        tensor = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            response.raw_output_contents.append(array.tobytes())
        else:
            getattr(tensor.contents, codec.DATATYPES[datatype][1]).extend(array.ravel().tolist())
    return response


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_parse_reads_raw_and_typed_contents(raw):
    output = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    probs = RNG.random((2, 2, 3, 4)).astype(np.float32)
    result = codec.parse_infer_response(_response({"output": output, "attn_probs": probs}, raw=raw))
    assert (result.model_name, result.model_version, result.id) == ("m", "1", "x")
    assert list(result.outputs) == ["output", "attn_probs"]
    np.testing.assert_array_equal(result.outputs["output"], output)
    np.testing.assert_array_equal(result.outputs["attn_probs"], probs)
    assert not result.outputs["output"].flags.writeable
    only = codec.parse_infer_response(_response({"output": output, "attn_probs": probs}, raw=raw), ("attn_probs",))
    assert list(only.outputs) == ["attn_probs"]


def _assert_malformed(response, requested=(), match=""):
    with pytest.raises(InferenceError) as exc:
        codec.parse_infer_response(response, requested)
    assert exc.value.code == grpc.StatusCode.INTERNAL
    assert match in exc.value.details


def test_parse_checks_byte_counts_datatypes_and_presence():
    output = np.zeros((1, 2, 3), np.float32)
    short = _response({"output": output})
    short.raw_output_contents[0] = short.raw_output_contents[0][:-4]
    _assert_malformed(short, match="expected 24 bytes, got 20")

    wrong_type = _response({"output": output.astype(np.float64)})
    _assert_malformed(wrong_type, match="expected datatype FP32, got FP64")

    unknown = _response({"output": output})
    unknown.outputs[0].datatype = "BF17"
    _assert_malformed(unknown, match="cannot read")

    _assert_malformed(_response({"output": output}), ("output", "attn_probs"),
                      match="requested outputs ['attn_probs'] missing")

    count = _response({"output": output}, raw=False)
    del count.outputs[0].contents.fp32_contents[-1]
    _assert_malformed(count, match="expected 6 values in contents.fp32_contents, got 5")

    extra_raw = _response({"output": output})
    extra_raw.raw_output_contents.append(b"")
    _assert_malformed(extra_raw, match="1 outputs but 2 raw_output_contents")

    mixed = _response({"output": output})
    mixed.outputs[0].contents.fp32_contents.extend([0.0] * 6)
    _assert_malformed(mixed, match="typed contents beside raw_output_contents")


def test_output_shapes_must_line_up_with_the_request():
    inputs = codec.validate_inputs(*_inputs(b=2, lq=3, lk=4))
    codec.check_output_shapes({"output": np.zeros((2, 3, 7)), "attn_probs": np.zeros((2, 5, 3, 4))}, inputs)
    with pytest.raises(InferenceError, match="output: expected shape"):
        codec.check_output_shapes({"output": np.zeros((1, 3, 7))}, inputs)
    with pytest.raises(InferenceError, match="attn_probs: expected shape"):
        codec.check_output_shapes({"attn_probs": np.zeros((2, 5, 3, 5))}, inputs)


def test_metadata_messages_become_dataclasses():
    response = pb.ModelMetadataResponse(name="m", versions=["1", "2"], platform="onnxruntime_onnx")
    response.inputs.add(name="query", datatype="FP32", shape=[-1, -1, 32])
    response.outputs.add(name="attn_probs", datatype="FP32", shape=[-1, 2, -1, -1])
    meta = codec.parse_model_metadata(response)
    assert meta.versions == ("1", "2") and meta.input("query").shape == (-1, -1, 32)
    assert meta.output("attn_probs").shape[1] == 2 and meta.output("output") is None
    assert meta.to_dict()["inputs"] == [{"name": "query", "datatype": "FP32", "shape": [-1, -1, 32]}]
    server = codec.parse_server_metadata(pb.ServerMetadataResponse(name="s", version="0.1", extensions=["statistics"]))
    assert server.to_dict() == {"name": "s", "version": "0.1", "extensions": ["statistics"]}


# ---------------------------------------------------------------------------
# Connection options and retries
# ---------------------------------------------------------------------------


def test_addresses_parse_with_default_port_and_ipv6():
    assert parse_addresses("a:1, b:2,[::1]:3,c") == [("a", 1), ("b", 2), ("::1", 3), ("c", 8001)]
    for bad, message in (("a:1,", "empty address"), ("a:x", "bad port"), ("a:70000", "port must be in"),
                         (":5", "bad address")):
        with pytest.raises(ValueError, match=message):
            parse_addresses(bad)
    with pytest.raises(ValueError, match="bad port"):
        ClientOptions(url="host:port")


def test_targets_for_round_robin():
    assert grpc_target("127.0.0.1:5001") == "ipv4:127.0.0.1:5001"
    assert grpc_target("[::1]:5001") == "ipv6:[::1]:5001"
    assert grpc_target("example.invalid:5001") == "dns:///example.invalid:5001"  # gRPC resolves a single name
    assert grpc_target("127.0.0.1:1,127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    # Names in a list are resolved to IP literals (localhost has an IPv4 address everywhere).
    assert grpc_target("localhost:1,127.0.0.1:2").startswith("ipv4:127.0.0.1:1,")
    assert grpc_target("dns:///svc:80") == "dns:///svc:80"  # gRPC syntax passes through
    with pytest.raises(ValueError, match="cannot resolve"):
        grpc_target("no-such-host.invalid:1,127.0.0.1:2")


def test_channel_options_raise_limits_and_balance():
    options = dict(ClientOptions(url="a:1", max_message_bytes=128 << 20).channel_options())
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 128 << 20
    assert options["grpc.lb_policy_name"] == "round_robin"
    assert ClientOptions(token="s3cret").call_metadata() == (("authorization", "Bearer s3cret"),)
    assert "s3cret" not in repr(ClientOptions(token="s3cret"))
    # A certificate is checked against the name even when a list of names became IP literals.
    tls = dict(ClientOptions(url="localhost:1,localhost:2", tls=TlsConfig()).channel_options())
    assert tls["grpc.ssl_target_name_override"] == "localhost"
    with pytest.raises(ValueError, match="both a client certificate and its key"):
        TlsConfig(cert_file="c.pem")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ClientOptions(timeout_s=0)


def test_backoff_grows_with_jitter_and_respects_the_deadline():
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2)
    rng = random.Random(1)
    for retry_index, cap in enumerate((0.1, 0.2, 0.3, 0.3)):
        delays = [policy.backoff_s(retry_index, rng) for _ in range(200)]
        assert cap / 2 <= min(delays) and max(delays) <= cap
        assert max(delays) - min(delays) > cap / 4  # jittered, not fixed
    unavailable = InferenceError(grpc.StatusCode.UNAVAILABLE, "draining")
    assert policy.delay_before_retry(unavailable, 0, remaining_s=10) is not None
    assert policy.delay_before_retry(unavailable, 3, remaining_s=10) is None  # 4 attempts made
    assert policy.delay_before_retry(unavailable, 0, remaining_s=0.01) is None  # would pass the deadline
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert policy.delay_before_retry(InferenceError(code, ""), 0, remaining_s=10) is None


def test_inference_error_carries_code_and_details():
    err = InferenceError(grpc.StatusCode.NOT_FOUND, "unknown model 'x'")
    assert (err.code, err.details, str(err)) == (grpc.StatusCode.NOT_FOUND, "unknown model 'x'",
                                                 "NOT_FOUND: unknown model 'x'")
    assert not err.retryable and InferenceError(grpc.StatusCode.UNAVAILABLE, "").retryable


# ---------------------------------------------------------------------------
# .npz streaming
# ---------------------------------------------------------------------------


def test_open_npz_memory_maps_stored_members_and_loads_compressed(tmp_path):
    q = RNG.standard_normal((5, 3, 4)).astype(np.float32)
    mask = RNG.random((5, 3, 3)) > 0.5
    fortran = np.asfortranarray(RNG.standard_normal((4, 6)))
    np.savez(tmp_path / "s.npz", query=q, mask=mask, f=fortran)
    np.savez_compressed(tmp_path / "c.npz", query=q)
    stored = npzio.open_npz(tmp_path / "s.npz")
    assert all(isinstance(a, np.memmap) for a in stored.values())
    np.testing.assert_array_equal(stored["query"], q)
    np.testing.assert_array_equal(stored["mask"], mask)
    np.testing.assert_array_equal(stored["f"], fortran)
    compressed = npzio.open_npz(tmp_path / "c.npz")
    assert not isinstance(compressed["query"], np.memmap)
    np.testing.assert_array_equal(compressed["query"], q)
    headers = npzio.read_headers(tmp_path / "c.npz")
    assert headers["query"] == npzio.MemberInfo((5, 3, 4), np.dtype("<f4"), stored=False)


def test_write_npz_streams_chunks_into_a_zip64_file_numpy_reads(tmp_path):
    rows = RNG.standard_normal((10, 3, 2)).astype(np.float32)
    members = [
        npzio.StreamedMember("output", np.dtype("<f4"), (10, 3, 2), (rows[i:i + 4] for i in range(0, 10, 4))),
        npzio.StreamedMember("empty", np.dtype("<f4"), (0, 2), iter(())),
    ]
    path = tmp_path / "out.npz"
    npzio.write_npz(path, members, comment=b"job-key")
    with np.load(path) as npz:
        assert npz.files == ["output", "empty"]
        np.testing.assert_array_equal(npz["output"], rows)
        assert npz["empty"].shape == (0, 2)
    with zipfile.ZipFile(path) as zf:
        assert all(info.compress_type == zipfile.ZIP_STORED for info in zf.infolist())
    assert npzio.read_comment(path) == b"job-key"
    np.testing.assert_array_equal(npzio.open_npz(path)["output"], rows)  # and it maps back
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]  # no temporary left


def test_write_npz_refuses_a_short_member_and_leaves_nothing(tmp_path):
    members = [npzio.StreamedMember("output", np.dtype("<f4"), (10, 2), [np.zeros((4, 2))])]
    with pytest.raises(ValueError, match="expected 80"):
        npzio.write_npz(tmp_path / "out.npz", members)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# Batch planning
# ---------------------------------------------------------------------------


def test_plan_chunks_stay_in_shards_and_skip_finished_ranges():
    shards = [Shard(None, 0, 10, False), Shard(None, 10, 5, False)]
    chunks = plan_chunks(shards, [(0, 4), (12, 15)], batch_size=4)
    assert [(c.shard_index, c.start, c.stop) for c in chunks] == [(0, 4, 8), (0, 8, 10), (1, 10, 12)]
    assert check_parts(shards, [(0, 4), (12, 15)]) == 7
    with pytest.raises(BatchError, match="does not fit the input's shards"):
        check_parts(shards, [(8, 12)])
    with pytest.raises(BatchError, match="overlaps"):
        check_parts(shards, [(0, 4), (3, 6)])


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    batch_size=st.integers(1, 7),
    old_batch_size=st.integers(1, 7),
    finished=st.data(),
)
def test_plan_chunks_cover_exactly_what_is_left(sizes, batch_size, old_batch_size, finished):
    shards, offset = [], 0
    for size in sizes:
        shards.append(Shard(None, offset, size, False))
        offset += size
    # Parts a previous run (maybe with another batch size) finished: any subset of its chunks.
    previous = plan_chunks(shards, [], old_batch_size)
    done = [(c.start, c.stop) for c in previous if finished.draw(st.booleans())]
    chunks = plan_chunks(shards, done, batch_size)
    covered = [i for c in chunks for i in range(c.start, c.stop)]
    assert covered == sorted(set(range(offset)) - {i for a, b in done for i in range(a, b)})
    for c in chunks:
        shard = shards[c.shard_index]
        assert 1 <= c.count <= batch_size and shard.offset <= c.start and c.stop <= shard.offset + shard.count


def test_check_values_counts_exactly_what_float32_rounds_and_refuses_what_it_cannot_hold():
    ints = np.array([[[2**24 + 1, 2**24, 2**60, 2**60 + 1, -(2**63), 2**63 - 1, 3]]], dtype=np.int64)
    assert codec.check_values({"query": ints}) == 3  # 2**24+1, 2**60+1 and 2**63-1 change
    assert codec.check_values({"query": np.array([[[2**64 - 1, 2**63, 2**25 + 2]]], dtype=np.uint64)}) == 2
    assert codec.check_values({"query": np.full((1, 1, 2), 0.5), "key": np.full((1, 1, 2), 0.1)}) == 2
    assert codec.check_values({"query": np.ones((1, 1, 2), np.float32), "mask": np.ones((1, 1, 1), np.uint8)}) == 0
    with pytest.raises(ValueError, match=r"^value of item 5, at \[5, 0, 1\], is 1e\+39, beyond float32's range"):
        codec.check_values({"value": np.array([[[0.0, 1e39]]])}, first_item=5)
    with pytest.raises(ValueError, match=r"^mask, at \[0, 1\], is -3; expected bool"):
        codec.check_values({"mask": np.array([[1, -3]])})
