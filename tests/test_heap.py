"""server.heap: the cyclic collector leaves out what exists when the server has started
(gc.freeze) until a model change or the stop gives it back. A real in-process Server on the
exported models; no mocks. And glibc's trim threshold: what configure_allocator keeps at the
top of a heap, measured in page faults of a fresh process."""

from __future__ import annotations

import asyncio
import gc
import os
import platform
import shutil
import subprocess
import sys
import weakref

import pytest

from attnserve.server import heap
from attnserve.server.app import Server
from attnserve.server.config import ServerConfig


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_leaves_earlier_objects_out_of_collections_and_later_cycles_in():
    before = _Cycle()
    watched_before = weakref.ref(before)
    heap.settle()
    try:
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert watched_before() is not None  # frozen: no collection walks it
        later = _Cycle()
        watched_later = weakref.ref(later)
        del later
        gc.collect()
        assert watched_later() is None  # made after settle: collected as ever
    finally:
        heap.unsettle()
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
from attnserve.server import heap
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
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_")}
    got = subprocess.run([sys.executable, "-c", _REUSE_FAULTS], env={**environ, **env},
                         capture_output=True, text=True, check=True)
    return int(got.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_freed_small_blocks_stay_for_the_next_request_unless_the_operator_sets_the_threshold():
    kept = _reuse_faults()
    # The operator's own threshold wins (glibc's default, 128 KiB): the 4 MiB went back to the
    # system when freed, and the second take faults its 1,024 pages in again.
    returned = _reuse_faults(MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    assert returned >= 900, returned
    assert kept <= 100, (kept, returned)


def test_the_trim_threshold_is_named_by_the_tunable_or_the_older_variable():
    assert not heap.trim_threshold_named({})
    assert not heap.trim_threshold_named({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert heap.trim_threshold_named({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=1048576"})
    assert heap.trim_threshold_named({"MALLOC_TRIM_THRESHOLD_": "1048576"})
