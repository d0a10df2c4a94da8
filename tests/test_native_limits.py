"""The native data plane keeps the server's memory bounds (docs/memory.md, "The native data plane's memory bounds").

Against real `attnserve serve --data-plane native` processes, each bound answered on the native
port with the Python port's status and words (the same request sent to both), the plane serving
the next call after each and the server's peak memory bounded:
- the memory budget: a request that could never fit (INVALID_ARGUMENT), and, on a gated server
  (tests/gated_server.py), one without a deadline that does not fit now beside a held call
  (RESOURCE_EXHAUSTED), whichever plane holds the call: the two planes share one budget (its
  waits: tests/test_native_waits.py);
- an answer over --max-message-bytes, typed inputs or a typed answer over --max-typed-bytes;
- a stream's answers bounded by its share of the budget (service.STREAM_BUDGET_SHARE): a stream
  of calls that would not fit the budget together is answered whole;
- a stream message that does not parse ends the stream with INVALID_ARGUMENT after the answers
  before it;
- --max-receiving-bytes as the native port's receive slots (server.gate.ReceiveSlots' rule): a
  message beyond them is held back by flow control until a slot is free, then read and answered.
The native cost figures are checked against server.memory.costs.request_cost in-process.
Skips, saying why, where the extension is not built (`make native`).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
import zlib

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native
from attnserve.server.memory.costs import AttentionDims, request_cost
from attnserve.server.repository import read_model_spec

from attnserve.contract import ALL_OUTPUTS, HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_OUTPUT_ONLY, OUTPUT_ONLY
from tests.gated_server import GatedServer
from tests.h2_client import RawGrpcClient, grpc_frame
from tests.oip import infer_request, refusal
from tests.server_process import ServerProcess
from tests.test_mask_shapes import DIMS

WHY_NOT = native.why_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

MiB = 1 << 20
MESSAGE_BYTES = 2 * MiB
TYPED_BYTES = 64 << 10
BUDGET_BYTES = 48 * MiB
PEAK_GROWTH_KIB = 256 << 10  # as the hostile tests bound it
REACHED_WITHIN_S = 60.0  # a bound on waiting for a state the test caused, not a guess of speed
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def _dims(model_repository, model: str) -> AttentionDims:
    spec = read_model_spec(model_repository / model)
    d_model = spec.d_model or max(spec.query_dim, spec.kv_dim, spec.out_dim)
    return AttentionDims(spec.query_dim, spec.kv_dim, d_model, spec.out_dim, spec.num_heads)


def _x(model: str, b: int, lq: int, lk: int, seed: str) -> dict:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    width = DIMS[model][0]
    return {"query": rng.standard_normal((b, lq, width), dtype=np.float32),
            "key": rng.standard_normal((b, lk, width), dtype=np.float32),
            "value": rng.standard_normal((b, lk, width), dtype=np.float32)}


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def _until_reserved_is_zero(proc: ServerProcess) -> None:
    """Answers are released once sent (the call's end, just after the client has it)."""
    deadline = time.monotonic() + REACHED_WITHIN_S
    while _metric(proc.scrape(), "attnserve_memory_reserved_bytes") != 0:
        assert time.monotonic() < deadline, proc.scrape()
        time.sleep(0.01)


def _native_channel(proc: ServerProcess) -> grpc.Channel:
    options = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    return grpc.insecure_channel(f"127.0.0.1:{proc.native_port}", options=options)


def _good(stub) -> None:
    """The plane serves the next call."""
    answer = stub.ModelInfer(infer_request("self_attention", outputs=("output",),
                                           **_x("self_attention", 1, 3, 4, "next")), timeout=60)
    assert [t.name for t in answer.outputs] == ["output"]


# -- the cost model ------------------------------------------------------------------------------


def test_native_cost_is_request_cost(model_repository):
    """The plane's per-call figures are server.memory.costs.request_cost's, on the graph the
    engine takes for the batch (attn_probs asked: all outputs; heads differ: the head-mask graphs)."""
    from attnserve.server import _native
    from attnserve.server.memory.costs import native_cost_terms

    plane = native.new_plane()
    plane.set_budget(_native.Budget(1 << 40, 1 << 37), native_cost_terms(), 0.25)
    for index, model in enumerate(sorted(DIMS)):
        dims = _dims(model_repository, model)
        assert plane.add_model(model, "1", dims.query_dim, dims.kv_dim, dims.out_dim, dims.num_heads, 32, 8192,
                               8192, 2 << 30, 512, 0.5) == index
        plane.set_model_bounds(index, dims.d_model, 0, 0, 4096)
        for rows, lq, lk in ((1, 1, 1), (3, 10, 7), (2, 300, 900), (8, 1024, 1024)):
            input_bytes = 4 * rows * (lq * dims.query_dim + 2 * lk * dims.kv_dim) + rows * lq * lk
            for want_probs, heads_differ in ((False, False), (True, False), (False, True), (True, True)):
                kind = ((HEAD_MASK_ALL_OUTPUTS if want_probs else HEAD_MASK_OUTPUT_ONLY) if heads_differ
                        else (ALL_OUTPUTS if want_probs else OUTPUT_ONLY))
                want = request_cost(kind, dims, rows, lq, lk, input_bytes, want_probs)
                got = plane.cost(index, rows, lq, lk, input_bytes, want_probs, heads_differ)
                assert got == (want.inputs, want.run, want.answer), (model, rows, lq, lk, want_probs, heads_differ)


# -- a merged batch's bounds, in-process (the test is the runner) --------------------------------------


def _merged_plane(model_repository, max_attention_bytes: int, crossover: int = 0, budget=None):
    """A plane serving self_attention whose fused graphs run from sqrt(Lq * Lk) >= crossover (0: not
    loaded), started on a loopback port; (plane, index, port, engine)."""
    from attnserve.server.codec import native_graph_terms
    from attnserve.server.engine import Engine, choose_device
    from attnserve.server.graphs import GraphSet
    from attnserve.server.memory.costs import native_cost_terms

    from attnserve.contract import FUSED, FUSED_KEY_PADDING

    spec = read_model_spec(model_repository / "self_attention")
    plane = native.new_plane()
    if budget is not None:
        plane.set_budget(budget, native_cost_terms(), 0.25)
    index = plane.add_model(spec.name, "1", spec.query_dim, spec.kv_dim, spec.out_dim, spec.num_heads, 32,
                            spec.max_q_len, spec.max_kv_len, max_attention_bytes, 16, 0.9)
    fused = {FUSED: crossover, FUSED_KEY_PADDING: crossover} if crossover else {}
    plane.set_graphs(index, **native_graph_terms(GraphSet(frozenset({ALL_OUTPUTS, OUTPUT_ONLY, *fused}), fused)))
    plane.set_model_bounds(index, spec.d_model or spec.query_dim, 0, 0, 4096)
    return plane, index, plane.start(["127.0.0.1:0"], 64 << 20, 100), Engine(spec, choose_device("cpu"))


def _batches(plane, index: int, port: int, engine, cases: list[tuple[int, int, bool]], during=None) -> list[int]:
    """Send one output-only call per (lq, lk, masked) case, in order, each queued before the next
    is sent; then run every batch the plane forms on the real engine (`during(batch)` first): the
    number of requests in each batch, in order. Every call is answered."""
    rng = np.random.default_rng(21)
    futures = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        for lq, lk, masked in cases:
            x = {"query": rng.standard_normal((1, lq, 512), dtype=np.float32),
                 "key": rng.standard_normal((1, lk, 512), dtype=np.float32)}
            x["value"] = x["key"]
            if masked:  # a mask that needs the whole (Lq, Lk) matrix: rows differ
                x["mask"] = np.ones((1, lq, lk), dtype=np.bool_)
                x["mask"][0, 1:, 0] = False
            futures.append(pool.submit(stub.ModelInfer, infer_request("self_attention", outputs=("output",), **x),
                                       timeout=60))
            deadline = time.monotonic() + REACHED_WITHIN_S
            while plane.queued(index) < len(futures):  # queued in this order: the service order
                assert time.monotonic() < deadline and not futures[-1].done(), "the call was not queued"
                time.sleep(0.005)
        sizes = []
        try:
            while sum(sizes) < len(cases):
                batch = plane.next_batch(index, 1000)
                assert batch is not None
                sizes.append(batch.requests)
                if during is not None:
                    during(batch)
                output, _ = engine.run(batch.feeds(512, 512), False)
                plane.complete(batch, output, None)
            for future in futures:
                assert future.result().outputs[0].name == "output"
        finally:
            plane.stop(1.0)
    return sizes


def test_a_batch_on_the_flash_path_stays_on_it(model_repository):
    """A request on the flash path (no mask, fused from 4) holds no scores, so the attention bound
    never counted them: a masked request cannot join it (their run would hold them all), as in
    server.batcher. The other way round, the flash request joins the masked one's run."""
    bound = 4 * 8 * 16 * 16  # one (1, 16, 16) request's matrix on 8 heads
    plane, index, port, engine = _merged_plane(model_repository, bound, crossover=4)
    assert _batches(plane, index, port, engine, [(16, 16, False), (8, 8, True)]) == [1, 1]
    plane, index, port, engine = _merged_plane(model_repository, 4 * 8 * 2 * 16 * 16, crossover=4)
    assert _batches(plane, index, port, engine, [(8, 8, True), (16, 16, False)]) == [2]


def test_a_merged_batch_keeps_within_the_attention_bound(model_repository):
    """Each (1, 16, 16) masked request is within --max-attention-bytes alone; two merged would
    hold twice its matrix, over the bound: one per batch. With room for both, one batch."""
    one = 4 * 8 * 16 * 16
    plane, index, port, engine = _merged_plane(model_repository, one)
    assert _batches(plane, index, port, engine, [(16, 16, True), (16, 16, True)]) == [1, 1]
    plane, index, port, engine = _merged_plane(model_repository, 2 * one)
    assert _batches(plane, index, port, engine, [(16, 16, True), (16, 16, True)]) == [2]


def test_a_merged_runs_memory_beyond_its_requests_is_reserved_or_they_run_apart(model_repository):
    """Two requests whose merged run holds more than their own reservations (the short one's
    padding): with that much free beside them they run together and the batch holds the extra
    until it is settled; with a byte less, apart (server.batcher's costing rule)."""
    from attnserve.server import _native
    from attnserve.server.memory.costs import native_cost_terms

    def cost(lq: int, lk: int, rows: int = 1) -> tuple[int, int, int]:
        plane = native.new_plane()
        plane.set_budget(_native.Budget(1 << 40, 0), native_cost_terms(), 0.25)
        index = plane.add_model("m", "1", 512, 512, 512, 8, 32, 4096, 4096, 1 << 40, 16, 0.9)
        plane.set_model_bounds(index, 512, 0, 0, 4096)
        return plane.cost(index, rows, lq, lk, 4 * rows * (lq * 512 + 2 * lk * 512), False, False)

    short, long = cost(4, 4), cost(64, 64)
    needed = cost(64, 64, rows=2)[1] - short[1] - long[1]
    assert needed > 0
    room = 1 << 20
    for spare, want in ((needed - 1, [1, 1]), (needed, [2])):
        budget = _native.Budget(room + sum(short) + sum(long) + spare, room)
        plane, index, port, engine = _merged_plane(model_repository, 1 << 30, budget=budget)
        held = []
        assert _batches(plane, index, port, engine, [(4, 4, False), (64, 64, False)],
                        during=lambda batch, held=held, budget=budget: held.append(budget.reserved())) == want, spare
        if want == [2]:
            assert held == [sum(short) + sum(long) + needed]
        deadline = time.monotonic() + REACHED_WITHIN_S
        while budget.reserved() != 0:  # the calls' own go back once their answers are sent
            assert time.monotonic() < deadline, budget.reserved()
            time.sleep(0.005)


# -- one server with small bounds ------------------------------------------------------------------


BOUNDS = ("--max-message-bytes", str(MESSAGE_BYTES), "--max-typed-bytes", str(TYPED_BYTES),
          "--memory-limit-bytes", str(BUDGET_BYTES), "--max-receiving-bytes", str(MESSAGE_BYTES))


@pytest.fixture(scope="module")
def bounded_server(model_repository):
    proc = ServerProcess(model_repository, "--data-plane", "native", *BOUNDS)
    proc.native_port = proc.port
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def python_bounded_server(model_repository):
    """The same bounds on the Python plane: the words the native plane's refusals must equal."""
    proc = ServerProcess(model_repository, "--data-plane", "python", *BOUNDS)
    yield proc
    proc.stop()


def _bounded_cases() -> dict[str, tuple[pb.ModelInferRequest, str]]:
    """Each case's request and the start of the Python plane's words for it."""
    return {
        # (1, 2000, 2000) scores: its run could never fit the 48 MiB budget, its message and answer are small.
        "never_fits": (infer_request("cross_attention", outputs=("output",),
                                     **_x("cross_attention", 1, 2000, 2000, "never")),
                       "model cross_attention: this request (inputs "),
        # attn_probs (1, 8, 300, 300): 2.9 MB, over the 2 MiB message limit; the request is 1.8 MB.
        "answer_over_message_limit": (infer_request("self_attention", request_id="big",
                                                    **_x("self_attention", 1, 300, 300, "answer")),
                                      "the response would need "),
        "typed_inputs": (infer_request("self_attention", raw=False, outputs=("output",),
                                       **_x("self_attention", 1, 20, 20, "typed in")),
                         "typed contents: its inputs would hold 122,880 bytes"),
        "typed_answer": (infer_request("cross_attention", raw=False, **_x("cross_attention", 1, 100, 100, "typed out")),
                         "typed contents: its answer would hold 92,800 bytes"),
    }


@pytest.mark.parametrize("case", sorted(_bounded_cases()))
def test_a_bound_is_refused_with_the_python_planes_words(bounded_server, python_bounded_server, case):
    request, words = _bounded_cases()[case]
    before_kib = bounded_server.memory_kib("VmHWM")
    with _native_channel(bounded_server) as ch, python_bounded_server.channel() as python_ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        got = refusal(stub, request)
        want = refusal(pb_grpc.GRPCInferenceServiceStub(python_ch), request)
        assert got == want, (got, want)
        assert got[0] == grpc.StatusCode.INVALID_ARGUMENT and got[1].startswith(words), got
        _good(stub)
    assert bounded_server.memory_kib("VmHWM") - before_kib < PEAK_GROWTH_KIB


def test_a_stream_message_that_does_not_parse_ends_the_stream(bounded_server):
    """Two answers, then INVALID_ARGUMENT with a message, on both planes; the plane serves on."""
    good = [infer_request("self_attention", request_id=f"r{i}", outputs=("output",),
                          **_x("self_attention", 1, 3, 4, f"s{i}")).SerializeToString() for i in range(2)]
    sent = [*good, b"\xff\xff\xff\xff", good[0]]
    results = []
    with _native_channel(bounded_server) as ch, bounded_server.channel() as python_ch:
        for channel in (ch, python_ch):
            call = channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                         response_deserializer=pb.ModelStreamInferResponse.FromString)
            answers = []
            with pytest.raises(grpc.RpcError) as exc:
                for answer in call(iter(sent), timeout=60):
                    answers.append(answer)
            results.append(([(a.error_message, a.infer_response.id) for a in answers], exc.value.code()))
            assert "does not parse" in exc.value.details(), exc.value.details()
        assert results[0] == results[1] == ([("", "r0"), ("", "r1")], grpc.StatusCode.INVALID_ARGUMENT), results
        _good(pb_grpc.GRPCInferenceServiceStub(ch))


