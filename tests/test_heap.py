"""server.heap: the cyclic collector leaves out what exists when the server has started
(gc.freeze) until a model change or the stop gives it back. A real in-process Server on the
exported models; no mocks."""

from __future__ import annotations

import asyncio
import gc
import shutil
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
