"""Connections that rebalance (docs/deployment.md, "Connections"): --grpc-max-connection-age-s
closes each gRPC connection after its age, so that a long-lived channel reconnects and the
kernel (SO_REUSEPORT) or a load balancer places it again; keepalive settings.

Which worker answered is read from the gate (tests.gated_server: each call is held there and
names its process), as tests/test_workers.py does."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.app import grpc_connection_options
from attnserve.server.config import ServerConfig, load_config

from tests.gated_server import GatedServer
from tests.oip import WIDTHS, infer_request, random_inputs

MODEL = "cross_attention"
# A channel's reconnections land on either worker with even odds (the kernel hashes each new
# connection): within this bound, hundreds of reconnections, all on one worker has odds < 2**-100.
BOUND_S = 60.0


@pytest.mark.e2e
def test_a_long_lived_channel_moves_between_two_workers_after_the_connection_age(model_repository):
    """One channel (its own connection), calls one after another: every call succeeds, and
    after the connection age its calls reach the other worker too. Without the age, a channel
    stays on the worker its connection reached (tests/test_workers.py relies on that)."""
    x = random_inputs(np.random.default_rng(0), 1, 4, 4, WIDTHS[MODEL], WIDTHS[MODEL])
    request = infer_request(MODEL, **x)
    with GatedServer(model_repository, "--workers", "2", "--grpc-max-connection-age-s", "0.5",
                     "--grpc-max-connection-age-grace-s", "30") as proc, \
            proc.channel(**{"grpc.use_local_subchannel_pool": 1}) as channel, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls_by_pid: dict[int, int] = {}
        deadline = time.monotonic() + BOUND_S
        while len(calls_by_pid) < 2:
            assert time.monotonic() < deadline, f"one channel stayed on one worker for {BOUND_S}s: {calls_by_pid}"
            future = pool.submit(stub.ModelInfer, request, timeout=60)
            proc.gate.wait_started()
            proc.gate.release()
            assert future.result().outputs[0].name == "output"  # GOAWAY fails no call
            calls_by_pid[proc.gate.last_pid] = calls_by_pid.get(proc.gate.last_pid, 0) + 1
        assert "max_connection_age" not in proc.log()  # no error about the options


def test_connection_age_is_off_by_default_and_keepalive_has_defaults():
    options = dict(grpc_connection_options(ServerConfig()))
    assert "grpc.max_connection_age_ms" not in options and "grpc.max_connection_age_grace_ms" not in options
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_connection_age_and_keepalive_from_flags_and_environment():
    config = load_config(["--grpc-max-connection-age-s", "300", "--grpc-keepalive-time-s", "30"],
                         {"ATTNSERVE_GRPC_MAX_CONNECTION_AGE_GRACE_S": "15"})
    options = dict(grpc_connection_options(config))
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert options["grpc.max_connection_age_grace_ms"] == 15_000
    assert options["grpc.keepalive_time_ms"] == 30_000


@pytest.mark.parametrize("flag,value", [("--grpc-max-connection-age-s", "0"),
                                        ("--grpc-max-connection-age-grace-s", "-1"),
                                        ("--grpc-keepalive-time-s", "0"), ("--grpc-keepalive-timeout-s", "inf"),
                                        ("--grpc-keepalive-min-ping-interval-s", "-5")])
def test_bad_connection_settings_are_flag_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        load_config([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err  # the flag as given (server.config.FLAG_RANGES)


# -- keepalive: the server's ping policy, on a raw HTTP/2 connection ------------------------------


class _Pinger:
    """An HTTP/2 connection (the `h2` library) that opens no call and sends PING frames."""

    def __init__(self, port: int) -> None:
        import socket

        import h2.config
        import h2.connection

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.goaway = None  # the server's ConnectionTerminated event, once it came

    def ping_and_wait(self, n: int) -> bool:
        """Sends PING n; True once its ACK came, False if the server ended the connection first."""
        import h2.events

        if self.goaway is not None:
            return False
        self.conn.ping(n.to_bytes(8, "big"))
        self.sock.sendall(self.conn.data_to_send())
        deadline = time.monotonic() + BOUND_S
        acked = False
        while self.goaway is None and not acked:
            assert time.monotonic() < deadline, f"no answer to PING {n} in {BOUND_S}s"
            data = self.sock.recv(65536)
            if not data:
                return False
            for event in self.conn.receive_data(data):  # all of them: a GOAWAY may follow the ACK
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = event
                elif isinstance(event, h2.events.PingAckReceived) and event.ping_data == n.to_bytes(8, "big"):
                    acked = True
            if self.goaway is None:
                self.sock.sendall(self.conn.data_to_send())
        return acked and self.goaway is None

    def close(self) -> None:
        self.sock.close()


@pytest.mark.e2e
def test_pings_closer_than_the_min_ping_interval_get_goaway_too_many_pings_and_slower_ones_do_not(model_repository):
    """--grpc-keepalive-min-ping-interval-s reaches gRPC core: a client pinging without calls
    more often than it allows is sent GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (after gRPC's
    ping strikes); pings spaced wider than it are all answered, where the default (10 s) would
    have sent GOAWAY: the setting, not gRPC's default, decides. The spacing is a lower bound
    (each ping waits for the last one's ACK, then at least the interval twice): a slow machine
    only spaces them more."""
    import h2.errors

    from tests.server_process import ServerProcess

    interval_s = 0.2
    proc = ServerProcess(model_repository, "--grpc-keepalive-min-ping-interval-s", str(interval_s))
    try:
        slow = _Pinger(proc.port)
        try:
            for n in range(5):
                assert slow.ping_and_wait(n), f"ping {n} at >= {2 * interval_s}s apart refused: {slow.goaway}"
                resume = time.monotonic() + 2 * interval_s
                while time.monotonic() < resume:
                    time.sleep(resume - time.monotonic())
        finally:
            slow.close()
    finally:
        proc.stop()
    proc = ServerProcess(model_repository)  # the default interval, 10 s: back-to-back pings are too many
    try:
        fast = _Pinger(proc.port)
        try:
            for n in range(20):
                if not fast.ping_and_wait(n):
                    break
            assert fast.goaway is not None, "20 pings back to back were all answered"
            assert fast.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert fast.goaway.additional_data == b"too_many_pings"
        finally:
            fast.close()
    finally:
        proc.stop()
