"""A real server whose batches wait at a gate the test holds: work in flight without guessing
how long a request takes on this machine.

Test side:
    with GatedServer(model_repository, "--max-batch-size", "2") as proc:
        ... send calls ...
        rows = proc.gate.wait_started()   # a batch is now running (held), `rows` sequences in it
        proc.gate.release()               # let one batch compute (release(n): n batches)
        proc.stall_loop()                 # the server's event loop blocks, as on a busy machine
        proc.gate.unstall_after(n)        # ... until gRPC's core has received n more calls

Server side (`python -m tests.gated_server [server flags]`, started by GatedServer): the real
server, batcher and servicer of `attnserve serve` through app.Server's one seam (run_batch), each
model's run the real ONNX Runtime Engine behind a gate. Before a batch computes it writes a
line to DIR/started and then blocks, on its worker thread, for one byte from DIR/release
(DIR: $ATTNSERVE_TEST_GATE, FIFOs the test made). The event loop never waits on the gate.
SIGUSR1 blocks the event loop itself (a signal handler that waits on DIR/unstall, then for
gRPC's core to receive that many calls): calls arrive and wait in core, as they do when the
machine's cores are busy and the loop lags.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.server_process import ServerProcess

GATE_ENV = "ATTNSERVE_TEST_GATE"


class Gate:
    """The test's end of the two FIFOs. Opened read-write so that neither side blocks on open."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="attnserve-gate-"))
        for name in ("started", "release", "stalled", "unstall"):
            os.mkfifo(self.directory / name)
        self._started = os.open(self.directory / "started", os.O_RDWR | os.O_NONBLOCK)
        self._release = os.open(self.directory / "release", os.O_RDWR)
        self._stalled = os.open(self.directory / "stalled", os.O_RDWR | os.O_NONBLOCK)
        self._unstall = os.open(self.directory / "unstall", os.O_RDWR)
        self._pending = b""
        self.last_pid: int | None = None

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """Block until a batch reaches the gate; the rows (sequences) in it (its process: last_pid)."""
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self._started], [], [], timeout_s)
            if not ready:
                raise AssertionError(f"no batch reached the gate within {timeout_s}s")
            self._pending += os.read(self._started, 4096)
        line, self._pending = self._pending.split(b"\n", 1)
        rows, pid = line.split()
        self.last_pid = int(pid)  # the process whose batch it is (one of the workers, with --workers)
        return int(rows)

    def has_started(self) -> bool:
        """Whether a batch has reached the gate that wait_started() has not yet reported."""
        if b"\n" not in self._pending and select.select([self._started], [], [], 0)[0]:
            self._pending += os.read(self._started, 4096)
        return b"\n" in self._pending

    def release(self, batches: int = 1) -> None:
        os.write(self._release, b"x" * batches)

    def wait_stalled(self, timeout_s: float = 60.0) -> None:
        """Block until the server's event loop is stalled (after GatedServer.stall_loop())."""
        if not select.select([self._stalled], [], [], timeout_s)[0]:
            raise AssertionError(f"the server's event loop did not stall within {timeout_s}s")
        os.read(self._stalled, 4096)

    def unstall_after(self, calls: int) -> None:
        """Let the stalled loop go once gRPC's core has received `calls` more calls."""
        os.write(self._unstall, f"{calls}\n".encode())

    def close(self) -> None:
        for fd in (self._started, self._release, self._stalled, self._unstall):
            os.close(fd)


class GatedServer(ServerProcess):
    COMMAND = ("-m", "tests.gated_server")

    def __init__(self, model_repository: Path, *extra_args: str, **kwargs) -> None:
        self.gate = Gate()
        env = {**kwargs.pop("env", {}), GATE_ENV: str(self.gate.directory)}
        super().__init__(model_repository, *extra_args, env=env, **kwargs)

    def __enter__(self) -> GatedServer:
        return self

    def stall_loop(self) -> None:
        """Block the server's event loop until gate.unstall_after(n) (and n calls reached core)."""
        self.signal(signal.SIGUSR1)
        self.gate.wait_stalled()

    def __exit__(self, *exc_info: object) -> None:
        self.gate.unstall_after(0)  # nothing stays held by a failed test
        self.gate.release(10_000)
        self.stop()
        self.gate.close()


# -- the server side ---------------------------------------------------------------------------


def _gated_engine_factory(directory: Path, intra_op_threads: int):
    from attnserve.server.engine import Engine, choose_device

    device = choose_device("cpu")
    lock = threading.Lock()  # one batch at a time passes the gate's bookkeeping
    fifos: dict[str, int] = {}

    def fifo(name: str, flags: int) -> int:
        if name not in fifos:
            fifos[name] = os.open(directory / name, flags)
        return fifos[name]

    def factory(spec):
        engine = Engine(spec, device, intra_op_threads)

        def run(feeds, want_probs, stop=None):
            with lock:
                os.write(fifo("started", os.O_WRONLY), f"{feeds['query'].shape[0]} {os.getpid()}\n".encode())
            if not os.read(fifo("release", os.O_RDONLY), 1):
                raise RuntimeError("the test closed the gate")
            return engine.run(feeds, want_probs, stop=stop)

        return run

    factory.stoppable = True  # its runs stop as the server's own do (server.models)
    return factory


def _stall_on_sigusr1(directory: Path, native: bool) -> None:
    """SIGUSR1 runs, on the event loop's thread, a handler that blocks it: it reads a count n
    from DIR/unstall, then waits (at most 60 s) until gRPC's core has received n more calls
    (native: the core of the native data plane, which serves --port)."""
    from attnserve.server.handover import CoreCalls

    stalled = os.open(directory / "stalled", os.O_WRONLY)
    unstall = os.open(directory / "unstall", os.O_RDONLY)

    def stall(signum, frame) -> None:
        if native:
            from attnserve.server import _native

            core = CoreCalls(max(CoreCalls.server_ids(_native)), _native)  # the plane's one gRPC server
        else:
            core = CoreCalls(max(CoreCalls.server_ids()))  # the one gRPC server of this process
        base = core.started()
        os.write(stalled, b"stalled\n")
        line = b""
        while not line.endswith(b"\n"):
            line += os.read(unstall, 1)
        deadline = time.monotonic() + 60
        while core.started() < base + int(line) and time.monotonic() < deadline:
            time.sleep(0.001)

    signal.signal(signal.SIGUSR1, stall)


def main(argv: list[str] | None = None) -> int:
    from attnserve.server.__main__ import configure_logging, run
    from attnserve.server.config import load_config
    from attnserve.server.workers import WorkerContext, default_workers

    argv = list(sys.argv[1:] if argv is None else argv)
    config = load_config(argv, prog="python -m tests.gated_server")
    configure_logging(config)
    command = [sys.executable, "-m", "tests.gated_server"]
    if default_workers(config) > 1 and WorkerContext.from_env() is None:
        return run(config, argv, command)  # the supervisor: each of its workers is a gated server
    factory = _gated_engine_factory(Path(os.environ[GATE_ENV]), config.intra_op_threads)
    from attnserve.server.data_plane import choose_data_plane

    plane, _ = choose_data_plane(config.data_plane)  # auto (the default) resolved as the server will
    _stall_on_sigusr1(Path(os.environ[GATE_ENV]), native=plane == "native")
    return run(config, argv, command, run_batch=factory)


if __name__ == "__main__":
    sys.exit(main())
