"""The native data plane follows the model repository, and its rare RPCs answer live.

Against real `--data-plane native` servers over real repositories in tmp dirs: the native port
serves exactly the models and versions the Python port serves, at the same moment (load,
unload, a new version, version policies, polling, explicit mode; a version warming is not
served), with the Python port's statuses and words for what it does not serve; a swap while a
batch is held at the gate (tests/gated_server.py) lets the calls queued on the old version
finish on it. ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics and RepositoryIndex on the native port equal the Python port's answers at the
time (statistics counting native calls). Waits are on observables (the log, the metrics, a
held gate or warm-up), each with a generous deadline.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import time
import urllib.request

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native

from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess
from tests.test_model_repository import (  # noqa: F401 (second_version is a fixture)
    MODEL,
    TOLERANCE,
    WIDTH,
    _add_version,
    _repository,
    _set_policy,
    second_version,
)
from tests.warmup_held_server import HeldWarmUpServer

WHY_NOT = native.why_unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)), pytest.mark.e2e]

NATIVE = ("--data-plane", "native")
WAIT_S = 60.0  # a bound on waiting for an observable, not a guess of speed


def _native_port(proc: ServerProcess) -> int:
    return proc.port


def _channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])


class Ports:
    """Both ports of one server: `native` and `python` stubs, to ask each the same thing."""

    def __init__(self, proc: ServerProcess) -> None:
        self._channels = [_channel(_native_port(proc)), proc.channel()]
        self.native, self.python = (pb_grpc.GRPCInferenceServiceStub(ch) for ch in self._channels)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def both(self, method: str, request):
        """(native answer, python answer): each the response, or the (code, details) it was refused with."""
        return tuple(_outcome(getattr(stub, method), request) for stub in (self.native, self.python))

    def same(self, method: str, request):
        """The answer both ports give; asserts they are equal."""
        native_answer, python_answer = self.both(method, request)
        assert native_answer == python_answer, f"{method}: native {native_answer!r} != python {python_answer!r}"
        return native_answer


def _outcome(call, request):
    try:
        return call(request, timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()


def _close_to(got: np.ndarray, module, x: dict) -> bool:
    return float(np.max(np.abs(got - eager(module, **x)["output"]))) <= TOLERANCE


def _wait_until(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.01)
    return got


def _metric(proc: ServerProcess, line_start: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    return next((float(row[len(line_start):]) for row in text.splitlines() if row.startswith(line_start)), None)


RARE = (("ServerReady", pb.ServerReadyRequest()), ("ServerMetadata", pb.ServerMetadataRequest()),
        ("RepositoryIndex", pb.RepositoryIndexRequest()))


def _per_model(name: str, version: str = ""):
    return (("ModelReady", pb.ModelReadyRequest(name=name, version=version)),
            ("ModelMetadata", pb.ModelMetadataRequest(name=name, version=version)),
            ("ModelConfig", pb.ModelConfigRequest(name=name, version=version)),
            ("ModelStatistics", pb.ModelStatisticsRequest(name=name, version=version)))


def test_the_rare_rpcs_answer_as_the_python_port_does_now(model_repository, eager_modules, tmp_path):
    """Native calls move ModelStatistics on the native port as on the Python one; an unload
    and a load change readiness, metadata and the index on both at once; client text in a
    refusal is quoted with the Python port's words."""
    root = _repository(tmp_path, model_repository, MODEL, "self_attention")
    proc = ServerProcess(root, "--model-control-mode", "explicit", *NATIVE)
    ports = Ports(proc)
    try:
        for method, request in RARE + _per_model(MODEL) + _per_model(MODEL, "1") + _per_model(MODEL, "7"):
            ports.same(method, request)
        rng = np.random.default_rng(26)
        cases = [random_inputs(rng, 1, 4 + i, 5, WIDTH, WIDTH) for i in range(3)]
        for x in cases:
            got = outputs_of(ports.native.ModelInfer(infer_request(MODEL, **x), timeout=30))["output"]
            assert _close_to(got, eager_modules[MODEL], x)
        request = pb.ModelStatisticsRequest(name=MODEL)
        # The batches' figures reach the event loop once per batch, after the answers.
        _wait_until("3 native calls in the statistics",
                    lambda: ports.python.ModelStatistics(request, timeout=30).model_stats[0].inference_count == 3)
        stats = ports.same("ModelStatistics", request)
        assert stats.model_stats[0].inference_count == 3 and stats.model_stats[0].execution_count >= 1

        ports.python.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=MODEL), timeout=60)
        assert not ports.same("ModelReady", pb.ModelReadyRequest(name=MODEL)).ready
        for method, request in RARE + _per_model(MODEL):
            ports.same(method, request)
        assert ports.same("ModelMetadata", pb.ModelMetadataRequest(name=MODEL))[0] == grpc.StatusCode.UNAVAILABLE
        ports.python.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        assert ports.same("ModelReady", pb.ModelReadyRequest(name=MODEL)).ready
        for method, request in RARE + _per_model(MODEL):
            ports.same(method, request)

        x = cases[0]
        for name in ("nope", "it's", 'say "hi"', "tab\there", "back\\slash", "x" * 300, "é\u00a0"):
            native_answer, python_answer = (_outcome(stub.ModelInfer, infer_request(name, **x))
                                            for stub in (ports.native, ports.python))
            assert native_answer == python_answer, name
            assert native_answer[0] == grpc.StatusCode.NOT_FOUND
    finally:
        ports.close()
        proc.stop()


