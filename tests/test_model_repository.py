"""The model repository API against real server processes: RepositoryIndex, RepositoryModelLoad
and RepositoryModelUnload (ours and NVIDIA's tritonclient, unmodified), --model-control-mode,
version policies, and a new version swapped in while 32 clients call the model."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess

MODEL = "cross_attention"  # width 32, 2 heads: the cheap one to export twice
WIDTH = 32
TOLERANCE = 1e-5
CLIENTS = 32


@pytest.fixture(scope="module")
def second_version(tmp_path_factory, model_repository):
    """cross_attention exported again as version 2 with other weights (demo seed 1), kept aside:
    (its version directory, the eager module behind it)."""
    from attnserve.export import checkpoint
    from attnserve.export.config import PRESETS
    from attnserve.export.onnx_export import export_model

    root = tmp_path_factory.mktemp("v2")
    shutil.copytree(model_repository / MODEL, root / MODEL)
    _set_policy(root, {"latest": {"num_versions": 2}})
    queue_policy = {"priority_levels": 2, "default_queue_policy": {"default_timeout_microseconds": 0}}
    _set_config(root, "dynamic_batching", queue_policy)
    module = checkpoint.demo_module(PRESETS[MODEL], seed=1)
    export_model(module, root, MODEL, weights={"source": "demo", "seed": 1})
    # An export rewrites config.json and keeps the version policy and queue policy a user put there.
    config = json.loads((root / MODEL / "config.json").read_text())
    assert config["version_policy"] == {"latest": {"num_versions": 2}}
    assert config["dynamic_batching"] == queue_policy
    return root / MODEL / "2", module


def _repository(tmp_path: Path, model_repository: Path, *names: str) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    for name in names:
        shutil.copytree(model_repository / name, root / name)
    return root


def _add_version(root: Path, version_dir: Path) -> None:
    """A version appears whole, as `attnserve export` makes it appear: copied aside, renamed in."""
    staging = root / MODEL / ".staging"
    shutil.copytree(version_dir, staging)
    staging.rename(root / MODEL / version_dir.name)


def _set_policy(root: Path, policy) -> None:
    _set_config(root, "version_policy", policy)


def _set_config(root: Path, key: str, value) -> None:
    path = root / MODEL / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))


def _index(stub) -> list[tuple[str, str, str]]:
    return [(m.name, m.version, m.state) for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models]


def _which(got: np.ndarray, refs: dict[int, np.ndarray]) -> int:
    """The version whose eager output `got` equals within TOLERANCE (0: neither)."""
    for version, want in refs.items():
        if got.shape == want.shape and float(np.max(np.abs(got - want))) <= TOLERANCE:
            return version
    return 0


def test_hot_swap_under_32_clients_fails_no_call(model_repository, second_version, eager_modules, tmp_path):
    """Version 2 is loaded while 32 clients call the model: no call fails; calls sent before the
    load are answered by version 1 (among them a batch held computing and the calls queued
    behind it, which finish on version 1 after version 2 is installed), calls sent after it by
    version 2; the index shows the change."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    rng = np.random.default_rng(1414)
    inputs = [random_inputs(rng, 1, 16, 12, WIDTH, WIDTH) for _ in range(4)]
    refs = [{1: eager(eager_modules[MODEL], **x)["output"], 2: eager(module_v2, **x)["output"]} for x in inputs]
    for r in refs:
        assert float(np.max(np.abs(r[1] - r[2]))) > 1e-2  # the two versions tell apart

    with GatedServer(root, "--model-control-mode", "explicit", "--max-batch-size", "8") as proc:
        gate = proc.gate
        lock = threading.Lock()
        sent = [0]  # calls sent so far, all clients together: each call's ticket
        # (ticket, input, version that answered, whether it was answered after the swap)
        answers: list[tuple[int, int, int, bool]] = []
        failures: list[str] = []
        swap = {"before": -1, "after": None}  # tickets: last sent before the load / first after
        after_swap = [0] * CLIENTS
        flowing = threading.Event()  # enough answers before the swap
        stop = threading.Event()  # the clients stop calling
        clients_done = threading.Event()
        hold, held, resume = threading.Event(), threading.Event(), threading.Event()
        held_rows = [0]

        def pump() -> None:
            """Lets batches through one at a time, and holds one at the gate when told."""
            while not clients_done.is_set():  # the clients' last calls too
                try:
                    rows = gate.wait_started(timeout_s=1.0)
                except AssertionError:
                    continue
                if hold.is_set() and not resume.is_set():
                    held_rows[0] = rows
                    held.set()
                    resume.wait(60)
                gate.release()

        def client(i: int) -> None:
            with proc.channel() as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                for n in range(400):  # bounded; ends far sooner, at `stop`
                    if stop.is_set():
                        return
                    which = (i + n) % len(inputs)
                    with lock:
                        ticket = sent[0]
                        sent[0] += 1
                    try:
                        response = stub.ModelInfer(infer_request(MODEL, outputs=("output",), **inputs[which]),
                                                   timeout=30)
                    except grpc.RpcError as err:
                        with lock:
                            failures.append(f"{err.code().name}: {err.details()}")
                        continue
                    version = _which(outputs_of(response)["output"], refs[which])
                    with lock:
                        answers.append((ticket, which, version, resume.is_set()))
                        if len(answers) >= 3 * CLIENTS:
                            flowing.set()
                        if swap["after"] is not None and ticket >= swap["after"]:
                            after_swap[i] += 1
                            if min(after_swap) >= 3:
                                stop.set()

        pumper = threading.Thread(target=pump, daemon=True)
        pumper.start()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            assert flowing.wait(120), "calls did not flow before the swap"
            hold.set()
            assert held.wait(60), "no batch reached the gate to hold"
            # Every client has one call out; wait until the server holds all 32 (the held batch's
            # and the queued ones): nothing is on its way, so every call sent so far is version 1's.
            _wait_for_queue_depth(proc, CLIENTS - held_rows[0])
            with proc.channel() as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                assert _index(stub) == [(MODEL, "1", "READY")]
                with lock:
                    swap["before"] = sent[0] - 1
                _add_version(root, version_dir)
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
                with lock:
                    swap["after"] = sent[0]
                assert _index(stub) == [(MODEL, "2", "READY")]  # latest 1: version 1 left the index
                metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))
                assert list(metadata.versions) == ["2"]
            resume.set()
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads)
        finally:
            stop.set()
            resume.set()
            clients_done.set()
            pumper.join(30)  # before the gate closes
        proc.wait_for_log(f"model {MODEL} version 1 retired")

    assert failures == []
    assert all(version for _, _, version, _ in answers), "an answer equals neither version's eager output"
    before = [v for ticket, _, v, _ in answers if ticket <= swap["before"]]
    after = [v for ticket, _, v, _ in answers if ticket >= swap["after"]]
    assert len(before) + len(after) == len(answers)  # no call was sent while the load ran: all were held
    assert set(before) == {1} and set(after) == {2}
    # The calls in the server during the swap (held computing, or queued) finished on version 1.
    in_flight = [v for ticket, _, v, late in answers if late and ticket <= swap["before"]]
    assert in_flight == [1] * CLIENTS
    counts = {v: sum(1 for _, _, got, _ in answers if got == v) for v in (1, 2)}
    print(f"hot swap: {len(answers)} calls answered, {len(failures)} failed; version 1 answered {counts[1]} "
          f"({len(in_flight)} of them in the server during the swap), version 2 answered {counts[2]}")
    assert counts[2] >= 3 * CLIENTS


