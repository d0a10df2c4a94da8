"""Triton's schedule policy (server.scheduling, docs/scheduling.md "Priorities and queue timeouts"):
request `priority` and `timeout` on both transports, config.json's dynamic_batching, the
priority queue with aging, and requests refused unrun once their deadline passes in the queue.

Work is held with gates the tests control (the batcher's held Model, tests.gated_server), never
with a sleep: what is asserted is the order batches formed in and what was computed."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.batcher import BatchPolicy, DeadlineExpired
from attnserve.server.scheduling import PriorityQueue, QueuePolicy, Schedule, request_schedule

from tests.gated_server import GatedServer
from tests.oip import infer_request
from tests.server_process import ServerProcess
from tests.test_batcher import Model, make_work, started, stop, wait_until

WAIT_S = 60.0
MODEL = "self_attention"


# -- config.json's dynamic_batching ----------------------------------------------------------


def test_queue_policy_defaults_and_tritons_names():
    assert QueuePolicy.from_config(None) == QueuePolicy(2, 1, 0, True)
    policy = QueuePolicy.from_config({"priority_levels": 3, "default_priority_level": 2, "default_queue_policy": {
        "timeout_action": "REJECT", "default_timeout_microseconds": 5000, "allow_timeout_override": False}})
    assert policy == QueuePolicy(3, 2, 5000, False)
    assert QueuePolicy.from_config(policy.to_config()) == policy


@pytest.mark.parametrize(("section", "says"), [
    ({"priority_levels": 0}, "dynamic_batching.priority_levels must be an integer in 1..9223372036854775807, got 0"),
    ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level must be in 1..priority_levels (2)"),
    ({"priority_levels": "2"}, "priority_levels must be an integer in 1..9223372036854775807, got '2'"),
    ({"default_queue_policy": {"timeout_action": "DELAY"}}, "DELAY is not supported"),
    ({"default_queue_policy": {"default_timeout_microseconds": -1}}, "default_timeout_microseconds must be"),
    # The native plane's longest timer (2**50 us) reads as none, and 1e30 is beyond int64: refused.
    ({"default_queue_policy": {"default_timeout_microseconds": 2**50}},
     "default_timeout_microseconds must be an integer in 0..1125899906842623 microseconds"),
    ({"default_queue_policy": {"default_timeout_microseconds": 1e30}}, "got 1e+30"),
    ({"priority_levels": 2**64}, "priority_levels must be an integer in 1..9223372036854775807"),
    ({"default_queue_policy": {"allow_timeout_override": 1}}, "allow_timeout_override must be true or false"),
    ({"priority_queue_policy": {}}, "'priority_queue_policy' not supported"),
    ([], "dynamic_batching must be an object"),
])
def test_queue_policy_refuses_what_it_cannot_serve_naming_the_key(section, says):
    with pytest.raises(ValueError) as exc:
        QueuePolicy.from_config(section)
    assert says in str(exc.value)


# -- request parameters ------------------------------------------------------------------------


def _parameters(**values) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    for name, (kind, value) in values.items():
        setattr(request.parameters[name], kind, value)
    return request


def test_request_schedule_reads_priority_and_timeout_and_ignores_the_rest():
    policy = QueuePolicy(priority_levels=3, default_priority_level=2, default_timeout_us=0)
    assert request_schedule(_parameters().parameters, policy) == Schedule(2, None)
    request = _parameters(priority=("uint64_param", 3), timeout=("int64_param", 1500),
                          binary_data_output=("bool_param", True), anything=("string_param", "x"))
    assert request_schedule(request.parameters, policy) == Schedule(3, 0.0015)
    assert request_schedule(_parameters(priority=("int64_param", 0)).parameters, policy).priority == 2


def test_a_request_timeout_only_shortens_the_models_and_only_where_allowed():
    assert request_schedule(_parameters(timeout=("uint64_param", 2**50 - 1)).parameters,
                            QueuePolicy()).timeout_s == (2**50 - 1) / 1e6  # the longest taken
    policy = QueuePolicy(default_timeout_us=2000)
    assert request_schedule(_parameters(timeout=("int64_param", 500)).parameters, policy).timeout_s == 0.0005
    assert request_schedule(_parameters(timeout=("int64_param", 9000)).parameters, policy).timeout_s == 0.002
    fixed = QueuePolicy(default_timeout_us=2000, allow_timeout_override=False)
    assert request_schedule(_parameters(timeout=("int64_param", 500)).parameters, fixed).timeout_s == 0.002


@pytest.mark.parametrize(("values", "says"), [
    ({"priority": ("string_param", "high")}, "parameter 'priority' must be an integer"),
    ({"priority": ("bool_param", True)}, "parameter 'priority' must be an integer"),
    ({"timeout": ("double_param", 1.5)}, "parameter 'timeout' must be an integer"),
    ({"timeout": ("int64_param", -1)}, "parameter 'timeout' must be >= 0, got -1"),
    ({"priority": ("uint64_param", 3)}, "parameter 'priority': this model has priority levels 1..2"),
    ({"timeout": ("uint64_param", 2**50)},
     "parameter 'timeout' must be an integer in 0..1125899906842623 microseconds, got 1125899906842624"),
    ({"timeout": ("uint64_param", 2**64 - 1)}, "parameter 'timeout' must be an integer in 0..1125899906842623"),
])
def test_malformed_schedule_parameters_are_refused_naming_the_parameter(values, says):
    with pytest.raises(ValueError) as exc:
        request_schedule(_parameters(**values).parameters, QueuePolicy())
    assert says in str(exc.value)


# -- the priority queue, in the batcher ------------------------------------------------------------


def test_the_queue_serves_by_level_then_arrival_and_ages_what_it_passes_over():
    class Item:
        def __init__(self, name: str, priority: int) -> None:
            self.name, self.priority, self.since = name, priority, 0

    queue = PriorityQueue(aging_batches=2)
    low, high1, high2 = Item("low", 2), Item("high1", 1), Item("high2", 1)
    for item in (low, high1, high2):
        queue.append(item)
    assert [i.name for i in queue.in_service_order()] == ["high1", "high2", "low"]
    queue.batch_formed([high2, low], batch_taken=True)  # high1 went
    assert [i.name for i in queue.in_service_order()] == ["high2", "low"]
    queue.batch_formed([low], batch_taken=True)  # high2 went: low passed over twice, now level 1
    high3 = Item("high3", 1)
    queue.append(high3)
    assert [i.name for i in queue.in_service_order()] == ["low", "high3"]  # older, at the same level


def _ran(model: Model, works) -> list[int]:
    """The index in `works` of the request each run (after the blocker) computed."""
    order = []
    for call in model.calls[1:]:
        order += [i for i, w in enumerate(works) if call.holds(w)]
    return order


def test_higher_priority_leaves_the_batchers_queue_first():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=1, max_queue_delay_s=0))
        try:
            model.hold()
            blocker = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(1)
            works = [make_work() for _ in range(4)]
            levels = [2, 2, 1, 1]  # the low ones queue first
            tasks = []
            for queued, (work, level) in enumerate(zip(works, levels, strict=True), start=1):
                tasks.append(asyncio.create_task(batcher.submit(work, priority=level)))
                await wait_until(lambda n=queued: batcher.queue_depth == n)
            model.open()
            await asyncio.gather(blocker, *tasks)
            assert _ran(model, works) == [2, 3, 0, 1]
        finally:
            await stop(batcher, model)

    asyncio.run(main())


def test_a_low_priority_request_is_not_starved_by_a_stream_of_higher_ones():
    """Aging 2: the low request is passed over by two batches, then goes before the newer high
    ones. Without aging it would run after every one of the stream's requests."""
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=1, max_queue_delay_s=0, priority_aging_batches=2))
        try:
            model.hold()
            blocker = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(1)
            low = make_work()
            tasks = [asyncio.create_task(batcher.submit(low, priority=2))]
            stream = []
            for i in range(6):  # one more high request queued before each batch forms
                stream.append(make_work())
                tasks.append(asyncio.create_task(batcher.submit(stream[-1], priority=1)))
                await wait_until(lambda: batcher.queue_depth == 2)
                model.release()
                await model.run_started(i + 2)
            model.open()
            await asyncio.gather(blocker, *tasks)
            ran = _ran(model, [low, *stream])
            assert ran.index(0) == 2, f"runs in order {ran}: the low request (0) should run third"
        finally:
            await stop(batcher, model)

    asyncio.run(main())


