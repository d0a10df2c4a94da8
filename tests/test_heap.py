"""server.memory.heap: the cyclic collector leaves out what exists when the server has started
(gc.freeze) until a model change or the stop gives it back. A real in-process Server on the
exported models; no mocks. And glibc's allocator (server.memory.heap's two modes), in fresh processes:
what the roomy mode keeps at the top of a heap, measured in page faults; huge pages on and off
with the mode (/proc/self/status); the tunable a served process runs with (its environment, read
from /proc)."""

from __future__ import annotations

import asyncio
import gc
import os
import platform
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from attnserve.server.app import Server
from attnserve.server.config import ServerConfig
from attnserve.server.memory import heap
from grpc_health.v1 import health_pb2

from tests.server_process import ServerProcess

pytestmark = pytest.mark.e2e  # starts servers and fresh processes


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_leaves_earlier_objects_out_of_collections_and_later_cycles_in():
    before = _Cycle()
    watched_before = weakref.ref(before)
    heap.freeze_gc()
    try:
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert watched_before() is not None  # frozen: no collection walks it
        later = _Cycle()
        watched_later = weakref.ref(later)
        del later
        gc.collect()
        assert watched_later() is None  # made after freeze_gc: collected as ever
    finally:
        heap.unfreeze_gc()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert watched_before() is None  # given back: collected


def test_a_server_settles_once_started_and_gives_it_back_on_a_model_change_and_on_stop(model_repository, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(model_repository / "cross_attention", root / "cross_attention")
    config = ServerConfig(model_repository=root, host="127.0.0.1", port=0, http_port=-1, metrics_port=-1,
                          model_control_mode="explicit", drain_delay_s=0, grace_period_s=5)

    async def main() -> list[bool]:
        server = Server(config)
        await server.start()
        seen = [gc.get_freeze_count() > 0]
        await server.registry.unload("cross_attention")  # its version retires: collectable again
        seen.append(gc.get_freeze_count() > 0)
        await server.stop(5)
        seen.append(gc.get_freeze_count() > 0)
        server2 = Server(config)
        await server2.start()
        seen.append(gc.get_freeze_count() > 0)
        await server2.stop(5)
        seen.append(gc.get_freeze_count() > 0)
        return seen

    gc.unfreeze()
    assert asyncio.run(main()) == [True, False, False, True, False]


@pytest.fixture(autouse=True)
def _nothing_left_frozen():
    yield
    gc.unfreeze()


# A fresh process configures the allocator, then frees 4 MiB of 64 KiB blocks (malloc'd on the
# main heap, below the mmap threshold) and takes them again: the page faults of the second take.
_REUSE_FAULTS = """
import ctypes, resource
from attnserve.server.memory import heap
heap.configure_allocator()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def take():
    blocks = [libc.malloc(64 << 10) for _ in range(64)]
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    return blocks
for block in reversed(take()):
    libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
take()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _reuse_faults(**env: str) -> int:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")}
    got = subprocess.run([sys.executable, "-c", _REUSE_FAULTS], env={**environ, **env},
                         capture_output=True, text=True, check=True)
    return int(got.stdout)


GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_freed_small_blocks_stay_for_the_next_request_unless_the_operator_sets_the_threshold():
    kept = _reuse_faults()
    # The operator's own threshold wins (glibc's default, 128 KiB): the 4 MiB went back to the
    # system when freed, and the second take faults its 1,024 pages in again.
    returned = _reuse_faults(MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    assert returned >= 900, returned
    assert kept <= 100, (kept, returned)


def test_the_thresholds_are_named_by_the_tunables_or_the_older_variables():
    assert heap.thresholds_named({}) == frozenset()
    assert heap.thresholds_named({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == frozenset()
    tunables = "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=1048576"
    assert heap.thresholds_named({"GLIBC_TUNABLES": tunables}) == {"trim"}
    both = {"MALLOC_TRIM_THRESHOLD_": "1048576", "MALLOC_MMAP_THRESHOLD_": "1"}
    assert heap.thresholds_named(both) == {"trim", "mmap"}


# A fresh process: roomy, then crowded, then quiet again. Per mode: whether huge pages may be
# faulted in (the kernel's THP_enabled for the process) and whether a large release trims.
_MODES = """
from attnserve.server.memory import heap
def state():
    thp = [line.split()[1] for line in open("/proc/self/status") if line.startswith("THP_enabled:")]
    return [heap.is_lean(), thp[0] if thp else None, heap.release_after(heap.TRIM_MIN_BYTES),
            heap.release_after(heap.TRIM_MIN_BYTES - 1)]
heap.configure_allocator()
seen = [state()]
heap.go_lean()
seen.append(state())
heap.go_roomy()
seen.append(state())
print(seen)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_crowded_the_heap_turns_lean_without_huge_pages_and_trims_after_large_work_then_roomy_again():
    got = subprocess.run([sys.executable, "-c", _MODES], capture_output=True, text=True, check=True)
    roomy, lean, again = eval(got.stdout)  # noqa: S307 - our own child's repr of lists of bools and str
    thp = Path("/proc/self/status").read_text().count("THP_enabled:") > 0  # kernels since 6.0 say it
    assert roomy == [False, "1" if thp else None, False, False]
    assert lean == [True, "0" if thp else None, True, False]
    assert again == roomy


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mode_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "enabled"
    path.write_text(text + "\n")
    return path


@pytest.mark.skipif(not GLIBC, reason="glibc's tunable")
def test_the_huge_page_tunable_is_added_only_where_the_kernel_gives_huge_pages_on_request(tmp_path):
    madvise = _mode_file(tmp_path, "always [madvise] never")
    assert heap.huge_pages_environment({"A": "1"}, madvise) == {"A": "1", "GLIBC_TUNABLES": heap.HUGE_PAGES_TUNABLE}
    # Other tunables are kept, in their order.
    assert heap.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, madvise) == {
        "GLIBC_TUNABLES": f"glibc.malloc.tcache_count=0:{heap.HUGE_PAGES_TUNABLE}"}
    # Named already (on or off): the operator's choice; the process needs no restart.
    assert heap.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise) is None
    assert heap.huge_pages_environment({"GLIBC_TUNABLES": heap.HUGE_PAGES_TUNABLE}, madvise) is None
    # "always": every mapping has them already; "never": none can; no file: not Linux's THP.
    assert heap.huge_pages_environment({}, _mode_file(tmp_path, "[always] madvise never")) is None
    assert heap.huge_pages_environment({}, _mode_file(tmp_path, "always madvise [never]")) is None
    assert heap.huge_pages_environment({}, tmp_path / "missing") is None


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


@pytest.mark.skipif(not GLIBC or "[madvise]" not in (THP_MODE.read_text() if THP_MODE.exists() else ""),
                    reason="the kernel's transparent huge pages are not in madvise mode here")
def test_a_served_process_runs_with_the_tunable_and_keeps_an_operators_own(model_repository):
    server = ServerProcess(model_repository, env={"GLIBC_TUNABLES": ""})
    try:
        environ = _environ(server.proc.pid)  # the same PID: the server re-executed itself
        assert environ["GLIBC_TUNABLES"] == heap.HUGE_PAGES_TUNABLE
        assert server.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.stop() == 0  # drained on SIGTERM, signal handlers those of the new image
    server = ServerProcess(model_repository, env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    try:
        assert _environ(server.proc.pid)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    finally:
        server.stop()