def _wait_for_queue_depth(proc: ServerProcess, depth: int, timeout_s: float = 60.0) -> None:
    """Until the server's own gauge says `depth` requests wait in MODEL's queue."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    line = f'attnserve_queue_depth{{model="{MODEL}"}} '
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
        got = next((float(row[len(line):]) for row in text.splitlines() if row.startswith(line)), None)
        if got == depth:
            return
        assert time.monotonic() < deadline, f"queue depth {got}, expected {depth}"
        time.sleep(0.01)


def test_a_swap_during_a_drain_loses_no_admitted_call(model_repository, second_version, eager_modules, tmp_path):
    """12 calls admitted, the first batch held at the gate, the rest queued; SIGTERM; while the
    server drains, version 2 is loaded. Every admitted call is answered, by version 1, which
    held them; a call made after the drain began is refused; exit 0."""
    import concurrent.futures
    import signal

    version_dir, _module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    rng = np.random.default_rng(77)
    cases = [random_inputs(rng, 1, 6, 5, WIDTH, WIDTH) for _ in range(12)]
    with GatedServer(root, "--model-control-mode", "explicit", "--max-batch-size", "2", "--access-log",
                     "--grace-period-s", "120") as proc, proc.channel() as channel, \
            concurrent.futures.ThreadPoolExecutor(12) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        futures = [pool.submit(stub.ModelInfer, infer_request(MODEL, outputs=("output",), **x), timeout=120)
                   for x in cases]
        proc.gate.wait_started()
        proc.wait_for_log("rpc /inference.GRPCInferenceService/ModelInfer", count=12)
        proc.signal(signal.SIGTERM)
        proc.wait_for_log("refusing new calls (UNAVAILABLE)")
        _add_version(root, version_dir)
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        with pytest.raises(grpc.RpcError) as late:
            stub.ModelInfer(infer_request(MODEL, **cases[0]), timeout=30)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.gate.release(100)
        for x, future in zip(cases, futures, strict=True):
            got = outputs_of(future.result(timeout=120))["output"]
            assert float(np.max(np.abs(got - eager(eager_modules[MODEL], **x)["output"]))) <= TOLERANCE
        assert proc.wait(timeout=60) == 0, proc.log()
        assert f"model {MODEL} version 1 retired" in proc.log()


def test_tritonclient_index_load_unload(model_repository, second_version, eager_modules, tmp_path):
    """NVIDIA's tritonclient, unmodified: get_model_repository_index, load_model, unload_model;
    version policies (all, specific) and model_version in ModelInfer."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL, "self_attention")
    proc = ServerProcess(root, "--model-control-mode", "explicit")
    try:
        client = grpcclient.InferenceServerClient(proc.address)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"], m["state"]) for m in index] == [
            (MODEL, "1", "READY"), ("self_attention", "1", "READY")]

        _add_version(root, version_dir)
        _set_policy(root, {"all": {}})
        client.load_model(MODEL)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"], m["state"]) for m in index if m["name"] == MODEL] == [
            (MODEL, "1", "READY"), (MODEL, "2", "READY")]
        assert client.get_model_metadata(MODEL, as_json=True)["versions"] == ["1", "2"]
        x = random_inputs(np.random.default_rng(7), 2, 5, 6, WIDTH, WIDTH)
        for version, module in (("1", eager_modules[MODEL]), ("2", module_v2), ("", module_v2)):
            got = _triton_output(client, x, version)
            assert float(np.max(np.abs(got - eager(module, **x)["output"]))) <= TOLERANCE, version
        with pytest.raises(InferenceServerException) as exc:
            _triton_output(client, x, "3")
        assert exc.value.status() == "StatusCode.NOT_FOUND"

        _set_policy(root, {"specific": {"versions": [1]}})
        client.load_model(MODEL)
        assert [m["version"] for m in client.get_model_repository_index(as_json=True)["models"]
                if m["name"] == MODEL] == ["1"]
        got = _triton_output(client, x, "")
        assert float(np.max(np.abs(got - eager(eager_modules[MODEL], **x)["output"]))) <= TOLERANCE

        client.unload_model(MODEL)
        assert not client.is_model_ready(MODEL)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"], m["state"], m.get("reason")) for m in index if m["name"] == MODEL] == [
            (MODEL, "1", "UNAVAILABLE", "unloaded")]
        with pytest.raises(InferenceServerException) as exc:
            _triton_output(client, x, "")
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        assert client.is_model_ready("self_attention")
        with pytest.raises(InferenceServerException) as exc:
            client.load_model("nope")
        assert exc.value.status() == "StatusCode.NOT_FOUND"
        client.load_model(MODEL)
        assert client.is_model_ready(MODEL)
        client.close()
    finally:
        proc.stop()


def test_tritonclient_http_index_load_unload(model_repository, second_version, eager_modules, tmp_path):
    """The same API on the REST port, with tritonclient.http unmodified: a new version loaded
    swaps in; unload makes the model not ready (503 on inference); an unknown model is 404;
    outside explicit mode (test_model_control_none_refuses_load_and_unload) it is refused."""
    import tritonclient.http as httpclient

    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    proc = ServerProcess(root, "--model-control-mode", "explicit")
    try:
        client = httpclient.InferenceServerClient(url=proc.http_address)
        assert [(m["name"], m["version"], m["state"]) for m in client.get_model_repository_index()] == [
            (MODEL, "1", "READY")]
        _add_version(root, version_dir)
        client.load_model(MODEL)
        assert [(m["version"], m["state"]) for m in client.get_model_repository_index()] == [("2", "READY")]
        x = random_inputs(np.random.default_rng(9), 1, 4, 5, WIDTH, WIDTH)
        inputs = []
        for name in ("query", "key", "value"):
            tensor = httpclient.InferInput(name, list(x[name].shape), "FP32")
            tensor.set_data_from_numpy(x[name])
            inputs.append(tensor)
        got = client.infer(MODEL, inputs).as_numpy("output")
        assert float(np.max(np.abs(got - eager(module_v2, **x)["output"]))) <= TOLERANCE
        client.unload_model(MODEL)
        assert not client.is_model_ready(MODEL)
        with pytest.raises(InferenceServerException) as exc:
            client.infer(MODEL, inputs)
        assert exc.value.status() == "503"
        with pytest.raises(InferenceServerException) as exc:
            client.load_model("nope")
        assert exc.value.status() == "404"
        with pytest.raises(InferenceServerException) as exc:  # a config sent with the load: not supported
            client.load_model(MODEL, config='{"max_batch_size": 4}')
        assert exc.value.status() == "400" and "no parameters" in exc.value.message()
        client.close()
    finally:
        proc.stop()