def test_load_unload_and_versions_are_followed(model_repository, second_version, eager_modules, tmp_path):  # noqa: F811
    """Explicit mode: an unloaded model is refused on the native port with the Python port's
    status and words; loaded again it serves; a second version (latest 2) serves by number and
    by default; a version policy narrowed back leaves one version; a version not served is
    NOT_FOUND with the Python port's words."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    proc = ServerProcess(root, "--model-control-mode", "explicit", *NATIVE)
    ports = Ports(proc)
    x = random_inputs(np.random.default_rng(11), 2, 5, 6, WIDTH, WIDTH)

    def answers(version: str = ""):
        return [_outcome(stub.ModelInfer, infer_request(MODEL, version=version, **x))
                for stub in (ports.native, ports.python)]

    try:
        ports.python.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=MODEL), timeout=60)
        native_answer, python_answer = answers()
        assert native_answer == python_answer
        assert native_answer[0] == grpc.StatusCode.UNAVAILABLE and "unloaded" in native_answer[1]

        ports.python.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        assert _close_to(outputs_of(answers()[0])["output"], eager_modules[MODEL], x)

        _add_version(root, version_dir)
        _set_policy(root, {"latest": {"num_versions": 2}})
        ports.python.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        for version, module in (("1", eager_modules[MODEL]), ("2", module_v2), ("", module_v2), ("02", module_v2)):
            native_answer, python_answer = answers(version)
            assert native_answer.model_version == python_answer.model_version, version
            assert _close_to(outputs_of(native_answer)["output"], module, x), version
        for version in ("3", "v2", "x" * 300):
            native_answer, python_answer = answers(version)
            assert native_answer == python_answer, version
            assert native_answer[0] == grpc.StatusCode.NOT_FOUND
        ports.same("ModelMetadata", pb.ModelMetadataRequest(name=MODEL))

        _set_policy(root, {"specific": {"versions": [1]}})
        ports.python.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        assert _close_to(outputs_of(answers()[0])["output"], eager_modules[MODEL], x)
        native_answer, python_answer = answers("2")
        assert native_answer == python_answer and native_answer[0] == grpc.StatusCode.NOT_FOUND
    finally:
        ports.close()
        proc.stop()


def test_a_swap_while_a_batch_runs_finishes_the_calls_queued_on_the_old_version(
        model_repository, second_version, eager_modules, tmp_path):  # noqa: F811
    """Six native calls in the server, the first batch held at the gate, the rest queued; version
    2 replaces version 1 (latest 1). A call made after the load is answered by version 2; the
    six, by version 1, which held them; none fails."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    rng = np.random.default_rng(2626)
    cases = [random_inputs(rng, 1, 6, 5, WIDTH, WIDTH) for _ in range(6)]
    with GatedServer(root, "--model-control-mode", "explicit", "--max-batch-size", "2", *NATIVE) as proc, \
            _channel(_native_port(proc)) as channel, proc.channel() as python_channel, \
            concurrent.futures.ThreadPoolExecutor(7) as pool:
        stub, python = pb_grpc.GRPCInferenceServiceStub(channel), pb_grpc.GRPCInferenceServiceStub(python_channel)
        futures = [pool.submit(stub.ModelInfer, infer_request(MODEL, outputs=("output",), **x), timeout=120)
                   for x in cases]
        proc.gate.wait_started()
        _wait_until("six calls in the native plane", lambda: _metric(proc, "attnserve_native_in_flight ") == 6)
        _add_version(root, version_dir)
        python.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=120)
        assert [(m.name, m.version) for m in python.RepositoryIndex(pb.RepositoryIndexRequest()).models] == [
            (MODEL, "2")]
        late = pool.submit(stub.ModelInfer, infer_request(MODEL, outputs=("output",), **cases[0]), timeout=120)
        proc.gate.release(100)
        for x, future in zip(cases, futures, strict=True):
            assert _close_to(outputs_of(future.result(timeout=120))["output"], eager_modules[MODEL], x)
        answer = late.result(timeout=120)
        assert answer.model_version == "2"
        assert _close_to(outputs_of(answer)["output"], module_v2, cases[0])


