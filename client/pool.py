"""A client's channels: `ClientOptions.channels` of them, each its own connection, one per call in turn.

Why a pool: `attnserve serve --workers N` has its workers share one port (SO_REUSEPORT), and the
kernel places a connection on one worker for the connection's whole life; one channel is one
connection, so one channel reaches one worker however many calls it makes. N channels open N
connections (gRPC would otherwise share one between channels of equal settings: the options
ask for a local subchannel pool), which the kernel spreads over the workers. Channels connect
on their first call, so an unused lane costs nothing. See docs/client.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from attnserve.client.options import ClientOptions, open_channel
from attnserve.proto import inference_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc


@dataclass(frozen=True)
class Lane:
    """One channel and the stubs over it."""

    channel: Any  # grpc.Channel or grpc.aio.Channel
    infer: pb_grpc.GRPCInferenceServiceStub
    health: health_pb2_grpc.HealthStub


class ChannelPool:
    """`options.channels` lanes to `options.url`; `next()` hands them out round robin."""

    def __init__(self, options: ClientOptions, *, aio: bool = False) -> None:
        self.lanes: tuple[Lane, ...] = tuple(
            Lane(channel, pb_grpc.GRPCInferenceServiceStub(channel), health_pb2_grpc.HealthStub(channel))
            for channel in (open_channel(options, aio=aio) for _ in range(options.channels)))
        # next() on itertools.count is one C call, atomic under the GIL: threads need no lock.
        self._turn = itertools.count()

    def next(self) -> Lane:
        return self.lanes[next(self._turn) % len(self.lanes)]

    @property
    def channels(self) -> list[Any]:
        return [lane.channel for lane in self.lanes]
