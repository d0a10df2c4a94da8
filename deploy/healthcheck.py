#!/usr/bin/env python3
"""Container health probe: ask the server's standard grpc.health.v1 service; exit 0 when SERVING.

    python /opt/attnserve/healthcheck.py                    # 127.0.0.1:$ATTNSERVE_PORT (8001), overall health
    python /opt/attnserve/healthcheck.py --service self_attention --address host:8001

Exit status: 0 SERVING; 1 anything else (NOT_SERVING while draining or with no model loaded,
SERVICE_UNKNOWN, no answer within --timeout). Needs only grpcio and grpcio-health-checking,
both base dependencies of attnserve; it imports nothing of the project, so it can be copied
anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The server's own variable and default (server.config.ServerConfig.port).
PORT_VARIABLE = "ATTNSERVE_PORT"
DEFAULT_PORT = 8001


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="exit 0 when the gRPC health service answers SERVING")
    parser.add_argument("--address", default=f"127.0.0.1:{os.environ.get(PORT_VARIABLE) or DEFAULT_PORT}",
                        help=f"HOST:PORT of the server (default 127.0.0.1:${PORT_VARIABLE} or {DEFAULT_PORT})")
    parser.add_argument("--service", default="", help="health service name: '' = the whole server, or a model name")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    args = parser.parse_args(argv)
    try:
        with grpc.insecure_channel(args.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"unhealthy: {args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {args.address} service {args.service!r} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