def test_a_request_whose_deadline_passes_in_the_queue_is_refused_at_once_and_never_run():
    async def main():
        model = Model()
        batcher = await started(model, BatchPolicy(max_batch_size=1, max_queue_delay_s=0))
        try:
            model.hold()
            blocker = asyncio.create_task(batcher.submit(make_work()))
            await model.run_started(1)
            late = make_work()
            with pytest.raises(DeadlineExpired, match="not computed"):
                await batcher.submit(late, deadline=time.monotonic() + 0.01)
            assert not blocker.done() and batcher.queue_depth == 0  # refused while the batch ahead still ran
            with pytest.raises(DeadlineExpired, match="before it was queued"):
                await batcher.submit(make_work(), deadline=time.monotonic() - 1)
            model.open()
            await blocker
            assert not any(call.holds(late) for call in model.calls)
        finally:
            await stop(batcher, model)

    asyncio.run(main())


# -- real servers --------------------------------------------------------------------------------


def _inputs(rows: int, length: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows * 100 + length)
    return {name: rng.standard_normal((rows, length, 512), dtype=np.float32) for name in ("query", "key", "value")}


def _grpc_request(rows: int, model: str = MODEL, **parameters: tuple[str, object]) -> pb.ModelInferRequest:
    request = infer_request(model, **_inputs(rows))
    for name, (kind, value) in parameters.items():
        setattr(request.parameters[name], kind, value)
    return request


