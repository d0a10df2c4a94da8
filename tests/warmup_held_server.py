"""A real server whose warm-up (server.warmup) waits at a hold the test releases: the state
"warming" held as long as the test looks at it, without guessing how long a warm-up takes.

Test side:
    with HeldWarmUpServer(model_repository) as proc:
        name, version = proc.wait_held()   # a version's warm-up is about to run (held); ports known
        ... readiness is false, the index says WARMING ...
        proc.release()                     # let that version's warm-up run
        proc.wait_ready()                  # the ready file: every model warmed

Server side (`python -m tests.warmup_held_server [server flags]`): `attnserve serve` itself with
one hook, app.Server's warm_up_hold, which the installed server has no way to set: before each
version's warm-up it writes "name version grpc_port http_port metrics_port" to DIR/held and
blocks, on the warm-up's thread, for one byte from DIR/release (DIR: $ATTNSERVE_TEST_WARMUP_HOLD,
FIFOs the test made). The event loop never waits on it.
"""

from __future__ import annotations

import os
import select
import sys
import tempfile
from pathlib import Path

from tests.server_process import ServerProcess

HOLD_ENV = "ATTNSERVE_TEST_WARMUP_HOLD"


class HeldWarmUpServer(ServerProcess):
    COMMAND = ("-m", "tests.warmup_held_server")

    def __init__(self, model_repository: Path, *extra_args: str, **kwargs) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="attnserve-warmup-"))
        for name in ("held", "release"):
            os.mkfifo(self.directory / name)
        # Read-write, so that neither side blocks on open.
        self._held = os.open(self.directory / "held", os.O_RDWR | os.O_NONBLOCK)
        self._release = os.open(self.directory / "release", os.O_RDWR)
        self._pending = b""
        env = {**kwargs.pop("env", {}), HOLD_ENV: str(self.directory)}
        super().__init__(model_repository, *extra_args, env=env, **kwargs)

    def _wait_ready(self) -> tuple[int, int, int]:
        return 0, 0, 0  # the ports come with the first hold (wait_held), or from wait_ready()

    def wait_held(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """Block until a version's warm-up is held; (model, version). Sets the ports."""
        while b"\n" not in self._pending:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if not select.select([self._held], [], [], min(timeout_s, 1.0))[0]:
                timeout_s -= 1.0
                if timeout_s <= 0:
                    raise AssertionError(f"no warm-up was held:\n{self.log()}")
                continue
            self._pending += os.read(self._held, 4096)
        line, self._pending = self._pending.split(b"\n", 1)
        name, version, port, http_port, metrics_port = line.decode().split()
        self.port, self.http_port, self.metrics_port = int(port), int(http_port), int(metrics_port)
        self.address, self.http_address = f"127.0.0.1:{self.port}", f"127.0.0.1:{self.http_port}"
        return name, int(version)

    def release(self, versions: int = 1) -> None:
        os.write(self._release, b"x" * versions)

    def wait_ready(self) -> None:
        """Block until the ready file is written (every model warmed)."""
        self.port, self.http_port, self.metrics_port = ServerProcess._wait_ready(self)
        self.address, self.http_address = f"127.0.0.1:{self.port}", f"127.0.0.1:{self.http_port}"

    def __enter__(self) -> HeldWarmUpServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release(1000)  # nothing stays held by a failed test
        self.stop()
        os.close(self._held)
        os.close(self._release)


# -- the server side ---------------------------------------------------------------------------


def _hold(directory: Path):
    held = os.open(directory / "held", os.O_WRONLY)
    release = os.open(directory / "release", os.O_RDONLY)

    def hold(server, name: str, version: int) -> None:
        ports = f"{server.port} {server.http_port or 0} {server.metrics_port or 0}"
        os.write(held, f"{name} {version} {ports}\n".encode())
        if not os.read(release, 1):
            raise RuntimeError("the test closed the hold")

    return hold


def main(argv: list[str] | None = None) -> int:
    from attnserve.server.__main__ import configure_logging, run
    from attnserve.server.config import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    config = load_config(argv, prog="python -m tests.warmup_held_server")
    configure_logging(config)
    command = [sys.executable, "-m", "tests.warmup_held_server"]
    return run(config, argv, command, warm_up_hold=_hold(Path(os.environ[HOLD_ENV])))


if __name__ == "__main__":
    sys.exit(main())
