"""Triton's system shared memory extension (server.shm), through NVIDIA's tritonclient unmodified.

tritonclient.utils.shared_memory creates the regions; tritonclient.grpc and tritonclient.http
register them and name them in inputs and requested outputs. Answers are compared with the
seeds' code (tests.seed_reference's seed 000 with the served weights; our module for the cross
preset, which test_attention holds to seed 002). Every refusal is checked with the server
serving on afterwards; a region unregistered while a request (held at the gate) uses it stays
open until it ends; 1,000 register/unregister cycles leave the server's fds and mappings as
they were. (Objects shrunk under their regions: tests/test_shared_memory_shrunk.py.)
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from attnserve.server import shm as server_shm
from attnserve.server.memory.budget import MemoryBudget
from tritonclient.utils import InferenceServerException

from attnserve.contract import DATATYPES, INPUT_NAMES, OUTPUT_NAMES
from tests.gated_server import GatedServer
from tests.oip import CASES, WIDTHS, eager, random_inputs
from tests.seed_reference import Seed000MultiHeadAttention, served_references
from tests.server_process import ServerProcess

TOLERANCE = 1e-5
MAX_MESSAGE_BYTES = 4 << 20
MAX_REGIONS = 6
MAX_BYTES = 48 << 20
_keys = itertools.count()


def _key() -> str:
    return f"/attnserve-test-{os.getpid()}-{next(_keys)}"


@pytest.fixture(scope="module")
def shm_server(model_repository):
    proc = ServerProcess(model_repository, "--allow-shared-memory", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                         "--shared-memory-max-regions", str(MAX_REGIONS),
                         "--shared-memory-max-bytes", str(MAX_BYTES))
    yield proc
    proc.stop()


@pytest.fixture()
def grpc_client(shm_server):
    client = grpcclient.InferenceServerClient(url=shm_server.address)
    client.unregister_system_shared_memory()
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture()
def http_client(shm_server):
    client = httpclient.InferenceServerClient(url=shm_server.http_address)
    client.unregister_system_shared_memory()
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture()
def regions():
    """Regions this test created; destroyed (unlinked) after it."""
    with _Regions() as create:
        yield create


class _Regions:
    def __init__(self) -> None:
        self.made: list = []

    def __call__(self, name: str, byte_size: int):
        handle = shm.create_shared_memory_region(name, _key(), byte_size)
        self.made.append(handle)
        return handle

    def __enter__(self) -> _Regions:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.made:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def references(eager_modules):
    return served_references(eager_modules)


def _want(module, x: dict) -> dict:
    mask = x["mask"]
    if isinstance(module, Seed000MultiHeadAttention) and mask is not None:
        mask = mask[:, None]  # (b, lq, lk) is the same for every head: seed 000 takes it as (b, 1, lq, lk)
    return eager(module, x["query"], x["key"], x["value"], mask)


def _sizes(x: dict, heads: int, out_dim: int) -> dict[str, int]:
    b, lq, _ = x["query"].shape
    lk = x["key"].shape[1]
    return {"output": b * lq * out_dim * 4, "attn_probs": b * heads * lq * lk * 4}


HEADS = {"self_attention": 8, "cross_attention": 2}


def _shm_infer(module, client, model: str, x: dict, regions, in_shm: bool = True,
               out_in_shm: tuple[str, ...] = OUTPUT_NAMES, tag: str = "") -> dict[str, np.ndarray]:
    """One request with its inputs packed in one region (at offsets) and `out_in_shm` outputs
    packed in another; the rest of the outputs come in the answer."""
    arrays = [(name, x[name]) for name in INPUT_NAMES if x.get(name) is not None]
    inputs = []
    if in_shm:
        total = sum(a.nbytes for _, a in arrays)
        handle = regions(f"in{tag}", total)
        shm.set_shared_memory_region(handle, [a for _, a in arrays])
        module.InferenceServerClient.register_system_shared_memory(client, f"in{tag}", handle._shm_key, total)
    offset = 0
    for name, array in arrays:
        tensor = module.InferInput(name, list(array.shape), DATATYPES[name])
        if in_shm:
            tensor.set_shared_memory(f"in{tag}", array.nbytes, offset)
        else:
            tensor.set_data_from_numpy(array)
        offset += array.nbytes
        inputs.append(tensor)
    sizes = _sizes(x, HEADS[model], WIDTHS[model])
    outputs, placed = [], {}
    out_total = sum(sizes[name] for name in out_in_shm)
    out_handle = regions(f"out{tag}", out_total) if out_in_shm else None
    if out_handle is not None:
        module.InferenceServerClient.register_system_shared_memory(client, f"out{tag}", out_handle._shm_key, out_total)
    offset = 0
    for name in OUTPUT_NAMES:
        requested = module.InferRequestedOutput(name, binary_data=True) if module is httpclient else \
            module.InferRequestedOutput(name)
        if name in out_in_shm:
            requested.set_shared_memory(f"out{tag}", sizes[name], offset)
            placed[name] = offset
            offset += sizes[name]
        outputs.append(requested)
    result = client.infer(model, inputs, outputs=outputs)
    got = {}
    for name in OUTPUT_NAMES:
        tensor = result.get_output(name)
        shape = [int(d) for d in (tensor["shape"] if isinstance(tensor, dict) else tensor.shape)]
        if name in placed:
            got[name] = shm.get_contents_as_numpy(out_handle, np.float32, shape, offset=placed[name]).copy()
        else:
            got[name] = result.as_numpy(name)
    return got


def _check(got: dict, want: dict, case: str) -> None:
    for name in OUTPUT_NAMES:
        assert got[name].shape == want[name].shape, (case, name, got[name].shape)
        err = float(np.max(np.abs(got[name] - want[name])))
        assert err <= TOLERANCE, f"{case} {name}: max abs error {err}"


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "rest"])
def test_both_presets_masks_and_outputs_through_regions(module, grpc_client, http_client, regions, references):
    client = grpc_client if module is grpcclient else http_client
    rng = np.random.default_rng(7)
    for case, (model, b, lq, lk, masked) in CASES.items():
        x = random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=masked, fully_masked_row=masked)
        want = _want(references[model], x)
        _check(_shm_infer(module, client, model, x, regions, tag=case), want, case)
        # Mixed: inputs in the message, `output` in a region, attn_probs in the answer.
        _check(_shm_infer(module, client, model, x, regions, in_shm=False, out_in_shm=("output",), tag=case + "m"),
               want, case + " mixed")
        client.unregister_system_shared_memory()
    assert "system_shared_memory" in grpc_client.get_server_metadata(as_json=True)["extensions"]


def test_attn_probs_over_the_message_limit_come_through_a_region(grpc_client, regions, references):
    rng = np.random.default_rng(3)
    x = random_inputs(rng, 1, 512, 512, 512, 512)  # attn_probs: 1 x 8 x 512 x 512 x 4 = 8 MiB
    assert _sizes(x, 8, 512)["attn_probs"] > MAX_MESSAGE_BYTES
    with pytest.raises(InferenceServerException) as exc:  # the same request answered in the message
        _shm_infer(grpcclient, grpc_client, "self_attention", x, regions, out_in_shm=(), tag="plain")
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT" and "message limit" in exc.value.message()
    got = _shm_infer(grpcclient, grpc_client, "self_attention", x, regions, tag="big")
    _check(got, _want(references["self_attention"], x), "over the message limit")


def _refused(call, *words: str, status: str = "StatusCode.INVALID_ARGUMENT") -> str:
    with pytest.raises(InferenceServerException) as exc:
        call()
    message = exc.value.message()
    assert str(exc.value.status()) in (status, "400", "503"), (exc.value.status(), message)
    for word in words:
        assert word in message, (word, message)
    return message


def test_each_validation_case_is_refused_and_the_server_serves_on(grpc_client, http_client, regions, references):
    good = regions("good", 1 << 16)
    register = grpc_client.register_system_shared_memory
    # Keys that are not plain shm names; a key that does not exist.
    for key in ("/a/b", "/..", "/.", "/bad\0key", "", "/", "/" + "k" * 300):
        _refused(lambda key=key: register("r", key, 16), "not a POSIX shm key")
    _refused(lambda: register("r", "/attnserve-test-absent", 16), "'r'", "cannot open")
    _refused(lambda: register("r", "/../etc/passwd", 16), "not a POSIX shm key")
    # Offsets and sizes against the object (64 KiB), overflow included.
    _refused(lambda: register("r", good._shm_key, (1 << 16) + 1), "'r'", "runs past the end", "65536 bytes")
    _refused(lambda: register("r", good._shm_key, 16, offset=(1 << 16) - 8), "runs past the end")
    _refused(lambda: register("r", good._shm_key, 2, offset=(1 << 64) - 1), "runs past the end")
    _refused(lambda: register("r", good._shm_key, 0), "byte_size at least 1")
    # The name is taken; the count and bytes bounds.
    register("good", good._shm_key, 1 << 16)
    _refused(lambda: register("good", good._shm_key, 16), "'good'", "already registered")
    for i in range(MAX_REGIONS - 1):
        register(f"extra{i}", good._shm_key, 16)
    # The bounds are spent now (retry once regions go): RESOURCE_EXHAUSTED, not the caller's mistake.
    _refused(lambda: register("one-more", good._shm_key, 16), "'one-more'", f"bound is {MAX_REGIONS}",
             "--shared-memory-max-regions", status="StatusCode.RESOURCE_EXHAUSTED")
    grpc_client.unregister_system_shared_memory()
    big = regions("big", MAX_BYTES)
    register("big", big._shm_key, MAX_BYTES)
    _refused(lambda: register("more", good._shm_key, 16), "'more'", f"{MAX_BYTES:,}", "--shared-memory-max-bytes",
             status="StatusCode.RESOURCE_EXHAUSTED")
    grpc_client.unregister_system_shared_memory()
    bigger = regions("bigger", MAX_BYTES + 4096)  # more than the bound itself: never fits
    _refused(lambda: register("bigger", bigger._shm_key, MAX_BYTES + 1), "'bigger'", "exceed the bound",
             "--shared-memory-max-bytes")
    # Unknown names.
    _refused(lambda: grpc_client.unregister_system_shared_memory("nope"), "'nope'", "not registered")
    _refused(lambda: grpc_client.get_system_shared_memory_status("nope"), "'nope'", "not registered")

    # Requests: placements checked against the region (64 KiB holds a (1, 4, 512) query at most).
    register("good", good._shm_key, 1 << 16)
    x = random_inputs(np.random.default_rng(1), 1, 4, 4, 512, 512)

    def infer(placements: dict, outputs: dict | None = None):
        inputs = []
        for name in ("query", "key", "value"):
            tensor = grpcclient.InferInput(name, list(x[name].shape), "FP32")
            if name in placements:
                tensor.set_shared_memory(*placements[name])
            else:
                tensor.set_data_from_numpy(x[name])
            inputs.append(tensor)
        requested = []
        for name, placement in (outputs or {}).items():
            requested.append(grpcclient.InferRequestedOutput(name))
            requested[-1].set_shared_memory(*placement)
        return grpc_client.infer("self_attention", inputs, outputs=requested or None)

    nbytes = x["query"].nbytes  # 8 KiB
    _refused(lambda: infer({"query": ("good", nbytes - 4)}), "'query'", f"{nbytes:,} bytes", "'good'")
    _refused(lambda: infer({"query": ("good", nbytes, (1 << 16) - nbytes + 4)}), "'query'", "runs past the end",
             "'good'", "65,536 bytes")
    _refused(lambda: infer({"query": ("good", nbytes, (1 << 63) - 1)}), "'query'", "runs past the end")
    _refused(lambda: infer({"query": ("absent", nbytes)}), "'absent'", "not registered")
    _refused(lambda: infer({}, {"output": ("good", 100)}), "'output'", "at least 8,192 bytes")
    _refused(lambda: infer({}, {"output": ("good", 1 << 16, 8)}), "'output'", "runs past the end")
    # REST: the same checks, 400.
    with pytest.raises(InferenceServerException) as exc:
        http_client.register_system_shared_memory("r", "/a/b", 16)
    assert "not a POSIX shm key" in exc.value.message()
    _refused(lambda: http_client.unregister_system_shared_memory("nope"), "'nope'", "not registered")
    tensor = httpclient.InferInput("query", list(x["query"].shape), "FP32")
    tensor.set_shared_memory("good", nbytes + 4)
    rest_inputs = [tensor] + [httpclient.InferInput(n, list(x[n].shape), "FP32") for n in ("key", "value")]
    for t, n in zip(rest_inputs[1:], ("key", "value"), strict=True):
        t.set_data_from_numpy(x[n])
    _refused(lambda: http_client.infer("self_attention", rest_inputs), "'query'", f"{nbytes:,} bytes")

    # The server serves on: a region request answers right.
    assert grpc_client.is_server_live()
    after = random_inputs(np.random.default_rng(2), 1, 5, 5, 512, 512)
    _check(_shm_infer(grpcclient, grpc_client, "self_attention", after, regions, tag="after"),
           _want(references["self_attention"], after), "after the refusals")
    status = grpc_client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["good"]["key"] == good._shm_key and int(status["good"]["byte_size"]) == 1 << 16
    assert {r["name"] for r in http_client.get_system_shared_memory_status()} == {"good", "inafter", "outafter"}


def _fds(pid: int) -> list[str]:
    fds = []
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{entry}"))
        except FileNotFoundError:
            pass
    return fds


def _maps(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/maps").read_text().splitlines()


def test_a_thousand_register_unregister_cycles_leave_fds_and_mappings(grpc_client, shm_server, regions):
    handle = regions("cycled", 1 << 16)
    key = handle._shm_key
    pid = shm_server.proc.pid
    for _ in range(10):  # warm: gRPC's and Python's own first-call allocations
        grpc_client.register_system_shared_memory("cycled", key, 4096, offset=4096)
        grpc_client.unregister_system_shared_memory("cycled")
    fds, maps, threads = len(_fds(pid)), len(_maps(pid)), len(os.listdir(f"/proc/{pid}/task"))
    grpc_client.register_system_shared_memory("cycled", key, 4096, offset=4096)
    # One descriptor, and never a mapping (regions are read and written through it: server.shm).
    assert sum(key in line for line in _maps(pid)) == 0 and sum(key in f for f in _fds(pid)) == 1
    grpc_client.unregister_system_shared_memory("cycled")
    for i in range(1000):
        grpc_client.register_system_shared_memory("cycled", key, 4096 + i % 7, offset=i % 5 * 4096)
        grpc_client.unregister_system_shared_memory("cycled")
    assert sum(key in line for line in _maps(pid)) == 0
    assert sum(key in f for f in _fds(pid)) == 0
    assert len(_fds(pid)) == fds
    # The allocator may map an arena, and a thread the server started meanwhile (a memory reclaim
    # pass on the default executor) its stack, guard page and arena; a leak would be a thousand.
    started = max(len(os.listdir(f"/proc/{pid}/task")) - threads, 0)
    assert len(_maps(pid)) <= maps + 2 + 3 * started


def test_off_by_default(server, regions):
    client = grpcclient.InferenceServerClient(url=server.address)
    try:
        assert "system_shared_memory" not in client.get_server_metadata(as_json=True)["extensions"]
        handle = regions("off", 4096)
        _refused(lambda: client.register_system_shared_memory("off", handle._shm_key, 4096), "--allow-shared-memory",
                 status="StatusCode.UNAVAILABLE")
        tensor = grpcclient.InferInput("query", [1, 2, 512], "FP32")
        tensor.set_shared_memory("off", 4096)
        others = [grpcclient.InferInput(n, [1, 2, 512], "FP32") for n in ("key", "value")]
        for t in others:
            t.set_data_from_numpy(np.zeros((1, 2, 512), np.float32))
        _refused(lambda: client.infer("self_attention", [tensor, *others]), "'query'", "--allow-shared-memory")
        assert client.is_server_ready()
    finally:
        client.close()
    rest = httpclient.InferenceServerClient(url=server.http_address)
    try:
        _refused(lambda: rest.get_system_shared_memory_status(), "--allow-shared-memory")
    finally:
        rest.close()


def test_cuda_shared_memory_says_why_it_is_unavailable(grpc_client, http_client):
    """On this CPU server every CUDA shared memory call is UNAVAILABLE / 503 saying it needs a GPU
    server and why this one runs on the CPU (not UNIMPLEMENTED, not a bare "not served")."""
    for call in (grpc_client.get_cuda_shared_memory_status,
                 lambda: grpc_client.register_cuda_shared_memory("c", b"\0" * 64, 0, 16),
                 lambda: grpc_client.unregister_cuda_shared_memory("c")):
        with pytest.raises(InferenceServerException) as exc:
            call()
        assert exc.value.status() == "StatusCode.UNAVAILABLE", exc.value
        assert "CUDA shared memory needs a GPU server: this one runs on the CPU" in exc.value.message()
    for call in (http_client.get_cuda_shared_memory_status,
                 lambda: http_client.register_cuda_shared_memory("c", b"\0" * 64, 0, 16),
                 http_client.unregister_cuda_shared_memory):
        with pytest.raises(InferenceServerException) as exc:
            call()
        assert exc.value.status() == "503" and "needs a GPU server" in exc.value.message(), exc.value
    assert "cuda_shared_memory" not in grpc_client.get_server_metadata(as_json=True)["extensions"]
    assert grpc_client.is_server_ready()


def _region_metrics(proc: ServerProcess) -> dict[str, float]:
    """attnserve_shared_memory_{regions,bytes,mapped_regions,mapped_bytes} on /metrics."""
    text = _metrics_text(proc)
    found = {}
    for line in text.splitlines():
        for name in ("regions", "bytes", "mapped_regions", "mapped_bytes"):
            if line.startswith(f"attnserve_shared_memory_{name} "):
                found[name] = float(line.split()[1])
    return found


def test_a_region_unregistered_in_use_stays_open_until_the_request_ends(model_repository, regions, references):
    x = random_inputs(np.random.default_rng(5), 1, 6, 6, 512, 512)
    x["mask"] = None
    with GatedServer(model_repository, "--allow-shared-memory") as proc:
        client = grpcclient.InferenceServerClient(url=proc.address)
        try:
            answer: dict = {}
            thread = threading.Thread(target=lambda: answer.update(
                got=_shm_infer(grpcclient, client, "self_attention", x, regions, tag="held")))
            thread.start()
            proc.gate.wait_started()  # the request is in its run, reading the input region
            in_key = next(h._shm_key for h in regions.made if h._triton_shm_name == "inheld")
            status = client.get_system_shared_memory_status(as_json=True)["regions"]
            registered = sum(int(r["byte_size"]) for r in status.values())
            assert _region_metrics(proc) == {"regions": 2, "bytes": registered, "mapped_regions": 2,
                                             "mapped_bytes": registered}
            client.unregister_system_shared_memory()
            assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
            assert sum(in_key in f for f in _fds(proc.proc.pid)) == 1  # still open: in use
            assert _region_metrics(proc) == {"regions": 0, "bytes": 0, "mapped_regions": 2,
                                             "mapped_bytes": registered}
            proc.gate.release()
            thread.join(60)
            _check(answer["got"], _want(references["self_attention"], x), "unregistered in use")
            assert sum(in_key in f for f in _fds(proc.proc.pid)) == 0  # closed once it ended
            assert sum(in_key in line for line in _maps(proc.proc.pid)) == 0  # never mapped
            assert _region_metrics(proc) == {"regions": 0, "bytes": 0, "mapped_regions": 0, "mapped_bytes": 0}
            assert client.is_server_live()
        finally:
            client.close()



def test_placement_parameters_past_their_bounds_are_refused_on_both_ports(shm_server, grpc_client, http_client,
                                                                            regions):
    """shared_memory_offset / _byte_size are Triton's int64: a uint64_param past 2^63 - 1 over gRPC
    (the native port relays the request to the Python request path) is refused naming the
    parameter and the bound, as REST refuses a JSON integer past it; the server serves on."""
    import grpc
    from attnserve.proto import inference_pb2 as pb
    from attnserve.proto import inference_pb2_grpc as pb_grpc

    handle = regions("bounded", 1 << 16)
    grpc_client.register_system_shared_memory("bounded", handle._shm_key, 1 << 16)
    x = random_inputs(np.random.default_rng(9), 1, 2, 2, 512, 512)
    for key in (server_shm.OFFSET, server_shm.BYTE_SIZE):
        request = pb.ModelInferRequest(model_name="self_attention")
        for name in ("query", "key", "value"):
            tensor = request.inputs.add(name=name, datatype="FP32", shape=x[name].shape)
            tensor.parameters[server_shm.REGION].string_param = "bounded"
            tensor.parameters[server_shm.BYTE_SIZE].int64_param = x[name].nbytes
        request.inputs[0].parameters[key].uint64_param = 1 << 63
        with grpc.insecure_channel(shm_server.address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        assert exc.value.details() == (f"input 'query': {key} must be at most 9223372036854775807 (an int64), "
                                       "got 9223372036854775808")
        tensor = httpclient.InferInput("query", list(x["query"].shape), "FP32")
        tensor.set_shared_memory("bounded", x["query"].nbytes)
        tensor._parameters[key] = 1 << 63
        others = [httpclient.InferInput(n, list(x[n].shape), "FP32") for n in ("key", "value")]
        for t, n in zip(others, ("key", "value"), strict=True):
            t.set_data_from_numpy(x[n])
        _refused(lambda tensor=tensor, others=others: http_client.infer("self_attention", [tensor, *others]),
                 f"input 'query': {key} must be a non-negative integer, got 9223372036854775808")
    assert grpc_client.is_server_ready()


# -- server.shm on its own ---------------------------------------------------------------------


def test_keys_are_plain_shm_names():
    assert server_shm.check_key("/abc") == "abc" and server_shm.check_key("abc.d-e_f") == "abc.d-e_f"
    for key in ("", "/", "/a/b", "a/b", "/..", "..", ".", "/a\0b", "/" + "x" * 255):
        with pytest.raises(server_shm.SharedMemoryError):
            server_shm.check_key(key)


def test_mapped_bytes_are_reserved_in_the_memory_budget(regions):
    handle = regions("budgeted", 1 << 20)
    budget = MemoryBudget(4 << 20)
    table = server_shm.SystemSharedMemory(8, 1 << 30, budget)
    table.register("a", handle._shm_key, 0, 1 << 20)
    assert budget.reserved_bytes == 1 << 20
    with pytest.raises(Exception, match="memory budget"):  # 1 MiB more would not fit beside the waiting room
        for name in "bcd":
            table.register(name, handle._shm_key, 0, 1 << 20)
    table.unregister()
    assert budget.reserved_bytes == 0 and table.mapped == 0


def test_a_lease_keeps_an_unregistered_region_open(regions):
    handle = regions("leased", 4096)
    shm.set_shared_memory_region(handle, [np.arange(8, dtype=np.float32)])
    table = server_shm.SystemSharedMemory(8, 1 << 30)
    table.register("r", handle._shm_key, 0, 4096)
    lease = table.lease()
    view = lease.input(server_shm.Placement("r", 4, 8), 8, "input 'query'")
    table.unregister("r")
    assert table.mapped == 1 and table.status() == []
    table.register("r", handle._shm_key, 0, 4096)  # the name is free again
    assert np.frombuffer(view, np.float32).tolist() == [1.0, 2.0]
    assert not np.frombuffer(view, np.float32).flags.writeable
    del view
    lease.release()
    assert table.mapped == 1  # only the new registration
    table.close()
    assert table.mapped == 0


def test_staging_buffers_are_kept_only_after_an_answered_request_and_within_the_regions_bytes(regions):
    """Inputs are read into, and outputs put in, buffers that a request answered (its batch done
    with them) leaves for the next of the same sizes; a request refused or cancelled (a run may
    still read them) leaves none. What is kept stays within the bytes of the regions held (which
    the memory budget reserves), and goes with them."""
    handle = regions("staged", 1 << 16)
    shm.set_shared_memory_region(handle, [np.arange(1 << 14, dtype=np.float32)])
    table = server_shm.SystemSharedMemory(8, 1 << 30)
    table.register("r", handle._shm_key, 0, 1 << 16)

    def use(answered: bool, nbytes: int = 4096) -> tuple[int, int]:
        lease = table.lease()
        data = lease.input(server_shm.Placement("r", 0, nbytes), nbytes, "input 'query'")
        writer = lease.output(server_shm.Placement("r", 1 << 15, nbytes), nbytes, "output 'output'")
        assert np.frombuffer(data, np.float32).tolist() == list(range(nbytes // 4))  # its own bytes, reused or not
        assert writer.buffer.ctypes.data % 64 == 0  # where ONNX Runtime may write
        addresses = (np.frombuffer(data, np.uint8).ctypes.data, writer.buffer.ctypes.data)
        lease.release(answered)
        return addresses

    first = use(answered=False)
    assert table._staging.free_bytes == 0  # refused or cancelled: nothing kept
    second = use(answered=True)
    assert table._staging.free_bytes == 2 * 4096
    assert set(use(answered=True)) == set(second)  # the same two buffers again
    assert table._staging.free_bytes == 2 * 4096 and first  # (the first pair went with the request)
    use(answered=True, nbytes=1 << 15)  # 64 KiB of regions: two more of 32 KiB would pass it
    assert table._staging.free_bytes <= 1 << 16
    table.unregister("r")
    assert table._staging.free_bytes == 0 and table.mapped == 0


def test_the_kubernetes_example_shares_dev_shm_and_enables_the_extension():
    yaml = pytest.importorskip("yaml")
    from attnserve.server.config import load_config

    from tests.server_process import REPO_ROOT

    folder = REPO_ROOT / "deploy" / "k8s" / "shared-memory"
    (deployment,) = list(yaml.safe_load_all((folder / "deployment.yaml").read_text()))
    assert yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"] == ["deployment.yaml"]
    pod = deployment["spec"]["template"]["spec"]
    (shm_volume,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm_volume["emptyDir"]["medium"] == "Memory"
    server, sidecar = pod["containers"]
    for container in (server, sidecar):
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"], container["name"]
    env = {e["name"]: e["value"] for e in server["env"]}
    config = load_config([], env)
    assert config.allow_shared_memory and config.workers == 1
    assert "--shared-memory" in sidecar["command"]


def test_the_messages_are_tritons():
    from attnserve.proto import inference_pb2 as pb
    from tritonclient.grpc import service_pb2 as triton

    def fields(desc):
        return {(f.name, f.number, f.type, f.label): fields(f.message_type) if f.message_type else None
                for f in desc.fields}

    names = [n for n in triton.DESCRIPTOR.message_types_by_name if "SharedMemory" in n]
    assert len(names) == 12
    for name in names:
        theirs = triton.DESCRIPTOR.message_types_by_name[name]
        assert fields(pb.DESCRIPTOR.message_types_by_name[name]) == fields(theirs)
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for method in triton.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        if "SharedMemory" in method.name:
            assert ours[method.name].input_type.name == method.input_type.name


def test_the_batch_cli_goes_through_shared_memory_when_the_server_allows_it(shm_server, server, eager_modules,
                                                                            tmp_path):
    from attnserve.client.batch import BatchJob, run_batch
    from attnserve.client.options import ClientOptions
    from attnserve.client.shm import same_host

    from tests.test_batch_job import assert_matches_eager, cli, make_input

    assert same_host(shm_server.address) and same_host("localhost:1") and not same_host("127.0.0.1:1,127.0.0.1:2")
    shards = [make_input(tmp_path / "in.npz", "cross_attention", 300, 4, 6, seed=4)]
    objects = {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}  # multiprocessing's
    for where, allowed in ((shm_server, True), (server, False)):
        for mode in ("auto", "off"):
            out = tmp_path / f"{allowed}-{mode}.npz"
            job = BatchJob(model="cross_attention", input_path=tmp_path / "in.npz", output_path=out,
                           outputs=("output", "attn_probs"), batch_size=32, concurrency=3, shared_memory=mode)
            summary = run_batch(job, ClientOptions(url=where.address))
            assert summary.shared_memory == (allowed and mode == "auto"), (where, mode)
            assert (summary.computed, summary.errors) == (300, 0)
            assert_matches_eager(out, eager_modules["cross_attention"], shards, names=("output", "attn_probs"))
    # The slots unregistered their regions and unlinked them.
    client = grpcclient.InferenceServerClient(url=shm_server.address)
    try:
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    finally:
        client.close()
    assert {name for name in os.listdir("/dev/shm") if name.startswith("psm_")} <= objects  # unlinked
    done = cli("--url", shm_server.address, "--model", "cross_attention", "--input", str(tmp_path / "in.npz"),
               "--output", str(tmp_path / "cli.npz"), "--outputs", "output", "--shared-memory", "auto",
               "--concurrency", "2")
    assert done.returncode == 0 and "tensors through shared memory" in done.stdout, done.stderr[-600:]


def test_a_small_mask_in_a_large_message_is_checked_not_an_internal_error(server, references):
    """A message of codec.WIRE_MIN_BYTES or more hands decode memoryviews (no bytes.translate): a
    mask under the translate path's size must still be checked, not raise AttributeError (INTERNAL)."""
    from attnserve.client import InferenceClient

    x = random_inputs(np.random.default_rng(9), 1, 600, 6, 512, 512, masked=True)  # 1.2 MB; mask 3,600 bytes
    with InferenceClient(server.address) as client:
        got = client.infer("self_attention", x["query"], x["key"], x["value"], mask=x["mask"],
                           outputs=("output", "attn_probs"))
    _check(got, _want(references["self_attention"], x), "small mask, large message")


