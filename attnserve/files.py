"""Files that appear whole or not at all: one atomic-write routine for the whole project.

    write_atomic(path, b"...")                      # bytes
    write_atomic(path, lambda f: np.save(f, a))     # or a writer given the open binary file
    write_json_atomic(path, {"a": 1})

The data goes to a temporary file beside `path`, is flushed and fsynced, renamed over `path`,
and the directory is fsynced so the rename itself survives a crash. On any error the temporary
file is removed and `path` is left as it was. A leaf: the standard library only.

Only a kill (kill -9, a power cut) can leave a temporary behind: `.<name>.<random>.tmp`, beside
`path`. `remove_temporaries(directory)` clears them from a directory its caller owns.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# mkstemp makes files 0600; servers and jobs may run as another user than the writer.
DEFAULT_MODE = 0o644
# Temporaries are `.<name>.<random>.tmp`: hidden, and never matched by a caller's own names.
_TMP_PREFIX = "."
_TMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in `directory` durable (a no-op where directories cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], Any], mode: int = DEFAULT_MODE) -> Path:
    """Write `data` (bytes, or a function that writes into the open file) to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def remove_temporaries(directory: Path) -> list[Path]:
    """Remove the temporaries that killed writers left in `directory`; returns what was removed.

    Only for a directory that no other process writes while this runs (the caller holds its
    lock): a live writer's temporary would be pulled from under it.
    """
    removed = []
    for tmp in Path(directory).glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return sorted(removed)


def write_json_atomic(path: Path, data: Any) -> Path:
    """`data` as indented JSON, with a final newline, written atomically."""
    return write_atomic(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; ValueError if the file holds anything else."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