def _rest_infer(proc: ServerProcess, rows: int, parameters: dict | None = None,
                model: str = MODEL) -> tuple[int, dict]:
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}
                       for n, a in _inputs(rows).items()]}
    if parameters is not None:
        body["parameters"] = parameters
    request = urllib.request.Request(f"http://{proc.http_address}/v2/models/{model}/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get_json(proc: ServerProcess, path: str) -> dict:
    with urllib.request.urlopen(f"http://{proc.http_address}{path}", timeout=WAIT_S) as response:
        return json.loads(response.read())


def _queue_depth(proc: ServerProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'attnserve_queue_depth{{model="{MODEL}"}} '):
            return float(line.split()[-1])
    return 0.0


def _wait_queue_depth(proc: ServerProcess, depth: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while _queue_depth(proc) != depth:
        assert time.monotonic() < deadline, f"queue depth of {MODEL} never reached {depth}"
        time.sleep(0.01)


def _statistics(stub) -> tuple[int, int]:
    (stats,) = stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=WAIT_S).model_stats
    return stats.inference_count, stats.execution_count


def _repository(tmp_path: Path, model_repository: Path, sections: dict[str, dict]) -> Path:
    """A repository of the exported models (their versions linked) whose config.json carry `sections`."""
    root = tmp_path / "models"
    for model_dir in sorted(p for p in model_repository.iterdir() if (p / "config.json").exists()):
        target = root / model_dir.name
        target.mkdir(parents=True)
        config = json.loads((model_dir / "config.json").read_text())
        config.update(sections.get(model_dir.name, {}))
        (target / "config.json").write_text(json.dumps(config))
        for version in model_dir.iterdir():
            if version.name.isdigit():
                (target / version.name).symlink_to(version, target_is_directory=True)
    return root


def test_a_timeout_shorter_than_the_queue_ahead_is_refused_unrun_on_grpc_rest_and_from_the_batch_cli(
        model_repository, tmp_path, capsys):
    from attnserve.client.__main__ import main as cli

    # One queue for gRPC and REST: on the native plane they queue apart (test_native_control has its gRPC case).
    with GatedServer(model_repository, "--data-plane", "python", "--max-batch-size", "1") as proc, \
            proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        pool = futures.ThreadPoolExecutor(max_workers=2)
        held = pool.submit(stub.ModelInfer, _grpc_request(1), timeout=WAIT_S)
        assert proc.gate.wait_started() == 1  # the batch ahead runs, held

        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(_grpc_request(2, timeout=("int64_param", 1000)), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "not computed" in exc.value.details()
        status, body = _rest_infer(proc, 3, {"timeout": 1000})
        assert status == 504 and "not computed" in body["error"]
        np.savez(tmp_path / "in.npz", **_inputs(4))
        code = cli(["batch", "--url", proc.address, "--model", MODEL, "--input", str(tmp_path / "in.npz"),
                    "--output", str(tmp_path / "out.npz"), "--timeout-us", "1000"])
        assert code != 0 and "DEADLINE_EXCEEDED" in capsys.readouterr().err
        assert not held.done()  # each was refused in the queue, while the batch ahead was held

        proc.gate.release()
        held.result()
        assert _statistics(stub) == (1, 1)  # only the held request's one row was ever computed
        assert not proc.gate.has_started()


def test_higher_priority_leaves_first_behind_a_gated_batch_on_grpc_and_rest(model_repository):
    # One queue for gRPC and REST: on the native plane they queue apart (test_native_control has its gRPC case).
    with GatedServer(model_repository, "--data-plane", "python", "--max-batch-size", "1") as proc, \
            proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        pool = futures.ThreadPoolExecutor(max_workers=5)
        calls = [pool.submit(stub.ModelInfer, _grpc_request(1), timeout=WAIT_S)]
        assert proc.gate.wait_started() == 1
        # Low priority first (2 and 3 rows: the batch's rows tell which ran), then high (4, 5).
        calls.append(pool.submit(stub.ModelInfer, _grpc_request(2, priority=("uint64_param", 2)), timeout=WAIT_S))
        _wait_queue_depth(proc, 1)
        calls.append(pool.submit(_rest_infer, proc, 3, {"priority": 2}))
        _wait_queue_depth(proc, 2)
        calls.append(pool.submit(stub.ModelInfer, _grpc_request(4), timeout=WAIT_S))  # the default: 1
        _wait_queue_depth(proc, 3)
        calls.append(pool.submit(_rest_infer, proc, 5, {"priority": 1}))
        _wait_queue_depth(proc, 4)
        order = []
        for _ in range(4):
            proc.gate.release()
            order.append(proc.gate.wait_started())
        proc.gate.release()
        for call in calls:
            answer = call.result()
            assert not isinstance(answer, tuple) or answer[0] == 200, answer
    assert order == [4, 5, 2, 3]


def test_a_low_priority_request_is_not_starved_on_a_real_server(model_repository):
    """--priority-aging-batches 2: the low request (2 rows) runs third among a stream of high ones
    (1 row), one queued before each batch forms; at the default (4) it would run fifth."""
    with GatedServer(model_repository, "--max-batch-size", "1", "--priority-aging-batches", "2") as proc, \
            proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        pool = futures.ThreadPoolExecutor(max_workers=8)
        calls = [pool.submit(stub.ModelInfer, _grpc_request(1), timeout=WAIT_S)]
        assert proc.gate.wait_started() == 1
        calls.append(pool.submit(stub.ModelInfer, _grpc_request(2, priority=("uint64_param", 2)), timeout=WAIT_S))
        _wait_queue_depth(proc, 1)
        order = []
        for _ in range(5):
            calls.append(pool.submit(stub.ModelInfer, _grpc_request(1), timeout=WAIT_S))
            _wait_queue_depth(proc, 2)
            proc.gate.release()
            order.append(proc.gate.wait_started())
        proc.gate.release(10)
        for call in calls:
            call.result()
    assert order == [1, 1, 2, 1, 1]


def test_malformed_schedule_parameters_are_refused_and_unknown_ones_ignored(server):
    with server.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        past = "'timeout' must be an integer in 0..1125899906842623 microseconds, got "
        for parameters, says in (({"priority": ("string_param", "high")}, "'priority' must be an integer"),
                                 ({"timeout": ("int64_param", -5)}, "'timeout' must be >= 0"),
                                 ({"priority": ("uint64_param", 3)}, "priority levels 1..2"),
                                 ({"timeout": ("uint64_param", 2**50)}, past + "1125899906842624"),
                                 ({"timeout": ("int64_param", 2**63 - 1)}, past + str(2**63 - 1))):
            with pytest.raises(grpc.RpcError) as exc:
                stub.ModelInfer(_grpc_request(1, **parameters), timeout=WAIT_S)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in exc.value.details()
        response = stub.ModelInfer(_grpc_request(1, sequence_id=("string_param", "x"), timeout=("int64_param", 0)),
                                   timeout=WAIT_S)
        assert response.outputs
        response = stub.ModelInfer(_grpc_request(1, timeout=("uint64_param", 2**50 - 1)), timeout=WAIT_S)
        assert response.outputs  # the longest timeout taken
    for parameters, says in (({"priority": "high"}, "'priority' must be an integer"),
                             ({"timeout": -1}, "'timeout' must be >= 0"),
                             ({"timeout": 1.5}, "'timeout' must be an integer"),
                             ({"priority": [1]}, "'priority' must be an integer"),
                             ({"priority": 7}, "priority levels 1..2"),
                             ({"timeout": 2**50}, past + "1125899906842624"),
                             ({"timeout": 2**64 - 1}, past + str(2**64 - 1)),
                             ({"timeout": 2**70}, past + str(2**70))):  # beyond 64 bits: the same words
        status, body = _rest_infer(server, 1, parameters)
        assert status == 400 and says in body["error"], (parameters, body)
    status, _ = _rest_infer(server, 1, {"sequence_id": {"nested": [1]}, "priority": 2, "timeout": 60_000_000})
    assert status == 200
    status, _ = _rest_infer(server, 1, {"timeout": 2**50 - 1})
    assert status == 200


def test_config_defaults_are_validated_reported_and_applied(model_repository, tmp_path):
    root = _repository(tmp_path, model_repository, {
        MODEL: {"dynamic_batching": {"priority_levels": 3, "default_priority_level": 2,
                                     "default_queue_policy": {"default_timeout_microseconds": 2_000_000}}},
        "cross_attention": {"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY"}}}})
    with GatedServer(root, "--max-batch-size", "1") as proc, proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        config = stub.ModelConfig(pb.ModelConfigRequest(name=MODEL), timeout=WAIT_S).config.dynamic_batching
        assert (config.priority_levels, config.default_priority_level) == (3, 2)
        assert config.default_queue_policy.default_timeout_microseconds == 2_000_000
        assert config.default_queue_policy.allow_timeout_override
        rest = _get_json(proc, f"/v2/models/{MODEL}/config")["dynamic_batching"]
        assert rest["priority_levels"] == 3 and rest["default_queue_policy"]["timeout_action"] == "REJECT"
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=WAIT_S).models
        (cross,) = [m for m in index if m.name == "cross_attention"]
        assert cross.state == "UNAVAILABLE" and "DELAY is not supported" in cross.reason

        pool = futures.ThreadPoolExecutor(max_workers=1)
        held = pool.submit(stub.ModelInfer, _grpc_request(1, priority=("uint64_param", 3)), timeout=WAIT_S)
        assert proc.gate.wait_started() == 1
        with pytest.raises(grpc.RpcError) as exc:  # no timeout of its own: the model's applies
            stub.ModelInfer(_grpc_request(2), timeout=WAIT_S)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not held.done()
        proc.gate.release()
        held.result()
        assert _statistics(stub) == (1, 1)


