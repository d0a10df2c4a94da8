"""Warm readiness (server.warmup): readiness is false and the index says WARMING until every
graph of a model has run; `--warmup none` is ready without a run. Real servers, the warm-up held
at a hold the test releases (tests.warmup_held_server), never a guess of how long it takes."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.config import load_config
from attnserve.server.graphs import GraphSet
from attnserve.server.repository import read_model_specs
from attnserve.server.warmup import LONG_LEN_FALLBACK, SHORT_LEN, warm_up_plan
from grpc_health.v1 import health_pb2

from attnserve.contract import (
    ALL_OUTPUTS,
    FUSED,
    FUSED_KEY_PADDING,
    GRAPH_FILES,
    HEAD_MASK_ALL_OUTPUTS,
    HEAD_MASK_OUTPUT_ONLY,
    OUTPUT_ONLY,
)
from tests.oip import WIDTHS, infer_request, random_inputs
from tests.server_process import ServerProcess
from tests.warmup_held_server import HeldWarmUpServer

MODELS = ("cross_attention", "self_attention")  # the order the server warms them in (by name)
SOLO_GRAPHS = (ALL_OUTPUTS, OUTPUT_ONLY)  # the graphs with spinning solo sessions (server.engine)


def _http(proc, path: str, body: bytes | None = None) -> tuple[int, object]:
    request = urllib.request.Request(f"http://{proc.http_address}{path}", data=body,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def _metrics(proc) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()


def _warm_up_runs(proc) -> dict[tuple[str, str, str], float]:
    """attnserve_warmup_runs_total by (model, graph, session)."""
    runs = {}
    for line in _metrics(proc).splitlines():
        found = re.match(r'attnserve_warmup_runs_total\{graph="(\w+)",model="(\w+)",session="(\w+)"\} (\S+)', line)
        if found:
            graph, model, session, value = found.groups()
            runs[model, graph, session] = float(value)
    return runs


def _warm_up_requests(proc) -> dict[tuple[str, str], float]:
    """attnserve_warmup_requests_total by (model, session): the request path's warm-up."""
    return {(model, session): float(value) for model, session, value in re.findall(
        r'^attnserve_warmup_requests_total\{model="(\w+)",session="(\w+)"\} (\S+)$', _metrics(proc), re.M)}


def _batches(proc, model: str) -> float:
    """Batches the model's batcher told its observer of (attnserve_batch_requests' count)."""
    found = re.search(rf'^attnserve_batch_requests_count\{{model="{model}"\}} (\S+)$', _metrics(proc), re.M)
    return float(found.group(1)) if found else 0.0


def _graphs_on_disk(model_repository: Path, model: str) -> set[str]:
    version_dir = max((model_repository / model).glob("[0-9]*"), key=lambda p: int(p.name))
    return {kind for kind, file in GRAPH_FILES.items() if (version_dir / file).exists()}


def _infer(stub, model: str):
    x = random_inputs(np.random.default_rng(0), 1, 4, 4, WIDTHS[model], WIDTHS[model])
    return stub.ModelInfer(infer_request(model, **x), timeout=60)


def _assert_states(proc, stub, ready: dict[str, bool]) -> None:
    """Readiness on every surface, and the index's state, as `ready` says for each model."""
    with proc.channel() as channel:
        health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                     request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert (health(health_pb2.HealthCheckRequest(service=""), timeout=10).status == serving) == any(ready.values())
        for model, is_ready in ready.items():
            assert (health(health_pb2.HealthCheckRequest(service=model), timeout=10).status == serving) == is_ready
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready == any(ready.values())
    assert _http(proc, "/v2/health/ready")[0] == (200 if any(ready.values()) else 503)
    for model, is_ready in ready.items():
        assert stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=10).ready == is_ready, model
        assert _http(proc, f"/v2/models/{model}/ready")[0] == (200 if is_ready else 503), model
    want = {model: "READY" if is_ready else "WARMING" for model, is_ready in ready.items()}
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
    assert {m.name: m.state for m in index} == want
    assert {m["name"]: m["state"] for m in _http(proc, "/v2/repository/index", b"{}")[1]} == want


