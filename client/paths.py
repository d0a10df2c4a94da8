"""The command line's paths, checked before any work: a file to read must be a regular file (a
FIFO would block the read forever, a directory fails half-way), and a file to write must be
creatable where it is named, which only trying tells (a read-only file system, /proc, a full
set of permissions for root): so `check_output_file` creates and removes a hidden temporary there.

    check_input_file(Path("in.npz"), "--input")    # ValueError naming the flag and the reason
    check_output_file(Path("out.npz"), "--output")
"""

from __future__ import annotations

import os
from pathlib import Path

from attnserve.files import FileRefused, check_regular, check_writable


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
        check_writable(path)
    except FileRefused as err:
        hint = "; name a file in it" if path.is_dir() else ""
        raise ValueError(f"cannot write {what} {path}: {err}{hint}") from None
