"""The process heap: glibc's allocator told to give memory back (the one place that trims).

    configure_allocator()       # once at startup: large blocks in mappings of their own, a
                                #   bounded top of each heap kept for the next request
    release_after(nbytes)       # after a large message parsed or a large run: trim
    reclaim()                   # after a large use of the memory budget: collect cycles, trim
    trim()                      # give freed heap back now

Large messages. gRPC receives a message into buffers of its own, gives Python a copy, then frees
them. glibc keeps freed heap resident for reuse, and the buffers that come next (the model's
run, the answer) are of other sizes, mapped elsewhere: so every large request left its size
behind, resident, through the rest of its run. Measured for a (1, 4096, 512) request (25 MB):
the server's peak RSS increase +118-132 MB without, +97 MB with a trim once the request is
parsed (in-process ONNX Runtime on the same graph: +88 MB).

Large runs. glibc raises its mmap threshold to the largest block freed (up to 32 MiB), so after
one large run the buffers of later ones stay in its heaps for good; a fixed threshold
(MMAP_THRESHOLD_BYTES) keeps them out, and a trim after a run whose attention matrix is large
returns what its smaller blocks left (server.engine).

Small requests. Fixing the mmap threshold also fixes glibc's trim threshold at its default,
128 KiB: whenever more than that lies free at the top of a heap, free() returns it, and the next
run faults it back in. Every batch's tensors are freed at its end, so at the seeds' sizes each
request paid that: (1, 10, 512) at concurrency 32, 13.2 page faults per request; with
TRIM_THRESHOLD_BYTES (8 MiB) kept at the top of each heap, 3.9 (1 MiB: 8.7, 32 MiB: 3.6). That
bounds what is kept: 8 MiB a heap (glibc keeps one per thread that allocates, up to 8 per core),
and every trim below still returns it all. An operator's own trim threshold (GLIBC_TUNABLES
glibc.malloc.trim_threshold, or MALLOC_TRIM_THRESHOLD_) is left as it is.

A trim walks the heap (1-2 ms here), so only messages and runs of TRIM_MIN_BYTES or more take
one. Elsewhere than glibc, nothing is done.

This costs long requests their page faults (each block is new memory: 2 us a 4 KiB page here).
Huge pages (glibc.malloc.hugetlb) and a heap kept between requests were measured against it and
left off: they break the memory budget's bound under concurrent large requests (README, Memory,
"Huge pages and a kept heap").

The cyclic collector. reclaim() collects reference cycles after a large use of the budget,
holding the GIL while it walks every tracked object: 35-250 ms in a server with its models
loaded (54,000 objects), so inside the next request when requests come back to back. settle(),
once the server has started, moves what exists then (modules, models, the servers) out of the
collector's walk (gc.freeze): a collection then costs about 0.2 ms. unsettle() gives it all
back to the collector (a model version unloaded or replaced: its objects must be collectable).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from collections.abc import Mapping

TRIM_MIN_BYTES = 16 << 20
# Blocks from this size up get their own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 1 << 20
# Free memory kept at the top of each heap for the next request ("Small requests").
TRIM_THRESHOLD_BYTES = 8 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3

_libc: ctypes.CDLL | None | bool = None  # looked up once; False where it is not glibc


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        _libc = False
        if platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None)
                libc.malloc_trim, libc.mallopt  # noqa: B018 - both are glibc's
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc or None


def configure_allocator(environ: Mapping[str, str] = os.environ) -> None:
    """Once at startup: blocks of MMAP_THRESHOLD_BYTES or more mapped on their own, and up to
    TRIM_THRESHOLD_BYTES free at the top of each heap kept, unless `environ` sets glibc's trim
    threshold itself."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        if not trim_threshold_named(environ):
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def trim_threshold_named(environ: Mapping[str, str]) -> bool:
    """Whether the environment sets glibc's trim threshold (the tunable or the older variable)."""
    return "MALLOC_TRIM_THRESHOLD_" in environ or "glibc.malloc.trim_threshold=" in environ.get("GLIBC_TUNABLES", "")


def trim() -> bool:
    """Give freed heap memory back to the system now. Whether a trim ran (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def release_after(nbytes: int) -> bool:
    """After a message of `nbytes` was received and parsed, or a run whose attention matrix has
    `nbytes`: give freed heap back to the system if that was large. Whether a trim ran."""
    return nbytes >= TRIM_MIN_BYTES and trim()


def settle() -> None:
    """Once the server has started: every object that exists now is left out of the cyclic
    collector's walks from now on (module docstring, "The cyclic collector")."""
    gc.freeze()


def unsettle() -> None:
    """Undo settle(): what it left out is collectable again (a model version was unloaded or
    replaced; collections walk everything again, as before settle)."""
    gc.unfreeze()


def reclaim() -> None:
    """After a large use of the memory budget: collect reference cycles (a refused request's
    exception holds its frames, and they its request's tensors, until the cyclic collector
    runs), then trim. Measured: without the collection RSS stayed 120-190 MB above idle after
    40 large refused calls."""
    gc.collect()
    trim()
