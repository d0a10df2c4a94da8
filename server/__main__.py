"""`attnserve serve`: flags and ATTNSERVE_* environment -> ServerConfig -> Server.

Exits 0 after a clean drain on SIGTERM/SIGINT; 2 on a bad flag; 3 when it cannot start
(--device cuda without CUDA, a port in use, no model repository).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from attnserve.server.config import ServerConfig, load_config

logger = logging.getLogger("attnserve.server")

EXIT_CANNOT_START = 3


async def serve(config: ServerConfig, servicer_class: type | None = None) -> int:
    from attnserve.server.app import Server
    from attnserve.server.engine import DeviceUnavailable
    from attnserve.server.repository import ModelLoadError

    server = Server(config) if servicer_class is None else Server(config, servicer_class)
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


def main(argv: list[str] | None = None, servicer_class: type | None = None,
         prog: str = "attnserve serve") -> int:
    config = load_config(argv, prog=prog)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config, servicer_class))


if __name__ == "__main__":
    sys.exit(main())
