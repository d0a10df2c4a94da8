"""The native data plane (server.native, attnserve.server._native): exact answers, batching, bad input.

Against a real `attnserve serve --data-plane native` process, through its native port: both
presets, raw and typed contents, each mask form, within 1e-5 of the seeds; bad input refused
with INVALID_ARGUMENT (NOT_FOUND for an unknown model), the plane serving on after each.
Batching is seen in-process: the test takes the batch itself (it is the runner, and so the gate)
once every concurrent call is queued, runs the real ONNX Runtime engine on the batch's views and
hands the outputs back. Skips, saying why, where the extension is not built (`make native`).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import zlib

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native
from attnserve.server.config import ServerConfig
from attnserve.server.engine import Engine, choose_device
from attnserve.server.repository import read_model_spec
from hypothesis import HealthCheck, given, settings

from tests import test_fuzz
from tests.oip import infer_request, outputs_of
from tests.server_process import ServerProcess
from tests.test_mask_shapes import DIMS, assert_close, inputs, reference, seed000, want  # noqa: F401 (fixture)

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

FORMS = (None, "q_k", "b_q_k", "b_1_q_k", "b_h_q_k")
QUEUED_WITHIN_S = 30.0  # a bound on waiting for the calls to reach the queue, not a guess of speed


@pytest.fixture(scope="module")
def native_server(model_repository):
    proc = ServerProcess(model_repository, "--data-plane", "native", "--native-port", "0")
    proc.native_port = json.loads(proc.ready_file.read_text())["native_port"]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def channel(native_server):
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{native_server.native_port}", options=options) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


def heads_alike(x: dict, heads: int) -> dict:
    """A (b, h, lq, lk) mask whose heads are all its first: the prototype serves only those."""
    if x["mask"] is not None and x["mask"].ndim == 4:
        x["mask"] = np.ascontiguousarray(np.repeat(x["mask"][:, :1], heads, axis=1))
    return x


@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f or "no_mask")
def test_each_preset_and_mask_form_matches_the_seed(stub, seed000, eager_modules, model, raw, form):  # noqa: F811
    rng = np.random.default_rng(zlib.crc32(f"native {model} {raw} {form}".encode()))
    x = heads_alike(inputs(model, rng, 3, 10, 7, form), DIMS[model][1])
    expected = want(reference(model, seed000, eager_modules), x)
    answer = stub.ModelInfer(infer_request(model, raw=raw, request_id="r1", **x))
    assert (answer.model_name, answer.model_version, answer.id) == (model, "1", "r1")
    assert bool(answer.raw_output_contents) == raw
    assert_close(outputs_of(answer), expected)
    only = stub.ModelInfer(infer_request(model, raw=raw, outputs=("output",), **x))
    assert [t.name for t in only.outputs] == ["output"]
    assert_close(outputs_of(only), expected, names=("output",))


def test_metadata_answers_as_the_python_port_does(native_server, stub):
    with native_server.channel() as ch:
        python = pb_grpc.GRPCInferenceServiceStub(ch)
        for name in DIMS:
            request = pb.ModelMetadataRequest(name=name)
            assert stub.ModelMetadata(request) == python.ModelMetadata(request)
    assert stub.ServerLive(pb.ServerLiveRequest()).live


def _bad_requests() -> dict[str, pb.ModelInferRequest]:
    rng = np.random.default_rng(3)
    good = inputs("self_attention", rng, 1, 4, 5, "b_q_k")
    cases = {
        "query_width": infer_request("self_attention", **{**good, "query": good["query"][..., :100].copy()}),
        "key_batch": infer_request("self_attention", **{**good, "key": np.concatenate([good["key"]] * 2)}),
        "value_shape": infer_request("self_attention", **{**good, "value": good["value"][:, :3].copy()}),
        "mask_shape": infer_request("self_attention", **{**good, "mask": good["mask"][:, :2].copy()}),
        "missing_value": infer_request("self_attention", **{**good, "value": None}),
        "q_len_over_limit": infer_request("self_attention", **{**good, "query": np.zeros((1, 9000, 512), np.float32)}),
        "unknown_output": infer_request("self_attention", outputs=("scores",), **good),
    }
    differ = np.repeat(good["mask"][:, None], 8, axis=1)
    differ[0, 1] = ~differ[0, 1]
    cases["heads_differ"] = infer_request("self_attention", **{**good, "mask": differ})
    r = infer_request("self_attention", **good)
    r.inputs[0].datatype = "FP16"
    cases["datatype"] = r
    r = infer_request("self_attention", **good)
    r.raw_input_contents[3] = bytes([2]) + r.raw_input_contents[3][1:]
    cases["bool_byte_2"] = r
    r = infer_request("self_attention", **good)
    r.raw_input_contents[0] = r.raw_input_contents[0][:-4]
    cases["raw_size"] = r
    r = infer_request("self_attention", **good)
    del r.raw_input_contents[2]
    cases["raw_count"] = r
    r = infer_request("self_attention", **good)
    r.inputs[0].shape[1] = -4
    cases["negative_dim"] = r
    r = infer_request("self_attention", **good)
    r.inputs[0].shape[:] = [1 << 40, 1 << 40, 512]
    cases["overflowing_dims"] = r
    r = infer_request("self_attention", **good)
    r.inputs.add(name="query", datatype="FP32", shape=[1, 4, 512])
    r.raw_input_contents.append(r.raw_input_contents[0])
    cases["input_twice"] = r
    r = infer_request("self_attention", **good)
    r.inputs[3].name = "bias"
    cases["unknown_input"] = r
    return cases


BAD = _bad_requests()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_and_the_plane_serves_on(stub, case):
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(BAD[case], timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    rng = np.random.default_rng(5)
    assert outputs_of(stub.ModelInfer(infer_request("self_attention", **inputs("self_attention", rng, 1, 3, 3, None))))


def test_unknown_model_and_version_are_not_found(stub):
    x = inputs("self_attention", np.random.default_rng(6), 1, 3, 3, None)
    for request in (infer_request("nope", **x), infer_request("self_attention", version="7", **x)):
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=30)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("data", [b"\xff\xff\xff\xff\x0f garbage", b"\x0a\xff\xff\xff\xff\x0f", b"\x12"],
                         ids=["bad_varint", "cut_string", "cut_tag"])
def test_bytes_that_are_no_message_are_invalid_argument_with_a_message(channel, stub, data):
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as exc:
        call(data, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert "does not parse as a ModelInferRequest" in exc.value.details()
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live


# -- hostile bytes: no crash, no overread, no unbounded allocation, a short answer ---------------

MAX_DETAILS = 1024 + 64  # server/quoting.py's MAX_DETAILS_CHARS and the cut marker


def _hostile_requests() -> dict[str, tuple[pb.ModelInferRequest, grpc.StatusCode]]:
    good = inputs("self_attention", np.random.default_rng(4), 1, 4, 5, "b_q_k")
    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    cases = {}
    for raw in (True, False):  # a huge declared shape (within every limit) and no contents at all
        r = infer_request("self_attention", raw=raw, **good)
        r.inputs[0].shape[:] = [1, 8192, 512]
        r.inputs[1].shape[:] = r.inputs[2].shape[:] = [1, 8192, 512]
        r.inputs[3].shape[:] = [1, 8192, 8192]
        del r.raw_input_contents[:]
        for t in r.inputs:
            t.ClearField("contents")
        cases[f"huge_shape_no_contents_{'raw' if raw else 'typed'}"] = (r, invalid)
    r = infer_request("self_attention", **good)
    r.inputs[0].shape[:] = [1] * 1_000_000  # the message names a million dims
    cases["million_dims"] = (r, invalid)
    r = infer_request("self_attention", **good)
    r.inputs[3].shape[:] = [1, 1 << 40, 4, 5]  # heads no data could fill
    cases["mask_heads_absurd"] = (r, invalid)
    big = inputs("self_attention", np.random.default_rng(5), 1, 64, 64, None)
    r = infer_request("self_attention", **big)
    for _ in range(20_000):  # each repeat would be answered in full: 20,000 x 128 KiB
        r.outputs.add(name="attn_probs")
    cases["outputs_repeated"] = (r, invalid)
    cases["output_twice"] = (infer_request("self_attention", outputs=("output", "output"), **good), invalid)
    r = infer_request("self_attention", **good)
    r.raw_input_contents.extend([b""] * 20_000)
    cases["raw_entries_blown_up"] = (r, invalid)
    r = infer_request("self_attention", **good)
    r.raw_input_contents.append(b"\x00" * 16)
    cases["raw_entry_extra"] = (r, invalid)
    r = infer_request("self_attention", **good)
    for _ in range(20_000):
        r.inputs.add(name="key", datatype="FP32", shape=[1, 5, 512])
    cases["inputs_repeated"] = (r, invalid)
    r = infer_request("self_attention", raw=False, **good)
    r.inputs[0].contents.fp32_contents.extend([0.0] * 4)  # typed values one row short of, then past, the shape
    cases["typed_count_over"] = (r, invalid)
    r = infer_request("self_attention", raw=False, **good)
    del r.inputs[1].contents.fp32_contents[-1]
    cases["typed_count_under"] = (r, invalid)
    r = infer_request("self_attention", raw=False, **good)
    r.inputs[3].contents.ClearField("bool_contents")
    r.inputs[3].contents.fp32_contents.extend([1.0] * 20)  # the mask's values in the wrong field
    cases["mask_wrong_field"] = (r, invalid)
    long_name = "x" * (1 << 20)  # quoted back: the trailer must stay small
    cases["long_model_name"] = (infer_request(long_name, **good), not_found)
    cases["long_version"] = (infer_request("self_attention", version=long_name, **good), not_found)
    r = infer_request("self_attention", **good)
    r.inputs[3].name = long_name
    cases["long_input_name"] = (r, invalid)
    r = infer_request("self_attention", **good)
    r.inputs[0].datatype = long_name
    cases["long_datatype"] = (r, invalid)
    cases["long_output_name"] = (infer_request("self_attention", outputs=(long_name,), **good), invalid)
    return cases


HOSTILE = _hostile_requests()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_request_gets_a_short_answer_and_no_memory_grows(native_server, stub, case):
    request, code = HOSTILE[case]
    before_kib = native_server.memory_kib("VmRSS")
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request, timeout=30)
    assert exc.value.code() == code, (exc.value.code(), exc.value.details()[:300])
    assert len(exc.value.details()) <= MAX_DETAILS, len(exc.value.details())
    # Nothing was allocated for what the shapes declare (a (1, 8192, 8192) mask and its batch, or
    # 20,000 answers of 128 KiB): the peak stays within the message itself, a few MiB.
    grown_kib = native_server.memory_kib("VmHWM") - before_kib
    assert grown_kib < 256 * 1024, grown_kib
    rng = np.random.default_rng(8)
    assert outputs_of(stub.ModelInfer(infer_request("self_attention", **inputs("self_attention", rng, 1, 3, 3, None))))


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(request=test_fuzz.malformed_requests())
def test_malformed_requests_get_a_proper_status(stub, request):
    """tests/test_fuzz.py's attack, against the native port."""
    try:
        response = stub.ModelInfer(request, timeout=30)
    except grpc.RpcError as err:
        assert err.code() not in test_fuzz.FORBIDDEN, (err.code(), err.details(), request)
    else:
        test_fuzz._check_ok(request, response)


