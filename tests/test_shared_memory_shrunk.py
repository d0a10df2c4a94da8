"""A shared memory object shrunk (ftruncate) below its registered region: the call that uses the
region is refused naming it, never a SIGBUS of the server (server.shm reads and writes regions
through their descriptor, never through a mapping), and the server serves on exactly.

The test's own side never maps an object either: it writes and reads them through a descriptor
(a mapping of a shrunk object would kill the test process the same way). What is held is held at
the gate of tests/gated_server.py (a region shrunk while its request waits or runs), never timed.
"""

from __future__ import annotations

import itertools
import os
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import shm as server_shm
from attnserve.server.memory.budget import MemoryBudget
from tritonclient.utils import InferenceServerException

from attnserve.contract import DATATYPES, INPUT_NAMES, OUTPUT_NAMES
from tests.gated_server import GatedServer
from tests.oip import eager, infer_request, random_inputs
from tests.server_process import ServerProcess

HEADS, WIDTH = 8, 512  # self_attention
PAGE = 4096
_keys = itertools.count()


class _Object:
    """A POSIX shm object under /dev/shm, written, read and resized through its descriptor."""

    def __init__(self, size: int) -> None:
        self.key = f"/attnserve-shrunk-{os.getpid()}-{next(_keys)}"
        self.path = f"{server_shm.SHM_DIR}/{self.key[1:]}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = size
        os.ftruncate(self.fd, size)

    def write(self, arrays: list[np.ndarray], offset: int) -> None:
        for array in arrays:
            data = np.ascontiguousarray(array).tobytes()
            assert os.pwrite(self.fd, data, offset) == len(data)
            offset += len(data)

    def read(self, shape: tuple[int, ...], offset: int) -> np.ndarray:
        nbytes = 4 * int(np.prod(shape))
        data = os.pread(self.fd, nbytes, offset)
        assert len(data) == nbytes
        return np.frombuffer(data, dtype="<f4").reshape(shape)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def restore(self) -> None:
        os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


@pytest.fixture()
def objects():
    made: list[_Object] = []

    def create(size: int) -> _Object:
        made.append(_Object(size))
        return made[-1]

    yield create
    for obj in made:
        obj.close()


@pytest.fixture(scope="module")
def shm_server(model_repository):
    proc = ServerProcess(model_repository, "--allow-shared-memory")
    yield proc
    proc.stop()


def _sizes(x: dict) -> dict[str, int]:
    b, lq, _ = x["query"].shape
    return {"output": b * lq * WIDTH * 4, "attn_probs": b * HEADS * lq * x["key"].shape[1] * 4}


def _shapes(x: dict) -> dict[str, tuple[int, ...]]:
    b, lq, _ = x["query"].shape
    return {"output": (b, lq, WIDTH), "attn_probs": (b, HEADS, lq, x["key"].shape[1])}


def _arrays(x: dict) -> list[tuple[str, np.ndarray]]:
    return [(name, x[name]) for name in INPUT_NAMES if x.get(name) is not None]


def _client_infer(module, client, x: dict, inputs_in: str | None, outputs_in: str | None):
    """tritonclient's call: inputs at offsets 0.. of region `inputs_in` (None: in the message),
    both outputs packed in region `outputs_in` (None: in the answer)."""
    inputs, offset = [], 0
    for name, array in _arrays(x):
        tensor = module.InferInput(name, list(array.shape), DATATYPES[name])
        if inputs_in:
            tensor.set_shared_memory(inputs_in, array.nbytes, offset)
        else:
            tensor.set_data_from_numpy(array)
        offset += array.nbytes
        inputs.append(tensor)
    outputs, offset = [], 0
    for name in OUTPUT_NAMES:
        requested = module.InferRequestedOutput(name, binary_data=True) if module is httpclient else \
            module.InferRequestedOutput(name)
        if outputs_in:
            requested.set_shared_memory(outputs_in, _sizes(x)[name], offset)
            offset += _sizes(x)[name]
        outputs.append(requested)
    return client.infer("self_attention", inputs, outputs=outputs)


