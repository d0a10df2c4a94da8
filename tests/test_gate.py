"""The gate in process: which handlers it wraps, and the call accounting it keeps (server.lifecycle).

The end-to-end behaviour (tokens, draining, garbage messages) is tested against real server
processes in test_security, test_server_lifecycle, test_fuzz and test_server.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from attnserve.server.app import SERVICE_NAME, method_handlers
from attnserve.server.gate import CallGate, HandlerTable
from attnserve.server.lifecycle import Admission, Arrivals, Draining
from attnserve.server.metrics import Metrics
from attnserve.server.models import ModelRegistry, _Model
from attnserve.server.parsing import SUPPORTED_KINDS, handler_kind
from attnserve.server.request_path import RequestPath
from attnserve.server.service import InferenceServicer
from grpc_health.v1 import health


def _served() -> dict[str, grpc.RpcMethodHandler]:
    return method_handlers(InferenceServicer(RequestPath(ModelRegistry(), Metrics(), Draining())),
                           health.aio.HealthServicer())


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
    CallGate(handlers, Admission(Arrivals()), Draining(), frozenset())  # builds without complaint


def test_health_list_is_left_out_while_grpc_health_leaves_it_synchronous():
    """Should grpc_health's aio servicer implement List one day, this fails: serve it then."""
    from grpc_health.v1 import health_pb2_grpc

    table = HandlerTable()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), table)
    list_method = "/grpc.health.v1.Health/List"
    if list_method in table.handlers:  # newer grpcio-health-checking releases define List; older ones do not
        assert handler_kind(table.handlers[list_method]) == ("unary_unary", "function")
    assert list_method not in _served()


def test_a_kind_the_gate_does_not_wrap_is_refused_at_startup():
    def sync(request, context):
        return request

    async def writes(requests, context):  # stream-unary: no method of ours is one
        return None

    cases = {"/x.Y/Sync": grpc.unary_unary_rpc_method_handler(sync, request_deserializer=bytes),
             "/x.Y/StreamUnary": grpc.stream_unary_rpc_method_handler(writes, request_deserializer=bytes)}
    for method, handler in cases.items():
        with pytest.raises(TypeError, match=method):
            CallGate({method: handler}, Admission(Arrivals()), Draining(), frozenset())


# -- lifecycle ---------------------------------------------------------------------------------


def test_arrivals_count_unary_calls_until_their_handler_starts():
    arrivals = Arrivals()
    first = arrivals.arrived(unary=True)
    stream = arrivals.arrived(unary=False)
    second = arrivals.arrived(unary=True)
    assert (arrivals.arriving, arrivals.calls) == (2, 3)  # streams are not requests on their way
    arrivals.started(first)
    arrivals.started(stream)
    assert (arrivals.arriving, arrivals.calls) == (1, 1)
    arrivals.started(second)
    arrivals.started(second)  # twice, or after being forgotten: no effect
    assert (arrivals.arriving, arrivals.calls) == (0, 0)


