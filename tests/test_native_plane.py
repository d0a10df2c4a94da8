"""The native data plane (server.native, attnserve.server._native): exact answers, batching, bad input.

Against a real `attnserve serve --data-plane native` process, through its native port: both
presets, raw and typed contents, each mask form (heads alike and differing), within 1e-5 of the
seeds; bad input refused with INVALID_ARGUMENT (NOT_FOUND for an unknown model), the plane
serving on after each; the log, ServerMetadata and --version saying which plane serves; native
calls counted in the metrics. A drain against a gated server (tests/gated_server.py): admitted
calls finish, new ones are refused UNAVAILABLE.
Batching is seen in-process: the test takes the batch itself (it is the runner, and so the gate)
once every concurrent call is queued, runs the real ONNX Runtime engine on the batch's views and
hands the outputs back. Skips, saying why, where the extension is not built (`make native`).
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
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
from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of
from tests.server_process import REPO_ROOT, ServerProcess
from tests.test_mask_shapes import DIMS, assert_close, inputs, reference, seed000, want  # noqa: F401 (fixture)

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

FORMS = (None, "q_k", "b_q_k", "b_1_q_k", "b_h_q_k")
QUEUED_WITHIN_S = 30.0  # a bound on waiting for the calls to reach the queue, not a guess of speed


@pytest.fixture(scope="module")
def native_server(model_repository):
    proc = ServerProcess(model_repository, "--data-plane", "native")
    proc.native_port = proc.port
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
    """A (b, h, lq, lk) mask whose heads are all its first (the batch takes a (B, Lq, Lk) mask)."""
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
    # The Python plane's words (server.errors.MalformedMessage over protobuf's DecodeError).
    assert exc.value.details() == ("the request message does not parse: DecodeError: Error parsing message with type "
                                   "'inference.ModelInferRequest'")
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

def test_an_answer_is_encoded_as_protobuf_serializes_it_with_large_outputs_in_slices_of_their_own():
    """EncodeAnswer and EncodeStreamAnswer: the bytes sent are the message's own serialization, byte
    for byte, alone and in a stream's message, for raw outputs below and above the size that is sent
    from a slice of its own (with one- to four-byte length prefixes), typed outputs, and none; each
    large output is one slice, not copied again."""
    from attnserve.server import _native

    rng = np.random.default_rng(5)
    small = rng.standard_normal(10).astype(np.float32).tobytes()  # 40 bytes: copied into the head
    large = rng.standard_normal(2048).astype(np.float32).tobytes()  # 8 KiB
    huge = np.arange(3 << 18, dtype=np.float32).tobytes()  # 3 MiB: a four-byte length
    for raw in ([], [small], [large], [large, small], [small, large, huge], [huge, b"", large]):
        answer = pb.ModelInferResponse(model_name="cross_attention", model_version="7", id="a-1")
        for i, data in enumerate(raw):
            answer.outputs.add(name=f"o{i}", datatype="FP32", shape=[1, len(data) // 4])
        answer.raw_output_contents.extend(raw)
        message = answer.SerializeToString()
        encoded, sizes = _native.encode_answer(message)
        assert encoded == message, [len(r) for r in raw]
        assert [s for s in sizes if s >= 4096] == [len(r) for r in raw if len(r) >= 4096]
        for error in ("", "INVALID_ARGUMENT: " + "x" * 200):  # in a stream: a two-byte length, and none
            streamed = pb.ModelStreamInferResponse(error_message=error, infer_response=answer).SerializeToString()
            encoded, sizes = _native.encode_answer(message, stream_error=error)
            assert encoded == streamed, (error, [len(r) for r in raw])
            assert [s for s in sizes if s >= 4096] == [len(r) for r in raw if len(r) >= 4096]
    typed = pb.ModelInferResponse(model_name="self_attention", model_version="1")
    typed.outputs.add(name="output", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([0.5, -1.0])
    message = typed.SerializeToString()
    assert _native.encode_answer(message) == (message, [len(message)])
    with pytest.raises(ValueError, match="not a ModelInferResponse"):
        _native.encode_answer(b"\xff\xff")


def test_concurrent_calls_form_one_padded_batch_and_each_gets_its_own_rows(model_repository, seed000):  # noqa: F811
    spec = read_model_spec(model_repository / "self_attention")
    engine = Engine(spec, choose_device("cpu"))
    cfg = ServerConfig()
    plane = native.new_plane()
    index = plane.add_model(spec.name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                            32, spec.max_q_len, spec.max_kv_len, cfg.max_attention_bytes, cfg.max_queue_size,
                            cfg.max_padding_ratio)
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
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
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
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


def _zeros_plane(model_repository, host: str, port: int):
    """A NativePlane answering zeros in this process (no runner threads), for --host and --port."""
    from attnserve.server.config import load_config

    from bench.native_floor import zeros_plane

    return zeros_plane(load_config(["--model-repository", str(model_repository), "--host", host,
                                    "--port", str(port), "--data-plane", "native"]))


@pytest.fixture
def two_addresses(monkeypatch):
    """A --host that resolves to 127.0.0.1 and ::1, as localhost does where /etc/hosts names both
    (this machine's names one): the resolution is the only thing not real here."""
    from attnserve.server import listen

    host = "two-addresses.test"
    resolve = listen.listen_addresses
    both = lambda name: ["127.0.0.1", "::1"] if name == host else resolve(name)  # noqa: E731
    monkeypatch.setattr(listen, "listen_addresses", both)
    monkeypatch.setattr(native, "listen_addresses", both)
    return host


def test_the_plane_listens_on_every_address_its_host_resolves_to_on_one_port(model_repository, two_addresses):
    """--port 0: one port, free on both, for both (gRPC alone would give each its own)."""
    from attnserve.client import InferenceClient

    plane = _zeros_plane(model_repository, two_addresses, 0)
    port = plane.start()
    try:
        for target in (f"127.0.0.1:{port}", f"[::1]:{port}"):
            with InferenceClient(target) as client:
                x = np.ones((1, 3, 512), np.float32)
                got = client.infer("self_attention", x, x, x, outputs=("output",))
            assert got["output"].shape == (1, 3, 512) and not got["output"].any(), target
        assert plane.counters()["requests"] == 2
    finally:
        plane.stop(1.0)


def test_the_plane_refuses_to_serve_on_part_of_its_hosts_addresses(model_repository, two_addresses):
    """The port taken on ::1 alone: the start fails naming [::1]:PORT, as server.app.bind's does,
    and 127.0.0.1 is not left serving."""
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plane = _zeros_plane(model_repository, two_addresses, port)
        with pytest.raises(OSError, match=re.escape(f"cannot listen on [::1]:{port} (--host {two_addresses})")):
            plane.start()
        with socket.socket() as probe:  # 127.0.0.1:PORT was let go: nothing listens there
            probe.bind(("127.0.0.1", port))


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="data_plane"):
        ServerConfig(data_plane="rust")
    assert ServerConfig().data_plane == "auto"  # native where it loads (tests/test_data_plane.py)
    # TLS, tokens and workers are served on the native port too (tests/test_native_security.py).
    ServerConfig(data_plane="native", workers=2, tls_cert="c.pem", tls_key="k.pem", auth_token_file="t")


# -- which plane serves ----------------------------------------------------------------------------

def test_the_log_and_server_metadata_say_the_native_plane_serves(native_server, stub):
    """The Python plane lists no such extension: tests/test_data_plane.py."""
    log = native_server.log()
    assert "data plane native, python behind it on unix:" in log
    assert "native data plane serving ModelInfer for each model once it is ready on 127.0.0.1:" in log  # not "for []"
    with native_server.channel() as ch:
        python_port = pb_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(pb.ServerMetadataRequest(), timeout=30)
    assert "native_data_plane" in stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=30).extensions
    assert "native_data_plane" in python_port.extensions


def test_version_says_whether_the_native_plane_can_serve():
    out = subprocess.run([sys.executable, "-m", "attnserve", "--version"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "native data plane: available (--data-plane native)" in out.stdout


# -- metrics -----------------------------------------------------------------------------------------

def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with these labels (0 before any)."""
    wanted = "".join(rf'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    labelled = rf'{{{wanted}[^}}]*}}' if labels else r'(?:\{[^}]*\})?'
    values = [float(m.group(1)) for m in re.finditer(rf'^{name}{labelled} (\S+)$', text, re.M)]
    return sum(values)


def test_native_calls_move_the_metrics(native_server, stub):
    """A native call that is answered, one refused and one for no model: attnserve_requests by
    code (read from C++ at the scrape), the batch's histograms (sent to the event loop per batch)."""
    model = "cross_attention"
    names = {"ok": ("attnserve_requests_total", {"model": model, "code": "OK"}),
             "invalid": ("attnserve_requests_total", {"model": model, "code": "INVALID_ARGUMENT"}),
             "unknown": ("attnserve_requests_total", {"model": "_unknown", "code": "NOT_FOUND"}),
             "batches": ("attnserve_batch_requests_count", {"model": model}),
             "queued": ("attnserve_queue_duration_seconds_count", {"model": model}),
             "answered": ("attnserve_request_duration_seconds_count", {"model": model}),
             "computed": ("attnserve_compute_duration_seconds_count", {"model": model})}

    def read() -> dict[str, float]:
        text = native_server.scrape()
        return {key: _metric(text, name, **labels) for key, (name, labels) in names.items()}

    before = read()
    x = inputs(model, np.random.default_rng(21), 2, 3, 4, None)
    assert outputs_of(stub.ModelInfer(infer_request(model, **x), timeout=30))
    for request in (infer_request(model, **{**x, "value": None}), infer_request("nope", **x)):
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(request, timeout=30)
    want_delta = {"ok": 1, "invalid": 1, "unknown": 1, "batches": 1, "queued": 1, "answered": 1, "computed": 1}
    deadline = time.monotonic() + QUEUED_WITHIN_S  # the batch's figures reach the event loop after its answer
    while (delta := {k: v - before[k] for k, v in read().items()}) != want_delta:
        assert time.monotonic() < deadline, delta
        time.sleep(0.01)
    assert re.search(r"^attnserve_native_in_flight 0\.0$", native_server.scrape(), re.M)
    with native_server.channel() as ch:  # Triton's statistics on the Python port count the native run too
        stats = pb_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=30)
    assert stats.model_stats[0].inference_stats.success.count >= 1


# -- masks whose heads differ --------------------------------------------------------------------------

@pytest.mark.parametrize("model", sorted(DIMS))
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_masks_whose_heads_differ_match_the_seed(stub, seed000, eager_modules, model, raw):  # noqa: F811
    rng = np.random.default_rng(zlib.crc32(f"native heads {model} {raw}".encode()))
    x = inputs(model, rng, 3, 10, 7, "b_h_q_k")
    assert not np.array_equal(x["mask"][:, 0], x["mask"][:, 1])  # the heads differ
    answer = stub.ModelInfer(infer_request(model, raw=raw, **x), timeout=60)
    assert_close(outputs_of(answer), want(reference(model, seed000, eager_modules), x))


def test_a_head_mask_batch_merges_every_form_and_each_gets_its_own_rows(model_repository, seed000):  # noqa: F811
    """In-process (the test is the runner): a request whose heads differ beside ones with no mask,
    a (q_len, k_len) mask and heads alike, of other lengths: one batch, fed as a (B, H, Lq, Lk)
    head_mask, on the real engine; every answer is its own seed run."""
    spec = read_model_spec(model_repository / "self_attention")
    engine = Engine(spec, choose_device("cpu"))
    assert engine.why_no_head_masks is None
    plane = native.new_plane()
    index = plane.add_model(spec.name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                            32, spec.max_q_len, spec.max_kv_len, 1 << 30, 16, 0.9)
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
    rng = np.random.default_rng(12)
    cases = [inputs("self_attention", rng, 2, 10, 7, "b_h_q_k"), inputs("self_attention", rng, 1, 8, 7, None),
             inputs("self_attention", rng, 1, 10, 6, "q_k", dead_row=False),
             heads_alike(inputs("self_attention", rng, 1, 9, 5, "b_h_q_k", dead_row=False), 8)]
    try:
        with (grpc.insecure_channel(f"127.0.0.1:{port}") as ch,
              concurrent.futures.ThreadPoolExecutor(len(cases)) as pool):
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", **x), timeout=60) for x in cases]
            deadline = time.monotonic() + QUEUED_WITHIN_S
            while plane.queued(index) < len(cases):
                assert time.monotonic() < deadline, f"{plane.queued(index)} of {len(cases)} calls queued"
                time.sleep(0.005)
            batch = plane.next_batch(index, 1000)
            assert (batch.requests, batch.rows) == (len(cases), 5)
            feeds = batch.feeds(spec.query_dim, spec.kv_dim)
            assert "mask" not in feeds and feeds["head_mask"].shape == (5, 8, 10, 7)
            output, attn_probs = engine.run(feeds, batch.want_probs)
            plane.complete(batch, output, attn_probs)
            answers = [outputs_of(f.result()) for f in futures]
    finally:
        plane.stop(1.0)
    for x, got in zip(cases, answers, strict=True):
        assert_close(got, want(seed000, x))


def _key_padding(x: dict) -> dict:
    """x with its mask's query rows all its first (per batch item and head): a key padding mask."""
    mask = x["mask"]
    x["mask"] = np.ascontiguousarray(np.broadcast_to(mask[..., :1, :], mask.shape))
    return x


@pytest.mark.parametrize("want_probs", [False, True], ids=["output", "probs"])
def test_a_key_padding_batch_is_fed_the_key_padding_mask_the_python_batcher_merges(model_repository, seed000,  # noqa: F811
                                                                                    want_probs):
    """In-process (the test is the runner): requests of other key lengths, without a mask or with
    masks whose query rows are alike in each form: one batch fed a (B, Lk) key_padding_mask, equal
    to server.tensors.merge's for the same requests, so the engine picks the graphs the Python
    plane's batch takes (fused_key_padding once long enough); every answer is its own seed run."""
    from attnserve.server.graphs import KEY_PADDING, masking_of
    from attnserve.server.tensors import Work, merge

    from attnserve.contract import KEY_PADDING_MASK

    spec = read_model_spec(model_repository / "self_attention")
    engine = Engine(spec, choose_device("cpu"))
    plane = native.new_plane()
    index = plane.add_model(spec.name, str(spec.version), spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads,
                            32, spec.max_q_len, spec.max_kv_len, 1 << 30, 16, 0.9)
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
    rng = np.random.default_rng(13)
    cases = [inputs("self_attention", rng, 2, 10, 7, None), inputs("self_attention", rng, 1, 8, 5, None),
             _key_padding(inputs("self_attention", rng, 2, 10, 7, "b_q_k", dead_row=False)),
             _key_padding(inputs("self_attention", rng, 1, 9, 6, "q_k", dead_row=False)),
             _key_padding(heads_alike(inputs("self_attention", rng, 1, 10, 7, "b_h_q_k", dead_row=False), 8))]
    outputs = ("output", "attn_probs") if want_probs else ("output",)
    try:
        with (grpc.insecure_channel(f"127.0.0.1:{port}") as ch,
              concurrent.futures.ThreadPoolExecutor(len(cases)) as pool):
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            futures = []
            for x in cases:  # each queued before the next is sent: the batch's rows in this order
                futures.append(pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=outputs, **x),
                                           timeout=60))
                deadline = time.monotonic() + QUEUED_WITHIN_S
                while plane.queued(index) < len(futures):
                    assert time.monotonic() < deadline, f"{plane.queued(index)} of {len(futures)} calls queued"
                    time.sleep(0.005)
            batch = plane.next_batch(index, 1000)
            assert (batch.requests, batch.rows, batch.masking) == (len(cases), 7, 1)  # 1: key padding
            feeds = batch.feeds(spec.query_dim, spec.kv_dim)
            python, _ = merge([Work(x["query"], x["key"], x["value"], x["mask"], want_probs) for x in cases])
            assert sorted(feeds) == sorted(python) == ["key", KEY_PADDING_MASK, "query", "value"]
            for name in python:
                assert feeds[name].dtype == python[name].dtype and np.array_equal(feeds[name], python[name]), name
            assert masking_of(feeds) == KEY_PADDING
            output, attn_probs = engine.run(feeds, batch.want_probs)
            plane.complete(batch, output, attn_probs)
            answers = [outputs_of(f.result()) for f in futures]
    finally:
        plane.stop(1.0)
    for x, got in zip(cases, answers, strict=True):
        assert_close(got, want(seed000, x), names=outputs)