def _answer(module, client, x: dict, inputs_in: str | None = None, out: tuple[str, _Object, int] | None = None
            ) -> dict[str, np.ndarray]:
    """Both outputs of one call: read from the output object (out: its region name, the object and
    the region's offset in it), or from the answer."""
    result = _client_infer(module, client, x, inputs_in, out[0] if out else None)
    if out is None:
        return {name: result.as_numpy(name) for name in OUTPUT_NAMES}
    _, obj, at = out
    got = {}
    for name in OUTPUT_NAMES:
        got[name] = obj.read(_shapes(x)[name], at).copy()
        at += _sizes(x)[name]
    return got


def _refused_shrunk(call, region: str, module) -> str:
    with pytest.raises(InferenceServerException) as exc:
        call()
    message = exc.value.message()
    assert str(exc.value.status()) == ("StatusCode.INVALID_ARGUMENT" if module is grpcclient else "400"), \
        (exc.value.status(), message)
    assert f"shared memory region {region!r} is smaller than registered" in message, message
    return message


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "rest"])
def test_a_shrunk_input_region_is_refused_naming_it_and_the_next_call_is_exact(module, shm_server, objects):
    """Inputs (a BOOL mask among them) in a region registered at an offset in its object; the
    object cut one byte short of the region's end, then to nothing: each call refused naming the
    region and the sizes; the server lives, and once the client restores the object the same
    call answers bit for bit what the request answers in a message."""
    client = (grpcclient.InferenceServerClient(url=shm_server.address) if module is grpcclient
              else httpclient.InferenceServerClient(url=shm_server.http_address))
    x = random_inputs(np.random.default_rng(31), 2, 5, 6, WIDTH, WIDTH, masked=True)
    total = sum(a.nbytes for _, a in _arrays(x))
    obj = objects(PAGE + total)
    obj.write([a for _, a in _arrays(x)], PAGE)
    region = f"in-{module.__name__}"
    try:
        client.unregister_system_shared_memory()
        client.register_system_shared_memory(region, obj.key, total, offset=PAGE)
        plain = _answer(module, client, x)
        for size in (PAGE + total - 1, PAGE, 0):
            obj.truncate(size)
            message = _refused_shrunk(lambda: _client_infer(module, client, x, region, None), region, module)
            assert f"key {obj.key!r} now has {size:,} bytes" in message, message
            assert f"offset {PAGE:,} + byte_size {total:,}" in message, message
            assert client.is_server_live()
        obj.restore()  # the bytes past the cut are gone: the client writes its inputs again
        obj.write([a for _, a in _arrays(x)], PAGE)
        got = _answer(module, client, x, inputs_in=region)
        for name in OUTPUT_NAMES:
            assert np.array_equal(got[name], plain[name]), name
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "rest"])
def test_a_shrunk_output_region_is_refused_naming_it_and_another_region_then_gets_the_exact_answer(
        module, shm_server, objects):
    client = (grpcclient.InferenceServerClient(url=shm_server.address) if module is grpcclient
              else httpclient.InferenceServerClient(url=shm_server.http_address))
    x = random_inputs(np.random.default_rng(32), 1, 7, 9, WIDTH, WIDTH)
    out_bytes = sum(_sizes(x).values())
    shrunk, other = objects(out_bytes), objects(PAGE + out_bytes)
    name = f"out-{module.__name__}"
    try:
        client.unregister_system_shared_memory()
        client.register_system_shared_memory(name, shrunk.key, out_bytes)
        client.register_system_shared_memory("other", other.key, out_bytes, offset=PAGE)
        plain = _answer(module, client, x)
        shrunk.truncate(out_bytes - 4)
        message = _refused_shrunk(lambda: _client_infer(module, client, x, None, name), name, module)
        assert f"output 'output': shared memory region {name!r}" in message, message
        assert shrunk.read((1,), 0).tolist() == [0.0]  # nothing was written there
        assert client.is_server_live()
        got = _answer(module, client, x, out=("other", other, PAGE))
        for output in OUTPUT_NAMES:
            assert np.array_equal(got[output], plain[output]), output
        shrunk.restore()
        got = _answer(module, client, x, out=(name, shrunk, 0))
        for output in OUTPUT_NAMES:
            assert np.array_equal(got[output], plain[output]), output
    finally:
        client.unregister_system_shared_memory()
        client.close()


