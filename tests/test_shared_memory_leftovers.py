"""Shared memory regions that callers leave behind, and the server's own limits (server.shm,
client.shm, docs/shared-memory.md): a batch job killed with SIGKILL has its regions released by
its rerun or by `--cleanup-shared-memory`; the server expires regions no request used for
--shared-memory-idle-timeout-s, never one a request (held at the gate) is using; regions belong
to no connection; running out of file descriptors is RESOURCE_EXHAUSTED, and registering works
again once regions are unregistered. Expiry is awaited by polling the status call (no sleeps).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.gated_server import GatedServer
from tests.oip import random_inputs
from tests.seed_reference import served_references
from tests.server_process import ServerProcess
from tests.test_shared_memory import _check, _metric, _Regions, _shm_infer, _want

POLL_BOUND_S = 60.0


@pytest.fixture(scope="module")
def references(eager_modules):
    return served_references(eager_modules)


def _names(client) -> set[str]:
    return set(client.get_system_shared_memory_status(as_json=True).get("regions", {}))


def _until(predicate, what: str, bound_s: float = POLL_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {bound_s}s")
        time.sleep(0.02)  # a poll's pace, not a guess: the predicate decides


def test_idle_regions_expire_but_not_one_a_held_request_uses(model_repository, references):
    x = random_inputs(np.random.default_rng(11), 1, 5, 5, 512, 512)
    x["mask"] = None
    with _Regions() as regions, GatedServer(model_repository, "--allow-shared-memory",
                                            "--shared-memory-idle-timeout-s", "0.3") as proc:
        client = grpcclient.InferenceServerClient(url=proc.address)
        try:
            idle = regions("idle", 4096)
            client.register_system_shared_memory("idle", idle._shm_key, 4096)
            answer: dict = {}
            thread = threading.Thread(target=lambda: answer.update(
                got=_shm_infer(grpcclient, client, "self_attention", x, regions, tag="held")))
            thread.start()
            proc.gate.wait_started()  # the request holds its regions 'inheld' and 'outheld'
            # Registered after the held request took its regions: once it expired, they would have too.
            client.register_system_shared_memory("later", idle._shm_key, 4096)
            _until(lambda: not {"idle", "later"} & _names(client), "the idle regions did not expire")
            assert _names(client) == {"inheld", "outheld"}  # in use: kept
            assert _metric(proc, "attnserve_shared_memory_expired_total") == 2
            # A request naming an expired region is told why it is gone.
            with pytest.raises(InferenceServerException) as exc:
                client.get_system_shared_memory_status("idle")
            assert "expired" in exc.value.message() and "--shared-memory-idle-timeout-s" in exc.value.message()
            proc.gate.release()
            thread.join(60)
            _check(answer["got"], _want(references["self_attention"], x), "while idle regions expired")
            _until(lambda: not _names(client), "the held regions did not expire once the request ended")
            assert _metric(proc, "attnserve_shared_memory_expired_total") == 4
            proc.wait_for_log("'idle'")
            assert "expired: unused for" in proc.log()
            client.register_system_shared_memory("idle", idle._shm_key, 4096)  # the name is free again
        finally:
            client.close()


def test_a_region_registered_on_one_connection_serves_calls_on_others(model_repository, references):
    """As in Triton, regions belong to no connection: registered on one gRPC channel, used from
    another and from REST, unregistered from a third, and still registered after the first closes."""
    x = random_inputs(np.random.default_rng(12), 1, 4, 4, 512, 512)
    x["mask"] = None
    proc = ServerProcess(model_repository, "--allow-shared-memory")
    try:
        with _Regions() as regions:
            first = grpcclient.InferenceServerClient(url=proc.address)
            handle = regions("shared-in", sum(x[n].nbytes for n in ("query", "key", "value")))
            shm.set_shared_memory_region(handle, [x["query"], x["key"], x["value"]])
            first.register_system_shared_memory("shared-in", handle._shm_key, 3 * x['query'].nbytes)
            first.close()
            for module, address in ((grpcclient, proc.address), (httpclient, proc.http_address)):
                other = module.InferenceServerClient(url=address)
                try:
                    inputs, offset = [], 0
                    for name in ("query", "key", "value"):
                        inputs.append(module.InferInput(name, list(x[name].shape), "FP32"))
                        inputs[-1].set_shared_memory("shared-in", x[name].nbytes, offset)
                        offset += x[name].nbytes
                    got = other.infer("self_attention", inputs).as_numpy("output")
                    want = _want(references["self_attention"], x)["output"]
                    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
                finally:
                    other.close()
            third = grpcclient.InferenceServerClient(url=proc.address)
            try:
                assert _names(third) == {"shared-in"}
                third.unregister_system_shared_memory("shared-in")
                assert _names(third) == set()
            finally:
                third.close()
    finally:
        proc.stop()


class _FewFdsServer(ServerProcess):
    """The server under RLIMIT_NOFILE = FD_LIMIT, set in its own process before it starts."""

    FD_LIMIT = 256
    COMMAND = ("-c", "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               f"({FD_LIMIT}, {FD_LIMIT})); from attnserve.cli import main; sys.exit(main(['serve', *sys.argv[1:]]))")


def test_running_out_of_file_descriptors_is_resource_exhausted(model_repository):
    proc = _FewFdsServer(model_repository, "--allow-shared-memory", "--shared-memory-max-regions", "4096")
    try:
        with _Regions() as regions:
            handle = regions("fds", 4096)
            client = grpcclient.InferenceServerClient(url=proc.address)
            try:
                registered, refusal = 0, None
                for i in range(2 * _FewFdsServer.FD_LIMIT):  # each region holds a descriptor: bounded
                    try:
                        client.register_system_shared_memory(f"r{i}", handle._shm_key, 4096)
                    except InferenceServerException as err:
                        refusal = err
                        break
                    registered += 1
                assert refusal is not None and registered > 0, registered
                assert refusal.status() == "StatusCode.RESOURCE_EXHAUSTED", (refusal.status(), refusal.message())
                assert f"'r{registered}'" in refusal.message() and "Too many open files" in refusal.message()
                client.unregister_system_shared_memory()
                for i in range(registered):  # all of them again: nothing leaked
                    client.register_system_shared_memory(f"again{i}", handle._shm_key, 4096)
                client.unregister_system_shared_memory()
                assert client.is_server_ready()
            finally:
                client.close()
    finally:
        proc.stop()


# -- the batch CLI killed mid-job ------------------------------------------------------------------


def _job_objects(prefix: str) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def _killed_mid_job(proc: GatedServer, args: list[str], workdir: Path) -> str:
    """Starts the batch CLI, holds its first request at the gate, SIGKILLs it; its job prefix."""
    from tests.test_batch_job import cli

    job = cli(*args, wait=False)
    try:
        proc.gate.wait_started()
        prefix = "attnserve-batch-" + (workdir / "shared-memory-id").read_text() + "-"
        job.send_signal(signal.SIGKILL)
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    return prefix


def test_a_killed_batch_job_s_regions_are_released_by_cleanup_and_by_its_rerun(model_repository, eager_modules,
                                                                                 tmp_path):
    from tests.test_batch_job import assert_matches_eager, cli, make_input

    shards = [make_input(tmp_path / "in.npz", "self_attention", 12, 4, 4, seed=7)]
    out = tmp_path / "out.npz"
    workdir = tmp_path / "out.npz.parts"
    # Room for one job's two regions and one more: a killed run's pair left registered fails the next.
    with GatedServer(model_repository, "--allow-shared-memory", "--shared-memory-max-regions", "3") as proc:
        client = grpcclient.InferenceServerClient(url=proc.address)
        try:
            args = ["--url", proc.address, "--model", "self_attention", "--input", str(tmp_path / "in.npz"),
                    "--output", str(out), "--batch-size", "4", "--concurrency", "1", "--shared-memory", "auto",
                    "--retries", "0"]
            prefix = _killed_mid_job(proc, args, workdir)
            assert {n for n in _names(client) if n.startswith(prefix)} == {prefix + "0-in", prefix + "0-out"}
            assert _job_objects(prefix) == {prefix + "0-in", prefix + "0-out"}

            done = cli("--url", proc.address, "--output", str(out), "--cleanup-shared-memory")
            assert done.returncode == 0, done.stderr[-800:]
            assert "released 2 region(s)" in done.stdout and "2 shm object(s)" in done.stdout, done.stdout
            assert _names(client) == set() and _job_objects(prefix) == set()
            proc.gate.release()  # the killed run's request ends

            again = _killed_mid_job(proc, args, workdir)
            assert again == prefix  # the id kept in the work directory: the rerun knows the names
            assert len(_names(client)) == 2 and len(_job_objects(prefix)) == 2
            proc.gate.release(100)
            done = cli(*args)
            assert done.returncode == 0 and "tensors through shared memory" in done.stdout, done.stderr[-800:]
            assert_matches_eager(out, eager_modules["self_attention"], shards)
            assert _names(client) == set() and _job_objects(prefix) == set()
            assert not workdir.exists()
        finally:
            client.close()
