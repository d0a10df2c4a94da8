"""`attnserve serve`: flags and ATTNSERVE_* environment -> ServerConfig -> Server.

Exits 0 after a clean drain on SIGTERM, SIGINT or SIGHUP (a second one stops at once); 2 on a
bad flag; 3 when it cannot start (--device cuda without CUDA, a port in use, no model repository).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from attnserve.server.config import ServerConfig, load_config

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnserve.server.app import Server
    from attnserve.server.models import RunBatchFactory

logger = logging.getLogger("attnserve.server")

EXIT_CANNOT_START = 3
# Each one drains; SIGHUP too (a terminal closing, a supervisor's stop), rather than killing the
# process with requests queued. Reloading models is the model repository API's job, not a signal's.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve(config: ServerConfig, run_batch: RunBatchFactory | None = None,
                warm_up_hold: Callable[[Server, str, int], None] | None = None) -> int:
    """Serve until a stop signal, then drain; the exit status. run_batch, warm_up_hold: see app.Server."""
    from attnserve.server.app import Server
    from attnserve.server.engine import DeviceUnavailable
    from attnserve.server.quoting import escaped
    from attnserve.server.repository import ModelLoadError
    from attnserve.server.workers import WorkerContext

    worker = WorkerContext.from_env()
    server = Server(config, run_batch, worker=worker, warm_up_hold=warm_up_hold)
    # Handlers first: a signal that comes while the server starts (its ready file may already
    # be written, telling a supervisor it may stop it) drains once the start is done, instead of
    # killing the process (a test under load caught a SIGTERM between the two).
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    if worker is not None:
        worker.answer_heartbeats(loop)  # the supervisor's watchdog (server.workers)
    try:
        await server.start()
    except (DeviceUnavailable, ModelLoadError, RuntimeError, OSError) as err:
        logger.error("cannot start: %s", escaped(err))
        return EXIT_CANNOT_START
    first = await signals.get()
    logger.info("%s received: draining (drain delay %.1fs, grace period %.1fs; a second signal stops at once)",
                first.name, config.drain_delay_s, config.grace_period_s)
    stopping = asyncio.create_task(server.stop(config.grace_period_s, config.drain_delay_s))
    second = asyncio.create_task(signals.get())
    done, _pending = await asyncio.wait((stopping, second), return_when=asyncio.FIRST_COMPLETED)
    if second in done:
        server.hurry()  # before the line: what has not started is refused once it is written
        logger.warning("%s received again: stopping now; what has not started is refused", second.result().name)
        await stopping
    else:
        second.cancel()
    return 0


def configure_logging(config: ServerConfig) -> None:
    import os

    from attnserve.server.workers import WorkerContext

    # A worker's lines say which (server.workers): they share the supervisor's log.
    worker = WorkerContext.from_env()
    if config.log_format == "json":
        from attnserve.server.tracing import JsonFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter(worker.index if worker is not None else None))
        logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
        return
    who = f"[worker {worker.index} pid {os.getpid()}] " if worker is not None else ""
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")


def run(config: ServerConfig, argv: list[str], command: list[str], run_batch: RunBatchFactory | None = None,
        warm_up_hold: Callable[[Server, str, int], None] | None = None) -> int:
    """Serve in this process, or as the supervisor of --workers processes, each `command argv`
    (server.workers). The supervisor imports no ONNX Runtime and loads no model."""
    from attnserve.server.workers import WorkerContext, default_workers, supervise

    workers = default_workers(config)
    if workers > 1 and WorkerContext.from_env() is None:
        return asyncio.run(supervise(config, argv, command, workers))
    return asyncio.run(serve(config, run_batch, warm_up_hold))


def start_on_huge_pages() -> None:
    """Re-execute this process (the same PID, interpreter and command line) with glibc's
    huge-page tunable in its environment, where that changes anything (server.memory.heap, "Roomy");
    workers inherit it. Before any model or library is loaded."""
    import os

    from attnserve.server.memory import heap

    environ = heap.huge_pages_environment(os.environ)
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def main(argv: list[str] | None = None, prog: str = "attnserve serve") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = load_config(argv, prog=prog)
    start_on_huge_pages()
    configure_logging(config)
    import os

    from attnserve.server.tracing import TracingUnavailable, check_environ

    try:  # before any worker starts: asked for traces that cannot be sent is a clear refusal
        check_environ(os.environ)
    except TracingUnavailable as err:
        logger.error("cannot start: %s", err)
        return EXIT_CANNOT_START
    return run(config, argv, [sys.executable, "-m", "attnserve", "serve"])


if __name__ == "__main__":
    sys.exit(main())