# -- shrunk while the request waits or runs (held at the gate) ----------------------------------


def _placed_request(x: dict, inputs_in: str | None, outputs_in: str | None) -> pb.ModelInferRequest:
    """The raw gRPC request: inputs packed from offset 0 of `inputs_in`, outputs of `outputs_in`."""
    request = infer_request("self_attention", **({} if inputs_in else x))
    if inputs_in:
        offset = 0
        for name, array in _arrays(x):
            tensor = request.inputs.add(name=name, datatype=DATATYPES[name], shape=array.shape)
            tensor.parameters[server_shm.REGION].string_param = inputs_in
            tensor.parameters[server_shm.OFFSET].int64_param = offset
            tensor.parameters[server_shm.BYTE_SIZE].int64_param = array.nbytes
            offset += array.nbytes
    offset = 0
    for name in OUTPUT_NAMES:
        output = request.outputs.add(name=name)
        if outputs_in:
            output.parameters[server_shm.REGION].string_param = outputs_in
            output.parameters[server_shm.OFFSET].int64_param = offset
            output.parameters[server_shm.BYTE_SIZE].int64_param = _sizes(x)[name]
            offset += _sizes(x)[name]
    return request


def test_regions_shrunk_while_their_requests_wait_for_the_run(model_repository, eager_modules, objects):
    """Behind a batch held at the gate, three requests queue (their placements checked, their
    inputs read): A's output region is then cut, B's input region is cut, C is left alone. A runs
    alone (its length pads too much to merge), then B and C in one batch: A is refused naming its
    region, and nothing is written into it; B's inputs were read when it was decoded, so it
    computes exactly, and so does C beside it in the merged batch; the server serves on."""
    rng = np.random.default_rng(33)
    xs = {tag: {**random_inputs(rng, b, lq, lk, WIDTH, WIDTH), "mask": None}
          for tag, b, lq, lk in (("held", 1, 3, 6), ("a", 1, 64, 64), ("b", 3, 5, 6), ("c", 3, 5, 6))}
    with GatedServer(model_repository, "--allow-shared-memory", "--max-batch-size", "8") as proc:
        channels = [grpc.insecure_channel(proc.address) for _ in xs]
        try:
            stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
            objs = {}
            for tag, x in xs.items():
                objs[f"{tag}-in"] = objects(sum(arr.nbytes for _, arr in _arrays(x)))
                objs[f"{tag}-in"].write([arr for _, arr in _arrays(x)], 0)
                objs[f"{tag}-out"] = objects(sum(_sizes(x).values()))
                for which in ("in", "out"):
                    obj = objs[f"{tag}-{which}"]
                    stubs[0].SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                        name=f"{tag}-{which}", key=obj.key, byte_size=obj.size), timeout=60)
            results: dict = {}

            def call(index: int, tag: str) -> None:
                request = _placed_request(xs[tag], f"{tag}-in", f"{tag}-out")
                try:
                    results[tag] = stubs[index].ModelInfer(request, timeout=120)
                except grpc.RpcError as err:
                    results[tag] = err

            threads = {tag: threading.Thread(target=call, args=(i, tag)) for i, tag in enumerate(xs)}
            threads["held"].start()
            assert proc.gate.wait_started() == 1  # held at the gate
            for queued, tag in enumerate(("a", "b", "c"), start=1):  # queued in this order
                threads[tag].start()
                _wait_queued(proc, queued)
            objs["a-out"].truncate(PAGE // 2)
            objs["b-in"].truncate(0)
            proc.gate.release()  # the held batch
            assert proc.gate.wait_started() == 1  # A alone
            proc.gate.release()
            assert proc.gate.wait_started() == 6  # B and C, three rows each
            proc.gate.release()
            for thread in threads.values():
                thread.join(120)
            assert isinstance(results["a"], grpc.RpcError), results["a"]
            assert results["a"].code() == grpc.StatusCode.INVALID_ARGUMENT, results["a"].details()
            assert results["a"].details().startswith("output 'output': shared memory region 'a-out' is smaller than "
                                                     "registered"), results["a"].details()
            assert objs["a-out"].read((PAGE // 8,), 0).tolist() == [0.0] * (PAGE // 8)  # nothing written there
            for tag in ("held", "b", "c"):
                assert not isinstance(results[tag], grpc.RpcError), (tag, results[tag])
                x = xs[tag]
                want = eager(eager_modules["self_attention"], x["query"], x["key"], x["value"])
                at = 0
                for name in OUTPUT_NAMES:
                    got = objs[f"{tag}-out"].read(_shapes(x)[name], at)
                    at += _sizes(x)[name]
                    assert np.max(np.abs(got - want[name])) <= 1e-5, (tag, name)
            assert proc.health() == 1  # SERVING
        finally:
            for ch in channels:
                ch.close()


def _wait_queued(proc: GatedServer, count: int) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + 60
    series = 'attnserve_queue_depth{model="self_attention"}'
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=30) as response:
            text = response.read().decode()
        depth = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.rsplit(" ", 1)[0] == series), 0.0)
        if depth == count:
            return
        assert time.monotonic() < deadline, f"queue depth {depth}, not {count}"
        time.sleep(0.01)  # polling a state the server reports


