"""bench.goals (issue 26's benchmark): its derivation of the goals from hand-made figures, the
pieces each side is driven with (perf_analyzer's shapes, the REST bodies, the aio floor's
answers, the PyTriton peer's arguments and session options), and a tiny real run. No figure of
speed is asserted: `make bench` reports speed, the tests check the arithmetic and the plumbing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import goals, perf_analyzer, pytriton_peer, rest_loadgen
from bench.inprocess import Shape
from tests.server_process import REPO_ROOT


def _level(rps: float, p50: float, cpu: float) -> dict:
    return {"requests_per_s": rps, "p50_ms": p50, "p99_ms": 2 * p50, "cpu_ms_per_req": cpu}


def _round(native_c32: float = 4000.0, native_p50: float = 0.5) -> dict:
    in_process = {1: {"ms_per_call": 0.15, "requests_per_s": 6000.0},
                  32: {"ms_per_call": 2.0, "requests_per_s": 16000.0}}
    sides = {"native_floor": {1: _level(3000, 0.2, 0.1), 32: {**_level(16000, 2.0, 0.05)}},
             "native": {1: _level(1500, native_p50, 0.6), 32: _level(native_c32, 8.0, 0.4)},
             "python": {1: _level(600, 1.5, 2.0), 32: _level(800, 40.0, 1.4)},
             "pytriton": {32: _level(1000, 30.0, 1.0)}}
    return {"in_process": in_process, "sides": sides, "derived": goals.derive(in_process, sides)}


def test_the_goals_are_derived_from_the_rounds_own_figures():
    got = _round()["derived"]
    ideal = 1 / (1 / 16000 + 1 / 16000)  # native floor c32 and in-process b32: 8,000 req/s
    c32 = got["native"]["c32"]
    assert c32["ideal_requests_per_s"] == pytest.approx(ideal)
    assert c32["goal_requests_per_s"] == pytest.approx(0.7 * ideal)
    assert c32["of_ideal"] == pytest.approx(0.5) and c32["met"] is False  # 4,000 < 5,600
    c1 = got["native"]["c1"]
    assert c1["goal_p50_ms"] == pytest.approx(0.2 + 0.15 + 0.1)  # floor p50 + b1 call + 0.1 ms
    assert c1["over_goal_ms"] == pytest.approx(0.05) and c1["met"] is False
    assert got["native"]["cpu_c32"] == {"cpu_ms_per_req": 0.4, "native_floor_cpu_ms_per_req": 0.05,
                                        "of_floor": pytest.approx(8.0)}
    assert got["native"]["pytriton"]["of_pytriton"] == pytest.approx(4.0) and got["native"]["pytriton"]["met"]
    assert got["python"]["pytriton"]["of_pytriton"] == pytest.approx(0.8) and not got["python"]["pytriton"]["met"]
    passing = _round(native_c32=5600.0, native_p50=0.44)["derived"]["native"]
    assert passing["c32"]["met"] and passing["c1"]["met"]  # at the c32 goal exactly, under the c1 goal


def test_a_goal_whose_figures_were_not_measured_is_left_out():
    in_process = {1: {"ms_per_call": 0.15}, 32: {"requests_per_s": 16000.0}}
    only_c1 = {"native_floor": {1: _level(3000, 0.2, 0.1)}, "native": {1: _level(1500, 0.4, 0.6)}}
    assert set(goals.derive(in_process, only_c1)["native"]) == {"c1", "cpu_c1"}
    assert goals.derive(in_process, {"native": {1: _level(1500, 0.4, 0.6)}}) == {}  # no floor, no goal


def test_the_summary_judges_the_median_of_the_per_round_ratios():
    rounds = [_round(native_c32=4000.0), _round(native_c32=6000.0), _round(native_c32=7000.0)]
    summary = goals.summarize(rounds)
    c32 = summary["goals"]["native"]["c32"]
    assert c32["of_ideal_per_round"] == pytest.approx([0.5, 0.75, 0.875])
    assert c32["of_ideal"] == pytest.approx(0.75) and c32["met"] is True
    assert summary["sides"]["native"][32]["requests_per_s"] == 6000.0
    assert summary["in_process"][32]["requests_per_s"] == 16000.0
    assert summary["goals"]["python"]["pytriton"]["met"] is False
    lines = "\n".join(goals.report("self_attention", Shape(1, 10, 10), summary))
    assert "native: c32 >= 0.7 x 1/(1/native floor + 1/in-process b32)" in lines and "PASS" in lines
    assert "python: c1 p50 <= native floor p50 + b1 call + 0.1 ms" in lines and "FAIL" in lines
    assert "c32 / PyTriton's c32 = 6.00 (goal 3x) PASS" in lines


def test_a_level_not_measured_in_one_round_leaves_that_round_out_of_its_goal():
    """perf_analyzer may find no stable window on a loaded machine: bench.goals then leaves the
    level out of that round, and the summary takes the rounds that have it."""
    first, second = _round(native_p50=0.3), _round(native_p50=0.9)
    del second["sides"]["native"][1]
    second["derived"] = goals.derive(second["in_process"], second["sides"])
    summary = goals.summarize([first, second])
    assert summary["goals"]["native"]["c1"]["over_goal_ms_per_round"] == [pytest.approx(-0.15)]
    assert summary["goals"]["native"]["c1"]["met"] is True
    assert len(summary["goals"]["native"]["c32"]["of_ideal_per_round"]) == 2
    assert summary["sides"]["native"][1]["p50_ms"] == 0.3


def test_the_rest_decision_sets_each_path_against_python_grpc():
    medians = {"python": {1: _level(600, 1.5, 2.0), 32: _level(800, 40.0, 1.0)},
               "native": {1: _level(1500, 0.5, 0.6), 32: _level(2400, 12.0, 0.4)},
               "rest_json": {1: _level(100, 9.0, 9.0), 32: _level(120, 250.0, 8.0)}}
    rows = {r["side"]: r for r in goals.rest_decision(medians)}
    assert set(rows) == {"python", "native", "rest_json"}
    assert rows["rest_json"]["cpu_of_python_grpc"] == pytest.approx(8.0)
    assert rows["native"]["cpu_of_python_grpc"] == pytest.approx(0.4) and rows["native"]["p50_ms_c1"] == 0.5


def test_a_sides_cpu_counts_the_processes_below_it():
    """PyTriton computes in tritonserver and its backend stub, below the process bench.goals
    started: their CPU time is the side's too."""
    from bench.__main__ import _cpu_s

    burn = ("import sys, time\nwhile time.process_time() < 1.0: pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()")  # then held alive until the test closes stdin
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    middle = subprocess.Popen([sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert middle.stdout.readline().strip() == "burnt"
        assert goals.tree_cpu_s(middle.pid) >= 1.0 > _cpu_s(middle.pid)
    finally:
        middle.stdin.close()
        middle.wait(timeout=60)


def test_perf_analyzer_shapes_leave_the_batch_dim_to_tritons_batcher():
    shape = Shape(4, 256, 77)
    assert perf_analyzer.shape_args((32, 16), shape) == [
        "--shape", "query:4,256,32", "--shape", "key:4,77,16", "--shape", "value:4,77,16", "--shape", "mask:4,256,77"]
    assert perf_analyzer.shape_args((32, 16), shape, triton_batching=True) == [
        "-b", "4", "--shape", "query:256,32", "--shape", "key:77,16", "--shape", "value:77,16",
        "--shape", "mask:256,77"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_the_rest_bodies_parse_as_the_server_reads_them(model_repository, binary):
    from attnserve.server.rest_codec import parse_infer

    data, headers = rest_loadgen.body("cross_attention", (32, 32), Shape(4, 256, 77), binary)
    length = int(headers[rest_loadgen.HEADER_LENGTH]) if binary else None
    assert (rest_loadgen.HEADER_LENGTH in headers) is binary
    request, outputs = parse_infer(data, length, "cross_attention", "")
    assert [(i.name, i.datatype, list(i.shape)) for i in request.inputs] == [
        ("query", "FP32", [4, 256, 32]), ("key", "FP32", [4, 77, 32]), ("value", "FP32", [4, 77, 32]),
        ("mask", "BOOL", [4, 256, 77])]
    assert (outputs["output"], outputs["attn_probs"]) == (binary, binary)
    # Zeros, as perf_analyzer sends them; JSON's `data` is converted to raw bytes too.
    assert [len(raw) for raw in request.raw_input_contents] == [4 * 4 * 256 * 32, 4 * 4 * 77 * 32, 4 * 4 * 77 * 32,
                                                                4 * 256 * 77]
    assert not any(any(raw) for raw in request.raw_input_contents)


def test_the_aio_floor_answers_zeros_of_the_graphs_shapes(model_repository):
    from attnserve.proto import inference_pb2 as pb
    from attnserve.server.repository import read_model_spec

    from bench.aio_floor import zero_answer

    spec = read_model_spec(model_repository / "cross_attention")  # out_dim 32, 2 heads
    request = pb.ModelInferRequest(model_name="cross_attention", id="r1")
    for name, shape in (("query", [3, 5, 32]), ("key", [3, 7, 32]), ("value", [3, 7, 32])):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
    answer = zero_answer(request, spec)
    assert answer.id == "r1" and answer.model_version == str(spec.version)
    assert [(o.name, list(o.shape)) for o in answer.outputs] == [("output", [3, 5, 32]), ("attn_probs", [3, 2, 5, 7])]
    assert [len(b) for b in answer.raw_output_contents] == [4 * 3 * 5 * 32, 4 * 3 * 2 * 5 * 7]
    assert not any(any(b) for b in answer.raw_output_contents)
    request.outputs.add(name="output")
    assert [o.name for o in zero_answer(request, spec).outputs] == ["output"]


def test_the_aiohttp_floor_answers_the_outputs_asked_for():
    from bench.aiohttp_floor import zero_outputs

    data, headers = rest_loadgen.body("cross_attention", (32, 32), Shape(3, 5, 7), binary=True)
    document = json.loads(data[:int(headers[rest_loadgen.HEADER_LENGTH])])
    assert zero_outputs(document, 32, 2) == [("output", [3, 5, 32]), ("attn_probs", [3, 2, 5, 7])]
    document["outputs"] = [{"name": "output"}]
    assert zero_outputs(document, 32, 2) == [("output", [3, 5, 32])]


def test_the_pytriton_peer_gets_each_models_graph_dims_and_batching(model_repository):
    command = goals.pytriton_command(model_repository, ["self_attention", "cross_attention"])
    models = [pytriton_peer.parse_model(command[i + 1]) for i, arg in enumerate(command) if arg == "--model"]
    assert [m["name"] for m in models] == ["self_attention", "cross_attention"]
    cross = models[1]
    assert cross["graph"].endswith("model.onnx") and (cross["query_dim"], cross["num_heads"]) == (32, 2)
    assert (cross["max_batch_size"], cross["max_queue_delay_ms"]) == (32, 1.0)  # config.json's batching
    with pytest.raises(ValueError, match="expected NAME=GRAPH"):
        pytriton_peer.parse_model("self_attention=model.onnx:512")


def test_the_pytriton_peer_opens_its_session_as_the_server_does():
    from attnserve.server.engine import session_options

    ours, peer = session_options(0), pytriton_peer.session_options(0)
    for field in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode",
                  "enable_cpu_mem_arena"):
        assert getattr(peer, field) == getattr(ours, field), field
    key = "session.intra_op.allow_spinning"
    assert peer.get_session_config_entry(key) == ours.get_session_config_entry(key) == "0"


@pytest.mark.e2e
@pytest.mark.timeout(900)  # a dozen short loads and six processes; one core may be all it gets
def test_a_tiny_goals_run_writes_its_report(model_repository, tmp_path):
    """Every side this machine can serve, one round of short windows, the python load generators
    (perf_analyzer may not be installed); the report's structure, not its speed."""
    from attnserve.server.native import why_unavailable

    native = why_unavailable() is None
    sides = ["aio_floor", "python", "rest_binary_aiohttp", "rest_json", "aiohttp_floor",
             *(["native_floor", "native_floor_handoff", "native"] if native else [])]
    done = subprocess.run(
        [sys.executable, "-m", "bench.goals", "--repository", str(model_repository), "--models", "self_attention",
         "--sides", ",".join(sides), "--rounds", "1", "--seconds", "0.3", "--in-process-s", "0.05",
         "--load-generator", "python", "--output", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "goals.json").read_text())
    data = report["models"]["self_attention"]
    assert set(data["sides"]) == set(sides) and len(data["rounds"]) == 1
    for side in sides:
        for level in ("1", "32"):
            figures = data["sides"][side][level]
            assert figures["requests_per_s"] > 0 and figures["errors"] == 0, (side, level, figures)
            assert figures["cpu_ms_per_req"] > 0 and 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert set(data["in_process"]) == {"1", "32"}
    assert {r["side"] for r in data["rest"]} == {"python", "rest_binary_aiohttp", "rest_json", "aio_floor",
                                                 "aiohttp_floor"} | ({"native", "native_floor"} if native else set())
    assert "REST next to gRPC" in done.stdout and report["machine"]["cpu_model"] in done.stdout
    if native:
        assert set(data["goals"]["native"]) >= {"c32", "c1", "cpu_c1", "cpu_c32"}
        assert "native: c32 >= 0.7 x 1/(1/native floor + 1/in-process b32)" in done.stdout
    else:
        assert data["goals"] == {} and "no native sides" in done.stdout


def test_the_native_floor_answers_zeros_from_its_own_thread_with_handoff(model_repository):
    """bench.native_floor's plane with `--handoff`: every call answered, with zeros of the
    request's shapes, by the plane's own thread (concurrent calls queue there)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from attnserve.client import InferenceClient
    from attnserve.server.config import load_config
    from attnserve.server.native import why_unavailable

    from bench.native_floor import zeros_plane

    if why_unavailable() is not None:
        pytest.skip(f"the native data plane is not built: {why_unavailable()}")
    config = load_config(["--model-repository", str(model_repository), "--host", "127.0.0.1", "--port", "0",
                          "--data-plane", "native"])
    plane = zeros_plane(config)
    plane.answer_from_own_thread()
    port = plane.start()
    shapes = [1, 2, 3, 4] * 4
    try:
        with InferenceClient(f"127.0.0.1:{port}") as client:
            def call(rows: int) -> dict:
                x = np.ones((rows, 3 + rows, 512), np.float32)
                return client.infer("self_attention", x, x, x, outputs=("output", "attn_probs"))

            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(call, shapes))
        assert plane.counters()["handed_off"] == len(shapes)
    finally:
        plane.stop(1.0)
    for rows, got in zip(shapes, answers, strict=True):
        assert got["output"].shape == (rows, 3 + rows, 512) and not got["output"].any()
        assert got["attn_probs"].shape == (rows, 8, 3 + rows, 3 + rows) and not got["attn_probs"].any()
