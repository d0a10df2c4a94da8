"""Files that appear whole or not at all: one atomic-write routine for the whole project.

    write_atomic(path, b"...")                      # bytes
    write_atomic(path, lambda f: np.save(f, a))     # or a writer given the open binary file
    write_json_atomic(path, {"a": 1})

The data goes to a temporary file beside `path`, is flushed and fsynced, renamed over `path`,
and the directory is fsynced so the rename itself survives a crash. On any error the temporary
file is removed and `path` is left as it was. A leaf: the standard library only.

Only a kill (kill -9, a power cut) can leave a temporary behind: `.<name>.<random>.tmp`, beside
`path`. `remove_temporaries(directory)` clears them from a directory its caller owns.

And one bounded-read routine for every file the server and the tools read (config.json, TLS
files, tokens, manifests):

    data = read_bounded(path, max_bytes)   # FileRefused: not a regular file, or larger than max_bytes
    config = read_json(path)               # the same, then a JSON object nested at most MAX_JSON_DEPTH deep
    check_regular(path)                    # before a library (ONNX Runtime, OpenSSL) opens it by name

A FIFO, a device (/dev/zero) or a directory is refused without blocking: the file is opened with
O_NONBLOCK (an open of a FIFO waits for a writer otherwise) and checked with fstat before any
read, and at most max_bytes + 1 bytes are read. Symlinks to regular files are followed
(Kubernetes mounts ConfigMaps and Secrets as symlinks).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# mkstemp makes files 0600; servers and jobs may run as another user than the writer.
DEFAULT_MODE = 0o644
# Temporaries are `.<name>.<random>.tmp`: hidden, and never matched by a caller's own names.
_TMP_PREFIX = "."
_TMP_SUFFIX = ".tmp"
# read_json's bounds: config.json and manifests are a few KiB; a deeper or larger one is an attack or a mistake.
MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 64
# The server's and the client's TLS files (a certificate chain, a key, a CA bundle) and token files.
MAX_PEM_BYTES = 1 << 20
MAX_TOKEN_BYTES = 64 << 10


class FileRefused(ValueError):
    """A file that is not read: not a regular file, too large, or (read_json) nested too deep.
    The message says why and leaves the path to the caller, which names the file (or its flag)."""


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


def file_kind(mode: int) -> str:
    """What a file that is not regular is, for a refusal's words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def check_regular(path: Path) -> os.stat_result:
    """The file's stat (symlinks followed) if it is a regular file, else FileRefused; opens nothing."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"not a regular file ({file_kind(st.st_mode)})")
    return st


def check_writable(path: Path, make_parents: bool = False) -> None:
    """Whether write_atomic could write `path` now, or FileRefused says why: a regular file or
    nothing there, and a temporary made and removed beside it (only trying tells a read-only file
    system or /proc, even to root). make_parents: missing directories are fine (write_atomic makes
    them), and the nearest one that exists is tried."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise FileRefused(err.strerror or str(err)) from None
    if mode is not None and not stat.S_ISREG(mode):
        raise FileRefused(f"not a regular file ({file_kind(mode)})")
    where = path.parent
    while make_parents and not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise FileRefused(f"its directory {where} " + ("is not a directory" if where.exists() else "does not exist"))
    try:
        fd, probe = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{path.name}.", suffix=_TMP_SUFFIX, dir=where)
    except OSError as err:
        raise FileRefused(f"cannot write a file in {where} ({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path`, a regular file of at most max_bytes; FileRefused otherwise (OSError
    when it cannot be opened). Never blocks on a FIFO, never reads more than max_bytes + 1."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # the file opened, not what the name points to by now
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"not a regular file ({file_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise FileRefused(f"larger than {max_bytes} bytes ({st.st_size} bytes)")
        chunks, got = [], 0
        while got <= max_bytes:  # the size may have grown since fstat: read one byte past the bound at most
            chunk = os.read(fd, max_bytes + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise FileRefused(f"larger than {max_bytes} bytes (it grew while read)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A JSON object from `path` (read_bounded); ValueError if the file holds anything else,
    FileRefused (a ValueError) if it is nested deeper than max_depth."""
    data = read_bounded(path, max_bytes)
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:  # the parser's own recursion: deeper than any bound we accept
        raise FileRefused(f"JSON nested deeper than {max_depth} levels") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    if json_depth(value) > max_depth:
        raise FileRefused(f"JSON nested deeper than {max_depth} levels")
    return value


def json_depth(value: Any) -> int:
    """How deep a parsed JSON value nests (a scalar: 0, {} or []: 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest
