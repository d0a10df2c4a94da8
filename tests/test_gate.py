"""The gate in process: which handlers it wraps.

The end-to-end behaviour (tokens, draining, garbage messages) is tested against real server
processes in test_security, test_server_lifecycle, test_fuzz and test_server.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health

from attnserve.server.app import SERVICE_NAME, method_handlers
from attnserve.server.gate import Admission, CallGate, HandlerTable
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelRegistry
from attnserve.server.parsing import SUPPORTED_KINDS, handler_kind
from attnserve.server.service import InferenceServicer


def _served() -> dict[str, grpc.RpcMethodHandler]:
    return method_handlers(InferenceServicer(ModelRegistry(), Metrics()), health.aio.HealthServicer())


def test_every_registered_method_has_a_kind_the_gate_wraps():
    handlers = _served()
    kinds = {method: handler_kind(h) for method, h in handlers.items()}
    assert {method: kind for method, kind in kinds.items() if kind not in SUPPORTED_KINDS} == {}
    # The kinds that make the gate's wrappers necessary, each reached by a registered method.
    assert kinds[f"/{SERVICE_NAME}/ModelInfer"] == ("unary_unary", "coroutine")
    assert kinds[f"/{SERVICE_NAME}/ModelStreamInfer"] == ("stream_stream", "async generator")
    assert kinds["/grpc.health.v1.Health/Check"] == ("unary_unary", "coroutine")
    assert kinds["/grpc.health.v1.Health/Watch"] == ("unary_stream", "coroutine")
    assert kinds["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"] == \
        ("stream_stream", "async generator")
    assert set(kinds.values()) == SUPPORTED_KINDS
    CallGate(handlers, Admission(), frozenset())  # builds without complaint


def test_health_list_is_left_out_while_grpc_health_leaves_it_synchronous():
    """Should grpc_health's aio servicer implement List one day, this fails: serve it then."""
    from grpc_health.v1 import health_pb2_grpc

    table = HandlerTable()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), table)
    assert handler_kind(table.handlers["/grpc.health.v1.Health/List"]) == ("unary_unary", "function")
    assert "/grpc.health.v1.Health/List" not in _served()


def test_a_kind_the_gate_does_not_wrap_is_refused_at_startup():
    def sync(request, context):
        return request

    async def writes(requests, context):  # stream-unary: no method of ours is one
        return None

    cases = {"/x.Y/Sync": grpc.unary_unary_rpc_method_handler(sync, request_deserializer=bytes),
             "/x.Y/StreamUnary": grpc.stream_unary_rpc_method_handler(writes, request_deserializer=bytes)}
    for method, handler in cases.items():
        with pytest.raises(TypeError, match=method):
            CallGate({method: handler}, Admission(), frozenset())
