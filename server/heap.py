"""The process heap: glibc's allocator on huge pages, and given back (the one place that trims).

    huge_pages_environment(env)  # the environment a server re-executes itself with, or None
    reclaim()                    # once no large work is in flight: collect cycles, trim
    trim()                       # give freed heap back now

Huge pages. A large request's buffers are new memory: gRPC's copy of the message, Python's
bytes, ONNX Runtime's tensors, the answer. Faulted in 4 KiB at a time, at 2 us a page on this
2-core VM (a 64 MiB buffer: 34 ms), they cost more than the copies themselves; numpy asks for
transparent huge pages (madvise) on its own large arrays, glibc does only when told by its
tunable glibc.malloc.hugetlb=1 (glibc 2.35 and later), which it reads once, at startup. So the
server's main() re-executes itself with it added to GLIBC_TUNABLES (attnserve.server.__main__)
where the kernel gives huge pages on request (transparent_hugepage "madvise"; with "always"
every mapping has them already, with "never" none can) and the environment does not name the
tunable (GLIBC_TUNABLES=glibc.malloc.hugetlb=0 keeps 4 KiB pages). Measured, (1, 4096, 512)
output alone through the server, 30 rounds paired with the in-process fused run, on the earlier
design (every block of 1 MiB or more mapped on its own, a trim after every large message and
run): 1.48-1.51x with huge pages, 1.72-1.73x without. grpc.aio alone, 24 MiB in and 8 MiB out
over loopback: 18 ms; 45 ms with every such block mapped on its own, without huge pages.

Freed heap stays for the next request. glibc keeps blocks up to its dynamic mmap threshold
(raised to the largest block freed, at most 32 MiB) in its heaps, where the next request of the
same size finds them resident: no new pages, no zeroing. Larger blocks (an unfused attention
matrix) are mapped on their own and go back when freed. Trimming after every large message and
run, with a first reclaim 0.05 s after the budget emptied, kept RSS lower between requests but
made long requests a client sends one after another fault everything in again: 1.40-1.46x
instead of 1.23-1.28x (the same pairing); mapping every block of 1 MiB on its own as well
(the earlier design): 1.72-1.73x.

Reclaim. The server (server.app) gives freed heap back once a large use of the memory budget is
over and no other is in flight: 1, 5 and 15 s after the budget empties, each pass only while
less than lifecycle.MemoryBudget.IDLE_AFTER_BYTES is in use, so a client's next long request
within a second keeps its heap and small traffic after a large request does not. A pass
collects reference cycles first (a refused request's exception holds its frames, and they its
request's tensors, until the cyclic collector runs; without it RSS stayed 120-190 MB above idle
after 40 large refused calls), then trims (malloc_trim walks the heap, 1-2 ms). Elsewhere than
glibc nothing is trimmed.

The cyclic collector walks every tracked object holding the GIL: 35-250 ms in a server with its
models loaded (54,000 objects), so inside the next request when requests come back to back.
settle(), once the server has started, moves what exists then (modules, models, the servers)
out of the collector's walk (gc.freeze): a collection then costs about 0.2 ms. unsettle() gives
it all back to the collector (a model version unloaded or replaced: its objects must be
collectable).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from pathlib import Path
from typing import Mapping

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_TUNABLES = "GLIBC_TUNABLES"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc: ctypes.CDLL | None | bool = None  # looked up once; False where it is not glibc


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        _libc = False
        if platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None)
                libc.malloc_trim  # noqa: B018 - glibc's
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc or None


def huge_pages_environment(environ: Mapping[str, str], thp_mode: Path = _THP_MODE) -> dict[str, str] | None:
    """`environ` with HUGE_PAGES_TUNABLE added to GLIBC_TUNABLES, for a process to start with;
    None where it would change nothing: not glibc, the kernel's transparent huge pages not
    "madvise" (its mode file reads e.g. "always [madvise] never"), or the tunable already named
    (whatever its value: the operator's choice)."""
    tunables = environ.get(_TUNABLES, "")
    if platform.libc_ver()[0] != "glibc" or "glibc.malloc.hugetlb=" in tunables:
        return None
    try:
        if "[madvise]" not in thp_mode.read_text():
            return None
    except OSError:
        return None
    return {**environ, _TUNABLES: f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE}


def huge_pages_in_use() -> bool:
    """Whether this process started with glibc's huge-page tunable on."""
    return HUGE_PAGES_TUNABLE in os.environ.get(_TUNABLES, "").split(":")


def trim() -> bool:
    """Give freed heap memory back to the system now. Whether a trim ran (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def settle() -> None:
    """Once the server has started: every object that exists now is left out of the cyclic
    collector's walks from now on (module docstring, "The cyclic collector")."""
    gc.freeze()


def unsettle() -> None:
    """Undo settle(): what it left out is collectable again (a model version was unloaded or
    replaced; collections walk everything again, as before settle)."""
    gc.unfreeze()


def reclaim() -> None:
    """Once large work is over: collect reference cycles, then trim (module docstring, "Reclaim")."""
    gc.collect()
    trim()
