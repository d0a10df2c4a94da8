"""The client's call control against real servers: infer_async's cancel handle (the call held at
the gate, the server seeing it go), a pool of channels reaching every worker of `--workers 2`,
and gzip-compressed requests (their bytes on the wire counted by a loopback TCP relay)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from attnserve.client import AsyncInferenceClient, InferenceClient, InferenceError

from tests.gated_server import GatedServer
from tests.oip import eager, random_inputs

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
MAX_CHANNELS = 40  # lanes tried to find a second worker (2 workers: 2**-39 to miss it)


def _metric(proc, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    """Until the server reaches a state (polled), not a guess of how long it takes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)


def _close_to_eager(got: dict, x: dict, eager_modules) -> None:
    want = eager(eager_modules["self_attention"], **x)["output"]
    assert float(np.max(np.abs(got["output"] - want))) <= TOLERANCE


# -- infer_async and its cancel ------------------------------------------------------------------


def test_cancel_of_a_held_call_cancels_it_on_the_server(model_repository, eager_modules):
    """The call's batch is held at the gate: cancel() settles it CANCELLED at once, and the server
    counts it CANCELLED while its batch is still held (the gRPC call itself was cancelled, not
    only the client's future). A later call is answered exactly."""
    rng = np.random.default_rng(21)
    x = random_inputs(rng, 1, 6, 5, 512, 512)
    with GatedServer(model_repository, "--max-batch-size", "1") as proc, \
            InferenceClient(proc.address, timeout_s=120) as client:
        call = client.infer_async("self_attention", **x)
        proc.gate.wait_started()
        assert not call.done()
        assert call.cancel()
        with pytest.raises(InferenceError) as exc:
            call.result(timeout=10)
        assert exc.value.code == grpc.StatusCode.CANCELLED, exc.value
        assert call.done() and call.cancelled() and not call.cancel()
        _wait_for(lambda: _metric(proc, 'attnserve_requests_total{code="CANCELLED"') == 1,
                  "the server counts the held call CANCELLED")
        proc.gate.release(2)  # the held batch ends; the next call's
        later = client.infer_async("self_attention", **x)
        _close_to_eager(later.result(timeout=120), x, eager_modules)
        assert later.done() and not later.cancelled() and not later.cancel()


def test_infer_async_reports_errors_as_infer_does(server):
    x = random_inputs(np.random.default_rng(22), 1, 3, 3, 32, 32)  # cross_attention's width, not this model's
    with InferenceClient(server.address, timeout_s=60) as client:
        call = client.infer_async("self_attention", **x)
        with pytest.raises(InferenceError) as exc:
            call.result(timeout=60)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "512" in exc.value.details
        with pytest.raises(ValueError, match="expected 3 dims"):  # the caller's error, raised before sending
            client.infer_async("self_attention", x["query"][0], x["key"], x["value"])


# -- the pool ------------------------------------------------------------------------------------

# Each of the pool's calls can be held at the gate at once, all on one worker if the pool fails.
FLAGS = ("--workers", "2", "--max-batch-size", "1", "--batches-in-flight", str(MAX_CHANNELS), "--grace-period-s", "120")


def test_a_pool_of_channels_reaches_every_worker(model_repository, eager_modules):
    """One client, one channel: every call on one connection, so on one worker. One client,
    `channels=40`: each call on the next connection, held at the gate, which names its worker;
    both workers are reached. Every answer is exact."""
    rng = np.random.default_rng(23)
    with GatedServer(model_repository, *FLAGS) as proc:
        workers = set(json.loads(Path(proc.ready_file).read_text())["workers"])
        assert len(workers) == 2
        held = []
        with InferenceClient(proc.address, timeout_s=120) as single:
            pids = set()
            for _ in range(6):
                x = random_inputs(rng, 1, 4, 3, 512, 512)
                held.append((single.infer_async("self_attention", **x), x))
                proc.gate.wait_started()
                pids.add(proc.gate.last_pid)
            assert len(pids) == 1, f"one channel reached {pids}"
            proc.gate.release(len(held))
            for call, x in held:
                _close_to_eager(call.result(timeout=120), x, eager_modules)
        held.clear()
        with InferenceClient(proc.address, timeout_s=120, channels=MAX_CHANNELS) as pooled:
            pids = set()
            while pids != workers and len(held) < MAX_CHANNELS:
                x = random_inputs(rng, 1, 4, 3, 512, 512)
                held.append((pooled.infer_async("self_attention", **x), x))
                proc.gate.wait_started()
                pids.add(proc.gate.last_pid)
            assert pids == workers, f"{len(held)} calls over {MAX_CHANNELS} channels reached only {pids}"
            proc.gate.release(len(held))
            for call, x in held:
                _close_to_eager(call.result(timeout=120), x, eager_modules)


# -- gzip ----------------------------------------------------------------------------------------


class ByteCountingRelay:
    """A loopback TCP relay in front of the server that counts the bytes clients send through it."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.sent = 0  # bytes from clients towards the server
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._target, timeout=60)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if counted:
                    with self._lock:
                        self.sent += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def _compressible(rng: np.random.Generator) -> dict:
    """Real attention inputs whose values are multiples of 0.5 in [-1, 1]: gzip shrinks them well."""
    return {name: (rng.integers(-2, 3, size=(2, 64, 512)) / 2).astype(np.float32) for name in ("query", "key", "value")}


@pytest.mark.parametrize("compression", ["gzip", None])
def test_gzip_requests_are_compressed_on_the_wire_and_answered_exactly(server, eager_modules, compression):
    rng = np.random.default_rng(24)
    x = _compressible(rng)
    raw = sum(array.nbytes for array in x.values())
    relay = ByteCountingRelay(server.address)
    try:
        with InferenceClient(relay.address, timeout_s=60, compression=compression) as client:
            _close_to_eager(client.infer("self_attention", **x), x, eager_modules)
            with client.stream() as stream:
                future = stream.submit("self_attention", **x)
            _close_to_eager(future.result(timeout=60), x, eager_modules)

        async def aio():
            async with AsyncInferenceClient(relay.address, timeout_s=60, compression=compression) as client:
                return await client.infer("self_attention", **x)

        _close_to_eager(asyncio.run(aio()), x, eager_modules)
    finally:
        relay.close()
    if compression == "gzip":
        assert relay.sent < raw, f"3 gzip requests of {raw} bytes each sent {relay.sent} bytes"
    else:
        assert relay.sent > 3 * raw, f"3 requests of {raw} bytes each sent only {relay.sent} bytes"


def test_a_gzip_request_that_inflates_past_the_servers_limit_is_refused(server, eager_modules):
    """82 MB of zeros gzip to well under the server's 64 MiB message limit; inflated, they are over
    it: RESOURCE_EXHAUSTED, and the server answers the next call exactly."""
    query = np.zeros((1, 40_000, 512), np.float32)
    kv = np.zeros((1, 4, 512), np.float32)
    with InferenceClient(server.address, timeout_s=60, compression="gzip", max_message_bytes=256 << 20) as client:
        with pytest.raises(InferenceError) as exc:
            client.infer("self_attention", query, kv, kv)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        x = _compressible(np.random.default_rng(25))
        _close_to_eager(client.infer("self_attention", **x), x, eager_modules)


def test_bad_pool_and_compression_settings_are_refused():
    with pytest.raises(ValueError, match="channels must be in 1..256, got 0"):
        InferenceClient("127.0.0.1:1", channels=0)
    with pytest.raises(ValueError, match="compression must be one of \\['gzip'\\] or None, got 'zstd'"):
        InferenceClient("127.0.0.1:1", compression="zstd")