def test_a_partial_batch_waits_for_company_being_received_and_no_longer_than_the_queue_delay(model_repository):
    """In-process (the test is the runner), the batcher's max_queue_delay_s rule: a queued call
    and another whose message is still arriving (headers and most of it sent, over raw HTTP/2). The
    batch waits for it and takes both; with a short delay it goes without it, and the late call
    runs next; with nothing arriving it does not wait at all."""
    from tests.h2_client import RawGrpcClient, grpc_frame

    spec = read_model_spec(model_repository / "self_attention")
    engine = Engine(spec, choose_device("cpu"))
    plane = native.new_plane()
    index = plane.add_model(spec.name, "1", spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads, 32,
                            spec.max_q_len, spec.max_kv_len, 1 << 30, 16, 0.5)
    port = plane.start(["127.0.0.1:0"], 64 << 20, 100)
    rng = np.random.default_rng(14)

    def request() -> pb.ModelInferRequest:
        x = rng.standard_normal((1, 4, 512), dtype=np.float32)
        return infer_request("self_attention", outputs=("output",), query=x, key=x, value=x)

    def run(batch) -> None:
        output, _ = engine.run(batch.feeds(spec.query_dim, spec.kv_dim), False)
        plane.complete(batch, output, None)

    client = RawGrpcClient(port)
    deadline = time.monotonic() + QUEUED_WITHIN_S

    def until(state, what: str) -> None:
        while not state():
            assert time.monotonic() < deadline, what
            client.pump(0.01)

    try:
        with (grpc.insecure_channel(f"127.0.0.1:{port}") as ch,
              concurrent.futures.ThreadPoolExecutor(2) as pool):
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            client.open_window()
            for delay_us, waits in ((600_000_000, True), (300_000, False)):
                plane.set_queue_delay(index, delay_us)
                first = pool.submit(stub.ModelInfer, request(), timeout=60)
                until(lambda: plane.queued(index) == 1, "the first call queued")
                frame = grpc_frame(request().SerializeToString())
                late = client.start_call("/inference.GRPCInferenceService/ModelInfer", None)
                client.send_bytes(late, frame[:-16])
                until(lambda: plane.arriving() == 1, "the late call's headers in, its message not")
                formed = pool.submit(plane.next_batch, index, 60_000)
                if waits:  # company is coming: the batch waits for it (600 s would outlast the test)
                    client.send_bytes(late, frame[-16:], end=True)
                    assert formed.result(timeout=60).requests == 2
                    run(formed.result())
                else:  # the delay passes first: the batch goes alone, the late call in the next one
                    batch = formed.result(timeout=60)
                    assert batch.requests == 1 and plane.arriving() == 1
                    run(batch)
                    client.send_bytes(late, frame[-16:], end=True)
                    run(plane.next_batch(index, 60_000))
                until(lambda late=late: client.calls[late].ended, "the late call answered")
                assert client.calls[late].status == 0 and first.result().outputs[0].name == "output"
            plane.set_queue_delay(index, 600_000_000)  # nothing arriving: no wait (600 s would outlast the test)
            alone = pool.submit(stub.ModelInfer, request(), timeout=60)
            until(lambda: plane.queued(index) == 1, "the call queued")
            assert plane.arriving() == 0
            run(pool.submit(plane.next_batch, index, 60_000).result(timeout=60))
            assert alone.result().outputs[0].name == "output"
    finally:
        client.close()
        plane.stop(1.0)


# -- drain ---------------------------------------------------------------------------------------------

def test_a_drain_finishes_admitted_native_calls_and_refuses_new_ones(model_repository, eager_modules):
    """Six calls admitted on the native port, the first batch held at the gate, the rest queued
    (attnserve_native_in_flight says so); SIGTERM: ServerReady turns false, a new call is
    UNAVAILABLE, and once the gate opens every admitted call is answered exactly; exit 0.
    The gated engine has no head-mask graphs: such a mask is refused as the Python port does."""
    rng = np.random.default_rng(31)
    cases = [inputs("self_attention", rng, 1, 4, 5, None) for _ in range(6)]
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "1",
                     "--grace-period-s", "120") as proc, concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        port = proc.port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, proc.channel() as python_ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            differ = infer_request("self_attention", **inputs("self_attention", rng, 1, 3, 4, "b_h_q_k"))
            errors = []
            for s in (stub, pb_grpc.GRPCInferenceServiceStub(python_ch)):
                with pytest.raises(grpc.RpcError) as exc:
                    s.ModelInfer(differ, timeout=30)
                errors.append((exc.value.code(), exc.value.details()))
            assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT, errors
            futures = [pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x),
                                   timeout=120) for x in cases]
            assert proc.gate.wait_started() == 1
            deadline = time.monotonic() + QUEUED_WITHIN_S
            while _metric(proc.scrape(), "attnserve_native_in_flight") < len(cases):  # admitted: the state reached
                assert time.monotonic() < deadline, proc.scrape()
                time.sleep(0.01)
            proc.signal(signal.SIGTERM)
            proc.wait_for_log("refusing new calls (UNAVAILABLE)")
            assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
            with pytest.raises(grpc.RpcError) as late:
                stub.ModelInfer(infer_request("self_attention", **cases[0]), timeout=30)
            assert late.value.code() == grpc.StatusCode.UNAVAILABLE, late.value.details()
            proc.gate.release(100)
            for x, future in zip(cases, futures, strict=True):
                got = outputs_of(future.result(timeout=120))["output"]
                assert float(np.max(np.abs(got - eager(eager_modules["self_attention"], **x)["output"]))) <= 1e-5
        assert proc.wait(timeout=60) == 0, proc.log()