def _receive_figures(proc: ServerProcess) -> dict[str, float]:
    """attnserve_receive_* on /metrics: slots, messages, deferred."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    names = {"attnserve_receive_slots": "slots", "attnserve_receiving_messages": "messages",
             "attnserve_receive_deferred_total": "deferred"}
    return {names[line.split()[0]]: float(line.split()[1]) for line in text.splitlines()
            if line.split() and line.split()[0] in names}


def test_receive_slots_hold_a_second_message_back_until_the_first_is_read(bounded_server):
    """--max-receiving-bytes (one 2 MiB message here) gives the native port one receive slot, the
    Python port's rule and number (server.gate.ReceiveSlots): while a first call's 1.8 MB message is
    incomplete, a second call's message is held back by HTTP/2 flow control (not read, not shed:
    gRPC's ResourceQuota, which this replaced, refused such calls). Once the first is read, the
    second is; both are answered, and the plane serves on."""
    request = infer_request("self_attention", outputs=("output",), **_x("self_attention", 1, 300, 300, "quota"))
    frame = grpc_frame(request.SerializeToString())
    before = _receive_figures(bounded_server)
    client = RawGrpcClient(bounded_server.port)
    deadline = time.monotonic() + REACHED_WITHIN_S

    def pump_until(state, what: str) -> None:
        while not state():
            assert time.monotonic() < deadline, f"not within {REACHED_WITHIN_S}s: {what}"
            assert not client.closed, "the server closed the connection"
            client.pump(0.05)

    try:
        client.open_window()  # answers are read as they come
        first = client.start_call(INFER, None)
        client.send_bytes(first, frame[:-16])
        second = client.start_call(INFER, None)
        client.send_bytes(second, frame[:-16])
        pump_until(lambda: client.unsent_bytes(first) == 0 and client.window_blocked(second),
                   "the first message let in, the second held back")
        held = _receive_figures(bounded_server)
        assert held["slots"] == 1 and held["messages"] == 1, held
        assert held["deferred"] - before["deferred"] == 1, (before, held)
        client.send_bytes(first, frame[-16:], end=True)
        pump_until(lambda: client.calls[first].ended and client.unsent_bytes(second) == 0,
                   "the first answered, the second let in")
        client.send_bytes(second, frame[-16:], end=True)
        pump_until(lambda: client.calls[second].ended, "the second answered")
    finally:
        client.close()
    for sid in (first, second):
        assert client.calls[sid].status == 0, (client.calls[sid].status, client.calls[sid].message)
    assert _receive_figures(bounded_server)["messages"] == 0
    with _native_channel(bounded_server) as ch:
        _good(pb_grpc.GRPCInferenceServiceStub(ch))


# -- one budget, both planes (a gated server) --------------------------------------------------------

HELD = ("self_attention", 1, 128, 128)  # with attn_probs: a few MiB of budget


@pytest.fixture(scope="module")
def held_cost(model_repository) -> int:
    model, rows, lq, lk = HELD
    dims = _dims(model_repository, model)
    input_bytes = 4 * rows * (lq * dims.query_dim + 2 * lk * dims.kv_dim)
    return request_cost(ALL_OUTPUTS, dims, rows, lq, lk, input_bytes, True).total


@pytest.fixture(scope="module")
def gated(model_repository, held_cost):
    """One HELD call fits the budget, two do not (the waiting room, an eighth, stays free)."""
    with GatedServer(model_repository, "--data-plane", "native", "--max-batch-size", "1",
                     "--memory-limit-bytes", str(held_cost * 3 // 2), "--grace-period-s", "120") as proc:
        proc.native_port = proc.port
        yield proc


def _held_request(seed: str, request_id: str = "") -> pb.ModelInferRequest:
    model, rows, lq, lk = HELD
    return infer_request(model, request_id=request_id, **_x(model, rows, lq, lk, seed))


@pytest.mark.parametrize("holder", ["native", "python"])
def test_both_planes_take_from_one_budget(gated, held_cost, holder):
    """A call held at the gate on one plane keeps the budget's room: the same call without a
    deadline on either plane is refused RESOURCE_EXHAUSTED with the same words (a call with one
    waits: tests/test_native_waits.py); once it is answered, both serve again."""
    limit = held_cost * 3 // 2
    _until_reserved_is_zero(gated)
    with _native_channel(gated) as ch, gated.channel() as python_ch, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        stubs = {"native": pb_grpc.GRPCInferenceServiceStub(ch), "python": pb_grpc.GRPCInferenceServiceStub(python_ch)}
        first = pool.submit(stubs[holder].ModelInfer, _held_request("held"), timeout=120)
        assert gated.gate.wait_started() == 1
        # No deadline: shed at once rather than waiting within one.
        refusals = {name: refusal(stub, _held_request("second"), timeout=None) for name, stub in stubs.items()}
        gated.gate.release()
        assert len(first.result(timeout=120).outputs) == 2
        _until_reserved_is_zero(gated)
        for name in ("native", "python"):
            again = pool.submit(stubs[name].ModelInfer, _held_request("again"), timeout=120)
            gated.gate.wait_started()
            gated.gate.release()
            assert len(again.result(timeout=120).outputs) == 2
            _until_reserved_is_zero(gated)
    words = f"memory budget: {held_cost:,} of {limit:,} bytes in use (--memory-limit-bytes), 0 request(s) waiting; "
    for name, (code, details) in refusals.items():
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(words), (name, details)
    assert refusals["native"] == refusals["python"], refusals


def test_a_streams_answers_are_bounded_by_its_share(gated):
    """Six calls that together would need four times the budget, in one stream: the stream reads
    on only while its calls in flight and unsent answers fit its share (a quarter of the budget;
    one call always goes), so every call is answered, none shed for memory. Without the share the
    stream reads them all while the first is held, and the budget sheds the second."""
    _until_reserved_is_zero(gated)
    count = 6

    def release_each() -> None:
        for _ in range(count):
            gated.gate.wait_started()
            gated.gate.release()

    with _native_channel(gated) as ch, concurrent.futures.ThreadPoolExecutor(1) as pool:
        releaser = pool.submit(release_each)
        requests = [_held_request(f"stream {i}", request_id=f"r{i}") for i in range(count)]
        answers = list(pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter(requests), timeout=120))
        assert [(a.error_message, a.infer_response.id) for a in answers] == [("", f"r{i}") for i in range(count)]
        releaser.result(timeout=120)
    assert all(len(a.infer_response.raw_output_contents) == 2 for a in answers)
    _until_reserved_is_zero(gated)


# -- malformed requests: the Python plane's words ------------------------------------------------


def _malformed_cases() -> dict[str, bytes]:
    """Requests codec.decode and server.parsing refuse, as bytes on the wire (some are no message)."""
    from attnserve.proto import wire
    from attnserve.server import parsing

    from tests.test_server import _bad_requests

    cases = {name: request.SerializeToString() for name, (request, _) in _bad_requests().items()
             if request.ByteSize() < MESSAGE_BYTES}
    x = _x("self_attention", 2, 3, 4, "malformed")
    mask = np.ones((2, 3, 4), np.bool_)

    def request(edit, **kw) -> bytes:
        r = infer_request("self_attention", **{**x, **kw})
        edit(r)
        return r.SerializeToString()

    def add_duplicate(r):
        r.inputs.add().CopyFrom(r.inputs[0])
        r.raw_input_contents.append(r.raw_input_contents[0])

    def set_shape(index, shape):
        return lambda r: r.inputs[index].shape.__setitem__(slice(None), shape)

    def parameters(where, count):
        def edit(r):
            target = r if where == "request" else r.inputs[0] if where == "input" else r.outputs.add(name="output")
            for i in range(count):
                target.parameters[f"p{i}"].int64_param = i
        return edit

    def renamed(r):
        r.inputs[0].name = "q\u00e9ry\x00" + "x" * 80
        parameters("input", parsing.MAX_PARAMETERS + 1)(r)

    cases |= {
        "duplicate": request(add_duplicate),
        "mask rank 5": request(set_shape(3, [2, 1, 1, 3, 4]), mask=mask),
        "mask of a million dims": request(set_shape(3, [1] * 1_000_000), mask=mask),
        "negative dim": request(set_shape(1, [2, -4, 512])),
        "zero rows": request(set_shape(0, [0, 3, 512])),
        "mask shape, zero rows": request(lambda r: [r.inputs[i].shape.__setitem__(0, 0) for i in range(3)]
                                         + [set_shape(3, [0, 3, 5])(r)], mask=mask),
        "rows no answer could hold": request(lambda r: [r.inputs[i].shape.__setitem__(0, 1 << 62) for i in range(3)]),
        "typed rows no message could hold": request(
            lambda r: [r.inputs[i].shape.__setitem__(0, 1 << 40) for i in range(3)], raw=False),
        "outputs repeated": request(lambda r: [r.outputs.add(name="attn_probs") for _ in range(40)]),
        "unknown output quoted": request(lambda r: r.outputs.add(name="o'\u2028" + "p" * 200)),
        "unknown datatype quoted": request(lambda r: setattr(r.inputs[1], "datatype", "F\"P'32" * 40)),
        "raw entries for inputs": request(lambda r: r.raw_input_contents.append(b"")),
        "request parameters": request(parameters("request", parsing.MAX_PARAMETERS + 1)),
        "input parameters, name quoted": request(renamed),
        "output parameters": request(parameters("output", parsing.MAX_PARAMETERS + 1)),
        "no message": b"\x0a\xff\xff\xff\xff\x0f",
    }
    # Messages of a MiB or more are scanned before protobuf parses them (server.parsing.PRESCAN_MIN_BYTES).
    big = infer_request("cross_attention", **_x("cross_attention", 1, 2800, 2800, "big")).SerializeToString()
    assert parsing.PRESCAN_MIN_BYTES <= len(big) < MESSAGE_BYTES - (64 << 10)
    entry = b"\x22\x0a\x0a\x02p0\x12\x02\x08\x01"  # parameters {"p0": bool_param true}, one record
    cases |= {
        "large, request parameters": big + entry * (parsing.MAX_PARAMETERS + 1),
        "large, top-level fields": big + b"\x08\x01" * parsing.MAX_REQUEST_FIELDS,
        "large, truncated varint": big + b"\x08\xff",
        "large, cut record": big + b"\x3a" + wire.encode_varint(1 << 40),
        "large, group": big + b"\x0b",
        "large, typed contents": infer_request("cross_attention", raw=False, outputs=("output",),
                                               **_x("cross_attention", 1, 2800, 2800, "typed")).SerializeToString(),
    }
    return cases


MALFORMED = _malformed_cases()


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_request_is_refused_with_the_python_planes_words(bounded_server, python_bounded_server, case):
    """The same bytes to both planes: the same status and the same details, then the plane serves on."""
    data = MALFORMED[case]
    refusals = []
    with _native_channel(bounded_server) as ch, python_bounded_server.channel() as python_ch:
        for channel in (ch, python_ch):
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as exc:
                call(data, timeout=60)
            refusals.append((exc.value.code(), exc.value.details()))
        assert refusals[0] == refusals[1], refusals
        assert refusals[0][0] == grpc.StatusCode.INVALID_ARGUMENT, refusals
        _good(pb_grpc.GRPCInferenceServiceStub(ch))


def test_the_config_layers_longest_wait_is_the_planes():
    """attnserve.ranges bounds every delay and timeout by the plane's longest timer: one number."""
    from attnserve.server import _native

    from attnserve.ranges import MAX_WAIT_US

    assert _native.MAX_TIMEOUT_US == MAX_WAIT_US
