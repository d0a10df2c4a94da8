"""A gRPC proxy in front of one server, for tests that must stop a client at a known point.

It forwards every unary call as bytes (no parsing) and lets the first `infer_budget` ModelInfer
calls through. Later ones wait at its gate until the test opens it (they are then forwarded) or
closes it (they fail with UNAVAILABLE and never reach the server). A client that needs more than
`infer_budget` answers therefore cannot finish before the test says so, however fast the machine.
Only grpc's public API: a GenericRpcHandler with raw-bytes method handlers.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

MESSAGE_BYTES = 64 << 20
HOLD_S = 120.0  # a held call gives up (UNAVAILABLE) only if the test never opens or closes the gate


class GatedProxy:
    def __init__(self, target: str, infer_budget: int) -> None:
        options = [("grpc.max_send_message_length", MESSAGE_BYTES), ("grpc.max_receive_message_length", MESSAGE_BYTES)]
        self._upstream = grpc.insecure_channel(target, options=options)
        self._cond = threading.Condition()
        self._budget = infer_budget
        self._state = "gated"  # gated: budget, then hold; open: forward all; closed: fail held and new
        self.forwarded = 0  # ModelInfer calls let through
        self.held = 0  # ModelInfer calls waiting at the gate now
        self._server = grpc.server(ThreadPoolExecutor(16, thread_name_prefix="gated-proxy"),
                                   handlers=[_Forward(self)], options=options)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.address = f"127.0.0.1:{port}"

    def open(self) -> None:
        """Forward the held calls and every later one."""
        with self._cond:
            self._state = "open"
            self._cond.notify_all()

    def close(self) -> None:
        """Fail the held calls and every later one with UNAVAILABLE; none reaches the server."""
        with self._cond:
            self._state = "closed"
            self._cond.notify_all()

    def stop(self) -> None:
        self.close()
        self._server.stop(grace=None)
        self._upstream.close()

    def _admit(self, context: grpc.ServicerContext) -> None:
        with self._cond:
            if self._state == "gated" and self._budget > 0:
                self._budget -= 1
                self.forwarded += 1
                return
            self.held += 1
            try:
                self._cond.wait_for(lambda: self._state != "gated", HOLD_S)
            finally:
                self.held -= 1
            if self._state != "open":
                context.abort(grpc.StatusCode.UNAVAILABLE, "gated proxy closed: the call was never forwarded")
            self.forwarded += 1

    def forward(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        if method.endswith("/ModelInfer"):
            self._admit(context)
        metadata = [(k, v) for k, v in context.invocation_metadata()
                    if not k.startswith((":", "grpc-")) and k != "user-agent"]
        try:
            return self._upstream.unary_unary(method)(request, timeout=context.time_remaining(), metadata=metadata)
        except grpc.RpcError as err:  # the server's status (or the transport's), passed on as it came
            context.abort(err.code(), err.details() or "")


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, proxy: GatedProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details):
        method = handler_call_details.method
        proxy = self._proxy
        return grpc.unary_unary_rpc_method_handler(lambda request, context: proxy.forward(method, request, context))