def test_the_batch_clis_priority_reaches_the_server(server, tmp_path, capsys):
    from attnserve.client.__main__ import main as cli

    np.savez(tmp_path / "in.npz", **_inputs(2))
    args = ["batch", "--url", server.address, "--model", MODEL, "--input", str(tmp_path / "in.npz")]
    assert cli([*args, "--output", str(tmp_path / "bad.npz"), "--priority", "3"]) != 0
    assert "parameter 'priority': this model has priority levels 1..2" in capsys.readouterr().err
    assert cli([*args, "--output", str(tmp_path / "ok.npz"), "--priority", "2", "--timeout-us", "60000000"]) == 0


def test_the_batch_cli_refuses_schedule_flags_it_cannot_send(tmp_path, capsys):
    from attnserve.client.__main__ import main as cli

    args = ["batch", "--url", "127.0.0.1:1", "--model", MODEL, "--input", str(tmp_path / "in.npz"),
            "--output", str(tmp_path / "out.npz")]
    assert cli([*args, "--priority", "-1"]) == 2
    assert "priority must be >= 0" in capsys.readouterr().err
    # Ray in process: each actor runs ONNX Runtime itself, there is no server queue to order.
    assert cli([*args, "--engine", "ray", "--model-repository", str(tmp_path), "--timeout-us", "5"]) == 2
    assert "timeout_us is a server's schedule policy: give urls (a client fleet)" in capsys.readouterr().err


def test_the_ray_fleets_priority_and_timeout_reach_the_server(server, tmp_path):
    """A Ray client fleet actor (made here as Ray makes it, from its kwargs; no Ray needed) sends
    --priority and --timeout-us on every request: a level the model lacks is refused by the
    server, a valid one is answered and its part written."""
    from attnserve.client.batch import tables
    from attnserve.client.batch.ray_job import FleetActor, read_output
    from attnserve.client.errors import InferenceError

    pa = tables.pyarrow()
    batch = pa.table({"id": tables.tensor_array(np.arange(2)),
                      **{name: tables.tensor_array(a) for name, a in _inputs(2).items()}})
    kwargs = dict(urls=(server.address,), model=MODEL, output_dir=str(tmp_path), outputs=("output",),
                  skip=frozenset(), request_items=2, concurrency=1, model_version="", timeout_s=60.0, retries=0)
    with pytest.raises(InferenceError) as exc:
        FleetActor(**kwargs, priority=3)(batch)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter 'priority': this model has priority levels 1..2" in exc.value.details
    assert FleetActor(**kwargs, priority=2, timeout_us=60_000_000)(batch)["computed"].tolist() == [2]
    assert read_output(tmp_path)["id"].tolist() == [0, 1]
