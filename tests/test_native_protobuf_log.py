"""protobuf's own log lines stay bounded (native/core/log.h): a flood of messages that make the
parser log (strings that are not UTF-8) gets each its INVALID_ARGUMENT, and the server's log a
few lines per minute and a count of what it left out, not one line per message."""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import native

from tests.oip import infer_request, outputs_of
from tests.server_process import ServerProcess

pytestmark = pytest.mark.skipif(native.why_unavailable() is not None, reason=str(native.why_unavailable()))

LINES_PER_WINDOW, WINDOW_S = 10, 60  # native/core/log.h's
FLOOD = 300
METHOD = "/inference.GRPCInferenceService/ModelInfer"


def test_a_flood_of_messages_protobuf_logs_about_writes_a_bounded_log(model_repository):
    server = ServerProcess(model_repository, "--data-plane", "native")
    try:
        # model_name (field 1) holding bytes that are not UTF-8: protobuf logs an error for each parse.
        bad = b"\x0a\x04\xff\xfe\xfd\xfc"
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            started = time.monotonic()
            for _ in range(FLOOD):
                with pytest.raises(grpc.RpcError) as refused:
                    call(bad, timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            windows = math.ceil((time.monotonic() - started) / WINDOW_S) + 1
            # The server serves on, exactly.
            x = np.random.default_rng(3).standard_normal((1, 4, 32), dtype=np.float32)
            got = outputs_of(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                infer_request("cross_attention", query=x, key=x, value=x), timeout=30))
            assert got["output"].shape == (1, 4, 32)
        lines = [line for line in server.log().splitlines() if "libprotobuf" in line]
        assert any("UTF-8" in line for line in lines)  # it does log: the flood is what is bounded
        assert len(lines) <= windows * (LINES_PER_WINDOW + 1)
    finally:
        server.stop()
