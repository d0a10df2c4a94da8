"""Which data plane serves ModelInfer: --data-plane auto, native or python, resolved once per start.

    plane, why_not_native = choose_data_plane(config.data_plane)  # ("native", None) where it loads

auto is native where attnserve.server._native (native/, `make native` or `pip install .`) loads,
else python, with the reason to log. Kept apart from server.native so that the workers'
supervisor, which loads no model and imports no ONNX Runtime, resolves it as its workers would
and hands each the result. docs/native-data-plane.md, "Which plane serves".
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Left by `pip install .` (setup.py) where the extension could not be built: what was missing.
NATIVE_MISSING_NOTE = Path(__file__).with_name("_native_missing.txt")


class DataPlaneUnavailable(RuntimeError):
    """--data-plane native was asked for and the extension does not load; the message says why."""


def why_unavailable() -> str | None:
    """None when the extension is built and loads; else why not, and how to build it."""
    try:
        from attnserve.server import _native  # noqa: F401
    except ImportError as err:
        if NATIVE_MISSING_NOTE.exists():
            return f"this installation was built without it: {NATIVE_MISSING_NOTE.read_text().strip()}"
        return f"attnserve.server._native is not built or does not load ({err}); build it with `make native`"
    return None


def choose_data_plane(asked: str) -> tuple[str, str | None]:
    """("native" or "python", why auto did not take native or None), the fallback logged once;
    DataPlaneUnavailable for 'native' without the extension."""
    if asked == "python":
        return "python", None
    why = why_unavailable()
    if why is None:
        return "native", None
    if asked == "native":
        raise DataPlaneUnavailable(f"--data-plane native: {why}")
    logger.info("data plane auto: the Python data plane serves; the native one is unavailable: %s", why)
    return "python", why
