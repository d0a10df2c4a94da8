"""The process heap: glibc's allocator, roomy while large work comes alone, lean once it comes
crowded (the one place that sets it up and trims).

    huge_pages_environment(env)  # the environment main() re-executes the server with, or None
    configure_allocator()        # once at startup: the roomy mode
    crowd()                      # a second large use of the memory budget began: the lean mode
    uncrowd()                    # the budget is quiet again: the roomy mode
    release_after(nbytes)        # lean mode: trim after a large message parsed or a large run
    reclaim()                    # once large work is over: collect cycles, trim
    trim()                       # give freed heap back now

Why two modes. A large request's buffers are new memory: gRPC's copy of the message, Python's
bytes, ONNX Runtime's tensors, the answer. Faulted in 4 KiB at a time, at 2 us a page on the
2-core VM this was first measured on (a 64 MiB buffer: 34 ms), they cost more than the copies;
and on a VM whose balloon reports free pages to its host (virtio-balloon free page reporting),
memory given back and faulted in again costs the host's fault too (about 1 ms per MB measured
on such a VM, 0.2 with huge pages). Huge pages under glibc's blocks, and freed heap kept for the
next request, remove much of that cost for a client's long requests that come one after another.
But under many concurrent large requests keeping freed blocks breaks the memory budget's bound:
the freed blocks of many requests pile up (tests/test_memory_attacks.py's overload case reached
idle + 860-1,003 MiB against the 736 it allows). So:

Roomy (from the start, while at most one large use of the budget is held). Blocks below
ROOMY_MMAP_THRESHOLD_BYTES come from glibc's heaps, and up to ROOMY_TRIM_THRESHOLD_BYTES free at
the top of each stays resident; larger blocks are mapped on their own and go back when freed.
The heaps and large blocks are on huge pages (glibc's tunable glibc.malloc.hugetlb=1, which it
reads once, at startup: main() re-executes the server with it where the kernel gives huge pages
on request, its transparent_hugepage mode "madvise", and the environment does not name it;
GLIBC_TUNABLES=glibc.malloc.hugetlb=0 keeps 4 KiB pages). Why blocks of 8 MiB and more are
mapped: with every block under 32 MiB kept (glibc's own dynamic ceiling), each thread's arena
(gRPC's core threads receive a message, the event loop copies it into bytes, the run thread holds
ONNX Runtime's tensors) kept what it had freed, and no other could reuse it: a (1, 4096, 512)
output-only request's peak RSS increase was 144 MB (1.64x the in-process fused run's 88 MB), and
210-300 MB once such requests came back to back; mapping blocks of 8 MiB and more (one
(4096, 512) fp32 tensor is 8 MiB): 105-114 MB (1.2-1.3x), 111-127 MB back to back, paired time
1.16-1.17x against 1.10-1.15x before (alternating runs on a 2-core AMD EPYC VM, load 1-2.7).
Mapping from 4 MiB (16 MiB kept) did as well there but took the seeds' cross-attention batches
with it: at concurrency 32 their (32, 2, 256, 77) attention probabilities (5 MB) were mapped
afresh for every batch, 0.87x the throughput (perf_analyzer, 4 alternating rounds); from 8 MiB,
0.98x (64 MiB kept), 0.97x (32 MiB kept).

Lean (from a second large use held at once, until the budget is quiet). crowd() turns huge pages
off for the process (prctl PR_SET_THP_DISABLE: what is faulted in from then on takes 4 KiB
pages), maps every block of LEAN_MMAP_THRESHOLD_BYTES or more on its own (returned whole when
freed), keeps at most LEAN_TRIM_THRESHOLD_BYTES free at a heap's top, and the server trims
(off the event loop) what the roomy mode kept. From then on release_after() trims after each
message and run of TRIM_MIN_BYTES or more (a trim walks the heap: 1-2 ms). Measured before the
modes, with the lean settings always on: for a (1, 4096, 512) request the server's peak RSS
increase was +118-132 MB without the trim after the message, +97 MB with it.

Small requests never make a use large enough to count, so the seeds' traffic stays roomy: a
fixed mmap threshold would otherwise leave glibc's trim threshold at its default, 128 KiB, and
every batch's freed tensors would go back to the system to be faulted in again (measured at
(1, 10, 512), concurrency 32: 13.2 page faults a request with 128 KiB, 3.9 with 8 MiB).

Reclaim. The server (server.app) gives freed heap back once the budget empties after a large
use, each pass only while less than 64 MiB of the budget is held: roomy, 1, 5 and 15 s later
(a client's next long request within a second finds its heap resident: a first pass at 0.05 s
gave 1.40-1.46x instead of 1.23-1.28x); lean, 0.05 s later and again at 1, 5 and 15 s, and the
first pass that finds at most one large use held calls uncrowd(). A pass collects
reference cycles first (a refused request's exception holds its frames, and they its request's
tensors, until the cyclic collector runs; without it RSS stayed 120-190 MB above idle after 40
large refused calls), then trims. An operator's own glibc.malloc.mmap_threshold or
trim_threshold (GLIBC_TUNABLES, or MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_) is left as
it is in both modes. Elsewhere than glibc on Linux nothing is set or trimmed.

The cyclic collector walks every tracked object holding the GIL: 35-250 ms in a server with its
models loaded (54,000 objects), so inside the next request when requests come back to back.
settle(), once the server has started, moves what exists then (modules, models, the servers) out
of the collector's walk (gc.freeze): a collection then costs about 0.2 ms. unsettle() gives it
all back to the collector (a model version unloaded or replaced: its objects must be collectable).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from collections.abc import Mapping
from pathlib import Path

TRIM_MIN_BYTES = 16 << 20
ROOMY_MMAP_THRESHOLD_BYTES = 8 << 20
ROOMY_TRIM_THRESHOLD_BYTES = 64 << 20
LEAN_MMAP_THRESHOLD_BYTES = 1 << 20
LEAN_TRIM_THRESHOLD_BYTES = 8 << 20
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's malloc arenas at most (its default: 8 per core). Each new ONNX Runtime pool thread (a
# model reloaded opens new sessions, new threads) may take a fresh arena, and what is freed in
# those stays: with the default every reload kept memory; with a few it is reused.
ARENA_MAX = 2
_PR_SET_THP_DISABLE = 41  # Linux prctl
_TUNABLES = "GLIBC_TUNABLES"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc: ctypes.CDLL | None | bool = None  # looked up once; False where it is not glibc
_lean = False  # the mode: crowd() .. uncrowd()
_operator_set = frozenset[str]()  # the thresholds the environment sets: "mmap", "trim"


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        _libc = False
        if platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.malloc_trim, libc.mallopt, libc.prctl  # noqa: B018 - all glibc's
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


def thresholds_named(environ: Mapping[str, str]) -> frozenset[str]:
    """Which of glibc's thresholds the environment sets ("mmap", "trim"): the tunables or the
    older variables."""
    tunables = environ.get(_TUNABLES, "")
    return frozenset(name for name in ("mmap", "trim") if f"glibc.malloc.{name}_threshold=" in tunables
                     or f"MALLOC_{name.upper()}_THRESHOLD_" in environ)


def _set(mmap_threshold: int, trim_threshold: int, huge_pages: bool) -> None:
    libc = _glibc()
    if libc is None:
        return
    if "mmap" not in _operator_set:
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    if "trim" not in _operator_set:
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    libc.prctl(_PR_SET_THP_DISABLE, 0 if huge_pages else 1, 0, 0, 0)  # fails harmlessly on old kernels


def configure_allocator(environ: Mapping[str, str] = os.environ) -> None:
    """Once at startup: the roomy mode (module docstring), with the environment's own
    thresholds left as they are."""
    global _operator_set, _lean
    _operator_set = thresholds_named(environ)
    _lean = False
    _set(ROOMY_MMAP_THRESHOLD_BYTES, ROOMY_TRIM_THRESHOLD_BYTES, huge_pages=True)
    libc = _glibc()
    if libc is not None and "MALLOC_ARENA_MAX" not in environ and "glibc.malloc.arena_max=" not in environ.get(
            "GLIBC_TUNABLES", ""):
        libc.mallopt(_M_ARENA_MAX, ARENA_MAX)


def crowd() -> None:
    """A second large use of the memory budget is held: the lean mode. The caller trims next
    (off the event loop), giving back what the roomy mode kept."""
    global _lean
    _lean = True
    _set(LEAN_MMAP_THRESHOLD_BYTES, LEAN_TRIM_THRESHOLD_BYTES, huge_pages=False)


def uncrowd() -> None:
    """The budget is quiet again: back to the roomy mode."""
    global _lean
    _lean = False
    _set(ROOMY_MMAP_THRESHOLD_BYTES, ROOMY_TRIM_THRESHOLD_BYTES, huge_pages=True)


def is_lean() -> bool:
    return _lean


def trim() -> bool:
    """Give freed heap memory back to the system now. Whether a trim ran (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def release_after(nbytes: int) -> bool:
    """After a message of `nbytes` was received and parsed, or a run whose attention matrix has
    `nbytes`: in the lean mode, give freed heap back to the system if that was large. Whether a
    trim ran."""
    return _lean and nbytes >= TRIM_MIN_BYTES and trim()


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