# -- server.shm on its own: a shrink racing the copies ------------------------------------------


def test_a_shrunk_object_is_refused_by_lease_input_and_output_naming_the_region(objects):
    obj = objects(3 * PAGE)
    obj.write([np.arange(PAGE // 4, dtype=np.float32)], PAGE)
    table = server_shm.SystemSharedMemory(8, 1 << 30, MemoryBudget(1 << 30))
    table.register("r", obj.key, PAGE, PAGE)
    lease = table.lease()
    try:
        data = lease.input(server_shm.Placement("r", 0, PAGE), PAGE, "input 'query'")
        assert np.frombuffer(data, np.float32).tolist() == list(range(PAGE // 4))
        writer = lease.output(server_shm.Placement("r", 0, PAGE), PAGE, "output 'output'")
        obj.truncate(PAGE + 8)
        with pytest.raises(server_shm.SharedMemoryError, match="input 'query': shared memory region 'r' is smaller "
                                                               "than registered"):
            lease.input(server_shm.Placement("r", 0, 4), 4, "input 'query'")
        writer.write(memoryview(np.ones(PAGE // 4, np.float32)).cast("B"))
        assert isinstance(writer.error, server_shm.SharedMemoryError)
        assert str(writer.error).startswith("output 'output': shared memory region 'r' is smaller than registered")
        assert os.fstat(obj.fd).st_size == PAGE + 8  # not grown back by the write it refused
    finally:
        lease.release()
        table.close()
    assert table.mapped == 0


def test_a_shrink_racing_reads_and_writes_never_kills_the_process(objects):
    """A thread cuts and restores the object over and over while this one reads inputs and writes
    outputs of the region: each read gives all its bytes or is refused, each write is done or
    refused; none can fault (a mapping's copy would die with SIGBUS on the first cut it met)."""
    size = 16 * PAGE
    obj = objects(size)
    table = server_shm.SystemSharedMemory(8, 1 << 30)
    table.register("r", obj.key, 0, size)
    stop = threading.Event()
    cuts = 0

    def shrink() -> None:
        nonlocal cuts
        while not stop.is_set():
            obj.truncate(PAGE)
            obj.restore()
            cuts += 1

    thread = threading.Thread(target=shrink)
    thread.start()
    outcomes = {"read": 0, "refused": 0, "written": 0, "write refused": 0}
    payload = memoryview(np.ones(size // 4, np.float32)).cast("B")
    try:
        for _ in range(500):
            lease = table.lease()
            try:
                assert len(lease.input(server_shm.Placement("r", 0, size), size, "input 'query'")) == size
                outcomes["read"] += 1
            except server_shm.SharedMemoryError as err:
                assert "is smaller than registered" in str(err), err
                outcomes["refused"] += 1
            writer = lease.output(server_shm.Placement("r", 0, size), size, "output 'output'")
            writer.write(payload)
            outcomes["write refused" if writer.error else "written"] += 1
            lease.release()
    finally:
        stop.set()
        thread.join()
        table.close()
    assert sum(outcomes.values()) == 1000 and cuts > 0, outcomes