# -- batching, in-process: the test is the plane's runner -----------------------------------------

def test_concurrent_calls_form_one_padded_batch_and_each_gets_its_own_rows(model_repository, seed000):  # noqa: F811
    spec = read_model_spec(model_repository / "self_attention")
    engine = Engine(spec, choose_device("cpu"))
    cfg = ServerConfig()
    plane = native.new_plane()
    index = plane.add_model(spec.name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                            32, spec.max_q_len, spec.max_kv_len, cfg.max_attention_bytes, cfg.max_queue_size,
                            cfg.max_padding_ratio)
    port = plane.start("127.0.0.1:0", 64 << 20, 100)
    assert port > 0
    rng = np.random.default_rng(11)
    # Lengths that pad (within the padding ratio), masks of each form and none; one fully masked
    # query row, whose keys are the batch's longest (so it may join: its keys are not padded).
    cases = [heads_alike(inputs("self_attention", rng, b, lq, lk, form, dead_row=form == "b_q_k"), 8)
             for b, lq, lk, form in ((1, 9, 7, "b_q_k"), (2, 10, 6, None), (1, 8, 7, "q_k"), (2, 10, 6, "b_1_q_k"),
                                     (1, 9, 5, "b_h_q_k"), (1, 10, 7, None))]
    try:
        with (grpc.insecure_channel(f"127.0.0.1:{port}") as ch,
              concurrent.futures.ThreadPoolExecutor(len(cases)) as pool):
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", **x), timeout=60) for x in cases]
            deadline = time.monotonic() + QUEUED_WITHIN_S
            while plane.queued(index) < len(cases):  # the state reached, not a guess
                assert time.monotonic() < deadline, f"{plane.queued(index)} of {len(cases)} calls queued"
                assert not any(f.done() for f in futures), [f.exception() for f in futures if f.done()]
                time.sleep(0.005)
            batch = plane.next_batch(index, 1000)
            assert (batch.requests, batch.rows) == (len(cases), sum(x["query"].shape[0] for x in cases))
            assert plane.in_flight() == len(cases)  # what chooses the solo sessions (server.native)
            feeds = batch.feeds(spec.query_dim, spec.kv_dim)
            assert feeds["query"].shape == (batch.rows, 10, 512) and feeds["mask"].shape == (batch.rows, 10, 7)
            assert all(not a.flags.owndata for a in feeds.values())  # views of the batch's buffers
            output, attn_probs = engine.run(feeds, batch.want_probs)
            plane.complete(batch, output, attn_probs)
            answers = [outputs_of(f.result()) for f in futures]
            assert plane.in_flight() == 0
    finally:
        plane.stop(1.0)
    for x, got in zip(cases, answers, strict=True):
        assert_close(got, want(seed000, x))
    counters = plane.counters()
    assert (counters["batches"], counters["requests"]) == (1, len(cases))


def test_a_failed_batch_fails_its_calls_and_stop_refuses_queued_ones(model_repository):
    spec = read_model_spec(model_repository / "cross_attention")
    plane = native.new_plane()
    index = plane.add_model(spec.name, "1", spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads, 1,
                            spec.max_q_len, spec.max_kv_len, 1 << 30, 16, 0.5)
    port = plane.start("127.0.0.1:0", 64 << 20, 100)
    x = inputs("cross_attention", np.random.default_rng(2), 1, 3, 4, None)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        futures = [pool.submit(stub.ModelInfer, infer_request("cross_attention", **x), timeout=60) for _ in range(2)]
        deadline = time.monotonic() + QUEUED_WITHIN_S
        while plane.queued(index) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        batch = plane.next_batch(index, 1000)  # max_batch_size 1: one call; the other stays queued
        assert batch.requests == 1
        plane.fail(batch, "the engine broke")
        plane.stop(1.0)
        codes = sorted(str(f.exception().code()) for f in futures)
    assert codes == ["StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"]
    assert plane.next_batch(index, 10) is None


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="data_plane"):
        ServerConfig(data_plane="rust")
    with pytest.raises(ValueError, match="--workers 1"):
        ServerConfig(data_plane="native", workers=2)