def _triton_output(client, x: dict, version: str) -> np.ndarray:
    inputs = []
    for name in ("query", "key", "value"):
        tensor = grpcclient.InferInput(name, list(x[name].shape), "FP32")
        tensor.set_data_from_numpy(x[name])
        inputs.append(tensor)
    result = client.infer(MODEL, inputs, model_version=version, outputs=[grpcclient.InferRequestedOutput("output")])
    return result.as_numpy("output")


def test_failed_load_keeps_the_old_version_serving(model_repository, eager_modules, tmp_path):
    """A version 2 whose graph is not ONNX, then a config.json that does not parse: each load
    fails with INVALID_ARGUMENT and the reason, version 1 goes on serving, the index says why."""
    root = _repository(tmp_path, model_repository, MODEL)
    proc = ServerProcess(root, "--model-control-mode", "explicit")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            shutil.copytree(root / MODEL / "1", root / MODEL / "2")
            (root / MODEL / "2" / "model.onnx").write_bytes(b"not an onnx graph")
            with pytest.raises(grpc.RpcError) as exc:
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "still serving version(s) [1]" in exc.value.details()
            models = stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
            assert [(m.version, m.state) for m in models] == [("1", "READY"), ("2", "UNAVAILABLE")]
            assert "model.onnx" in models[1].reason or "ONNX" in models[1].reason
            x = random_inputs(np.random.default_rng(3), 1, 4, 4, WIDTH, WIDTH)
            got = outputs_of(stub.ModelInfer(infer_request(MODEL, **x)))["output"]
            assert float(np.max(np.abs(got - eager(eager_modules[MODEL], **x)["output"]))) <= TOLERANCE

            shutil.rmtree(root / MODEL / "2")
            (root / MODEL / "config.json").write_text("{not json")
            with pytest.raises(grpc.RpcError) as exc:
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "config.json" in exc.value.details()
            models = stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
            assert [(m.version, m.state) for m in models] == [("1", "READY"), ("", "UNAVAILABLE")]
            assert "config.json" in models[1].reason
            assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
            got = outputs_of(stub.ModelInfer(infer_request(MODEL, **x)))["output"]
            assert float(np.max(np.abs(got - eager(eager_modules[MODEL], **x)["output"]))) <= TOLERANCE
    finally:
        proc.stop()


def test_model_control_none_refuses_load_and_unload(server):
    """The default, --model-control-mode none: the models found at start; load and unload are
    UNAVAILABLE, as in Triton, and say which mode allows them."""
    with server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for rpc, request in ((stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=MODEL)),
                             (stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=MODEL))):
            with pytest.raises(grpc.RpcError) as exc:
                rpc(request)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--model-control-mode explicit" in exc.value.details()
        assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
    for action in ("load", "unload"):  # the REST port: the same refusal
        connection = http.client.HTTPConnection(server.http_address, timeout=30)
        connection.request("POST", f"/v2/repository/models/{MODEL}/{action}", body=b"{}")
        answer = connection.getresponse()
        assert answer.status == 503 and "--model-control-mode explicit" in json.loads(answer.read())["error"]
        connection.close()


