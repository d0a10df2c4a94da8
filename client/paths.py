"""The command line's paths, checked before any work: a file to read must be a regular file (a
FIFO would block the read forever, a directory fails half-way), and a file to write must be
creatable where it is named, which only trying tells (a read-only file system, /proc, a full
set of permissions for root): so `check_output_file` creates and removes a hidden temporary there.

    check_input_file(Path("in.npz"), "--input")    # ValueError naming the flag and the reason
    check_output_file(Path("out.npz"), "--output")
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from attnserve.files import FileRefused, check_regular, file_kind


def check_input_file(path: Path, what: str) -> None:
    """`path` is a regular file this process can open for reading, or a ValueError says why not."""
    try:
        check_regular(path)
    except FileNotFoundError:
        broken = " (a link to nothing)" if os.path.islink(path) else ""
        raise ValueError(f"cannot read {what} {path}: it does not exist{broken}") from None
    except FileRefused as err:
        raise ValueError(f"cannot read {what} {path}: {err}") from None
    except OSError as err:
        raise ValueError(f"cannot read {what} {path}: {err.strerror}") from None
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ValueError(f"cannot read {what} {path}: {err.strerror}") from None


def check_output_file(path: Path, what: str) -> None:
    """A file can be written at `path` (replacing a regular file there), or a ValueError says why not."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise ValueError(f"cannot write {what} {path}: {err.strerror}") from None
    if mode is not None and not stat.S_ISREG(mode):
        hint = "; name a file in it" if stat.S_ISDIR(mode) else ""
        raise ValueError(f"cannot write {what} {path}: not a regular file ({file_kind(mode)}){hint}")
    parent = path.parent
    if not parent.is_dir():
        reason = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"cannot write {what} {path}: its directory {parent} {reason}")
    try:
        # Named like attnserve.files' temporaries, so a kill between these two lines leaves what
        # a killed writer would.
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as err:
        raise ValueError(f"cannot write {what} {path}: {err.strerror} (in {parent})") from None
    os.close(fd)
    os.unlink(probe)