# -- ModelStreamInfer ----------------------------------------------------------------------------------

def test_a_stream_answers_in_request_order_exactly_and_goes_on_after_an_error(stub, seed000, eager_modules):  # noqa: F811
    """Answers in request order, each within 1e-5 of the seed; a refused request is answered in
    the stream (error_message with the status's name, its id) and the stream goes on; more
    requests than the stream window (reading pauses, then resumes) all answered."""
    rng = np.random.default_rng(41)
    good = {"a": ("self_attention", True, inputs("self_attention", rng, 2, 5, 6, "b_q_k")),
            "b": ("cross_attention", False, inputs("cross_attention", rng, 1, 4, 3, None)),
            "c": ("self_attention", True, inputs("self_attention", rng, 1, 6, 6, "b_h_q_k"))}
    requests = [infer_request(m, raw=raw, request_id=key, **x) for key, (m, raw, x) in good.items()]
    requests.insert(1, infer_request("self_attention", request_id="bad", **{**good["a"][2], "value": None}))
    requests.insert(3, infer_request("nope", request_id="gone", **good["b"][2]))
    small = inputs("cross_attention", rng, 1, 2, 2, None)
    requests += [infer_request("cross_attention", request_id=f"n{i}", outputs=("output",), **small) for i in range(100)]
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=120))
    assert [a.infer_response.id for a in answers] == [r.id for r in requests]
    by_id = {a.infer_response.id: a for a in answers}
    for key, (model, _raw, x) in good.items():
        assert by_id[key].error_message == ""
        assert_close(outputs_of(by_id[key].infer_response), want(reference(model, seed000, eager_modules), x))
    assert by_id["bad"].error_message.startswith("INVALID_ARGUMENT: "), by_id["bad"].error_message
    assert by_id["gone"].error_message.startswith("NOT_FOUND: "), by_id["gone"].error_message
    expected = want(reference("cross_attention", seed000, eager_modules), small)
    for i in range(100):
        assert_close(outputs_of(by_id[f"n{i}"].infer_response), expected, names=("output",))