def test_poll_mode_loads_a_new_model_and_a_new_version(model_repository, second_version, eager_modules, tmp_path):
    """--model-control-mode poll: a model copied into the repository is served after a rescan, a
    new version replaces the old one, a removed model is unloaded. Each change is awaited in the
    server's log (its own report), not guessed."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, "self_attention")
    proc = ServerProcess(root, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            staging = tmp_path / "staging"
            shutil.copytree(model_repository / MODEL, staging)
            staging.rename(root / MODEL)
            proc.wait_for_log(f"model {MODEL} version 1 ready")
            x = random_inputs(np.random.default_rng(9), 1, 4, 5, WIDTH, WIDTH)
            got = outputs_of(stub.ModelInfer(infer_request(MODEL, **x)))["output"]
            assert float(np.max(np.abs(got - eager(eager_modules[MODEL], **x)["output"]))) <= TOLERANCE
            _add_version(root, version_dir)
            proc.wait_for_log(f"model {MODEL} version 2 ready")
            got = outputs_of(stub.ModelInfer(infer_request(MODEL, **x)))["output"]
            assert float(np.max(np.abs(got - eager(module_v2, **x)["output"]))) <= TOLERANCE
            shutil.rmtree(root / "self_attention")
            proc.wait_for_log("model self_attention unloaded")
            assert not stub.ModelReady(pb.ModelReadyRequest(name="self_attention")).ready
    finally:
        proc.stop()


@pytest.mark.e2e  # starts server processes
def test_empty_repository_is_an_error_unless_models_can_come_later(tmp_path):
    """An empty repository at start: exit 3 with one line that says what to do; with model
    control explicit (or poll) the server starts, not ready, and loads a model later."""
    import subprocess
    import sys

    from tests.server_process import REPO_ROOT

    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--model-repository", str(empty),
                             "--port", "0", "--metrics-port", "-1", "--workers", "1"], cwd=REPO_ROOT,
                             capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "holds no model" in result.stderr and "--model-control-mode" in result.stderr
    proc = ServerProcess(empty, "--model-control-mode", "explicit")
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert not stub.ServerReady(pb.ServerReadyRequest()).ready
            assert list(stub.RepositoryIndex(pb.RepositoryIndexRequest()).models) == []
    finally:
        proc.stop()


def test_graphs_that_do_not_match_config_json_make_the_version_unavailable_with_the_reason(model_repository,
                                                                                           tmp_path):
    """self_attention's config.json over cross_attention's ONNX files (another preset's widths):
    the version is UNAVAILABLE from the start with the mismatch in the index, and a call is
    UNAVAILABLE naming it; never READY with every call INTERNAL. The other model serves."""
    root = _repository(tmp_path, model_repository, "self_attention", "cross_attention")
    for graph in (root / "self_attention" / "1").glob("*.onnx"):
        graph.unlink()
    for graph in (root / "cross_attention" / "1").glob("*.onnx"):
        shutil.copy(graph, root / "self_attention" / "1" / graph.name)
    proc = ServerProcess(root)
    try:
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            index = {(m.name, m.version): m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
            entry = index[("self_attention", "1")]
            assert entry.state == "UNAVAILABLE", index
            assert "does not match config.json" in entry.reason and "512" in entry.reason, entry.reason
            assert index[("cross_attention", "1")].state == "READY", index
            assert not stub.ModelReady(pb.ModelReadyRequest(name="self_attention")).ready
            x = random_inputs(np.random.default_rng(0), 1, 4, 4, 512, 512)
            with pytest.raises(grpc.RpcError) as exc:
                stub.ModelInfer(infer_request("self_attention", **x), timeout=60)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
            assert "does not match config.json" in exc.value.details()
    finally:
        proc.stop()


def test_reloads_give_their_memory_back(model_repository, tmp_path):
    """--model-control-mode poll, the graph touched 12 times: 12 reloads, each retiring the old
    version. The server's RSS after the last stays within three times the version's graph bytes
    of what it was after the second (before: every reload kept about two and a half of them, as
    freed sessions stayed in glibc's per-thread arenas, untrimmed)."""
    import os
    import time

    root = _repository(tmp_path, model_repository, "self_attention")
    version_dir = root / "self_attention" / "1"
    graph_bytes = sum(p.stat().st_size for p in version_dir.glob("*.onnx"))
    proc = ServerProcess(root, "--model-control-mode", "poll", "--repository-poll-secs", "0.1")

    def reload(count: int) -> int:
        stamp = time.time() + 10 * count  # a new mtime each time, whatever the clock's resolution
        os.utime(version_dir / "model.onnx", (stamp, stamp))
        proc.wait_for_log("model self_attention version 1 retired", count=count, timeout_s=120)
        return proc.memory_kib("VmRSS") * 1024

    try:
        rss = [reload(n) for n in range(1, 13)]
        grown = rss[-1] - rss[1]
        assert grown <= 3 * graph_bytes, (f"RSS grew {grown / 2**20:.0f} MiB over 10 reloads of a "
                                          f"{graph_bytes / 2**20:.0f} MiB version", [r >> 20 for r in rss])
        with proc.channel() as channel:  # and it still serves
            x = random_inputs(np.random.default_rng(0), 1, 4, 4, 512, 512)
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request("self_attention", **x), timeout=60)
    finally:
        proc.stop()