def test_readiness_is_false_and_the_index_says_warming_until_each_models_warm_up_ran(model_repository):
    """Both models held before their warm-up: nothing ready, the index WARMING, calls refused
    UNAVAILABLE (REST 503); released one at a time, each turns ready on its own, and then every
    graph on disk has run on the regular sessions, the unfused ones on the solo ones too, a short
    request went down the request path (decode, batcher, encode) twice on the solo sessions and
    once on the regular ones, and no inference is counted in ModelStatistics or the batch
    metrics (warm-up is no caller's)."""
    with HeldWarmUpServer(model_repository) as proc:
        assert proc.wait_held() == (MODELS[0], 1)
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            _assert_states(proc, stub, {MODELS[0]: False, MODELS[1]: False})
            for model in MODELS:
                with pytest.raises(grpc.RpcError) as exc:
                    _infer(stub, model)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "warming up" in exc.value.details()
            assert not any(model == MODELS[0] for model, _, _ in _warm_up_runs(proc))
            assert _warm_up_requests(proc) == {}
            assert not proc.ready_file.exists()  # it still means ready

            proc.release()
            assert proc.wait_held() == (MODELS[1], 1)  # the first is warmed and ready by now
            _assert_states(proc, stub, {MODELS[0]: True, MODELS[1]: False})
            _infer(stub, MODELS[0])

            proc.release()
            proc.wait_ready()
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            _assert_states(proc, stub, {MODELS[0]: True, MODELS[1]: True})
            runs = _warm_up_runs(proc)
            for model in MODELS:
                graphs = _graphs_on_disk(model_repository, model)
                assert graphs == {graph for m, graph, session in runs if m == model and session == "regular"}
                assert {graph for m, graph, session in runs if m == model and session == "solo"} == set(SOLO_GRAPHS)
                stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10).model_stats[0]
                assert stats.inference_count == (1 if model == MODELS[0] else 0)  # the one call above
                assert _batches(proc, model) == (1 if model == MODELS[0] else 0)
                assert _warm_up_requests(proc)[model, "solo"] == 3
                assert _warm_up_requests(proc)[model, "regular"] == 1
                assert re.search(rf'attnserve_model_ready_seconds\{{model="{model}"\}} [0-9.]+', _metrics(proc))
        assert re.search(rf"model {MODELS[1]} ready: time-to-ready [0-9.]+s since the server's start", proc.log())


def test_warmup_none_is_ready_without_a_run(model_repository):
    """--warmup none: the hold is never reached (the ready file comes without a release), no
    warm-up run is counted, ModelStatistics count no inference, and time-to-ready is still logged."""
    with HeldWarmUpServer(model_repository, "--warmup", "none") as proc:
        proc.wait_ready()
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            _assert_states(proc, stub, {MODELS[0]: True, MODELS[1]: True})
            for model in MODELS:
                stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10).model_stats[0]
                assert (stats.inference_count, stats.execution_count) == (0, 0)
        assert _warm_up_runs(proc) == {}
        assert _warm_up_requests(proc) == {}
        assert "warmed up" not in proc.log()
        assert "time-to-ready" in proc.log() and "(--warmup none)" in proc.log()


def test_a_new_version_warms_before_it_serves_while_the_old_one_keeps_serving(model_repository, tmp_path):
    """Explicit control, a version 2 added and loaded: while its warm-up is held, the model stays
    ready on version 1 (calls answered), the index says 1 READY and 2 WARMING; released, the load
    returns and version 2 is READY."""
    root = tmp_path / "models"
    shutil.copytree(model_repository / MODELS[0], root / MODELS[0])
    with HeldWarmUpServer(root, "--model-control-mode", "explicit") as proc:
        proc.wait_held()
        proc.release()
        proc.wait_ready()
        shutil.copytree(root / MODELS[0] / "1", root / MODELS[0] / ".staging")
        (root / MODELS[0] / ".staging").rename(root / MODELS[0] / "2")
        with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            load = pool.submit(stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=MODELS[0]),
                               timeout=120)
            assert proc.wait_held() == (MODELS[0], 2)
            assert stub.ModelReady(pb.ModelReadyRequest(name=MODELS[0]), timeout=10).ready
            assert _infer(stub, MODELS[0]).model_version == "1"
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
            assert sorted((m.version, m.state) for m in index) == [("1", "READY"), ("2", "WARMING")]
            assert not load.done()
            proc.release()
            load.result(timeout=120)
            # Version 2's own batcher: its request path warmed before it served, as version 1's did.
            assert _warm_up_requests(proc) == {(MODELS[0], "solo"): 6, (MODELS[0], "regular"): 2}
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=10).models
            assert [(m.version, m.state) for m in index] == [("2", "READY")]
            assert _infer(stub, MODELS[0]).model_version == "2"