def test_a_version_warming_is_not_served_until_it_is_installed(
        model_repository, second_version, eager_modules, tmp_path):  # noqa: F811
    """A load's new version warms (held) while version 1 serves: the native port, like the
    Python one, refuses version 2 and answers by version 1; once the warm-up ends, both serve
    version 2."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL)
    x = random_inputs(np.random.default_rng(12), 1, 4, 4, WIDTH, WIDTH)
    with HeldWarmUpServer(root, "--model-control-mode", "explicit", *NATIVE) as proc, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert proc.wait_held() == (MODEL, 1)
        proc.release()
        proc.wait_ready()
        ports = Ports(proc)
        try:
            _add_version(root, version_dir)
            _set_policy(root, {"latest": {"num_versions": 2}})
            load = pool.submit(ports.python.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=MODEL),
                               timeout=120)
            assert proc.wait_held() == (MODEL, 2)
            native_answer, python_answer = (_outcome(stub.ModelInfer, infer_request(MODEL, version="2", **x))
                                            for stub in (ports.native, ports.python))
            assert native_answer == python_answer and native_answer[0] == grpc.StatusCode.NOT_FOUND
            ports.same("ModelReady", pb.ModelReadyRequest(name=MODEL, version="2"))
            got = ports.native.ModelInfer(infer_request(MODEL, **x), timeout=30)
            assert got.model_version == "1" and _close_to(outputs_of(got)["output"], eager_modules[MODEL], x)
            proc.release()
            load.result(timeout=120)
            got = ports.native.ModelInfer(infer_request(MODEL, version="2", **x), timeout=30)
            assert _close_to(outputs_of(got)["output"], module_v2, x)
            assert ports.same("ModelReady", pb.ModelReadyRequest(name=MODEL, version="2")).ready
        finally:
            ports.close()


def test_poll_mode_is_followed(model_repository, second_version, eager_modules, tmp_path):  # noqa: F811
    """--model-control-mode poll: a new version served on the native port once the rescan loads
    it, a removed model refused there as on the Python port, and readiness with it."""
    version_dir, module_v2 = second_version
    root = _repository(tmp_path, model_repository, MODEL, "self_attention")
    proc = ServerProcess(root, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", *NATIVE)
    ports = Ports(proc)
    x = random_inputs(np.random.default_rng(13), 1, 4, 5, WIDTH, WIDTH)
    try:
        _add_version(root, version_dir)
        proc.wait_for_log(f"model {MODEL} version 2 ready")
        got = ports.native.ModelInfer(infer_request(MODEL, **x), timeout=30)
        assert got.model_version == "2" and _close_to(outputs_of(got)["output"], module_v2, x)
        shutil.rmtree(root / "self_attention")
        proc.wait_for_log("model self_attention unloaded")
        sx = random_inputs(np.random.default_rng(14), 1, 3, 3, 512, 512)
        native_answer, python_answer = (_outcome(stub.ModelInfer, infer_request("self_attention", **sx))
                                        for stub in (ports.native, ports.python))
        assert native_answer == python_answer and native_answer[0] == grpc.StatusCode.UNAVAILABLE
        assert not ports.same("ModelReady", pb.ModelReadyRequest(name="self_attention")).ready
    finally:
        ports.close()
        proc.stop()