# -- outputs written from the run's own arrays, and from a merged batch's rows ---------------------


def _metrics_text(proc: ServerProcess) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=30) as response:
        return response.read().decode()


def _metric(proc: ServerProcess, series: str) -> float:
    """The value of one series (`name` or `name{labels}`) on /metrics; 0 if absent."""
    for line in _metrics_text(proc).splitlines():
        if line.rsplit(" ", 1)[0] == series:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


_RUN, _COPIED = ('attnserve_shared_memory_outputs_total{written="run"}',
                 'attnserve_shared_memory_outputs_total{written="copied"}')


def _infer_placed(client, model: str, x: dict, inputs_in: tuple[str, int] | None,
                  outputs_in: dict[str, tuple[str, int]], regions_by_name: dict) -> dict[str, np.ndarray]:
    """One gRPC request: inputs packed in region inputs_in[0] from offset inputs_in[1] (None: in
    the message), each output in `outputs_in` at (region, offset), the others in the answer."""
    arrays = [(name, x[name]) for name in INPUT_NAMES if x.get(name) is not None]
    tensors, offset = [], inputs_in[1] if inputs_in else 0
    if inputs_in:
        shm.set_shared_memory_region(regions_by_name[inputs_in[0]], [a for _, a in arrays], offset=offset)
    for name, array in arrays:
        tensor = grpcclient.InferInput(name, list(array.shape), DATATYPES[name])
        if inputs_in:
            tensor.set_shared_memory(inputs_in[0], array.nbytes, offset)
        else:
            tensor.set_data_from_numpy(array)
        offset += array.nbytes
        tensors.append(tensor)
    sizes = _sizes(x, HEADS[model], WIDTHS[model])
    outputs = []
    for name in OUTPUT_NAMES:
        requested = grpcclient.InferRequestedOutput(name)
        if name in outputs_in:
            requested.set_shared_memory(outputs_in[name][0], sizes[name], outputs_in[name][1])
        outputs.append(requested)
    result = client.infer(model, tensors, outputs=outputs)
    got = {}
    for name in OUTPUT_NAMES:
        shape = list(result.get_output(name).shape)
        if name in outputs_in:
            region, at = outputs_in[name]
            got[name] = shm.get_contents_as_numpy(regions_by_name[region], np.float32, shape, offset=at).copy()
        else:
            got[name] = result.as_numpy(name)
    return got


def test_a_lone_request_s_outputs_are_written_from_the_run_itself_and_exact(shm_server, grpc_client, regions):
    """A lone request's outputs are written into its region from the run's own arrays (one write
    through the region's descriptor, counted as written="run"), bit for bit the answer the same
    request gets in the message, wherever they are placed: at an unaligned offset too, and over
    the request's own inputs (read into the request's memory when it was decoded)."""
    rng = np.random.default_rng(11)
    cases = {  # the graph with both outputs, and one with `output` alone (which: the export's crossover)
        "masked": (random_inputs(rng, 2, 40, 24, 512, 512, masked=True), OUTPUT_NAMES),
        "unmasked": ({**random_inputs(rng, 1, 300, 300, 512, 512), "mask": None}, ("output",)),
    }
    for case, (x, names) in cases.items():
        plain = _infer_placed(grpc_client, "self_attention", x, None, {}, {})
        sizes = _sizes(x, 8, 512)
        in_bytes = sum(a.nbytes for a in x.values() if a is not None)
        byte_sizes = {f"{case}-in": in_bytes, f"{case}-out": 64 + sum(sizes.values())}
        made = {name: regions(name, size) for name, size in byte_sizes.items()}
        for name, handle in made.items():
            grpc_client.register_system_shared_memory(name, handle._shm_key, byte_sizes[name])
        placements = {  # (outputs' offsets, how they are written)
            "in place": ({n: (f"{case}-out", 64 * i + sum(sizes[m] for m in names[:i])) for i, n in enumerate(names)},
                         _RUN),
            "unaligned": ({n: (f"{case}-out", 4 + sum(sizes[m] for m in names[:i])) for i, n in enumerate(names)},
                          _RUN),
            "over its inputs": ({"output": (f"{case}-in", 0)}, _RUN),  # query's bytes: read before the run
        }
        for how, (outputs_in, series) in placements.items():
            before = _metric(shm_server, series)
            got = _infer_placed(grpc_client, "self_attention", x, (f"{case}-in", 0), outputs_in, made)
            assert _metric(shm_server, series) == before + len(outputs_in), (case, how)
            for name in names:  # over its inputs: the run read them all before the copy
                assert np.array_equal(got[name], plain[name]), (case, how, name)
        grpc_client.unregister_system_shared_memory()


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    """Poll a condition the server reports (not a guess at how long it takes)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s}s")
        time.sleep(0.01)


def test_a_merged_batch_copies_each_request_s_rows_into_its_region(model_repository, regions, references):
    """Two requests merged into one run (queued behind a batch held at the gate) each get their own
    rows, the padded query rows dropped, copied into their own region by the split."""
    rng = np.random.default_rng(13)
    xs = [{**random_inputs(rng, 1, lq, 8, 512, 512), "mask": None} for lq in (8, 6)]
    with GatedServer(model_repository, "--allow-shared-memory", "--max-batch-size", "8") as proc:
        clients = [grpcclient.InferenceServerClient(url=proc.address) for _ in range(3)]
        try:
            made = {}
            for i, x in enumerate(xs):
                sizes = _sizes(x, 8, 512)
                for name, size in ((f"in{i}", sum(a.nbytes for a in x.values() if a is not None)),
                                   (f"out{i}", sum(sizes.values()))):
                    made[name] = regions(f"merged-{name}", size)
                    clients[0].register_system_shared_memory(name, made[name]._shm_key, size)
            # Its inputs in a region too: with the native data plane, requests with shared memory go to
            # the Python request path, so the held one must queue where the two others will.
            size = sum(a.nbytes for a in xs[0].values() if a is not None)
            made["held"] = regions("merged-held", size)
            clients[0].register_system_shared_memory("held", made["held"]._shm_key, size)
            held = threading.Thread(target=lambda: _infer_placed(clients[0], "self_attention", xs[0], ("held", 0), {},
                                                                 made))
            held.start()
            assert proc.gate.wait_started() == 1  # a plain request's batch, held
            before = _metric(proc, _COPIED)
            answers: dict = {}

            def send(i: int) -> None:
                outputs_in = {"output": (f"out{i}", 0), "attn_probs": (f"out{i}", _sizes(xs[i], 8, 512)["output"])}
                answers[i] = _infer_placed(clients[1 + i], "self_attention", xs[i], (f"in{i}", 0), outputs_in, made)

            threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            _wait_until(lambda: _metric(proc, 'attnserve_queue_depth{model="self_attention"}') == 2)
            proc.gate.release()  # the held batch; the two queued ones merge into the next
            assert proc.gate.wait_started() == 2
            proc.gate.release()
            for thread in (held, *threads):
                thread.join(60)
            for i, x in enumerate(xs):
                _check(answers[i], _want(references["self_attention"], x), f"merged {i}")
            assert _metric(proc, _COPIED) == before + 4
        finally:
            for client in clients:
                client.close()


def test_the_batch_preflight_does_not_count_bytes_that_go_through_shared_memory(shm_server, eager_modules, tmp_path):
    """Chunks over the client's message limit are refused by the preflight when they would travel in
    messages, and run when the tensors go through regions (the messages carry names and shapes)."""
    from attnserve.client.batch import BatchError, BatchJob, run_batch
    from attnserve.client.options import ClientOptions

    from tests.test_batch_job import assert_matches_eager, make_input

    shards = [make_input(tmp_path / "in.npz", "self_attention", 16, 64, 64, seed=6)]
    options = ClientOptions(url=shm_server.address, max_message_bytes=1 << 20)  # a chunk of 8: about 3 MiB
    for mode in ("off", "auto"):
        job = BatchJob(model="self_attention", input_path=tmp_path / "in.npz", output_path=tmp_path / f"{mode}.npz",
                       outputs=("output", "attn_probs"), batch_size=8, concurrency=2, shared_memory=mode)
        if mode == "off":
            with pytest.raises(BatchError, match="over the 1 MiB limit"):
                run_batch(job, options)
            continue
        summary = run_batch(job, options)
        assert summary.shared_memory and (summary.computed, summary.errors) == (16, 0)
        assert_matches_eager(job.output_path, eager_modules["self_attention"], shards, names=("output", "attn_probs"))