def test_every_worker_warms_its_own_sessions(model_repository):
    """--workers 2: each worker runs the whole warm-up before the server's ready file (the
    supervisor's /metrics sums the counters: twice one worker's)."""
    proc = ServerProcess(model_repository, "--workers", "2")
    try:
        log = proc.log()
        for model in MODELS:
            warmed = re.findall(rf"\[worker (\d+) pid \d+\] attnserve\.server\.models: model {model} version 1 "
                                r"warmed up", log)
            assert sorted(warmed) == ["0", "1"], log
            request_path = re.findall(rf"\[worker (\d+) pid \d+\] attnserve\.server\.models: model {model} version 1: "
                                      r"request path warmed up", log)
            assert sorted(request_path) == ["0", "1"], log
        runs = _warm_up_runs(proc)
        assert runs and all(count % 2 == 0 for count in runs.values()), runs
        requests = _warm_up_requests(proc)  # solo too where a worker has solo sessions
        assert all(requests[m, "regular"] == 2 for m in MODELS) and all(n % 2 == 0 for n in requests.values()), requests
    finally:
        proc.stop()


# -- the plan and the setting, without a server ------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_the_plan_runs_each_graph_at_a_short_and_at_the_crossover_length(model_repository, model):
    spec = read_model_specs(model_repository / model)[-1]
    kinds = frozenset(_graphs_on_disk(model_repository, model))
    graphs = GraphSet(kinds, dict(spec.crossover))
    plan = warm_up_plan(graphs, spec)
    for run in plan:  # each run takes the graph it is meant to warm
        assert graphs.graph_for(run.masking, run.want_probs, run.length, run.length) == run.graph
    crossover = max(graphs.crossover.get(k, 0) for k in (FUSED, FUSED_KEY_PADDING))
    long = crossover if crossover > SHORT_LEN else LONG_LEN_FALLBACK
    lengths = {kind: {r.length for r in plan if r.graph == kind} for kind in kinds}
    for kind in (ALL_OUTPUTS, OUTPUT_ONLY, HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_OUTPUT_ONLY):
        assert lengths[kind] == {SHORT_LEN, long}, kind
    for kind in (FUSED, FUSED_KEY_PADDING):
        assert lengths[kind] == {max(graphs.crossover[kind], SHORT_LEN), long}, kind


def test_a_version_without_fused_graphs_warms_at_the_fallback_length(model_repository):
    spec = read_model_specs(model_repository / "self_attention")[-1]
    plan = warm_up_plan(GraphSet(), spec)
    assert {(r.graph, r.length) for r in plan} == {(k, n) for k in (ALL_OUTPUTS, OUTPUT_ONLY)
                                                   for n in (SHORT_LEN, LONG_LEN_FALLBACK)}


def test_warmup_is_set_by_flag_or_environment_and_checked():
    assert load_config([]).warmup == "graphs"
    assert load_config([], {"ATTNSERVE_WARMUP": "none"}).warmup == "none"
    assert load_config(["--warmup", "graphs"], {"ATTNSERVE_WARMUP": "none"}).warmup == "graphs"
    with pytest.raises(SystemExit):
        load_config(["--warmup", "some"])


def test_a_refused_request_path_warm_up_is_logged_and_the_model_serves_all_the_same(model_repository):
    """--memory-limit-bytes 1: the warm-up's request is over the budget (refused, as a caller's
    would be); its graphs have run, so each model turns ready with the refusal in the log."""
    proc = ServerProcess(model_repository, "--memory-limit-bytes", "1")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for model in MODELS:
                assert stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=10).ready, model
        assert _warm_up_requests(proc) == {}
        assert _warm_up_runs(proc)  # the sessions' warm-up ran
        for model in MODELS:
            assert re.search(rf"model {model} version 1: the request path's warm-up was refused, serving without it",
                             proc.log()), proc.log()
    finally:
        proc.stop()
