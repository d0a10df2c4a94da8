"""The process heap: glibc's allocator, roomy while large work comes alone, lean once it comes
crowded (the one place that sets it up and trims).

    huge_pages_environment(env)  # the environment main() re-executes the server with, or None
    configure_allocator()        # once at startup: the roomy mode
    go_lean()                    # a second large use of the memory budget began: the lean mode
    go_roomy()                   # the budget is quiet again: the roomy mode
    release_after(nbytes)        # lean mode: trim after a large message parsed or a large run
    reclaim()                    # once large work is over: collect cycles, trim
    trim()                       # give freed heap back now

- Roomy: a large request's buffers faulted in 4 KiB at a time cost more than its copies, so
  blocks below ROOMY_MMAP_THRESHOLD_BYTES stay in the heaps, on huge pages, with freed heap kept.
- Lean: under many concurrent large requests kept blocks pile up past the memory budget, so huge
  pages go off, blocks from LEAN_MMAP_THRESHOLD_BYTES are mapped alone and freed heap is trimmed.
- Blocks of 8 MiB and more are mapped even when roomy: each thread's arena otherwise keeps what
  it freed for itself, and a long request's buffers cannot reuse each other.
- Reclaim collects reference cycles before trimming: a refused request's exception holds its
  tensors until the cyclic collector runs.
- freeze_gc() freezes what exists at startup out of the collector's walk (a collection holds the
  GIL); unfreeze_gc() gives it back when a model version goes.
An operator's own glibc tunables are left as they are. Elsewhere than glibc on Linux nothing is
set or trimmed. Figures and history: docs/design.md ("The heap") and docs/record/server.md ("Memory goes back").
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
_lean = False  # the mode: go_lean() .. go_roomy()
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


def go_lean() -> None:
    """A second large use of the memory budget is held: the lean mode. The caller trims next
    (off the event loop), giving back what the roomy mode kept."""
    global _lean
    _lean = True
    _set(LEAN_MMAP_THRESHOLD_BYTES, LEAN_TRIM_THRESHOLD_BYTES, huge_pages=False)


def go_roomy() -> None:
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


def freeze_gc() -> None:
    """Once the server has started: every object that exists now is left out of the cyclic
    collector's walks from now on (module docstring, "The cyclic collector")."""
    gc.freeze()


def unfreeze_gc() -> None:
    """Undo freeze_gc(): what it left out is collectable again (a model version was unloaded or
    replaced; collections walk everything again, as before freeze_gc)."""
    gc.unfreeze()


def reclaim() -> None:
    """Once large work is over: collect reference cycles, then trim (module docstring, "Reclaim")."""
    gc.collect()
    trim()
