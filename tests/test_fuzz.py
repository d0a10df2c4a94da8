"""Property-based attack on ModelInfer: malformed requests are refused with a proper status, and
the server goes on answering good requests correctly, within bounded memory.

Hypothesis builds requests from a valid one and breaks them: random and absurd shapes (negative,
zero, 1<<40, 2**63-1, wrong rank), wrong datatypes, raw byte counts and typed value counts off by
a few, typed contents in the wrong field, raw and typed mixed, raw entries missing or extra,
tensors missing, duplicated, renamed or unknown, unknown and duplicate outputs, unknown models;
and, separately, bytes that do not parse as a ModelInferRequest at all. Every answer must be a
status other than UNKNOWN and INTERNAL (a request that happens to be valid may be answered OK,
and then its output shapes are checked).

Figures (examples tried, answers by status, the server's peak resident memory) are printed
(`pytest -s`) and, when ATTNSERVE_FIGURES is set, appended to that file as JSON lines.
"""

from __future__ import annotations

import collections
import json
import os
import re
import time

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess

DIMS = {"self_attention": (512, 512, 512, 8), "cross_attention": (32, 32, 32, 2)}  # q, kv, out, heads
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
MAX_EXAMPLES = 300
ABSURD_DIMS = [-1, -(1 << 40), 1 << 31, 1 << 40, (1 << 63) - 1, 4097, 1 << 20]
DATATYPES = ["FP32", "BOOL", "FP16", "FP64", "INT32", "INT64", "UINT8", "BYTES", "", "fp32", "bool", "FP32 "]
TYPED_FIELDS = ["fp32_contents", "bool_contents", "int_contents", "int64_contents", "fp64_contents",
                "uint_contents", "bytes_contents"]
TENSOR_NAMES = ["query", "key", "value", "mask", "bias", "", "QUERY", "query\x00"]
OUTPUT_NAMES = ["output", "attn_probs", "logits", "", "OUTPUT"]
_FIGURES: dict = {"answers": collections.Counter(), "examples": 0, "stream_examples": 0, "garbage_examples": 0}


@pytest.fixture(scope="module")
def fuzz_server(model_repository):
    proc = ServerProcess(model_repository)
    _FIGURES["idle_rss_kib"] = proc.memory_kib("VmRSS")
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]  # already stopped by the last test, unless it failed


@pytest.fixture(scope="module")
def stub(fuzz_server):
    with fuzz_server.channel() as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


# -- the requests -----------------------------------------------------------------------------

def _count(shape: list[int]) -> int:
    """Element count to send for a (possibly absurd) shape: the real one when it is small."""
    if all(0 <= d <= 4096 for d in shape):
        n = int(np.prod(shape, dtype=object)) if shape else 1
        if n <= 1 << 16:
            return n
    return 7  # a shape no data could fill: send a little


@st.composite
def malformed_requests(draw):
    model = draw(st.sampled_from(["cross_attention"] * 4 + ["self_attention", "no_such_model", ""]))
    q_dim, kv_dim, _, _ = DIMS.get(model, DIMS["cross_attention"])
    b, lq, lk = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    tensors = [["query", "FP32", [b, lq, q_dim]], ["key", "FP32", [b, lk, kv_dim]], ["value", "FP32", [b, lk, kv_dim]]]
    if draw(st.booleans()):
        tensors.append(["mask", "BOOL", [b, lq, lk]])
    raw = draw(st.booleans())
    deltas = [0] * len(tensors)  # data length offsets, in elements
    typed_field = {}  # tensor index -> the typed field used instead of the right one
    both = set()  # tensor indexes carrying raw and typed contents
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["drop", "duplicate", "rename", "datatype", "dim", "rank", "length",
                                     "field", "both"]))
        if not tensors:
            break
        i = draw(st.integers(0, len(tensors) - 1))
        if kind == "drop":
            del tensors[i], deltas[i]
        elif kind == "duplicate":
            tensors.append([tensors[i][0], tensors[i][1], list(tensors[i][2])])
            deltas.append(deltas[i])
        elif kind == "rename":
            tensors[i][0] = draw(st.sampled_from(TENSOR_NAMES))
        elif kind == "datatype":
            tensors[i][1] = draw(st.sampled_from(DATATYPES) | st.text(max_size=6))
        elif kind == "dim":
            axis = draw(st.integers(0, len(tensors[i][2]) - 1)) if tensors[i][2] else 0
            if tensors[i][2]:
                tensors[i][2][axis] = draw(st.sampled_from(ABSURD_DIMS) | st.integers(0, 8))
        elif kind == "rank":
            tensors[i][2] = draw(st.lists(st.integers(0, 6) | st.sampled_from(ABSURD_DIMS), max_size=5))
        elif kind == "length":
            deltas[i] = draw(st.integers(-5, 5).filter(bool))
        elif kind == "field":
            typed_field[i] = draw(st.sampled_from(TYPED_FIELDS))
        else:
            both.add(i)
    raw_entries = len(tensors) + (draw(st.sampled_from([-1, 1])) if raw and draw(st.integers(0, 9)) == 0 else 0)
    outputs = draw(st.lists(st.sampled_from(OUTPUT_NAMES), max_size=3))
    if not any(o not in ("output", "attn_probs") for o in outputs) and draw(st.booleans()):
        outputs = [o for o in outputs if o in ("output", "attn_probs")]  # often a valid selection

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    request = pb.ModelInferRequest(model_name=model, id=draw(st.text(max_size=8)))
    for i, (name, datatype, shape) in enumerate(tensors):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        n = max(_count(shape) + deltas[i], 0)
        is_bool = datatype == "BOOL"
        if raw or i in both:
            if i < raw_entries:
                values = rng.random(n) > 0.3 if is_bool else rng.standard_normal(n, dtype=np.float32)
                data = values.tobytes()
                request.raw_input_contents.append(data)
        if not raw or i in both:
            field = typed_field.get(i, "bool_contents" if is_bool else "fp32_contents")
            values = rng.standard_normal(n)
            if field == "bool_contents":
                values = values > 0
            elif field == "bytes_contents":
                values = [bytes([int(abs(v) * 10) % 256]) for v in values]
            elif field in ("int_contents", "int64_contents", "uint_contents"):
                values = np.abs(values * 100).astype(np.int64)
            getattr(tensor.contents, field).extend(list(values) if field == "bytes_contents" else values.tolist())
    for _ in range(len(tensors), raw_entries):
        request.raw_input_contents.append(b"\x00" * 12)
    for name in outputs:
        request.outputs.add(name=name)
    return request


# -- the checks -----------------------------------------------------------------------------

def _check_ok(request: pb.ModelInferRequest, response: pb.ModelInferResponse) -> None:
    """A request answered OK must have been valid: its outputs have the shapes it implies."""
    shapes = {t.name: list(t.shape) for t in request.inputs}
    _, _, out_dim, heads = DIMS[request.model_name]
    b, lq, _ = shapes["query"]
    lk = shapes["key"][1]
    want = {"output": [b, lq, out_dim], "attn_probs": [b, heads, lq, lk]}
    asked = [o.name for o in request.outputs] or ["output", "attn_probs"]
    got = outputs_of(response)
    assert list(got) == asked
    for name, array in got.items():
        assert list(array.shape) == want[name]
        assert np.isfinite(array).all()


def _status_of_stream_error(message: str) -> grpc.StatusCode:
    name = message.split(":", 1)[0]
    return grpc.StatusCode[name]


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=malformed_requests(), via_stream=st.integers(0, 5).map(lambda i: i == 0))
def test_malformed_requests_get_a_proper_status(stub, request, via_stream):
    _FIGURES["examples"] += 1
    if via_stream:
        _FIGURES["stream_examples"] += 1
        (reply,) = list(stub.ModelStreamInfer(iter([request]), timeout=30))
        if not reply.error_message:
            _FIGURES["answers"]["OK"] += 1
            _check_ok(request, reply.infer_response)
            return
        code = _status_of_stream_error(reply.error_message)
    else:
        try:
            response = stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as err:
            code = err.code()
        else:
            _FIGURES["answers"]["OK"] += 1
            _check_ok(request, response)
            return
    _FIGURES["answers"][code.name] += 1
    assert code not in FORBIDDEN, (code, request)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.binary(min_size=1, max_size=256))
def test_bytes_that_are_not_a_request_get_invalid_argument(fuzz_server, data):
    _FIGURES["garbage_examples"] += 1
    with fuzz_server.channel() as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            call(data, timeout=30)
        except grpc.RpcError as err:
            code = err.code()
        else:
            pytest.fail(f"{data!r} was answered OK")
    _FIGURES["answers"][code.name] += 1
    assert code not in FORBIDDEN, (code, data)


@pytest.fixture(scope="module")
def attacked(fuzz_server, stub):
    """Both attacks have been run against `fuzz_server`: by their own tests earlier in this module,
    or here, when this module's tests run in another order or alone (`-k after_the_attack`)."""
    if not _FIGURES["examples"]:
        test_malformed_requests_get_a_proper_status(stub=stub)
    if not _FIGURES["garbage_examples"]:
        test_bytes_that_are_not_a_request_get_invalid_argument(fuzz_server=fuzz_server)
    return _FIGURES


def test_after_the_attack_the_server_answers_correctly_and_its_memory_stayed_bounded(
        fuzz_server, stub, attacked, eager_modules):
    assert attacked["examples"] and attacked["garbage_examples"], attacked
    rng = np.random.default_rng(99)
    for model, (q_dim, kv_dim, _, _) in DIMS.items():
        x = random_inputs(rng, 2, 6, 9, q_dim, kv_dim, masked=True)
        got = outputs_of(stub.ModelInfer(infer_request(model, **x), timeout=30))
        want = eager(eager_modules[model], **x)
        for name in ("output", "attn_probs"):
            assert float(np.max(np.abs(got[name] - want[name]))) <= 1e-5
    assert fuzz_server.health() == 1  # SERVING
    log = fuzz_server.log()
    assert "Traceback" not in log, log[-3000:]  # nothing unexpected was raised
    peak = fuzz_server.memory_kib("VmHWM")
    _FIGURES.update(peak_rss_kib=peak, tried=_FIGURES["examples"] + _FIGURES["garbage_examples"],
                    answers=dict(_FIGURES["answers"]))
    handled = sum(n for code, n in _FIGURES["answers"].items() if code not in {c.name for c in FORBIDDEN})
    _FIGURES["handled"] = handled
    print(f"\nfuzz figures: {json.dumps(_FIGURES, sort_keys=True)}")
    if os.environ.get("ATTNSERVE_FIGURES"):
        with open(os.environ["ATTNSERVE_FIGURES"], "a") as f:
            f.write(json.dumps({"test": "fuzz", "at": time.time(), **_FIGURES}, sort_keys=True) + "\n")
    # Small requests only: memory must stay near idle (nothing absurd was ever allocated).
    assert peak < _FIGURES["idle_rss_kib"] + 256 * 1024, _FIGURES
    # Every call, the unparseable ones included, ended: SIGTERM finds none in flight, so the drain
    # waits for nothing (the server's own account, not a guess of how long its exit takes); exit 0.
    assert fuzz_server.stop() == 0
    log = fuzz_server.log()
    assert re.search(r"stopped after [\d.]+s \(0 call\(s\) in flight when new calls were refused", log), log[-3000:]
    assert "unfinished; refusing queued ones" not in log, "draining waited for calls that had already been answered"
