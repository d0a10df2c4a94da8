"""How many calls gRPC's core has taken on our server, from its own channelz counters.

    taken = CoreCalls.of_new_server(before=CoreCalls.server_ids())  # right after grpc.aio.server()
    taken.started()   # calls core has received on it so far (None: channelz cannot tell)

Why: gRPC's stop cancels (CANCELLED, which clients do not retry) every call core has received
but not yet handed to the event loop, and Python's aio server takes them from core one at a
time, so a busy loop leaves several waiting there. Every call reaches the loop through
server.gate.CallGate.service(), which counts them: when that count equals core's, none is
waiting, and a stop begun at once (without giving the loop a turn) cancels none.

channelz is on by default in gRPC core; grpcio-channelz serves these same numbers. Where it is
off or its shape differs, started() is None and the stop gives the loop a short pause instead.
`channelz` is grpcio's core (cygrpc) unless given: the native data plane's module reads its own
core's the same way (attnserve.server._native.channelz_get_server).
"""

from __future__ import annotations

import json
import logging

from grpc._cython import cygrpc  # channelz's accessors; grpcio-channelz's servicer uses the same

logger = logging.getLogger(__name__)


class CoreCalls:
    def __init__(self, server_id: int, channelz=cygrpc) -> None:
        self.server_id = server_id
        self._channelz = channelz

    @staticmethod
    def server_ids(channelz=cygrpc) -> set[int]:
        """The channelz ids of this process's gRPC servers (empty if channelz cannot tell)."""
        try:
            ids, start = set(), 0
            while True:
                page = json.loads(channelz.channelz_get_servers(start))
                ids.update(int(s["ref"]["serverId"]) for s in page.get("server", []))
                if page.get("end", True) or not ids:
                    return ids
                start = max(ids) + 1
        except Exception:  # noqa: BLE001 - an internal interface: never let it fail a server
            logger.debug("channelz cannot list servers", exc_info=True)
            return set()

    @classmethod
    def of_new_server(cls, before: set[int]) -> CoreCalls | None:
        """Ours: the one server that appeared since `before` (None if not exactly one did, e.g.
        another thread created a server at the same moment)."""
        new = cls.server_ids() - before
        return cls(new.pop()) if len(new) == 1 else None

    def started(self) -> int | None:
        """Calls core has received on this server since it started; None if it cannot tell."""
        try:
            data = json.loads(self._channelz.channelz_get_server(self.server_id))["server"]["data"]
            return int(data.get("callsStarted", 0))  # proto3 JSON leaves out a 0
        except Exception:  # noqa: BLE001
            logger.debug("channelz cannot read server %d", self.server_id, exc_info=True)
            return None
