"""How a client connects: addresses, TLS, bearer token, deadlines, retries, message limits.

One frozen `ClientOptions` serves both the sync and the asyncio client, so they open the same
channel (same target, same options) and retry by the same policy. Nothing here sends a request.

Several addresses (`"127.0.0.1:8001,127.0.0.1:8002"`) become one channel with gRPC's own
`round_robin` load balancing: every RPC goes to the next connected server, and a server that
is down is skipped. gRPC's `ipv4:`/`ipv6:` targets take IP literals only, so host names in a
list are resolved here, once, when the channel opens; a single host name becomes
`dns:///name:port`, which gRPC re-resolves itself (all of a name's addresses are balanced).

`channels=N` opens N such channels, each its own connection (client.pool), taken in turn per
call: one server's `--workers` share a port, and the kernel places connections, not calls.
`compression="gzip"` compresses every request message (the server decompresses it).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from attnserve.client.errors import InferenceError

from attnserve.files import MAX_PEM_BYTES, FileRefused, read_bounded

logger = logging.getLogger(__name__)

DEFAULT_URL = "localhost:8001"
DEFAULT_PORT = 8001
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the server's default limit, both ways
USER_AGENT = "attnserve-client/0.1"
# Targets already in gRPC's own syntax are passed through untouched.
GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")
# gRPC's reconnect backoff grows to 120 s by default; a restarted server should rejoin the
# round robin within seconds instead.
_MAX_RECONNECT_BACKOFF_MS = 5000
# Request compression by name (gRPC's own algorithms; the server accepts each of them).
COMPRESSION = {"gzip": grpc.Compression.Gzip}
MAX_CHANNELS = 256  # a pool larger than this is a connection leak, not a load spreader


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, used only for retryable statuses (UNAVAILABLE, CANCELLED by the server).

    Attempt n (n = 0 for the first retry) waits between half and all of
    `min(max_backoff_s, initial_backoff_s * multiplier**n)`, and never past the call's deadline:
    the deadline covers every attempt and every wait of one call.
    """

    max_attempts: int = 5  # the first try included; 1 = never retry
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (1 = no retries), got {self.max_attempts}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff_s(self, retry_index: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry_index` (0-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** retry_index)
        return cap / 2 + (rng or random).uniform(0, cap / 2)

    def delay_before_retry(self, error: InferenceError, retries_done: int, remaining_s: float) -> float | None:
        """Seconds to wait before sending the call again, or None to give up and raise `error`."""
        if not error.retryable or retries_done + 1 >= self.max_attempts:
            return None
        delay = self.backoff_s(retries_done)
        # Waiting past the deadline would only end in DEADLINE_EXCEEDED; the real cause is `error`.
        return delay if delay < remaining_s else None


@dataclass(frozen=True)
class TlsConfig:
    """Server authentication, and client authentication (mTLS) when cert and key are given."""

    ca_file: str | Path | None = None  # PEM roots; None: the system's roots
    cert_file: str | Path | None = None  # PEM client certificate chain (mTLS)
    key_file: str | Path | None = None  # PEM client private key (mTLS)
    server_name: str | None = None  # name to verify in the server's certificate, if not the host's

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("mTLS needs both a client certificate and its key (--tls-cert and --tls-key), got one")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | Path | None) -> bytes | None:
            if path is None:
                return None
            try:  # a FIFO or /dev/zero is refused, never waited on or read without end
                return read_bounded(Path(path), MAX_PEM_BYTES)
            except FileRefused as err:
                raise ValueError(f"cannot read TLS file {path}: {err}") from None
            except OSError as err:
                raise ValueError(f"cannot read TLS file {path}: {err.strerror}") from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def parse_addresses(url: str) -> list[tuple[str, int]]:
    """'h1:p1,[::1]:p2,h3' -> [('h1', p1), ('::1', p2), ('h3', 8001)]."""
    addresses = []
    for entry in url.split(","):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"empty address in url {url!r}; expected HOST:PORT[,HOST:PORT...]")
        if entry.startswith("["):  # [v6]:port
            host, sep, rest = entry[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"bad address {entry!r}; expected [IPV6]:PORT")
            port_text = rest[1:]
        elif entry.count(":") > 1:  # a bare IPv6 literal cannot carry a port
            host, port_text = entry, ""
        else:
            host, _, port_text = entry.partition(":")
        if not host:
            raise ValueError(f"bad address {entry!r}; expected HOST:PORT")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"bad port in {entry!r}; expected HOST:PORT with PORT a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port} in {entry!r}")
        addresses.append((host, port))
    return addresses


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def _format(version: int, host: str, port: int) -> str:
    return f"[{host}]:{port}" if version == 6 else f"{host}:{port}"


def grpc_target(url: str) -> str:
    """The gRPC target for a `--url` value (resolving host names when there are several)."""
    url = url.strip()
    if url.startswith(GRPC_SCHEMES):
        return url
    addresses = parse_addresses(url)
    if len(addresses) == 1:
        host, port = addresses[0]
        version = _ip_version(host)
        if version is None:
            return f"dns:///{host}:{port}"
        return f"ipv{version}:{_format(version, host, port)}"
    by_version: dict[int, list[str]] = {4: [], 6: []}
    has: dict[int, int] = {4: 0, 6: 0}  # how many entries have an address of each family
    for host, port in addresses:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise ValueError(f"cannot resolve {host!r} in url {url!r}: {err}") from None
        seen = set()
        for family, *_, sockaddr in infos:
            version = 4 if family == socket.AF_INET else 6 if family == socket.AF_INET6 else None
            if version is None:
                continue
            address = _format(version, sockaddr[0], port)
            if address not in by_version[version]:
                by_version[version].append(address)
            seen.add(version)
        for version in seen:
            has[version] += 1
    # One target holds one family: IPv4 when every entry has an IPv4 address, else IPv6.
    for version in (4, 6):
        if has[version] == len(addresses):
            return f"ipv{version}:" + ",".join(by_version[version])
    raise ValueError(f"the addresses in {url!r} do not all resolve to one IP family; give IP literals")


@dataclass(frozen=True)
class ClientOptions:
    """Everything a client needs to open its channel and make calls."""

    url: str = DEFAULT_URL  # HOST:PORT[,HOST:PORT...] or a gRPC target such as dns:///name:port
    timeout_s: float = DEFAULT_TIMEOUT_S  # default deadline of each call, retries included
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # send and receive limit
    tls: TlsConfig | None = None  # None: plaintext
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer <token>`
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    channels: int = 1  # connections opened, each call on the next (client.pool)
    compression: str | None = None  # "gzip": requests compressed on the wire; None: sent as they are

    def __post_init__(self) -> None:
        if not self.url.strip().startswith(GRPC_SCHEMES):
            parse_addresses(self.url)  # raises ValueError with the bad entry
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if self.token is not None and (not self.token or any(c in self.token for c in "\r\n")):
            raise ValueError("token must be one non-empty line")
        if not 1 <= self.channels <= MAX_CHANNELS:
            raise ValueError(f"channels must be in 1..{MAX_CHANNELS}, got {self.channels}")
        if self.compression is not None and self.compression not in COMPRESSION:
            raise ValueError(f"compression must be one of {sorted(COMPRESSION)} or None, got {self.compression!r}")

    @classmethod
    def build(cls, url: str | ClientOptions = DEFAULT_URL, **settings: Any) -> ClientOptions:
        """Options from a url and keyword settings, or an existing ClientOptions with some replaced."""
        if isinstance(url, ClientOptions):
            return dataclasses.replace(url, **settings) if settings else url
        return cls(url=url, **settings)

    def channel_options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
            ("grpc.primary_user_agent", USER_AGENT),
        ]
        if self.channels > 1:
            # gRPC shares one connection between channels of equal settings; a pool needs its own each.
            options.append(("grpc.use_local_subchannel_pool", 1))
        if self.tls is not None:
            server_name = self.tls.server_name or self._first_host_name()
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
        return options

    def _first_host_name(self) -> str | None:
        # A list of names is resolved to IP literals, so the certificate check needs the name back.
        if self.url.strip().startswith(GRPC_SCHEMES):
            return None
        addresses = parse_addresses(self.url)
        if len(addresses) == 1:
            return None  # dns:///name:port (or an IP literal) is verified as given
        host = addresses[0][0]
        return host if _ip_version(host) is None else None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def open_channel(options: ClientOptions, *, aio: bool = False):
    """A grpc (or grpc.aio) channel for `options`; the caller closes it."""
    target = grpc_target(options.url)
    module = grpc.aio if aio else grpc
    channel_options = options.channel_options()
    compression = COMPRESSION.get(options.compression) if options.compression else None
    if options.tls is None:
        if options.token:
            logger.warning("sending a bearer token over a plaintext channel to %s; use TLS outside loopback", target)
        return module.insecure_channel(target, options=channel_options, compression=compression)
    return module.secure_channel(target, options.tls.credentials(), options=channel_options, compression=compression)
