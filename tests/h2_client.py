"""A gRPC client over a raw HTTP/2 socket (the `h2` library) that reads answers only when told.

    client = RawGrpcClient(port)
    sid = client.start_call("/inference.GRPCInferenceService/ModelInfer", request.SerializeToString())
    client.pump()              # handle what the server sent; never sends WINDOW_UPDATE ...
    client.open_window()       # ... until now: from here on every received byte is acknowledged
    client.calls[sid].messages, client.calls[sid].status

What a careless or hostile client does: it opens calls and never reads the answers, so the
server's writes stop at HTTP/2 flow control (64 KiB per connection by default). It obeys the
server's SETTINGS_MAX_CONCURRENT_STREAMS (h2 refuses to open more). 127.0.0.1 only.
"""

from __future__ import annotations

import select
import socket
import struct
import time
import urllib.parse
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions


@dataclass
class Call:
    stream_id: int
    outgoing: bytearray = field(default_factory=bytearray)  # request bytes not yet sent (flow control)
    end_after_outgoing: bool = True
    received: bytearray = field(default_factory=bytearray)
    got_headers: bool = False
    ended: bool = False
    reset: bool = False
    refused: bool = False  # RST_STREAM REFUSED_STREAM before any answer: never seen by the server, retry
    status: int | None = None  # grpc-status
    message: str = ""  # grpc-message

    @property
    def messages(self) -> list[bytes]:
        """The length-prefixed gRPC messages received so far, whole ones only."""
        out, at, data = [], 0, bytes(self.received)
        while at + 5 <= len(data):
            (length,) = struct.unpack(">I", data[at + 1:at + 5])
            if at + 5 + length > len(data):
                break
            out.append(data[at + 5:at + 5 + length])
            at += 5 + length
        return out


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


class RawGrpcClient:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setblocking(False)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.calls: dict[int, Call] = {}
        self.reading = False
        self.closed = False
        self._unacked: list[tuple[int, int]] = []  # (bytes, stream) received and not acknowledged
        self._flush()
        self.pump(0.5)  # the server's SETTINGS

    # -- calls -----------------------------------------------------------------------------

    def can_start(self) -> bool:
        return self.conn.open_outbound_streams < self.conn.remote_settings.max_concurrent_streams

    def start_call(self, method: str, message: bytes | None = None, timeout_s: float | None = None) -> int:
        """Open a call and send `message` (as flow control allows; None: a stream whose
        messages come from send()). Raises h2's TooManyStreamsError beyond the server's limit."""
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "127.0.0.1"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if timeout_s is not None:
            headers.append(("grpc-timeout", f"{int(timeout_s * 1000)}m"))
        self.conn.send_headers(sid, headers)
        call = Call(sid, end_after_outgoing=message is not None)
        self.calls[sid] = call
        if message is not None:
            call.outgoing += grpc_frame(message)
        self._send_pending()
        self._flush()
        return sid

    def send(self, sid: int, message: bytes, end: bool = False) -> None:
        """Queue one more message on a streaming call (and half-close after it if `end`)."""
        call = self.calls[sid]
        call.outgoing += grpc_frame(message)
        call.end_after_outgoing = end
        self._send_pending()
        self._flush()

    def send_bytes(self, sid: int, data: bytes, end: bool = False) -> None:
        """Queue raw bytes on a call (part of a gRPC frame, say), half-closing after them if `end`."""
        call = self.calls[sid]
        call.outgoing += data
        call.end_after_outgoing = end
        self._send_pending()
        self._flush()

    def cancel(self, sid: int) -> None:
        """Cancel the call (RST_STREAM CANCEL, what a client's cancel() sends), whatever it has sent."""
        self.calls[sid].outgoing.clear()
        self.conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.CANCEL)
        self._flush()

    def window_blocked(self, sid: int) -> bool:
        """Bytes are queued on the call and the server's flow control for the call itself (not the
        connection's, which the other calls share) lets none of them go."""
        stream = self.conn.streams.get(sid)
        return bool(self.calls[sid].outgoing) and stream is not None and stream.outbound_flow_control_window <= 0

    def unsent_bytes(self, sid: int) -> int:
        return len(self.calls[sid].outgoing)

    def open_window(self) -> None:
        """From now on acknowledge every byte received (WINDOW_UPDATE), including what came so far."""
        self.reading = True
        self._send_pending()
        self._flush()

    # -- the socket ------------------------------------------------------------------------

    def pump(self, timeout_s: float = 0.05) -> int:
        """Read and handle what the server sent within timeout_s; the number of frames' events."""
        handled = 0
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.sock], [], [], max(remaining, 0))
            if not ready:
                break
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            for event in self.conn.receive_data(data):
                handled += 1
                self._handle(event)
            self._send_pending()
            self._flush()
            if remaining <= 0:
                break
        return handled

    def _handle(self, event) -> None:
        call = self.calls.get(getattr(event, "stream_id", None) or -1)
        if isinstance(event, h2.events.ResponseReceived) and call is not None:
            call.got_headers = True
            self._trailers(call, event.headers)  # a trailers-only answer carries grpc-status here
        elif isinstance(event, h2.events.DataReceived) and call is not None:
            call.received += event.data
            if self.reading:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                self._unacked.append((event.flow_controlled_length, event.stream_id))
        elif isinstance(event, h2.events.TrailersReceived) and call is not None:
            self._trailers(call, event.headers)
        elif isinstance(event, h2.events.StreamEnded) and call is not None:
            call.ended = True
        elif isinstance(event, h2.events.StreamReset) and call is not None:
            call.ended = call.reset = True
            call.refused = event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM and not call.got_headers
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True

    @staticmethod
    def _trailers(call: Call, headers) -> None:
        for name, value in headers:
            if name == "grpc-status":
                call.status = int(value)
            elif name == "grpc-message":
                call.message = urllib.parse.unquote(value)

    def _send_pending(self) -> None:
        if self.reading and self._unacked:
            for length, sid in self._unacked:
                try:
                    self.conn.acknowledge_received_data(length, sid)
                except (h2.exceptions.StreamClosedError, KeyError):
                    pass
            self._unacked.clear()
        for call in self.calls.values():
            while call.outgoing:
                try:
                    window = self.conn.local_flow_control_window(call.stream_id)
                except (h2.exceptions.StreamClosedError, KeyError):
                    call.outgoing.clear()
                    break
                size = min(window, self.conn.max_outbound_frame_size, len(call.outgoing))
                if size <= 0:
                    break
                chunk = bytes(call.outgoing[:size])
                del call.outgoing[:size]
                try:
                    self.conn.send_data(call.stream_id, chunk,
                                        end_stream=not call.outgoing and call.end_after_outgoing)
                except h2.exceptions.StreamClosedError:  # the server answered (or refused) it already
                    call.outgoing.clear()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        while data and not self.closed:
            try:
                sent = self.sock.send(data)
                data = data[sent:]
            except (BlockingIOError, InterruptedError):
                select.select([], [self.sock], [], 1.0)
            except OSError:
                self.closed = True

    def close(self) -> None:
        try:
            self.conn.close_connection()
            self._flush()
        finally:
            self.sock.close()
            self.closed = True
