"""A real server whose batches wait at a gate the test holds: work in flight without guessing
how long a request takes on this machine.

Test side:
    with GatedServer(model_repository, "--max-batch-size", "2") as proc:
        ... send calls ...
        rows = proc.gate.wait_started()   # a batch is now running (held), `rows` sequences in it
        proc.gate.release()               # let one batch compute (release(n): n batches)

Server side (`python -m tests.gated_server [server flags]`, started by GatedServer): the real
server, batcher and servicer of `attnserve serve` through app.Server's one seam (run_batch), each
model's run the real ONNX Runtime Engine behind a gate. Before a batch computes it writes a
line to DIR/started and then blocks, on its worker thread, for one byte from DIR/release
(DIR: $ATTNSERVE_TEST_GATE, two FIFOs the test made). The event loop never waits on the gate.
"""

from __future__ import annotations

import asyncio
import os
import select
import sys
import tempfile
import threading
from pathlib import Path

from tests.server_process import ServerProcess

GATE_ENV = "ATTNSERVE_TEST_GATE"


class Gate:
    """The test's end of the two FIFOs. Opened read-write so that neither side blocks on open."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="attnserve-gate-"))
        for name in ("started", "release"):
            os.mkfifo(self.directory / name)
        self._started = os.open(self.directory / "started", os.O_RDWR | os.O_NONBLOCK)
        self._release = os.open(self.directory / "release", os.O_RDWR)
        self._pending = b""

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """Block until a batch reaches the gate; the rows (sequences) in it."""
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self._started], [], [], timeout_s)
            if not ready:
                raise AssertionError(f"no batch reached the gate within {timeout_s}s")
            self._pending += os.read(self._started, 4096)
        line, self._pending = self._pending.split(b"\n", 1)
        return int(line)

    def has_started(self) -> bool:
        """Whether a batch has reached the gate that wait_started() has not yet reported."""
        if b"\n" not in self._pending and select.select([self._started], [], [], 0)[0]:
            self._pending += os.read(self._started, 4096)
        return b"\n" in self._pending

    def release(self, batches: int = 1) -> None:
        os.write(self._release, b"x" * batches)

    def close(self) -> None:
        os.close(self._started)
        os.close(self._release)


class GatedServer(ServerProcess):
    COMMAND = ("-m", "tests.gated_server")

    def __init__(self, model_repository: Path, *extra_args: str, **kwargs) -> None:
        self.gate = Gate()
        env = {**kwargs.pop("env", {}), GATE_ENV: str(self.gate.directory)}
        super().__init__(model_repository, *extra_args, env=env, **kwargs)

    def __enter__(self) -> "GatedServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.gate.release(10_000)  # nothing stays held by a failed test
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

        def run(feeds, want_probs):
            with lock:
                os.write(fifo("started", os.O_WRONLY), f"{feeds['query'].shape[0]}\n".encode())
            if not os.read(fifo("release", os.O_RDONLY), 1):
                raise RuntimeError("the test closed the gate")
            return engine.run(feeds, want_probs)

        return run

    return factory


def main(argv: list[str] | None = None) -> int:
    from attnserve.server.__main__ import configure_logging, serve
    from attnserve.server.config import load_config

    config = load_config(argv, prog="python -m tests.gated_server")
    configure_logging(config)
    factory = _gated_engine_factory(Path(os.environ[GATE_ENV]), config.intra_op_threads)
    return asyncio.run(serve(config, run_batch=factory))


if __name__ == "__main__":
    sys.exit(main())
