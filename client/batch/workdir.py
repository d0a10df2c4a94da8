"""`<output>.parts/`: the manifest, one `<start>-<stop>.npz` per finished chunk (global item
indices, zero-padded so names sort), and a lock against two runs writing it at once.

Every file in it is written by `attnserve.files.write_atomic`, so a part exists whole or not at
all whenever the job is killed (kill -9 included); taking the lock clears the temporaries a
killed run left.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import IO

import numpy as np
from attnserve.client.batch.manifest import Manifest
from attnserve.client.batch.spec import BatchError

from attnserve.files import read_json, remove_temporaries, write_atomic, write_json_atomic

MANIFEST = "manifest.json"
LOCK = ".lock"
_PART = re.compile(r"^(\d{12})-(\d{12})\.npz$")


class WorkDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file: IO[bytes] | None = None

    def exists(self) -> bool:
        return self.path.exists()

    def lock(self) -> None:
        """Take the directory (made if missing), or BatchError when another run holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.path / LOCK, "wb")
        try:
            # Released by the kernel when the process dies, kill -9 included.
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise BatchError(f"another batch job is writing {self.path}; wait for it or stop it") from None
        remove_temporaries(self.path)  # a killed run's half-written files: ours now that we hold the lock

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def read_manifest(self) -> Manifest | None:
        """The manifest, None when there is none yet, BatchError when it cannot be read."""
        path = self.path / MANIFEST
        try:
            return Manifest.from_json(read_json(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise BatchError(f"{path} is unreadable ({err}); delete {self.path} to start over") from None

    def write_manifest(self, manifest: Manifest) -> None:
        write_json_atomic(self.path / MANIFEST, manifest.to_json())

    def part_path(self, start: int, stop: int) -> Path:
        return self.path / f"{start:012d}-{stop:012d}.npz"

    def parts(self) -> list[tuple[int, int]]:
        """Finished chunks as (start, stop) item ranges, sorted."""
        ranges = []
        for entry in os.scandir(self.path):
            match = _PART.match(entry.name)
            if match:
                ranges.append((int(match.group(1)), int(match.group(2))))
        return sorted(ranges)

    def write_part(self, start: int, stop: int, arrays: dict[str, np.ndarray]) -> None:
        """Items [start, stop)'s outputs, by name, each (stop - start, ...)."""
        write_atomic(self.part_path(start, stop), lambda f: np.savez(f, **arrays))

    def remove(self) -> None:
        # Parts first and the manifest last: a kill midway leaves a directory a rerun recognises
        # (and the output's zip comment already says the job is complete).
        for start, stop in self.parts():
            self.part_path(start, stop).unlink(missing_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)
        self.unlock()
        shutil.rmtree(self.path, ignore_errors=True)