def test_a_drain_answers_a_streams_admitted_requests_and_refuses_later_ones_in_the_stream(model_repository,
                                                                                        eager_modules):
    """A stream's three requests admitted (the first held at the gate); SIGTERM; a fourth sent
    after the refusal began is answered in the stream with UNAVAILABLE; the gate opens, the
    three are answered exactly, the client closes its side, the stream ends OK; exit 0."""
    import queue as queue_module

    rng = np.random.default_rng(51)
    cases = [inputs("self_attention", rng, 1, 4, 5, None) for _ in range(4)]
    outgoing: queue_module.Queue = queue_module.Queue()

    def requests():
        while (request := outgoing.get()) is not None:
            yield request

    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "1",
                     "--grace-period-s", "120") as proc, concurrent.futures.ThreadPoolExecutor(1) as pool:
        port = proc.port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(requests(), timeout=120)
            answers = pool.submit(list, stream)
            # Until one of its answers has shown its cost, a stream reads one request at a time (its
            # share of the memory budget, as on the Python plane): this one is answered first.
            outgoing.put(infer_request("self_attention", request_id="first", outputs=("output",), **cases[0]))
            assert proc.gate.wait_started() == 1
            proc.gate.release()
            for i, x in enumerate(cases[:3]):
                outgoing.put(infer_request("self_attention", request_id=f"r{i}", outputs=("output",), **x))
            assert proc.gate.wait_started() == 1
            deadline = time.monotonic() + QUEUED_WITHIN_S
            while _metric(proc.scrape(), "attnserve_native_in_flight") < 3:  # admitted: the state reached
                assert time.monotonic() < deadline, proc.scrape()
                time.sleep(0.01)
            proc.signal(signal.SIGTERM)
            proc.wait_for_log("refusing new calls (UNAVAILABLE)")
            outgoing.put(infer_request("self_attention", request_id="late", outputs=("output",), **cases[3]))
            proc.gate.release(100)
            outgoing.put(None)  # the client closes its side
            got = answers.result(timeout=120)
        assert [a.infer_response.id for a in got] == ["first", "r0", "r1", "r2", "late"]
        got = got[1:]
        for x, answer in zip(cases[:3], got, strict=False):
            assert answer.error_message == ""
            out = outputs_of(answer.infer_response)["output"]
            assert float(np.max(np.abs(out - eager(eager_modules["self_attention"], **x)["output"]))) <= 1e-5
        assert got[3].error_message.startswith("UNAVAILABLE: "), got[3].error_message
        assert proc.wait(timeout=60) == 0, proc.log()