def test_arrivals_whose_handler_never_runs_are_forgotten(monkeypatch):
    import attnserve.server.lifecycle as lifecycle

    now = [1000.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    arrivals = Arrivals()
    abandoned = arrivals.arrived(unary=True)  # headers came, the client went away
    arrivals.arrived(unary=False)
    assert (arrivals.arriving, arrivals.calls) == (1, 2)
    now[0] += Arrivals.TIMEOUT_S / 2
    recent = arrivals.arrived(unary=True)
    # The batchers' hint counts only calls whose headers came within HINT_S; the drain, all.
    assert (arrivals.arriving, arrivals.calls) == (1, 3)
    now[0] += Arrivals.HINT_S / 2
    assert (arrivals.arriving, arrivals.calls) == (1, 3)
    now[0] += Arrivals.HINT_S
    assert (arrivals.arriving, arrivals.calls) == (0, 3)  # a header-only call slows no batch for long
    now[0] += Arrivals.TIMEOUT_S / 2
    assert (arrivals.arriving, arrivals.calls) == (0, 1)
    arrivals.started(abandoned)  # late: already forgotten, counts nothing
    assert arrivals.calls == 1
    arrivals.started(recent)
    assert (arrivals.arriving, arrivals.calls) == (0, 0)


def test_admission_waits_for_arriving_and_running_calls():
    async def main():
        arrivals = Arrivals()
        admission = Admission(arrivals)
        assert await admission.wait_idle(0.01)
        ticket = admission.arrived(unary=True)
        assert admission.in_flight == 1 and arrivals.arriving == 1
        assert not await admission.wait_idle(0.01)  # its message is still on its way
        admission.started(ticket)
        assert admission.in_flight == 1 and arrivals.arriving == 0
        waiting = asyncio.create_task(admission.wait_idle(5))
        await asyncio.sleep(0)
        assert not waiting.done()
        admission.finished()
        return await asyncio.wait_for(waiting, 1), admission.in_flight

    assert asyncio.run(main()) == (True, 0)


def test_admission_is_alone_with_one_unary_call_after_a_quiet_spell():
    now = [100.0]
    admission = Admission(Arrivals(), clock=lambda: now[0])
    quiet = Admission.QUIET_S

    def arrive_after(gap_s: float, *, stream: bool = False) -> None:
        now[0] += gap_s
        admission.started(admission.arrived(unary=not stream), stream=stream)

    arrive_after(quiet)
    assert admission.lone_call  # the server had been empty QUIET_S
    admission.finished()
    arrive_after(quiet / 2)
    assert not admission.lone_call  # it came right after the last call: a loop catching up, maybe
    admission.finished()
    arrive_after(quiet * 10)
    assert admission.lone_call
    arrive_after(quiet * 10)  # a second call while the first runs
    assert not admission.lone_call
    admission.finished()
    assert not admission.lone_call  # the one left arrived while another was in flight
    admission.finished()
    arrive_after(quiet * 10, stream=True)
    assert admission.in_flight == 1 and not admission.lone_call  # a stream carries many requests
    admission.finished(stream=True)
    arrive_after(quiet * 10)
    assert admission.lone_call


def test_a_call_whose_message_waited_for_a_receive_slot_leaves_admission_when_done():
    """With every receive slot taken a call's message is read later (a stream-unary handler);
    once it is answered the call is no longer in flight (it was left arriving, so a drain waited
    up to Arrivals.TIMEOUT_S for it, when the slot's ticket stood in for the call's)."""
    infer = f"/{SERVICE_NAME}/ModelInfer"

    async def answer(request, context):
        return request.upper()

    async def main():
        arrivals = Arrivals()
        admission = Admission(arrivals)
        gate = CallGate({infer: grpc.unary_unary_rpc_method_handler(answer)}, admission, Draining(),
                        frozenset({infer}), receive_slots=1)
        admission.started(admission.arrived(unary=True))  # an earlier call (over REST, say): answered
        admission.finished()
        first = gate.service(_CallDetails(infer, ()))  # takes the one slot
        second = gate.service(_CallDetails(infer, ()))  # its message waits for a slot
        assert first.stream_unary is not None and second.stream_unary is not None
        assert admission.in_flight == 2

        async def one_message(text=b"second"):
            yield text

        assert await first.stream_unary(one_message(b"first"), None) == b"FIRST"  # gives its slot back
        assert await asyncio.wait_for(second.stream_unary(one_message(), None), 5) == b"SECOND"
        return admission.in_flight, arrivals.calls, gate.receive.receiving

    assert asyncio.run(main()) == (0, 0, 0)


def test_one_draining_state_for_gate_and_servicer():
    """Server.stop begins draining once: the gate refuses new inference calls (without reading
    them, or counting them) and the servicer's readiness turns false, from the same object."""
    draining = Draining()
    registry = ModelRegistry()
    registry._models["m"] = _Model(versions={1: object()})  # a loaded model, as far as readiness goes
    servicer = InferenceServicer(RequestPath(registry, Metrics(), draining))
    arrivals = Arrivals()
    infer = f"/{SERVICE_NAME}/ModelInfer"
    gate = CallGate(method_handlers(servicer, health.aio.HealthServicer()), Admission(arrivals), draining,
                    frozenset({infer}))

    def call(method: str) -> grpc.RpcMethodHandler:
        return gate.service(_CallDetails(method, ()))

    async def ready() -> bool:
        return (await servicer.ServerReady(None, None)).ready

    assert asyncio.run(ready())
    admitted = call(infer)
    assert admitted.request_deserializer is not None and arrivals.arriving == 1  # admitted: it will be parsed
    draining.begin()  # the drain delay: not ready, but calls are still admitted
    assert not asyncio.run(ready())
    assert call(infer).request_deserializer is not None and arrivals.arriving == 2
    draining.refuse()  # the delay is over
    refused = call(infer)
    assert refused.stream_unary is not None and refused.request_deserializer is None  # never parsed
    assert arrivals.arriving == 2  # the refused call is not counted
    assert call(f"/{SERVICE_NAME}/ServerReady").unary_unary is not None  # metadata RPCs still answer
    assert not asyncio.run(ready())


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata
