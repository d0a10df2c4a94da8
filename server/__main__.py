"""`attnserve serve`: flags and ATTNSERVE_* environment -> ServerConfig -> Server.

Exits 0 after a clean drain on SIGTERM/SIGINT; 2 on a bad flag; 3 when it cannot start
(--device cuda without CUDA, a port in use, no model repository).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from attnserve.server.config import ServerConfig, load_config

if TYPE_CHECKING:
    from attnserve.server.models import RunBatchFactory

logger = logging.getLogger("attnserve.server")

EXIT_CANNOT_START = 3


async def serve(config: ServerConfig, run_batch: RunBatchFactory | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain; the exit status. run_batch: see app.Server."""
    from attnserve.server.app import Server
    from attnserve.server.engine import DeviceUnavailable
    from attnserve.server.repository import ModelLoadError

    server = Server(config, run_batch)
    try:
        await server.start()
    except (DeviceUnavailable, ModelLoadError, RuntimeError, OSError) as err:
        logger.error("cannot start: %s", err)
        return EXIT_CANNOT_START
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received: draining (grace period %.1fs)", config.grace_period_s)
    await server.stop(config.grace_period_s)
    return 0


def configure_logging(config: ServerConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None, prog: str = "attnserve serve") -> int:
    config = load_config(argv, prog=prog)
    configure_logging(config)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
